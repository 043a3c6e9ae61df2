"""`KernelPlan`: which CPU kernel path each part of a model step takes, as measured on the machine it runs on.

A step's rows fall in one of `ROW_BUCKETS` (`bucket_of`)::

    rows     1    2    3-4    5-8    9-16    17+
    bucket   0    1     2      3      4       5  ("many": prefill chunks and large decode batches)

For each kind of linear layer of a dense decoder (`LINEAR_KINDS`) the plan names one path per bucket
(`LINEAR_PATHS`: the C++ ``blocked`` few-row kernel, oneDNN's packed matmul ``onednn`` — AMX where the CPU has it
— or ``torch``'s ``F.linear``); for each few-row bucket whether a decode-only step runs as the one C++ call
(``stack``, `model.llama.LlamaForCausalLM.decode_logits`) or layer by layer in Python with the linear paths above;
and which prefill and decode attention the per-layer path takes (``cpp`` or ``torch``).

The choices come from timing every candidate on the model's own shapes (`engine.kernel_tuning`), never from a table
of machines: on a Zen 4 VM the blocked kernel took 0.58x oneDNN's time at one row, while on an AMX Xeon oneDNN's
tile path makes it the slower one. `builtin_plan` is the rule the code had before the plan was measured (blocked at
1-16 rows, the stack, the C++ attention), kept as the plan of a machine where measuring is turned off.

`deterministic_plan` is the plan of deterministic mode (``engine.deterministic``): not the fastest paths but ones
whose bits do not depend on the batch, the chunk or the thread count. The blocked kernel sums each output row on
its own in input order, at any row count (oneDNN and ``F.linear`` pick other blockings, so other sums, as the rows
change); the C++ decode attention with its keys in one part (`kernels.cpu_attention`), and prefill as decode rows
(`kernels.cpu_attention.prefill_attention_rows`); the one-call stack where every layer fuses, its attention's keys
in one part too (it runs the per-layer path's kernels in the same order).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

ROW_BUCKETS = (1, 2, 4, 8, 16, 64)  # the rows each bucket is timed at; the last stands for 17 and more
FEW_ROW_BUCKETS = 5  # buckets 0-4 (1 to 16 rows): where the blocked kernel and the one-call stack may run
FEW_ROWS = ROW_BUCKETS[FEW_ROW_BUCKETS - 1]  # 16 = kernels.cpu_small.BLOCKED_MAX_ROWS
LINEAR_KINDS = ("qkv", "out", "gate_up", "down", "head")
LINEAR_PATHS = ("blocked", "onednn", "torch")
ATTENTION_PATHS = ("cpp", "torch")
PLAN_VERSION = 1  # bumped when the meaning of a stored plan changes: older cached plans are measured again


def bucket_of(rows: int) -> int:
    """The `ROW_BUCKETS` index of a step of ``rows`` (>= 1) rows: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, 9-16 -> 4,
    17 and more -> 5."""
    return min((rows - 1).bit_length(), len(ROW_BUCKETS) - 1)


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """The paths a model's steps take (see module doc).

    Attributes:
        linear: kind (`LINEAR_KINDS`) -> one `LINEAR_PATHS` name per `ROW_BUCKETS` bucket (``blocked`` only in
            the few-row buckets).
        stack: per few-row bucket (`FEW_ROW_BUCKETS`), whether a decode-only step of that many rows runs as the
            one C++ call.
        prefill_attention, decode_attention: `ATTENTION_PATHS` names for the per-layer path.
        source: ``measured`` (timed in this process), ``cached`` (timed earlier on this CPU model, read back),
            ``builtin`` (`builtin_plan`: nothing timed) or ``deterministic`` (`deterministic_plan`).
        cpu: the CPU it was measured on (`model.cpu_identity.CpuIdentity.kernel_label`), or "" when not timed.
        timings_us: the median time of every candidate timed (``"linear.qkv.1.blocked"``, ``"stack.4.layers"``,
            ``"prefill_attention.cpp"``...), microseconds; empty for ``builtin``.
        deterministic: `deterministic_plan`'s (source ``deterministic``): blocked at every bucket, the C++
            attention and the stack (where taken) in their batch-invariant form.
    """

    linear: dict[str, tuple[str, ...]]
    stack: tuple[bool, ...]
    prefill_attention: str = "cpp"
    decode_attention: str = "cpp"
    source: str = "builtin"
    cpu: str = ""
    timings_us: dict[str, float] = field(default_factory=dict)
    deterministic: bool = False

    def __post_init__(self) -> None:
        """Raises ValueError naming the field that does not fit."""
        if set(self.linear) != set(LINEAR_KINDS):
            raise ValueError(f"KernelPlan.linear must name {', '.join(LINEAR_KINDS)}; got {sorted(self.linear)}")
        for kind, paths in self.linear.items():
            if len(paths) != len(ROW_BUCKETS) or any(p not in LINEAR_PATHS for p in paths):
                raise ValueError(f"KernelPlan.linear[{kind!r}] must be {len(ROW_BUCKETS)} of {LINEAR_PATHS}; "
                                 f"got {paths}")
            if self.deterministic and set(paths) != {"blocked"}:
                raise ValueError(f"KernelPlan.linear[{kind!r}]: a deterministic plan takes the blocked kernel at "
                                 f"every row count; got {paths}")
            if paths[-1] == "blocked" and not self.deterministic:
                raise ValueError(f"KernelPlan.linear[{kind!r}]: the blocked kernel is for 1-16 rows only "
                                 "(every row count in a deterministic plan)")
        if len(self.stack) != FEW_ROW_BUCKETS:
            raise ValueError(f"KernelPlan.stack must have {FEW_ROW_BUCKETS} entries; got {len(self.stack)}")
        for name in ("prefill_attention", "decode_attention"):
            if getattr(self, name) not in ATTENTION_PATHS:
                raise ValueError(f"KernelPlan.{name} must be one of {ATTENTION_PATHS}; got {getattr(self, name)!r}")
        if self.deterministic and {self.prefill_attention, self.decode_attention} != {"cpp"}:
            raise ValueError("KernelPlan: a deterministic plan takes the C++ attention")
        if self.deterministic and len(set(self.stack)) > 1:
            raise ValueError("KernelPlan: a deterministic plan takes the stack at every few-row bucket or at none")

    @property
    def stack_rows(self) -> tuple[int, ...]:
        """The decode-only row counts (1-16) that run as the one C++ call."""
        return tuple(r for r in range(1, ROW_BUCKETS[FEW_ROW_BUCKETS - 1] + 1) if self.stack[bucket_of(r)])

    def uses(self, kind: str, path: str) -> bool:
        """Whether linear layers of ``kind`` take ``path`` at some bucket, or need its copy for the stack (the
        stack reads every blocked copy)."""
        return path in self.linear[kind] or (path == "blocked" and any(self.stack))

    def summary(self) -> dict[str, object]:
        """The choices without the timings, for logs and ``/health``: ``{"source", "cpu", "linear": {kind:
        {"1": path, "2": ..., "17+": ...}}, "stack_rows", "prefill_attention", "decode_attention",
        "deterministic"}``."""
        names = [str(r) for r in ROW_BUCKETS[:-1]] + [f"{ROW_BUCKETS[-2] + 1}+"]
        return {"source": self.source, "cpu": self.cpu,
                "linear": {k: dict(zip(names, p, strict=True)) for k, p in self.linear.items()},
                "stack_rows": list(self.stack_rows),
                "prefill_attention": self.prefill_attention, "decode_attention": self.decode_attention,
                "deterministic": self.deterministic}

    def to_json(self) -> str:
        return json.dumps({"version": PLAN_VERSION, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str = "cached") -> KernelPlan:
        """The plan `to_json` wrote, with ``source`` in place of the stored one.

        Raises:
            ValueError: not such a plan, or one of another `PLAN_VERSION`.
        """
        try:
            data = json.loads(text)
            if data.pop("version", None) != PLAN_VERSION:
                raise ValueError(f"not a version-{PLAN_VERSION} kernel plan")
            data["linear"] = {k: tuple(v) for k, v in data["linear"].items()}
            data["stack"] = tuple(data["stack"])
            data["source"] = source
            return cls(**data)
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a kernel plan: {exc}") from None


def builtin_linear_paths(*, packed: bool) -> tuple[str, ...]:
    """The fixed rule's paths of one weight: blocked at 1-16 rows, above them oneDNN's packed matmul where it
    packs the weight (``packed``), else ``F.linear``."""
    return ("blocked",) * FEW_ROW_BUCKETS + ("onednn" if packed else "torch",)


def builtin_plan(*, packed: bool) -> KernelPlan:
    """The fixed rule (see module doc): `builtin_linear_paths` for every kind, the stack at 1-16 rows, the C++
    attention."""
    return KernelPlan(linear=dict.fromkeys(LINEAR_KINDS, builtin_linear_paths(packed=packed)),
                      stack=(True,) * FEW_ROW_BUCKETS)


def deterministic_plan(*, stack: bool) -> KernelPlan:
    """Deterministic mode's plan (see module doc): the blocked kernel at every row count for every kind, the C++
    attention (prefill as decode rows, the keys in one part), and the one-call stack at 1-16 rows with ``stack``
    (pass whether the model has one: `model.llama.LlamaForCausalLM.decode_stack`)."""
    return KernelPlan(linear=dict.fromkeys(LINEAR_KINDS, ("blocked",) * len(ROW_BUCKETS)),
                      stack=(stack,) * FEW_ROW_BUCKETS, source="deterministic", deterministic=True)
