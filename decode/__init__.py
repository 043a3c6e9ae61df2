"""kvrelay: decode."""
