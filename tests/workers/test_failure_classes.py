"""Failure classes on a real redis-server with an in-process worker: a request the engine can
never serve fails at once as request_error (one attempt, no retry); one that asked to be capped
generates what fits; a rollout whose workers keep dying fails as worker_lost."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aredis
from redis import Redis
from rq.registry import FailedJobRegistry, FinishedJobRegistry

from statemachine import (
    AbortReason,
    FailureClass,
    FinishReason,
    RolloutRequest,
    SamplingParams,
    Status,
)
from store import EventStore
from store.client import RolloutClient
from store.leases import Leases
from store.queue import enqueue_rollouts, rollout_queue
from store.redis_server import RedisServer
from tests import factories as f
from tests.engine_pool import EnginePool
from workers.engines.synthetic import SyntheticEngine
from workers.reaper import Reaper
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.redis_server

CONTEXT = 32


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


async def burst(server: RedisServer, engine: object, **kw: object) -> Worker:
    worker = Worker(WorkerConfig(redis_url=server.url, burst=True, **kw), engine)  # type: ignore[arg-type]
    await worker.run()
    return worker


def event_names(events: list) -> list[str]:
    return [type(e).__name__ for e in events]


async def test_requests_the_engine_can_never_serve_fail_at_once(server: RedisServer) -> None:
    client = RolloutClient(server.url)
    cases = {
        "too_long": RolloutRequest(
            prompt_token_ids=tuple(range(1, CONTEXT + 1)), sampling=greedy(4)
        ),
        "out_of_vocab": RolloutRequest(prompt_token_ids=(5, 40_000, 7), sampling=greedy(4)),
        "stop_id_out_of_vocab": RolloutRequest(
            prompt_token_ids=(5, 6, 7), sampling=greedy(4, stop_token_ids=(99_999,))
        ),
        "beyond_context": RolloutRequest(prompt_token_ids=(1,) * 8, sampling=greedy(CONTEXT)),
        "capped": RolloutRequest(
            prompt_token_ids=(1,) * 8, sampling=greedy(CONTEXT, cap_to_context=True)
        ),
        "fits": RolloutRequest(prompt_token_ids=(1,) * 8, sampling=greedy(CONTEXT - 8)),
    }
    ids = await client.submit(list(cases.values()), ids=list(cases))
    engine = SyntheticEngine(context_length=CONTEXT)  # vocab 32,000
    await burst(server, engine, max_engine_attempts=3)
    results = {r.rollout_id: r for r in await client.wait(ids, timeout=30)}

    messages = {
        "too_long": "prompt of 32 tokens leaves no room within context_length=32",
        "out_of_vocab": "prompt token ids outside the vocabulary (size 32000): [40000]",
        "stop_id_out_of_vocab": "stop_token_ids token ids outside the vocabulary",
        "beyond_context": "prompt of 8 tokens + max_tokens 32 exceeds",
    }
    for rid, message in messages.items():
        r = results[rid]
        assert r.status is Status.FAILED, rid
        assert r.failure is FailureClass.REQUEST_ERROR, rid
        assert r.attempts == 1, rid  # no retry: the engine-error budget of 3 is untouched
        assert message in (r.error or ""), (rid, r.error)
        assert event_names(await client.store.events(rid)) == ["Submitted", "Started", "Failed"]
    # Capped: what fits in the context, ended by length; the one that fits runs in full.
    capped = results["capped"]
    assert capped.status is Status.DONE and capped.finish_reason is FinishReason.LENGTH
    assert len(capped.response_token_ids) == CONTEXT - 8
    assert results["fits"].status is Status.DONE
    assert len(results["fits"].response_token_ids) == CONTEXT - 8
    # rq: the refused ones are failed jobs (with the reason), nothing went back to the queue.
    queue = rollout_queue(Redis.from_url(server.url))
    assert FailedJobRegistry(queue=queue).count == len(messages)
    assert FinishedJobRegistry(queue=queue).count == 2
    assert queue.count == 0
    await client.aclose()


async def test_a_request_the_engine_refuses_mid_submission_is_not_retried(
    server: RedisServer,
) -> None:
    # The engine's own refusal (RequestRejected from generate, as vLLM's validation becomes),
    # not the worker's pre-check: still one attempt, request_error.
    client = RolloutClient(server.url)
    ids = await client.submit(
        [RolloutRequest(prompt_token_ids=(1, 2, 3), sampling=greedy(8))] * 2, ids=["bad", "good"]
    )
    await burst(server, SyntheticEngine(reject_rollouts=["bad"]))
    bad, good = await client.wait(ids, timeout=30)
    assert bad.status is Status.FAILED and bad.failure is FailureClass.REQUEST_ERROR
    assert bad.attempts == 1 and "reject list" in (bad.error or "")
    assert good.status is Status.DONE
    await client.aclose()


async def test_engine_errors_keep_their_budget_and_class(server: RedisServer) -> None:
    client = RolloutClient(server.url)
    [rid] = await client.submit([RolloutRequest(prompt_token_ids=(1, 7, 2), sampling=greedy(8))])
    await burst(server, SyntheticEngine(poison_token=7), max_engine_attempts=2)
    [r] = await client.wait([rid], timeout=30)
    assert r.status is Status.FAILED and r.failure is FailureClass.ENGINE_ERROR
    assert r.attempts == 2 and "poison token 7" in (r.error or "")
    await client.aclose()


@pytest.mark.slow
async def test_the_cpu_engine_refuses_what_its_model_cannot_serve(
    server: RedisServer, cpu_pool: EnginePool, tiny_dense_dir: Path
) -> None:
    engine = await cpu_pool.get(tiny_dense_dir)
    context, vocab = engine.limits.context_length, engine.limits.vocab_size
    assert context is not None and vocab is not None
    client = RolloutClient(server.url)
    requests = [
        RolloutRequest(prompt_token_ids=(3,) * context, sampling=greedy(2)),
        RolloutRequest(prompt_token_ids=(5, vocab, 7), sampling=greedy(2)),
        RolloutRequest(prompt_token_ids=(5, 6, 7), sampling=greedy(context)),
        RolloutRequest(prompt_token_ids=(5, 6, 7), sampling=greedy(4)),
    ]
    ids = await client.submit(requests, ids=["long", "vocab", "budget", "good"])
    await burst(server, engine)
    results = await client.wait(ids, timeout=120)
    assert [r.status for r in results] == [Status.FAILED] * 3 + [Status.DONE]
    for r in results[:3]:
        assert r.failure is FailureClass.REQUEST_ERROR and r.attempts == 1, r.error
    assert f"prompt of {context} tokens leaves no room" in (results[0].error or "")
    assert "outside the vocabulary" in (results[1].error or "")
    assert f"exceeds context_length={context}" in (results[2].error or "")
    await client.aclose()


# -- the worker-lost budget, where it is decided: the reaper and a takeover -------------------


async def _lost_times(store: EventStore, rid: str, times: int) -> None:
    """A rollout whose workers already died ``times`` times, now generating on "dead"."""
    s = await store.append(None, f.submitted(rid, max_tokens=64, prompt=(1, 2, 3)))
    for i in range(times + 1):
        s = await store.append(s, (f.started if s.attempt == 0 else f.resumed)(s, worker="dead"))
        if i < times:
            s = await store.append(s, f.aborted(s, AbortReason.WORKER_LOST))


async def _expire(leases: Leases, rid: str) -> None:
    await leases.take(rid, 0.001)


async def test_the_reaper_fails_a_rollout_whose_workers_keep_dying(server: RedisServer) -> None:
    redis = aredis.Redis.from_url(server.url)
    store, leases = EventStore(redis), Leases(redis)
    await _lost_times(store, "poison", 4)  # the 5th loss spends a budget of 5
    await _lost_times(store, "unlucky", 3)  # the 4th does not
    for rid in ("poison", "unlucky"):
        await _expire(leases, rid)
    reaper = Reaper(store, leases, Redis.from_url(server.url), max_worker_lost=5)
    given_back = []
    for _ in range(50):  # until both leases are seen expired
        given_back += await reaper.reap_once()
        if (await store.load("poison")).terminal and given_back:
            break
    poison = await store.load("poison")
    assert poison.status is Status.FAILED and poison.failure is FailureClass.WORKER_LOST
    assert "5 workers were lost" in (poison.error or "")
    assert event_names(await store.events("poison"))[-2:] == ["Aborted", "Failed"]
    assert given_back == ["unlucky"]  # requeued; the failed one is not
    assert (await store.load("unlucky")).status is Status.ABORTED
    await redis.aclose()


async def test_a_takeover_that_spends_the_budget_fails_instead_of_resuming(
    server: RedisServer,
) -> None:
    redis = aredis.Redis.from_url(server.url)
    store = EventStore(redis)
    await _lost_times(store, "poison", 2)
    # Live on a dead worker, with no lease for the reaper to see (it died as it took it): the
    # next job for it takes it over, which is the 3rd worker lost under it.
    queue = rollout_queue(Redis.from_url(server.url))
    enqueue_rollouts(queue, ["poison"])
    await burst(server, SyntheticEngine(), max_worker_lost=3)
    state = await store.load("poison")
    assert state.status is Status.FAILED and state.failure is FailureClass.WORKER_LOST
    assert "taken over by" in (state.error or "")
    assert event_names(await store.events("poison"))[-2:] == ["Aborted", "Failed"]
    assert FailedJobRegistry(queue=queue).count == 1
    await redis.aclose()
