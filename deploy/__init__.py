"""kvrelay: deploy."""
