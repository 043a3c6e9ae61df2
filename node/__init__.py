"""kvrelay: the engine node's HTTP shell (`node.app`: health, metrics, KV events, request intake) and the
typed requests it decodes with `transfer.wire` (the one wire module, torch-free: the router imports it too)."""
