"""kvrelay: model."""
