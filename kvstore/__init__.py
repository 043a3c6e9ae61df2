"""kvrelay: kvstore."""
