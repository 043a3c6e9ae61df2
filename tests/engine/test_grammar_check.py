"""A constraint whose compile runs past ``compile_timeout_s`` is refused, its compile killed, and a repeat refused
at once, while other constraints compile (gap B of the 2026-12-07 edges notes: compiles had no deadline and could
not be stopped; measured with SmolLM2's vocabulary on this machine, ``[a-z]*`` written 1,600 times, 11 KB within
every router limit, compiled for 16 s on each node).

SmolLM2's 49,152-token vocabulary: the tiny model's 258 tokens compile the slow grammar too fast to test."""

from __future__ import annotations

import os
import threading

import pytest
from kvrelay.engine.grammar import GrammarError, Grammars
from kvrelay.model.structured import StructuredOutput

SLOW = StructuredOutput("grammar", "root ::= " + " ".join(["[a-z]*"] * 1600))
SMALL = StructuredOutput("grammar", 'root ::= "yes" | "no"')
SCHEMA = StructuredOutput("json", '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}')


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def grammars(smollm2):
    g = Grammars(smollm2.model_dir, 49152, [2], compile_timeout_s=2.0)
    yield g
    assert g.check is not None
    g.check.close()


def test_a_compile_past_the_deadline_is_killed_and_refused_and_others_compile_meanwhile(grammars):
    check = grammars.check
    assert check is not None
    grammars.compile(SMALL)  # the child started (its start is not timed against the deadline)
    assert (check.checks, check.timeouts, grammars.compiles) == (1, 0, 1)
    child_pid = check.child_pid
    assert child_pid is not None and pid_alive(child_pid)

    errors: list[str] = []

    def slow() -> None:
        try:
            grammars.compile(SLOW)
        except GrammarError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=slow)
    thread.start()
    compiled = grammars.compile(SCHEMA)  # waits for the slow one's check, at most its deadline, then compiles
    thread.join(timeout=120)
    assert not thread.is_alive() and compiled is grammars.compile(SCHEMA)
    assert errors == ["structured output: the grammar constraint took longer than 2 s to compile"]
    assert (check.checks, check.timeouts, grammars.compiles) == (3, 1, 2)
    assert not pid_alive(child_pid)  # killed: its CPU stopped at the deadline

    with pytest.raises(GrammarError, match="^structured output: the grammar constraint took longer than 2 s to "
                                           "compile$"):
        grammars.compile(SLOW)  # remembered: refused at once, not compiled again
    assert (check.checks, check.timeouts) == (3, 1)
    small = grammars.compile(SMALL)
    assert check.checks == 3  # a cache hit needs no check
    assert grammars.compiled_bytes == small.memory_size_bytes + compiled.memory_size_bytes  # the cache is sized


def test_a_constraint_xgrammar_refuses_is_refused_once_in_the_child(grammars):
    check = grammars.check
    assert check is not None
    bad = StructuredOutput("grammar", "root ::= undefined_rule")
    before = check.checks
    for _ in range(2):
        with pytest.raises(GrammarError, match="^structured output: the grammar constraint does not compile: "):
            grammars.compile(bad)
    assert check.checks == before + 1
