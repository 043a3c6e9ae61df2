"""vLLM's ``gpu_memory_utilization``: a share of the GPU's *total* memory for the whole node, and what it leaves
for the KV device tier.

::

    total_bytes × gpu_memory_utilization                       what this node may use on its GPU, in all
      − weights_bytes                                          the loaded parameters and buffers (measured)
      − activation_bytes                                       the activation reserve (estimated, below)
      = the device tier's bytes                                 KV blocks, then `// block_bytes`

The share is per node, as vLLM's is per instance: two nodes on one GPU take at most 0.5 each (`kvrelay up`
refuses more). Before the arithmetic the GPU must have the share free, counting what this node already holds:
``free_bytes + weights_bytes >= total_bytes × gpu_memory_utilization``, else another process holds the memory
and the node refuses to start (vLLM refuses alike).

The activation reserve is an estimate, not a profile (vLLM runs a dummy batch): the largest step's live
activations (``max_num_batched_tokens`` tokens, each holding its residual stream, q/k/v, the MLP's gate, up and
product, in the weights dtype), the sampled rows' float32 logits twice over (logits and probabilities), and
`NON_TORCH_BYTES` for what torch's allocator does not see (the CUDA context, cuBLAS and Triton workspaces, CUDA
graph pools).

On a CPU device ``gpu_memory_utilization`` means nothing (vLLM's CPU build ignores it too): the tier takes its
CPU default and the node's start-up line says so (`ignored_on_cpu`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.deploy.sizes import ConfigError

NON_TORCH_BYTES = 1 << 30  # CUDA context (~0.5 GiB on an H100/H200), library workspaces, CUDA graph pools
LOGITS_COPIES = 2  # float32 logits and the probabilities sampled from them
KEY = "kvstore.device.gpu_memory_utilization"


@dataclass(frozen=True, slots=True)
class GpuUse:
    """What a node's GPU holds when its device tier is sized (after its weights are loaded).

    Attributes:
        total_bytes: the GPU's total memory.
        free_bytes: free on the GPU now (weights already loaded).
        weights_bytes: this node's parameters and buffers on the GPU.
        activation_bytes: the activation reserve (`activation_reserve_bytes`).
    """

    total_bytes: int
    free_bytes: int
    weights_bytes: int
    activation_bytes: int


def activation_reserve_bytes(*, hidden: int, mlp_width: int, qkv_width: int, vocab: int, dtype_bytes: int,
                             max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The activation reserve of a node (see the module doc for what it counts).

    ``mlp_width``: the MLP's hidden width a token passes through (a mixture's: one expert's width × top-k);
    ``qkv_width``: q, k and v together per token (heads × head_dim + 2 × kv heads × head_dim).
    """
    per_token = (2 * hidden + qkv_width + 3 * mlp_width) * dtype_bytes
    logits = max_num_seqs * vocab * 4 * LOGITS_COPIES
    return max_num_batched_tokens * per_token + logits + NON_TORCH_BYTES


def kv_bytes_for_utilization(utilization: float, use: GpuUse) -> int:
    """The device tier's bytes under ``gpu_memory_utilization`` (the diagram in the module doc).

    Raises:
        ConfigError: naming `KEY`: the share is not free on the GPU (other processes hold it), or the weights
            and the activation reserve leave nothing for KV.
    """
    budget = int(use.total_bytes * utilization)
    if use.free_bytes + use.weights_bytes < budget:
        raise ConfigError(
            f"{KEY}: {utilization:g} of the GPU's {_gib(use.total_bytes)} is {_gib(budget)}, but only "
            f"{_gib(use.free_bytes + use.weights_bytes)} is free to this node (its weights counted); other "
            f"processes hold the rest: lower it, or free the GPU")
    kv = budget - use.weights_bytes - use.activation_bytes
    if kv <= 0:
        raise ConfigError(
            f"{KEY}: {utilization:g} of the GPU's {_gib(use.total_bytes)} is {_gib(budget)}, which the weights "
            f"({_gib(use.weights_bytes)}) and the activation reserve ({_gib(use.activation_bytes)}) fill, leaving "
            f"nothing for KV: raise it, or lower engine.max_num_batched_tokens")
    return kv


def ignored_on_cpu(utilization: float | None, device: str, cpu_fraction: float | None) -> str | None:
    """The start-up note of a node told ``gpu_memory_utilization`` on a CPU device, or None when nothing is
    ignored. ``cpu_fraction``: the share of free host memory the tier takes instead (None: sized in bytes)."""
    if utilization is None or device.startswith("cuda"):
        return None
    instead = (f"the device tier takes {cpu_fraction:g} of the host memory free at start"
               if cpu_fraction is not None else "the device tier takes its configured bytes")
    return (f"{KEY} {utilization:g} is ignored on {device} (it is a share of a GPU's memory, as vLLM's is); "
            f"{instead}; size it with kvstore.device.bytes (--kv-cache-memory) instead")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.1f} GiB"
