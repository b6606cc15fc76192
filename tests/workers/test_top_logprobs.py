"""Top-k logprobs (``logprobs=k``) through a worker: recorded with every checkpoint, so a
rollout aborted mid-generation and resumed by another worker returns the top-k of every token,
equal to an uninterrupted run's (greedy, the CPU engine on the tiny model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aredis

from statemachine import AbortReason, SamplingParams, Status, TokensAppended
from store import EventStore
from store.redis_server import RedisServer
from store.results import RolloutResult
from tests import factories as f
from tests.engine_pool import EnginePool
from workers.checkpoint import Cadence, Checkpointer
from workers.outcomes import Outcome
from workers.runner import RolloutRunner

# The CPU engines are pooled on the session loop.
pytestmark = pytest.mark.asyncio(loop_scope="session")

N, K = 24, 2
PROMPT = (5, 17, 29, 41)


def sampling() -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=K)


def runner(store: EventStore, engine: object, worker: str, stepped: bool) -> RolloutRunner:
    checkpoints = Checkpointer(store, cadence=Cadence(tokens=4, interval_s=60))
    return RolloutRunner(store, checkpoints, engine, worker, stepped=stepped)  # type: ignore[arg-type]


@pytest.mark.parametrize("stepped", [True, False], ids=["steps", "streams"])
async def test_a_resumed_rollout_returns_the_top_k_of_every_token_as_an_uninterrupted_one(
    redis_server: RedisServer, cpu_pool: EnginePool, tiny_dense_dir: Path, stepped: bool
) -> None:
    # A client of this (session) loop, the pooled engine's.
    client = aredis.Redis.from_url(redis_server.url)
    try:
        await client.flushall()
        await _abort_resume_and_compare(EventStore(client), cpu_pool, tiny_dense_dir, stepped)
    finally:
        await client.aclose()


async def _abort_resume_and_compare(
    store: EventStore, cpu_pool: EnginePool, tiny_dense_dir: Path, stepped: bool
) -> None:
    engine = await cpu_pool.get(tiny_dense_dir)
    for rid in ("whole", "cut"):
        await store.append(
            None, f.submitted(rid, prompt=PROMPT, **{**_kw(sampling()), "max_tokens": N})
        )
    whole = await runner(store, engine, "w0", stepped).run("whole")
    assert whole.outcome is Outcome.FINISHED

    first = runner(store, engine, "w1", stepped)
    task = asyncio.create_task(first.run("cut"))
    while (await store.load("cut")).num_tokens < 8:  # some checkpoints saved, more to come
        await asyncio.sleep(0.005)
    await first.stop("cut", AbortReason.WORKER_LOST, "test")
    aborted = await task
    assert aborted.outcome is Outcome.ABORTED and 8 <= aborted.state.num_tokens < N
    resumed = await runner(store, engine, "w2", stepped).run("cut")
    assert resumed.outcome is Outcome.FINISHED and resumed.state.attempt == 2

    ref = RolloutResult.from_state(await store.load("whole"))
    got = RolloutResult.from_state(await store.load("cut"))
    assert got.status is Status.DONE and got.aborts == 1
    assert got.response_token_ids.tolist() == ref.response_token_ids.tolist()
    assert ref.top_token_ids is not None and ref.top_logprobs is not None
    assert got.top_token_ids is not None and got.top_logprobs is not None
    assert got.top_token_ids.shape == got.top_logprobs.shape == (N, K)
    np.testing.assert_array_equal(got.top_token_ids, ref.top_token_ids)
    np.testing.assert_allclose(got.top_logprobs, ref.top_logprobs, rtol=0, atol=1e-5)
    # Greedy: each token is its position's most likely one.
    assert got.top_token_ids[:, 0].tolist() == got.response_token_ids.tolist()
    np.testing.assert_allclose(got.top_logprobs[:, 0], got.logprobs, rtol=0, atol=1e-6)
    # Every chunk of both attempts carried them, and the replay agrees with the snapshot.
    chunks = [e for e in await store.events("cut") if isinstance(e, TokensAppended)]
    assert {e.attempt for e in chunks} == {1, 2} and all(e.top_k == K for e in chunks)
    assert await store.load("cut") == await store.replay("cut")


def _kw(s: SamplingParams) -> dict[str, object]:
    return {k: v for k, v in s.to_dict().items() if k != "max_tokens"}
