"""kvrelay: router."""
