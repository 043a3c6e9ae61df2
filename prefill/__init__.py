"""kvrelay: prefill."""
