"""In-process vLLM beyond the shared contract: abort mid-stream then resume equals the
uninterrupted greedy run (float32), and an in-place reload equals a fresh engine on the new
weights, for the dense and the MoE tiny model (the MoE case needs the CPU repack fix in
workers/engines/vllm/ext.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from statemachine.request import SamplingParams
from tests.engines.stream import collect_request, merge_chunks
from workers.demo.tiny_model import make_tiny_checkpoint
from workers.engines.base import EngineRequest
from workers.engines.errors import RequestAborted

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

N = 40
PROMPTS = [(11, 402, 97, 1203, 7), (5, 6, 7, 8, 9, 10, 11), (1500, 3, 77), (42,) * 6]


# Module scope groups the tests by model, MoE first: the contract suite's last in-process
# case leaves the MoE engines in the pool.
@pytest.fixture(scope="module", params=["moe", "dense"])
def model(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture
def new_weights(model: Path, _checkpoints: dict[Path, Path], tmp_path_factory) -> Path:
    """The contract suite's seed-1 checkpoint of `model` (a pooled engine may exist on it)."""
    if model not in _checkpoints:
        _checkpoints[model] = make_tiny_checkpoint(
            tmp_path_factory.mktemp("v2") / "v2", like=model, seed=1
        )
    return _checkpoints[model]


def greedy(rid: str, prompt: tuple[int, ...], n: int = N) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
    )


async def test_abort_mid_stream_then_resume_is_exact(vllm_pool, model: Path) -> None:
    """Invariant 3 on vLLM: abort at several points (others in flight, so batches differ),
    resume with prompt + partial: exactly the uninterrupted tokens, logprobs within 1e-4."""
    engine = await vllm_pool.get(model)
    full = [await collect_request(engine, greedy(f"full{i}", p)) for i, p in enumerate(PROMPTS)]
    for cut in (1, 9, 23):
        others = [
            asyncio.create_task(collect_request(engine, greedy(f"o{cut}-{i}", p)))
            for i, p in enumerate(PROMPTS[1:])
        ]
        stream = engine.generate(greedy(f"cut{cut}", PROMPTS[0]))
        head = []
        while sum(len(c.token_ids) for c in head) < cut:
            head.append(await anext(stream))
        await engine.abort(f"cut{cut}")
        with pytest.raises(RequestAborted):
            await anext(stream)
        partial = merge_chunks(head)
        rest = await collect_request(
            engine,
            greedy(f"rest{cut}", PROMPTS[0] + tuple(partial.token_ids), N - len(partial.token_ids)),
        )
        assert partial.token_ids + rest.token_ids == full[0].token_ids
        np.testing.assert_allclose(
            np.concatenate([partial.logprobs, rest.logprobs]), full[0].logprobs, atol=1e-4, rtol=0
        )
        for task, reference in zip(others, full[1:], strict=True):
            assert (await task).token_ids == reference.token_ids  # batching changed nothing


async def test_reload_equals_fresh_engine_and_back(vllm_pool, model: Path, new_weights) -> None:
    new = new_weights
    fresh = await vllm_pool.get(new, 3)
    expected = [await collect_request(fresh, greedy(f"f{i}", p)) for i, p in enumerate(PROMPTS)]
    fresh_sum = await fresh.weight_checksum()

    engine = await vllm_pool.get(model)
    before = [await collect_request(engine, greedy(f"b{i}", p)) for i, p in enumerate(PROMPTS)]
    before_sum = await engine.weight_checksum()
    await engine.load_weights(str(new), 3)
    assert engine.weight_version == 3
    # Every parameter (MoE experts included) now equals the fresh engine's.
    assert await engine.weight_checksum() == pytest.approx(fresh_sum, rel=0, abs=1e-6)
    after = await asyncio.gather(
        *(collect_request(engine, greedy(f"a{i}", p)) for i, p in enumerate(PROMPTS))
    )
    for a, e in zip(after, expected, strict=True):
        assert a.token_ids == e.token_ids
        np.testing.assert_allclose(a.logprobs, e.logprobs, atol=1e-4, rtol=0)
        assert set(a.weight_versions) == {3}

    await engine.load_weights(str(model), 0)  # and back: the original outputs again
    assert await engine.weight_checksum() == pytest.approx(before_sum, rel=0, abs=1e-6)
    again = [await collect_request(engine, greedy(f"g{i}", p)) for i, p in enumerate(PROMPTS)]
    assert [g.token_ids for g in again] == [b.token_ids for b in before]


async def test_requests_in_flight_across_a_reload_continue_exactly(
    vllm_pool, model: Path, new_weights: Path
) -> None:
    """Four streams across a swap: each chunk carries one version, old tokens first, and the
    new-weights tail equals a fresh new-weights run resumed from the old tokens."""
    new = new_weights
    engine = await vllm_pool.get(model)
    streams = [engine.generate(greedy(f"s{i}", p)) for i, p in enumerate(PROMPTS)]
    chunks = [[await anext(s)] for s in streams]
    await engine.load_weights(str(new), 4)
    for s, got in zip(streams, chunks, strict=True):
        got.extend([c async for c in s])
    fresh = await vllm_pool.get(new, 4)
    for prompt, got in zip(PROMPTS, chunks, strict=True):
        versions = [c.weight_version for c in got]
        assert versions == sorted(versions)
        old = [int(t) for c in got if c.weight_version == 0 for t in c.token_ids]
        new_tokens = [int(t) for c in got if c.weight_version == 4 for t in c.token_ids]
        assert len(old) + len(new_tokens) == N
        if new_tokens:
            tail = await collect_request(fresh, greedy("t", prompt + tuple(old), N - len(old)))
            assert new_tokens == tail.token_ids
