"""The contract every engine must meet, run against each factory in conftest.ENGINE_CASES."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from statemachine.request import SamplingParams
from statemachine.status import FinishReason
from tests.engines.stream import Generation, collect_request
from workers.demo.tiny_model import make_tiny_model
from workers.engines.base import Chunk, Engine, EngineRequest
from workers.engines.errors import EngineError, RequestAborted, RequestRejected
from workers.engines.synthetic import SyntheticEngine

# The session loop: pooled vLLM engines are bound to it (tests/engines/vllm_support.py).
pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPTS = (
    "The quick model runs",
    "Alpha beta gamma delta river",
    "Worker engine queue 4217",
    "Should the trainer abort or resume?",
)
N = 24  # tokens per greedy run: long enough to cross several resume points


@pytest.fixture
def prompts(model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(p).input_ids for p in PROMPTS]


async def collect(
    engine: Engine, prompt: list[int], *, request_id: str = "r", **sampling: Any
) -> Generation:
    request = EngineRequest(
        request_id=request_id, prompt_token_ids=tuple(prompt), sampling=SamplingParams(**sampling)
    )
    return await collect_request(engine, request)


async def greedy(
    engine: Engine, prompt: list[int], n: int = N, *, request_id: str = "r", **kw: Any
) -> Generation:
    return await collect(
        engine,
        prompt,
        request_id=request_id,
        max_tokens=n,
        temperature=0.0,
        ignore_eos=True,
        **kw,
    )


def assert_same_logprobs(a: np.ndarray, b: np.ndarray, case: Any) -> None:
    np.testing.assert_allclose(a, b, rtol=0, atol=case.logprob_tol)


def assert_well_formed(out: Generation, *, routes: bool) -> None:
    for chunk in out.chunks:
        assert chunk.token_ids.dtype == np.int32
        assert chunk.token_ids.ndim == 1
        assert chunk.logprobs.dtype == np.float32
        assert chunk.logprobs.shape == chunk.token_ids.shape
        if routes:
            assert chunk.routed_experts is not None
            assert chunk.routed_experts.shape[0] == chunk.token_ids.shape[0]
        else:
            assert chunk.routed_experts is None
    assert all(c.finish_reason is None for c in out.chunks[:-1])
    assert out.finish_reason is not None


async def test_is_an_engine(engine: Engine) -> None:
    assert isinstance(engine, Engine)
    assert engine.weight_version == 0


async def test_greedy_is_deterministic(engine: Engine, prompts, engine_case: Any) -> None:
    first = await greedy(engine, prompts[0])
    second = await greedy(engine, prompts[0], request_id="again")
    assert len(first.token_ids) == N
    assert first.token_ids == second.token_ids
    assert_same_logprobs(first.logprobs, second.logprobs, engine_case)
    assert_well_formed(first, routes=engine_case.routes)


@pytest.mark.parametrize("split", [1, 7, 16, N - 1])
async def test_resume_equals_uninterrupted(
    engine: Engine, prompts, engine_case: Any, split: int
) -> None:
    """Invariant 3: prefix, then prompt + prefix for the rest == one uninterrupted run."""
    full = await greedy(engine, prompts[1])
    head = await greedy(engine, prompts[1], n=split, request_id="head")
    tail = await greedy(engine, prompts[1] + head.token_ids, n=N - split, request_id="tail")
    assert head.token_ids + tail.token_ids == full.token_ids
    assert_same_logprobs(np.concatenate([head.logprobs, tail.logprobs]), full.logprobs, engine_case)
    if engine_case.routes:
        assert head.routed_experts is not None
        assert tail.routed_experts is not None
        resumed = np.concatenate([head.routed_experts, tail.routed_experts])
        assert resumed.shape[0] == N  # one row per token: no duplicate row at the boundary
        np.testing.assert_array_equal(resumed, full.routed_experts)


async def test_max_tokens_gives_length(engine: Engine, prompts) -> None:
    out = await greedy(engine, prompts[0], n=5)
    assert len(out.token_ids) == 5
    assert out.finish_reason is FinishReason.LENGTH
    assert out.stop_reason is None


async def test_stop_token_id(engine: Engine, prompts) -> None:
    reference = await greedy(engine, prompts[0])
    stop_id = reference.token_ids[3]
    expected = reference.token_ids[: reference.token_ids.index(stop_id) + 1]
    out = await greedy(engine, prompts[0], request_id="s", stop_token_ids=(stop_id,))
    assert out.token_ids == expected  # the stop token itself is returned
    assert out.finish_reason is FinishReason.STOP
    assert out.stop_reason == stop_id


async def test_stop_string(engine: Engine, prompts, model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = await greedy(engine, prompts[2])
    text = tokenizer.decode(reference.token_ids, skip_special_tokens=True)
    # A stop string taken from the middle of the greedy text: the run must end on the
    # first token whose text completes it.
    stop = next(
        tokenizer.decode([t]).strip()
        for t in reference.token_ids[4:]
        if len(tokenizer.decode([t]).strip()) >= 2 and "\ufffd" not in tokenizer.decode([t])
    )
    assert stop in text
    k = next(
        k
        for k in range(1, N + 1)
        if stop in tokenizer.decode(reference.token_ids[:k], skip_special_tokens=True)
    )
    out = await greedy(engine, prompts[2], request_id="s", stop=(stop, "never-in-this-text"))
    assert out.token_ids == reference.token_ids[:k]
    assert out.finish_reason is FinishReason.STOP
    assert out.stop_reason == stop


async def test_eos_min_tokens_and_ignore_eos(engines, model_dir: Path, prompts, with_eos) -> None:
    """A model whose eos is its 2nd greedy token: stops there, unless min_tokens or ignore_eos."""
    plain = await engines(model_dir)
    reference = await greedy(plain, prompts[3])
    eos = reference.token_ids[1]
    first_eos = reference.token_ids.index(eos)
    engine = await engines(with_eos(eos))

    stopped = await collect(engine, prompts[3], max_tokens=N, temperature=0.0)
    assert stopped.token_ids == reference.token_ids[: first_eos + 1]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.stop_reason is None

    ignored = await collect(engine, prompts[3], max_tokens=N, temperature=0.0, ignore_eos=True)
    assert ignored.token_ids == reference.token_ids
    assert ignored.finish_reason is FinishReason.LENGTH

    min_tokens = first_eos + 3
    held = await collect(engine, prompts[3], max_tokens=N, min_tokens=min_tokens, temperature=0.0)
    assert len(held.token_ids) >= min_tokens
    assert eos not in held.token_ids[:min_tokens]  # eos is masked until min_tokens exist
    assert held.token_ids[:first_eos] == reference.token_ids[:first_eos]
    # min_tokens masks stop token ids too.
    by_id = await greedy(plain, prompts[3], stop_token_ids=(eos,), min_tokens=min_tokens)
    assert eos not in by_id.token_ids[:min_tokens]
    assert len(by_id.token_ids) >= min_tokens


async def test_seeded_sampling_reproducible_with_others_in_flight(engine: Engine, prompts) -> None:
    params = {"max_tokens": N, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "ignore_eos": True}
    alone = await collect(engine, prompts[0], seed=1234, **params)
    crowd = await asyncio.gather(
        collect(engine, prompts[0], request_id="seeded", seed=1234, **params),
        *(collect(engine, p, request_id=f"other{i}", **params) for i, p in enumerate(prompts)),
    )
    assert crowd[0].token_ids == alone.token_ids
    other_seed = await collect(engine, prompts[0], seed=99, **params)
    assert other_seed.token_ids != alone.token_ids
    greedy_run = await greedy(engine, prompts[0])
    assert greedy_run.token_ids != alone.token_ids  # temperature 1 really samples


async def test_concurrent_greedy_equals_alone(engine: Engine, prompts, engine_case: Any) -> None:
    alone = [await greedy(engine, p, request_id=f"a{i}") for i, p in enumerate(prompts)]
    together = await asyncio.gather(
        *(greedy(engine, p, request_id=f"t{i}") for i, p in enumerate(prompts))
    )
    for a, t in zip(alone, together, strict=True):
        assert t.token_ids == a.token_ids
        assert_same_logprobs(t.logprobs, a.logprobs, engine_case)
        if engine_case.routes:
            np.testing.assert_array_equal(t.routed_experts, a.routed_experts)


async def test_abort_mid_stream(engine: Engine, prompts) -> None:
    request = EngineRequest(
        request_id="long",
        prompt_token_ids=tuple(prompts[0]),
        sampling=SamplingParams(
            max_tokens=2000, temperature=0.0, ignore_eos=True, cap_to_context=True
        ),
    )
    stream = engine.generate(request)
    received = [await anext(stream) for _ in range(3)]
    assert all(c.finish_reason is None for c in received)
    await asyncio.sleep(0.05)  # let the engine run ahead: those outputs must be dropped
    await engine.abort("long")
    with pytest.raises(RequestAborted):
        await anext(stream)
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    await engine.abort("long")  # idempotent
    await engine.abort("never-existed")  # unknown ids are fine
    # The engine still serves, and the id can be reused.
    again = await greedy(engine, prompts[0], n=4, request_id="long")
    assert len(again.token_ids) == 4


async def test_abort_before_generate_ends_that_request_unrun(engine: Engine, prompts) -> None:
    # A worker may stop an attempt it is still opening: abort() reaches the engine before
    # generate() registered the request. Before, every real engine ignored the unknown id and
    # the request then ran to its end (a weight update waited a whole generation on old
    # weights; SIGTERM aborted nothing).
    await engine.abort("early")
    stream = engine.generate(
        EngineRequest(
            request_id="early",
            prompt_token_ids=tuple(prompts[0]),
            sampling=SamplingParams(
                max_tokens=2000, temperature=0.0, ignore_eos=True, cap_to_context=True
            ),
        )
    )
    with pytest.raises(RequestAborted):
        await anext(stream)
    assert "early" not in getattr(engine, "in_flight", [])
    # The abort is spent: the engine still serves, and the id can be used again.
    again = await greedy(engine, prompts[0], n=4, request_id="early")
    assert len(again.token_ids) == 4


async def test_abort_from_another_task(engine: Engine, prompts) -> None:
    got: list[int] = []

    async def consume() -> None:
        async for chunk in engine.generate(
            EngineRequest(
                request_id="bg",
                prompt_token_ids=tuple(prompts[1]),
                sampling=SamplingParams(
                    max_tokens=2000, temperature=0.0, ignore_eos=True, cap_to_context=True
                ),
            )
        ):
            got.extend(chunk.token_ids.tolist())

    task = asyncio.create_task(consume())
    while len(got) < 2:
        await asyncio.sleep(0.005)
    await engine.abort("bg")
    n_at_abort = len(got)
    with pytest.raises(RequestAborted):
        await task
    assert len(got) == n_at_abort  # nothing arrived after abort returned
    assert n_at_abort < 2000


async def test_bad_requests_fail_alone(engine: Engine, prompts) -> None:
    # Refused as the request's fault (RequestRejected: the worker fails it as request_error,
    # no retry), against the limits the engine reports.
    context, vocab = engine.limits.context_length, engine.limits.vocab_size
    assert context is not None and vocab is not None
    bad = [([1, 10_000_000], 3), ([1, vocab], 3), ([1] * context, 1), ([1, 2], context - 1)]
    for prompt, max_tokens in bad:
        with pytest.raises(RequestRejected):
            await collect(engine, prompt, max_tokens=max_tokens)
    out = await greedy(engine, prompts[0], n=3)
    assert len(out.token_ids) == 3


async def test_load_weights(
    engines, model_dir: Path, second_checkpoint: Path, prompts, engine_case: Any
) -> None:
    engine = await engines(model_dir)
    reference = await engines(second_checkpoint, weight_version=7)
    before = await greedy(engine, prompts[0])
    expected = await greedy(reference, prompts[0])
    assert before.token_ids != expected.token_ids

    await engine.load_weights(str(second_checkpoint), 7)
    assert engine.weight_version == 7
    after = await greedy(engine, prompts[0])
    assert after.token_ids == expected.token_ids
    assert_same_logprobs(after.logprobs, expected.logprobs, engine_case)
    assert set(after.weight_versions) == {7}


async def test_load_weights_under_inflight_request(
    engines, model_dir: Path, second_checkpoint: Path, prompts, engine_case: Any
) -> None:
    """In-flight requests continue on the new weights from a recomputed KV cache."""
    # Long enough that the request is usually still generating when the load lands: at N
    # tokens a fast machine (~4 ms steps) once finished all of them first. A loaded one can
    # still: a vLLM server's engine core runs apart from its API process and from this test's,
    # so when both are starved of CPU it generates every token before the first chunk comes
    # (CI runs lost three rounds of 4 * N, then rounds of 96, 192, 384, 384, 384 and 384
    # tokens). Then the round is run again, on the first weights put back under a new version,
    # with up to 16 * N tokens, and every other round sends the load right after the request,
    # without waiting for a chunk (such a load may land before the request starts: all its
    # tokens new, the round run again). A round counts when one request has tokens of both
    # versions; an engine that never switches a request in flight still fails, six times.
    engine = await engines(model_dir)
    reference = await engines(second_checkpoint, weight_version=1)
    for round_ in range(6):
        n = min(4 * N << round_, 16 * N)  # 96, 192, 384, ...: 384 still fits the context of 512
        before = engine.weight_version
        if round_:
            before += 1
            await engine.load_weights(str(model_dir), before)
        request = EngineRequest(
            request_id=f"inflight-{round_}",
            prompt_token_ids=tuple(prompts[2]),
            sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
        )
        stream = engine.generate(request)

        async def first_chunks(stream: AsyncIterator[Chunk] = stream) -> list[Chunk]:
            return [await anext(stream) for _ in range(3)]

        reading = asyncio.create_task(first_chunks())
        if round_ % 2:
            await asyncio.sleep(0.05)  # the request out (its first anext has run)
        else:
            await asyncio.wait({reading})
        await engine.load_weights(str(second_checkpoint), before + 1)
        chunks = await reading
        chunks += [c async for c in stream]
        versions = [c.weight_version for c in chunks]
        if (versions[0], versions[-1]) == (before, before + 1):
            break
    assert versions == sorted(versions)
    assert (versions[0], versions[-1]) == (before, before + 1)
    # Tokens, not chunks: vLLM merges outputs that queued up while the consumer was away (here,
    # awaiting the load), so one chunk can carry several tokens.
    old = [int(t) for c in chunks if c.weight_version == before for t in c.token_ids]
    new = [int(t) for c in chunks if c.weight_version == before + 1 for t in c.token_ids]
    assert len(old) + len(new) == n
    # The tokens after the swap are exactly a fresh new-weights run resumed from the old ones.
    continuation = await greedy(reference, prompts[2] + old, n=n - len(old))
    assert new == continuation.token_ids


async def test_load_weights_rejects_other_architecture(
    engine: Engine, engine_case: Any, tmp_path: Path, prompts
) -> None:
    other = make_tiny_model(tmp_path / "other", moe=not engine_case.moe, seed=0)
    before = await greedy(engine, prompts[0])
    with pytest.raises(EngineError):
        await engine.load_weights(str(other), 5)
    with pytest.raises(EngineError):
        await engine.load_weights(str(tmp_path / "missing"), 6)
    assert engine.weight_version == 0
    assert (await greedy(engine, prompts[0])).token_ids == before.token_ids


async def test_logprobs_match_a_direct_forward(
    engine: Engine, model_dir: Path, prompts, engine_case: Any
) -> None:
    out = await collect(engine, prompts[1], max_tokens=N, temperature=0.8, seed=7, ignore_eos=True)
    assert np.all(np.isfinite(out.logprobs))
    assert np.all(out.logprobs <= 0.0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompts[1] + out.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    start = len(prompts[1]) - 1
    expected = torch.log_softmax(logits[start : start + N], dim=-1)
    expected = expected.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0].numpy()
    # Raw-model logprobs (vLLM's default), not the temperature-scaled distribution.
    np.testing.assert_allclose(out.logprobs, expected, rtol=0, atol=engine_case.hf_logprob_tol)


def assert_top_logprobs(out: Generation, k: int, vocab: int, tol: float) -> None:
    """vLLM's ``logprobs=k``: every chunk carries [n, k] top arrays of valid, distinct ids whose
    logprobs are finite, <= 0 and sorted descending; under greedy the sampled token's logprob
    is the top-1 one."""
    assert out.chunks
    for chunk in out.chunks:
        n = len(chunk.token_ids)
        ids, lps = chunk.top_token_ids, chunk.top_logprobs
        assert ids is not None and lps is not None
        assert ids.dtype == np.int32 and lps.dtype == np.float32
        assert ids.shape == lps.shape == (n, k)
        assert ids.min() >= 0 and ids.max() < vocab
        assert all(len(set(row)) == k for row in ids.tolist())
        assert np.all(np.isfinite(lps)) and np.all(lps <= 0.0)
        assert np.all(np.diff(lps, axis=1) <= 0.0)
    top1 = np.concatenate([c.top_logprobs[:, 0] for c in out.chunks])  # type: ignore[index]
    np.testing.assert_allclose(out.logprobs, top1, rtol=0, atol=tol)


async def test_top_logprobs_per_token_with_logprobs_k(
    engine: Engine, prompts, engine_case: Any
) -> None:
    vocab = engine.limits.vocab_size
    assert vocab is not None
    plain = await greedy(engine, prompts[0])
    assert all(c.top_token_ids is None and c.top_logprobs is None for c in plain.chunks)
    for k in (1, 5):
        out = await greedy(engine, prompts[0], request_id=f"top{k}", logprobs=k)
        # Asking for top-k changes nothing of what is sampled.
        assert out.token_ids == plain.token_ids
        assert_same_logprobs(out.logprobs, plain.logprobs, engine_case)
        assert_top_logprobs(out, k, vocab, engine_case.logprob_tol)
        assert_well_formed(out, routes=engine_case.routes)


async def test_top_logprobs_are_the_raw_distributions_top_k(
    engine: Engine, model_dir: Path, prompts, engine_case: Any
) -> None:
    """The top-k come from the raw logits (vLLM's default ``raw_logprobs``), as the sampled
    logprob does: not from the temperature-scaled or top-p-masked distribution."""
    k = 4
    out = await collect(
        engine, prompts[1], max_tokens=N, temperature=0.8, top_p=0.5, seed=7,
        ignore_eos=True, logprobs=k,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompts[1] + out.token_ids])).logits[0].float()
    start = len(prompts[1]) - 1
    expected = torch.topk(torch.log_softmax(logits[start : start + N], dim=-1), k).values
    got = np.concatenate([c.top_logprobs for c in out.chunks])  # type: ignore[misc]
    np.testing.assert_allclose(got, expected.numpy(), rtol=0, atol=engine_case.hf_logprob_tol)


async def test_synthetic_engine_top_logprobs_meet_the_contract() -> None:
    """The synthetic engine (not a model, so not in ENGINE_CASES) under the same checks."""
    engine = SyntheticEngine(tokens_per_chunk=5, vocab=64)
    request = EngineRequest(
        request_id="s", prompt_token_ids=(60, 3),
        sampling=SamplingParams(max_tokens=12, temperature=0.0, logprobs=3),
    )  # fmt: skip
    out = await collect_request(engine, request)
    assert_top_logprobs(out, 3, 64, 0.0)
    np.testing.assert_array_equal(
        np.concatenate([c.top_token_ids for c in out.chunks])[:, 0],  # type: ignore[misc]
        out.token_ids,
    )
