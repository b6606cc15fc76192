"""Sampling and stop decisions, without a model."""

from __future__ import annotations

import torch

from statemachine.request import SamplingParams
from statemachine.status import FinishReason
from workers.engines.cpu.sampling import banned_tokens, sample, step_seed
from workers.engines.cpu.stopping import StopChecker


def test_greedy_takes_argmax_and_reports_the_raw_logprob() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])
    token, logprob = sample(
        logits, SamplingParams(max_tokens=1, temperature=0.0), banned=[], generator=None
    )
    assert token == 1  # ties break to the lowest id
    assert logprob == float(torch.log_softmax(logits, -1)[1])


def test_banned_tokens_are_never_sampled_but_logprob_stays_raw() -> None:
    logits = torch.tensor([5.0, 0.0, 1.0])
    params = SamplingParams(max_tokens=4, min_tokens=2, temperature=0.0, stop_token_ids=(2,))
    banned = banned_tokens(params, n_generated=0, eos_token_ids={0})
    assert banned == [0, 2]
    assert banned_tokens(params, n_generated=2, eos_token_ids={0}) == []
    ignore = SamplingParams(max_tokens=4, min_tokens=2, ignore_eos=True)
    assert banned_tokens(ignore, n_generated=0, eos_token_ids={0}) == []
    token, logprob = sample(logits, params, banned=banned, generator=None)
    assert token == 1
    assert logprob == float(torch.log_softmax(logits, -1)[1])


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    gen = torch.Generator()
    top_k = SamplingParams(max_tokens=1, temperature=1.0, top_k=2)
    top_p = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.5)
    seen_k = {sample(logits, top_k, banned=[], generator=gen.manual_seed(s))[0] for s in range(200)}
    seen_p = {sample(logits, top_p, banned=[], generator=gen.manual_seed(s))[0] for s in range(200)}
    assert seen_k == {0, 1}
    assert seen_p == {0}  # p(token 0) = 0.64 already covers top_p = 0.5


def test_step_seed_depends_on_seed_and_position_only() -> None:
    assert step_seed(7, 100) == step_seed(7, 100)
    assert len({step_seed(7, p) for p in range(1000)}) == 1000
    assert step_seed(7, 5) != step_seed(8, 5)
    assert all(0 <= step_seed(s, p) < 2**63 for s in (0, 2**62) for p in (0, 10**9))


def _checker(**kw: object) -> StopChecker:
    text = {1: "ab", 2: "c", 3: "\ufffd", 4: "d"}
    return StopChecker(
        SamplingParams(**{"max_tokens": 10, **kw}),
        eos_token_ids=frozenset({0}),
        # Token 3 is the first half of a character that token 4 completes.
        decode=lambda ids: "".join(text[i] for i in ids).replace("\ufffdd", "d"),
        max_total_tokens=100,
    )


def test_stop_order_and_reasons() -> None:
    assert _checker().check([1, 0], 5) == (FinishReason.STOP, None)
    assert _checker(ignore_eos=True).check([1, 0], 5) == (None, None)
    assert _checker(stop_token_ids=(2,)).check([1, 2], 5) == (FinishReason.STOP, 2)
    assert _checker(stop=("bc",)).check([1, 2], 5) == (FinishReason.STOP, "bc")
    assert _checker(max_tokens=2).check([1, 4], 5) == (FinishReason.LENGTH, None)
    assert _checker().check([1, 4], 100) == (FinishReason.LENGTH, None)  # context full
    # Nothing stops before min_tokens; stop strings only once more than min_tokens exist.
    assert _checker(min_tokens=3).check([1, 0], 5) == (None, None)
    assert _checker(min_tokens=2, stop=("bc",)).check([1, 2], 5) == (None, None)


def test_stop_string_across_calls() -> None:
    checker = _checker(stop=("bd",))
    assert checker.check([1], 5) == (None, None)
    assert checker.check([1, 3], 5) == (None, None)  # "ab\ufffd": the tail may still change
    assert checker.check([1, 3, 4], 5) == (FinishReason.STOP, "bd")  # "abd"
