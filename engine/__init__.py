"""kvrelay: the paged, continuous-batching engine shared by the prefill and decode services."""
