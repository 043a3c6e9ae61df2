"""kvrelay: benchmarks."""
