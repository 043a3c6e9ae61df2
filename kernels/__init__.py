"""kvrelay: kernels."""
