"""vLLM's allowed_token_ids and bad_words in the sampler (`model.sampling.adjust_logits`), and the rule that no mask
leaves a row with nothing to draw."""

from __future__ import annotations

import torch
from kvrelay.model.sampling import adjust_logits, sample
from kvrelay.model.sampling_params import SamplingParams

INF = float("-inf")


def adjusted(params: SamplingParams, output: list[int], eos: tuple[int, ...] = ()) -> list[float]:
    row = torch.arange(8, dtype=torch.float32)
    adjust_logits(row, params, ([], output), eos)
    return row.tolist()


def test_allowed_token_ids_keep_only_those():
    assert adjusted(SamplingParams(allowed_token_ids=(1, 3)), []) == [INF, 1.0, INF, 3.0, INF, INF, INF, INF]


def test_a_bad_word_bans_its_last_token_after_its_other_tokens():
    params = SamplingParams(bad_words_token_ids=((7,), (2, 6)))
    assert adjusted(params, [5]) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, INF]
    assert adjusted(params, [5, 2]) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, INF, INF]
    # greedy picks the best token the masks leave, sampled or not
    assert sample(torch.arange(8, dtype=torch.float32)[None], [params], [None], [([], [2])])[0] == [5]


def test_a_mask_that_would_leave_nothing_is_not_applied():
    # allowed {3}, the bad word 3, and min_tokens holding back the stop token 3: 3 stays, the only token left
    params = SamplingParams(allowed_token_ids=(3,), bad_words_token_ids=((3,),), min_tokens=2)
    assert adjusted(params, [], eos=(3,)) == [INF, INF, INF, 3.0, INF, INF, INF, INF]
    params = SamplingParams(allowed_token_ids=(1, 3), bad_words_token_ids=((3,),), temperature=1.0, seed=1)
    assert adjusted(params, []) == [INF, 1.0, INF, INF, INF, INF, INF, INF]
