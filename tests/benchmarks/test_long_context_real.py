"""`benchmarks.long_context_real`: the passkey prompts, the policy factories, and the engine runs (greedy and
teacher-forced) on the tiny byte-level model, where one character is one token."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from kvrelay.benchmarks.long_context_bench import main
from kvrelay.benchmarks.long_context_real import (
    ANSWER_PREFIX,
    FILLER_SENTENCES,
    INTRO,
    NEEDLE,
    QUESTION,
    TEXT_PATH,
    budget_blocks,
    generate,
    h2o_policy,
    infinigen_policy,
    make_passkey,
    make_passkey_examples,
    parse_passkey,
    select_policies,
    speculative_policy,
    teacher_forced,
    text_token_ids,
)
from kvrelay.engine.long_context import LongContextConfig
from kvrelay.model.loader import load_model
from kvrelay.model.tiny import BOS_ID
from kvrelay.model.tokenizer import Tokenizer, load_tokenizer

from tests.real_model import RealModel

HEAD = f"<|user|>\n{INTRO}"  # the tiny model's chat template around the user's message, after BOS
TAIL = f" {QUESTION}\n<|assistant|>\n{ANSWER_PREFIX}"
LONGEST = max(len(s) + 1 for s in FILLER_SENTENCES)  # a filler sentence's tokens, at most


def _text(tok: Tokenizer, ids: list[int]) -> str:
    """The prompt after its BOS: ASCII, one character a token."""
    assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
    text = tok.decode(ids[1:], skip_special_tokens=False)
    assert len(text) == len(ids) - 1
    return text


def _filler(start: int, count: int) -> str:
    return "".join(" " + FILLER_SENTENCES[i % len(FILLER_SENTENCES)] for i in range(start, start + count))


def test_passkey_prompt_is_head_filler_needle_filler_tail(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    e = make_passkey(tok, prompt_tokens=600, depth_frac=0.5, passkey="70412")
    needle = " " + NEEDLE.format(passkey="70412")
    text = _text(tok, e.prompt_ids)
    assert text.startswith(HEAD) and text.endswith(TAIL)
    assert e.needle_start_token == 1 + text.index(needle) and e.needle_tokens == len(needle)
    before = text[len(HEAD):e.needle_start_token - 1]
    after = text[e.needle_start_token - 1 + len(needle):-len(TAIL)]
    sentences_before = before.count(".")
    assert before == _filler(0, sentences_before)
    assert after == _filler(sentences_before, after.count("."))
    assert text.count("70412") == 2 and text.count("pass key is") == 2  # the needle's and the reply's start
    assert 600 - LONGEST < len(e.prompt_ids) <= 600
    assert e.depth_frac == len(before) / (len(before) + len(after))
    assert abs(e.depth_frac - 0.5) <= LONGEST / (len(before) + len(after))


@pytest.mark.parametrize("depth, sentences_before", [(0.0, 0), (1.0, None)])
def test_needle_at_the_ends(tiny_model_dir: Path, depth: float, sentences_before: int | None) -> None:
    tok = load_tokenizer(tiny_model_dir)
    e = make_passkey(tok, prompt_tokens=400, depth_frac=depth, passkey="12345")
    text = _text(tok, e.prompt_ids)
    if sentences_before == 0:
        assert e.needle_start_token == 1 + len(HEAD) and e.depth_frac == 0.0
    else:
        assert text.endswith(" " + NEEDLE.format(passkey="12345") + TAIL) and e.depth_frac == 1.0


def test_passkey_prompt_errors(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    with pytest.raises(ValueError, match="depth_frac must be in"):
        make_passkey(tok, prompt_tokens=600, depth_frac=1.5, passkey="12345")
    with pytest.raises(ValueError, match="leaves no room for filler"):
        make_passkey(tok, prompt_tokens=200, depth_frac=0.5, passkey="12345")


def test_passkey_examples_cover_depth_bands_and_repeat_per_seed(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    examples = make_passkey_examples(tok, lengths=(500, 900), per_length=4, seed=5)
    assert examples == make_passkey_examples(tok, lengths=(500, 900), per_length=4, seed=5)
    assert [e.passkey for e in examples] != [e.passkey for e in make_passkey_examples(
        tok, lengths=(500, 900), per_length=4, seed=6)]
    assert [e.target_tokens for e in examples] == [500] * 4 + [900] * 4
    for i, e in enumerate(examples):
        assert len(e.passkey) == 5 and e.passkey.isdigit()
        filler = len(e.prompt_ids) - 1 - len(HEAD) - e.needle_tokens - len(TAIL)
        slack = LONGEST / filler
        assert (i % 4) / 4 - slack <= e.depth_frac <= (i % 4 + 1) / 4 + slack


def test_parse_passkey() -> None:
    assert parse_passkey(" 71432. Remember it.") == "71432"
    assert parse_passkey(" 7143") == "7143"
    assert parse_passkey(" the sun. 12") == "12"
    assert parse_passkey(" a magical item") is None


def test_real_tokenizer_builds_the_prompt_the_text_encodes_to(smollm2: RealModel) -> None:
    tok = load_tokenizer(smollm2.model_dir)
    longest = max(len(tok.encode(" " + s, add_special_tokens=False)) for s in FILLER_SENTENCES)
    for depth in (0.0, 0.37, 1.0):
        e = make_passkey(tok, prompt_tokens=1024, depth_frac=depth, passkey="40917")
        text = tok.decode(e.prompt_ids, skip_special_tokens=False)
        assert tok.encode(text, add_special_tokens=False) == e.prompt_ids
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\nThe pass key is")
        assert 1024 - longest < len(e.prompt_ids) <= 1024
        assert tok.decode(e.prompt_ids[e.needle_start_token:e.needle_start_token + e.needle_tokens]) == (
            " " + NEEDLE.format(passkey="40917"))


def test_policy_factories_and_budgets() -> None:
    assert budget_blocks(0.1, 1000, 16) == 6 and budget_blocks(0.01, 1000, 16) == 1
    assert h2o_policy(1, 16) == LongContextConfig("h2o", 48, 16, 16)
    assert h2o_policy(10, 16) == LongContextConfig("h2o", 160, 16, 16)
    assert infinigen_policy(1, 16) == LongContextConfig("infinigen", 64, 16, 16, recall_blocks=1)
    assert infinigen_policy(10, 16) == LongContextConfig("infinigen", 160, 16, 16, recall_blocks=7)
    for b in (1, 4, 10):
        h2o_policy(b, 16).check(16)
        infinigen_policy(b, 16).check(16)
    assert speculative_policy(10, 16) == LongContextConfig("infinigen", 160, 16, 16, recall_blocks=7,
                                                           selection="speculative")
    assert [label for label, _ in select_policies(None)] == ["h2o", "infinigen", "infinigen-speculative"]
    assert [label for label, _ in select_policies(["none", "infinigen"])] == ["infinigen"]
    with pytest.raises(ValueError, match="unknown policy 'quest'"):
        select_policies(["quest"])


def test_generate_under_a_budget_holding_everything_is_full_attention(tiny_model_dir: Path) -> None:
    loaded, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    prompts = [e.prompt_ids for e in make_passkey_examples(tok, lengths=(400, 560), per_length=1, seed=1)]
    big = 40  # blocks of 16: 640 tokens, more than any prompt and its answer
    full = generate(loaded, prompts, [LongContextConfig()] * 2, answer_tokens=12)
    h2o = generate(loaded, prompts, [h2o_policy(big, 16)] * 2, answer_tokens=12)
    assert h2o.outputs == full.outputs and h2o.stats["evicted_tokens"] == 0
    # InfiniGen's staging blocks are part of the budget: it offloads all but 3 blocks, and recalls every one
    infinigen = generate(loaded, prompts, [infinigen_policy(big, 16)] * 2, answer_tokens=12)
    assert infinigen.outputs == full.outputs and infinigen.stats["offloaded_blocks"] > 0
    small = generate(loaded, prompts, [h2o_policy(4, 16)] * 2, answer_tokens=12)
    assert small.stats["evicted_tokens"] > 0 and [len(o) for o in small.outputs] == [12, 12]


def test_teacher_forced_nll_is_the_models_own(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    loaded, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    ids = text_token_ids(tok, num_tokens=224)
    assert tok.decode(ids) == TEXT_PATH.read_text()[:224]
    full = teacher_forced(loaded, ids, prefill_tokens=160, policy=LongContextConfig())
    assert len(full.nll) == len(full.top1_ids) == 64
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [-float(logp[i - 1, ids[i]]) for i in range(160, 224)]  # token i from the logits at i - 1
    torch.testing.assert_close(torch.tensor(full.nll), torch.tensor(expected), atol=1e-4, rtol=0)
    assert full.top1_ids == logp[159:223].argmax(dim=-1).tolist()
    with pytest.raises(ValueError, match="prefill_tokens must be in"):
        teacher_forced(loaded, ids, prefill_tokens=224, policy=LongContextConfig())


def test_teacher_forced_policies_with_room_match_full_attention(tiny_model_dir: Path) -> None:
    loaded, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    ids = text_token_ids(tok, num_tokens=224)
    full = teacher_forced(loaded, ids, prefill_tokens=160, policy=LongContextConfig())
    for factory in (h2o_policy, infinigen_policy):
        roomy = teacher_forced(loaded, ids, prefill_tokens=160, policy=factory(16, 16))  # 256 tokens
        assert roomy.top1_ids == full.top1_ids
        torch.testing.assert_close(torch.tensor(roomy.nll), torch.tensor(full.nll), atol=1e-5, rtol=0)
    tight = teacher_forced(loaded, ids, prefill_tokens=160, policy=infinigen_policy(5, 16))  # 80 tokens
    assert tight.stats["offloaded_blocks"] > 0 and tight.stats["recalled_layer_blocks"] > 0
    assert tight.nll != full.nll


def test_cli_runs_both_real_tasks_on_a_small_model(tiny_model_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "real.json"
    assert main(["--model", "real", "--real-model-dir", str(tiny_model_dir), "--lengths", "400", "--passkey-examples",
                 "2", "--prefill-tokens", "200", "--scored-tokens", "24", "--policies", "h2o", "infinigen",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert result["bench"] == "long-context-real" and result["block_size_tokens"] == 16
    passkey, ppl = result["passkey"], result["perplexity"]
    assert [e["prompt_tokens"] <= 400 for e in passkey["examples"]] == [True, True]
    labels = [("none", 1.0)] + [(p, f) for f in (0.1, 0.2, 0.5) for p in ("h2o", "infinigen")]
    assert [(r["policy"], r["budget_frac"]) for r in passkey["rows"]] == labels
    assert [(r["policy"], r["budget_frac"]) for r in ppl["rows"]] == labels
    none = passkey["rows"][0]
    assert none["agreement"] == 1.0 and set(none["accuracy_by_length"]) == {"400"} and len(none["answers"]) == 2
    assert ppl["rows"][0]["perplexity_vs_none"] == 1.0 and ppl["rows"][0]["top1_agreement"] == 1.0
    for r in ppl["rows"]:
        assert math.isclose(r["perplexity"], math.exp(r["nll_mean"]), rel_tol=1e-3)
        assert 0.0 <= r["top1_accuracy"] <= 1.0
    budgets = [r["device_budget_tokens"] for r in ppl["rows"][1:]]
    assert budgets == [48, 64, 48, 64, 96, 96]  # 10 and 20 % of 200 tokens raised to the policies' least
