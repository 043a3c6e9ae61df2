"""`DecodeGraphs`: decode-only steps replayed from CUDA graphs captured at start, one graph per batch size.

A decode step of a small batch launches a few hundred short kernels (projections, norms, rotary, KV write,
attention, per layer); on a GPU their launch cost, not their work, sets the step time. A CUDA graph records
those launches once and replays them with one call. A graph replays fixed shapes and fixed addresses, so:

* every graph reads one static int64 input tensor, ``[max_size, 4 + W]``, one row per sequence::

      column:  0 token id | 1 position | 2 slot | 3 KV length | 4 … 4+W block table (W = ceil(max_model_len / B))

  and writes its logits into one static ``[max_size, vocab]`` float32 buffer shared by every size;
* a step of ``n`` sequences replays the graph of the smallest captured size ``>= n``; rows ``n…size`` are
  padding: token 0 at position 0, slot -1 (its KV is written nowhere), KV length 1 over block 0. No op of
  the model mixes rows, so padding changes no real row; its logits are dropped;
* block tables are always ``W`` wide, so attention splits over the model's whole context (split-K: splits
  past a sequence's length return at once).

Only decode-only steps without a long-context policy (no `model.attention.KvHook`: its calls are host code
between kernels) and of at most ``max(sizes)`` sequences replay; every other step runs eagerly. Graphs need
an attention backend whose launches never read device memory on the host (``supports_cuda_graphs``: the
Triton one); `model.llama.LlamaForCausalLM.forward` takes ``max_position`` for the same reason.

With ``capture=False`` nothing is captured: each replay runs the same padded, static-buffer forward
eagerly. That is how a CPU (tests, under ``TRITON_INTERPRET=1`` or with the torch backend) proves the
layout, the padding and the row order that a GPU's graphs replay.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from kvrelay.model.attention import AttentionBackend, AttentionBatch

log = logging.getLogger(__name__)
INPUT_COLUMNS = 4  # token id, position, slot, KV length; the block table follows
PAD_SLOT = -1


def default_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8, up to and including ``max_num_seqs`` (as vLLM captures)."""
    sizes = {s for s in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if s <= max_num_seqs}
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def check_batch_sizes(sizes: Seq[int], *, max_num_seqs: int) -> tuple[int, ...]:
    """``sizes`` sorted, without repeats. Raises ValueError naming ``cuda_graph_batch_sizes`` for an empty
    list, a size that is not a positive integer, or one above ``max_num_seqs`` (it could never replay)."""
    if not sizes:
        raise ValueError("cuda_graph_batch_sizes: give at least one batch size (or turn cuda_graphs off)")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"cuda_graph_batch_sizes: {s!r} is not a positive integer")
        if s > max_num_seqs:
            raise ValueError(f"cuda_graph_batch_sizes: {s} is above max_num_seqs ({max_num_seqs}); "
                             "a step never holds that many sequences")
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True, slots=True)
class DecodeRow:
    """One decode sequence's inputs: its next token id and position, the slot its KV goes to, its KV
    length after this step, and its block table."""

    token_id: int
    position: int
    slot: int
    kv_len: int
    block_table: list[int]


class DecodeGraphs:
    """Captured decode steps for a set of batch sizes (see the module doc).

    Args:
        model: a `model.llama.LlamaForCausalLM` on ``kv_pool``'s device.
        kv_pool: ``[num_blocks, L, P, H, B, D]`` (`kvstore.block_spec`), the pool the graphs read and write.
        backend: the attention backend (must have ``supports_cuda_graphs`` when capturing).
        sizes: batch sizes, as `check_batch_sizes` returns them.
        max_model_len: tokens a sequence may reach; sets the block-table width.
        capture: record CUDA graphs (needs CUDA); False runs the padded forward eagerly.

    Raises:
        ValueError: ``capture`` on a non-CUDA pool, or a backend without ``supports_cuda_graphs``.

    One owner: the engine's model runner calls `run`, from one thread.
    """

    def __init__(self, model: torch.nn.Module, kv_pool: torch.Tensor, backend: AttentionBackend, *,
                 sizes: tuple[int, ...], max_model_len: int, capture: bool) -> None:
        if capture and kv_pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the KV pool is on {kv_pool.device}")
        if capture and not getattr(backend, "supports_cuda_graphs", False):
            raise ValueError(f"the {type(backend).__name__} attention backend cannot be captured in a CUDA graph; "
                             "use the triton backend or turn cuda_graphs off")
        self.model, self.kv_pool, self.backend = model, kv_pool, backend
        self.sizes = sizes
        self.capture = capture
        device = kv_pool.device
        self.block_size_tokens = int(kv_pool.shape[4])
        self.width = -(-max_model_len // self.block_size_tokens)
        max_size = sizes[-1]
        self._inputs = torch.zeros((max_size, INPUT_COLUMNS + self.width), dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self._host = torch.zeros(self._inputs.shape, dtype=torch.int64, pin_memory=pin)
        self._host_rows = self._host.numpy()  # the same memory, for cheap row writes
        self._copied = torch.cuda.Event() if capture else None  # recorded after each upload from ``_host``
        self._empty = torch.zeros((0, 0), dtype=torch.int32, device=device)
        self._empty_lens = torch.zeros((0,), dtype=torch.int32, device=device)
        self._zero_start = torch.zeros((1,), dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        vocab = model.lm_head.weight.shape[0]
        self._logits = torch.empty((max_size, vocab), dtype=torch.float32, device=device)  # outside the pool
        self.replays = 0  # steps served by `run` (tests and metrics)
        if capture:
            self._capture_all()

    # ------------------------------------------------------------------ capture
    def _forward(self, size: int) -> torch.Tensor:
        """The padded decode forward over the first ``size`` input rows; returns ``[size, vocab]`` float32."""
        rows = self._inputs[:size]
        batch = AttentionBatch(
            slot_mapping=rows[:, 2].contiguous(), num_prefill_tokens=0,
            prefill_block_tables=self._empty, prefill_seq_lens=self._empty_lens,
            prefill_query_start_loc=self._zero_start,
            decode_block_tables=rows[:, INPUT_COLUMNS:].to(torch.int32),
            decode_seq_lens=rows[:, 3].to(torch.int32),
        )
        hidden = self.model(rows[:, 0].contiguous(), rows[:, 1].contiguous(), self.kv_pool, batch, self.backend)
        out = self._logits[:size]
        out.copy_(self.model.compute_logits(hidden))  # the step's own logits go back to the pool
        return out

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Warm every size up on a side stream (Triton compiles its kernels there), then capture, largest
        first, into one memory pool (a smaller graph reuses the larger one's blocks)."""
        self._fill([], self.sizes[-1])
        self._inputs.copy_(self._host)
        stream = torch.cuda.Stream(self.kv_pool.device)
        stream.wait_stream(torch.cuda.current_stream(self.kv_pool.device))
        with torch.cuda.stream(stream):
            for size in self.sizes:
                self._forward(size)
        torch.cuda.current_stream(self.kv_pool.device).wait_stream(stream)
        torch.cuda.synchronize(self.kv_pool.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._forward(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.kv_pool.device)

    # --------------------------------------------------------------------- run
    def size_for(self, num_seqs: int) -> int | None:
        """The captured size a step of ``num_seqs`` sequences replays, or None (run it eagerly)."""
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def _fill(self, rows: Seq[DecodeRow], size: int) -> None:
        """Write the first ``size`` rows of the host input: ``rows``, then padding."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous upload has left the host buffer
        host = self._host_rows
        host[:size] = 0
        host[len(rows) : size, 2] = PAD_SLOT
        host[len(rows) : size, 3] = 1
        for i, r in enumerate(rows):
            host[i, :INPUT_COLUMNS] = (r.token_id, r.position, r.slot, r.kv_len)
            host[i, INPUT_COLUMNS : INPUT_COLUMNS + len(r.block_table)] = r.block_table

    @torch.inference_mode()
    def run(self, rows: Seq[DecodeRow]) -> torch.Tensor | None:
        """Logits ``[len(rows), vocab]`` float32 (a fresh tensor) for one decode-only step, or None when the
        step cannot replay (more rows than the largest size, or a block table wider than ``W``) and must run
        eagerly. Writes each row's KV at its slot, as the eager step does."""
        size = self.size_for(len(rows))
        if size is None or not rows or any(len(r.block_table) > self.width for r in rows):
            return None
        self._fill(rows, size)
        self._inputs[:size].copy_(self._host[:size], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
            self._graphs[size].replay()
        else:
            self._forward(size)
        self.replays += 1
        return self._logits[: len(rows)].clone()


def try_capture(model: torch.nn.Module, kv_pool: torch.Tensor, backend: AttentionBackend, *,
                sizes: tuple[int, ...], max_model_len: int) -> DecodeGraphs | None:
    """Captured `DecodeGraphs`, or None when capture fails: the error is logged and decode runs eagerly
    (serving matters more than launch overhead; ``engine.cuda_graphs: false`` skips the attempt)."""
    try:
        graphs = DecodeGraphs(model, kv_pool, backend, sizes=sizes, max_model_len=max_model_len, capture=True)
    except Exception:  # noqa: BLE001 - any capture failure leaves eager decode, which works
        log.exception("capturing CUDA graphs for decode batch sizes %s failed; decode runs eagerly "
                      "(set engine.cuda_graphs: false to skip the capture)", list(sizes))
        return None
    log.info("captured CUDA graphs for decode batch sizes %s", list(sizes))
    return graphs
