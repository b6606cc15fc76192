"""The synthetic engine is resume-exact, as the worker tests that run on it rely on: a rollout
aborted after any number of tokens and resumed (`prompt + partial` as the prompt,
`resumed_tokens=k`, `max_tokens` reduced by k) gets exactly the uninterrupted run's tokens,
logprobs and routes."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from statemachine import FinishReason, SamplingParams
from workers.engine_factory import SYNTHETIC_ARGS_ENV, make_engine
from workers.engines.base import EngineRequest, Joined, join_chunks
from workers.engines.errors import EngineError
from workers.engines.synthetic import SyntheticEngine

PROMPT = (11, 503, 8, 1999, 42)
N = 40


def sampling(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def run(
    engine: SyntheticEngine, prompt: tuple[int, ...], n: int, resumed: int = 0
) -> tuple[Joined, list[FinishReason | None]]:
    request = EngineRequest(
        request_id=f"r{resumed}-{n}",
        prompt_token_ids=prompt,
        sampling=sampling(n),
        resumed_tokens=resumed,
    )
    chunks = [c async for c in engine.generate(request)]
    return join_chunks(chunks), [c.finish_reason for c in chunks]


@pytest.mark.parametrize("tokens_per_chunk", [1, 5, 16])
@pytest.mark.parametrize("k", [1, 5, 7, 16, 17, 39])
async def test_a_resume_at_any_point_equals_the_uninterrupted_run(
    k: int, tokens_per_chunk: int
) -> None:
    engine = SyntheticEngine(tokens_per_chunk=tokens_per_chunk, experts=8, vocab=2048)
    full, reasons = await run(engine, PROMPT, N)
    assert reasons[-1] is FinishReason.LENGTH and len(full.token_ids) == N
    head, _ = await run(engine, PROMPT, k)
    tail, tail_reasons = await run(engine, (*PROMPT, *head.token_ids.tolist()), N - k, resumed=k)
    assert tail_reasons[-1] is FinishReason.LENGTH
    np.testing.assert_array_equal(np.concatenate([head.token_ids, tail.token_ids]), full.token_ids)
    np.testing.assert_array_equal(np.concatenate([head.logprobs, tail.logprobs]), full.logprobs)
    assert full.routed_experts is not None and head.routed_experts is not None
    assert tail.routed_experts is not None
    np.testing.assert_array_equal(
        np.concatenate([head.routed_experts, tail.routed_experts]), full.routed_experts
    )


async def test_a_resume_of_a_resume_is_still_exact() -> None:
    engine = SyntheticEngine(tokens_per_chunk=3, experts=8)
    full, _ = await run(engine, PROMPT, N)
    got: list[int] = []
    for k, n in [(0, 9), (9, 14), (23, N - 23)]:
        part, _ = await run(engine, (*PROMPT, *got), n, resumed=k)
        got += part.token_ids.tolist()
    assert got == full.token_ids.tolist()


async def test_output_depends_on_the_prompt_not_on_chunking_or_pace() -> None:
    a, _ = await run(SyntheticEngine(tokens_per_chunk=1, token_delay_s=0.001), PROMPT, N)
    b, _ = await run(SyntheticEngine(), PROMPT, N)
    other, _ = await run(SyntheticEngine(), (12, *PROMPT[1:]), N)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert not np.array_equal(a.token_ids, other.token_ids)


async def test_the_worker_cli_engine_takes_its_options_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    options = {"token_delay_s": 0.01, "tokens_per_chunk": 1, "poison_token": 7}
    monkeypatch.setenv(SYNTHETIC_ARGS_ENV, json.dumps(options))
    engine = make_engine("synthetic", None, weight_version=3)
    assert isinstance(engine, SyntheticEngine) and engine.weight_version == 3
    t0 = time.monotonic()
    joined, _ = await run(engine, PROMPT, 10)
    assert time.monotonic() - t0 >= 0.09  # paced: 10 tokens at 10 ms each
    assert len(joined.token_ids) == 10
    with pytest.raises(EngineError, match="poison token 7"):
        await run(engine, (1, 7), 4)
    monkeypatch.setenv(SYNTHETIC_ARGS_ENV, "[1]")
    with pytest.raises(ValueError, match="JSON object"):
        make_engine("synthetic", None)


@pytest.mark.parametrize("tokens_per_chunk", [1, 4])
async def test_a_script_is_said_whatever_the_prompt_and_ends_at_a_stop_token(
    tokens_per_chunk: int,
) -> None:
    """``script``: the tokens say it in a loop, the first stop token id ends the stream (kept,
    ``stop_reason`` its id), resumes stay exact, and the stepped path says the same."""
    script = (40, 41, 42, 7, 43)
    engine = SyntheticEngine(tokens_per_chunk=tokens_per_chunk, script=script)
    full, _ = await run(engine, PROMPT, 12)
    assert full.token_ids.tolist() == [*script, *script, 40, 41]
    other, _ = await run(engine, (1, 2), 12)
    assert other.token_ids.tolist() == full.token_ids.tolist()
    head, _ = await run(engine, PROMPT, 6)
    tail, _ = await run(engine, (*PROMPT, *head.token_ids.tolist()), 6, resumed=6)
    assert [*head.token_ids.tolist(), *tail.token_ids.tolist()] == full.token_ids.tolist()
    stop = SamplingParams(max_tokens=20, stop_token_ids=(7,), ignore_eos=True)
    chunks = [c async for c in engine.generate(EngineRequest(
        request_id="s", prompt_token_ids=PROMPT, sampling=stop))]  # fmt: skip
    said = join_chunks(chunks)
    assert said.token_ids.tolist() == [40, 41, 42, 7]
    assert (chunks[-1].finish_reason, chunks[-1].stop_reason) == (FinishReason.STOP, 7)
    # Resumed after the stop's first place: the next one ends it.
    rest = SamplingParams(max_tokens=20, stop_token_ids=(7,), ignore_eos=True)
    chunks = [c async for c in engine.generate(EngineRequest(
        request_id="t", prompt_token_ids=(*PROMPT, 40, 41, 42, 7), sampling=rest,
        resumed_tokens=4))]  # fmt: skip
    assert join_chunks(chunks).token_ids.tolist() == [43, 40, 41, 42, 7]
    await engine.add(EngineRequest(request_id="u", prompt_token_ids=(9,), sampling=stop))
    stepped = [s async for s in engine.steps()]
    assert np.concatenate([s.token_ids for s in stepped]).tolist() == [40, 41, 42, 7]
    assert stepped[-1].ends["u"].stop_reason == 7
    with pytest.raises(ValueError, match="script"):
        SyntheticEngine(vocab=10, script=(3, 10))
    assert engine.model_id != SyntheticEngine().model_id
