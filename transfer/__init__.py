"""kvrelay: transfer."""
