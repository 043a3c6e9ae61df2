"""`CompileCheck`: each constraint a node has not compiled before is compiled first in a child process, under a
deadline; one over it is refused, and so is every repeat of it, at once.

Why a child: xgrammar's compile is one C++ call that holds no Python lock a thread could be stopped at, so a
thread cannot be cancelled; a child can be killed, and its CPU stops with it. Why not use the child's result:
a compiled grammar serializes into far more than it weighs (a 1,000-rule chain: 1.3 MB compiled, 94 MB of JSON,
13 s to write; xgrammar 0.2.9), so the node compiles again itself once the child says it finishes in time.

    check(out) ──▶ refused before? ──yes──▶ GrammarError (the reason kept)
                        │no
                        ▼
                  child compiles it ── over timeout_s ──▶ child killed (restarted on the next check), refusal kept
                        │ within                           GrammarError "… took longer than N s to compile"
                        ▼
                  xgrammar's error? ──yes──▶ refusal kept, GrammarError
                        │no
                        ▼
                    returns (the caller compiles it in-process: it takes about as long)

One check at a time per node (a child compiles one grammar); a check waits for the one before it, at most its
deadline. The child's start (loading the vocabulary, seconds) does not count against the deadline.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

from kvrelay.model.structured import GRAMMAR_ERROR_PREFIX, StructuredOutput

log = logging.getLogger(__name__)

MAX_REFUSALS = 4096  # refused constraints remembered per node (a SHA-256 and a reason each)
CHILD_START_TIMEOUT_S = 300.0  # loading the vocabulary into xgrammar in the child (seconds; minutes on a busy host)


class CompileRefused(Exception):
    """Raised by `CompileCheck.check`: ``message`` is the 400's text (it starts with GRAMMAR_ERROR_PREFIX)."""


def refusal_key(out: StructuredOutput) -> bytes:
    return hashlib.sha256(repr(out.cache_key).encode()).digest()


class CompileCheck:
    """Compiles constraints in a child process with a deadline (see the module docstring). Thread-safe.

    Args:
        serve: the child's loop, ``serve(conn, model_dir, vocab_size, stop_token_ids)``: it sends ``"ready"`` once
            it can compile, then answers each `StructuredOutput` received with None (it compiles) or the refusal's
            text (`engine.grammar.serve_checks`; a module-level function: the child is spawned).
        model_dir, vocab_size, stop_token_ids: as `engine.grammar.Grammars`.
        timeout_s: the deadline of one compile, seconds.
    """

    def __init__(self, serve: Callable[[Connection, str, int, list[int]], None], model_dir: str | Path,
                 vocab_size: int, stop_token_ids: Sequence[int], *, timeout_s: float) -> None:
        self._serve = serve
        self._args = (str(model_dir), vocab_size, list(stop_token_ids))
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # one check at a time; guards _child and _conn
        self._child: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._refusals_lock = threading.Lock()
        self._key_to_refusal: OrderedDict[bytes, str] = OrderedDict()
        self.checks = 0  # constraints compiled in the child
        self.timeouts = 0  # of them, killed at the deadline

    def check(self, out: StructuredOutput) -> None:
        """Return when ``out`` compiles within the deadline; blocking (up to the deadline, plus the wait for the
        check before it and, the first time, the child's start).

        Raises:
            CompileRefused: it does not compile, or not within the deadline (now or before).
        """
        key = refusal_key(out)
        with self._refusals_lock:
            refused = self._key_to_refusal.get(key)
        if refused is not None:
            raise CompileRefused(refused)
        with self._lock:
            with self._refusals_lock:  # refused while this check waited for the one before
                refused = self._key_to_refusal.get(key)
            if refused is not None:
                raise CompileRefused(refused)
            error = self._compile_in_child(out)
        if error is not None:
            with self._refusals_lock:
                self._key_to_refusal[key] = error
                while len(self._key_to_refusal) > MAX_REFUSALS:
                    self._key_to_refusal.popitem(last=False)
            raise CompileRefused(error)

    def _compile_in_child(self, out: StructuredOutput) -> str | None:
        conn = self._started()
        self.checks += 1
        conn.send(out)
        if conn.poll(self.timeout_s):
            try:
                return conn.recv()
            except EOFError:
                self._stop()
                return (f"{GRAMMAR_ERROR_PREFIX}the {out.kind} constraint crashed its compile (the child process "
                        "compiling it exited)")
        self.timeouts += 1
        self._stop()
        log.warning("a %s constraint took longer than %g s to compile; its compile was killed", out.kind,
                    self.timeout_s)
        return f"{GRAMMAR_ERROR_PREFIX}the {out.kind} constraint took longer than {self.timeout_s:g} s to compile"

    def _started(self) -> Connection:
        if self._child is not None and self._child.is_alive() and self._conn is not None:
            return self._conn
        self._stop()
        ctx = mp.get_context("spawn")  # no fork of a process that runs threads (and maybe CUDA)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=self._serve, args=(child, *self._args), name="kvrelay-grammar-check", daemon=True)
        proc.start()
        child.close()
        if not parent.poll(CHILD_START_TIMEOUT_S) or parent.recv() != "ready":
            proc.kill()
            proc.join()
            raise RuntimeError(f"the grammar-check child did not start within {CHILD_START_TIMEOUT_S:g} s")
        self._child, self._conn = proc, parent
        return parent

    def _stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.join()
        if self._conn is not None:
            self._conn.close()
        self._child = self._conn = None

    @property
    def child_pid(self) -> int | None:
        """The compiling child's process id; None before the first check and after a kill."""
        child = self._child
        return None if child is None else child.pid

    def close(self) -> None:
        """Kill the child (a later check starts another)."""
        with self._lock:
            self._stop()

