"""`EngineConfig`: how one engine is sized (the YAML ``engine`` section, and the layout fields of ``kvstore``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.engine.cuda_graphs import check_batch_sizes, default_batch_sizes
from kvrelay.engine.kernel_tuning import PLAN_MODES
from kvrelay.engine.long_context import LongContextConfig
from kvrelay.engine.scheduler import PREFILL_PACKINGS
from kvrelay.kvstore.checks import require_int
from kvrelay.model.attention import BACKEND_NAME_TO_CLASS


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine sizing. ``max_model_len`` defaults to the model's ``max_position_embeddings``."""

    num_blocks: int = 1024
    block_size_tokens: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    # whether a prompt joins a step in which another prompt's prefill ends (`engine.scheduler`): "fill" (up to
    # max_num_batched_tokens) or "priced" (by the measured step cost)
    prefill_packing: str = "fill"
    # the CPU kernel paths (`engine.kernel_tuning.PLAN_MODES`): "auto" (timed once per machine and kept), "measure"
    # (timed again), "builtin" (the fixed rule)
    kernel_plan: str = "auto"
    # outputs that do not depend on the batch, the chunking, P/D placement or a migration (`model.kernel_plan`'s
    # deterministic plan, in place of kernel_plan's): opt-in, it costs speed (`kvrelay bench deterministic`)
    deterministic: bool = False
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # None: triton on CUDA, torch elsewhere
    kv_dtype: str | None = None  # None: the model's weights dtype
    long_context: LongContextConfig = LongContextConfig()  # the default policy; requests may override it
    cuda_graphs: bool = True  # capture decode steps on CUDA with a backend that allows it (`engine.cuda_graphs`)
    cuda_graph_batch_sizes: tuple[int, ...] | None = None  # None: `default_batch_sizes(max_num_seqs)`
    # a new constraint's compile runs first in a child killed after this (`engine.grammar_check`); None: no child
    grammar_compile_timeout_s: float | None = None

    def __post_init__(self) -> None:
        """Raises ValueError naming the field (as in the YAML ``engine``/``kvstore`` sections)."""
        for name in ("num_blocks", "block_size_tokens", "max_num_seqs", "max_num_batched_tokens"):
            require_int(name, getattr(self, name))
        if self.prefill_packing not in PREFILL_PACKINGS:
            raise ValueError(f"prefill_packing must be one of {', '.join(PREFILL_PACKINGS)}, "
                             f"got {self.prefill_packing!r}")
        if self.kernel_plan not in PLAN_MODES:
            raise ValueError(f"kernel_plan must be one of {', '.join(PLAN_MODES)}, got {self.kernel_plan!r}")
        if self.max_model_len is not None:
            require_int("max_model_len", self.max_model_len)
        if self.attention_backend is not None and self.attention_backend not in BACKEND_NAME_TO_CLASS:
            raise ValueError(f"attention_backend must be one of {sorted(BACKEND_NAME_TO_CLASS)} or unset, "
                             f"got {self.attention_backend!r}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be true or false, got {self.deterministic!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        if self.cuda_graph_batch_sizes is not None:
            check_batch_sizes(self.cuda_graph_batch_sizes, max_num_seqs=self.max_num_seqs)

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes to capture (sorted), when graphs are on and the device allows them."""
        if self.cuda_graph_batch_sizes is None:
            return default_batch_sizes(self.max_num_seqs)
        return check_batch_sizes(self.cuda_graph_batch_sizes, max_num_seqs=self.max_num_seqs)
