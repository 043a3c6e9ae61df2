"""kvrelay: the engine node's HTTP shell (`node.app`: health, metrics, KV events, request intake) and the
router ↔ node wire format (`node.protocol`, torch-free: the router imports it)."""
