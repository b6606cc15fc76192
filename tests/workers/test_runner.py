"""The rollout runner in-process, on a real redis-server: checkpoints, clamping, takeover."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aredis

from statemachine import AbortReason, Status
from statemachine.arrays import LOGPROB_FLOOR
from store import EventStore, StaleAttempt
from store.leases import Leases
from tests import factories as f
from workers.checkpoint import Cadence, Checkpointer
from workers.engines.base import Chunk, EngineRequest
from workers.engines.synthetic import SyntheticEngine
from workers.outcomes import Outcome, Stats
from workers.runner import RolloutRunner


class NonFiniteEngine(SyntheticEngine):
    """Every 5th logprob NaN, every 7th +inf or -inf: what a GPU occasionally returns."""

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        async for chunk in super().generate(request):
            lp = chunk.logprobs.copy()
            base = request.sampling.max_tokens - len(lp)  # not the offset; any pattern will do
            idx = np.arange(len(lp)) + base
            lp[idx % 5 == 0] = np.nan
            lp[idx % 7 == 0] = np.inf
            lp[idx % 11 == 0] = -np.inf
            yield Chunk(
                token_ids=chunk.token_ids,
                logprobs=lp,
                routed_experts=chunk.routed_experts,
                finish_reason=chunk.finish_reason,
                weight_version=chunk.weight_version,
            )


async def submit(store: EventStore, rid: str, max_tokens: int) -> None:
    await store.append(None, f.submitted(rid, max_tokens=max_tokens))


async def test_nonfinite_logprobs_are_clamped_counted_and_harmless(
    real_redis: aredis.Redis,
) -> None:
    assert LOGPROB_FLOOR == -9999.0  # the documented floor
    store = EventStore(real_redis)
    await submit(store, "nan", 64)
    stats = Stats()
    runner = RolloutRunner(
        store,
        Checkpointer(store),
        NonFiniteEngine(tokens_per_chunk=4),
        "w",
        cadence=Cadence(tokens=8),
        stats=stats,
    )
    result = await runner.run("nan")
    assert result.outcome is Outcome.FINISHED and result.state.status is Status.DONE
    state = await store.load("nan")
    assert state.num_tokens == 64 and np.isfinite(state.logprobs).all()
    clamped = int((state.logprobs == np.float32(-9999.0)).sum())
    assert clamped > 10
    assert state.nonfinite_logprobs == clamped == stats.nonfinite_logprobs
    assert state == await store.replay("nan")


class RecordingStore(EventStore):
    """Remembers which rollouts' events went to Redis together, one entry per round trip."""

    def __init__(self, redis: aredis.Redis) -> None:
        super().__init__(redis)
        self.batches: list[list[tuple[str, str]]] = []

    async def append_many(self, chains):  # type: ignore[no-untyped-def]
        self.batches.append(
            [(e.rollout_id, type(e).__name__) for _, events in chains for e in events]
        )
        return await super().append_many(chains)


class PacedEngine(SyntheticEngine):
    """One token every `pace_s` seconds per request, like a real decode loop."""

    def __init__(self, pace_s: float, **kw: object) -> None:
        super().__init__(tokens_per_chunk=1, **kw)  # type: ignore[arg-type]
        self.pace_s = pace_s

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        async for chunk in super().generate(request):
            await asyncio.sleep(self.pace_s)
            yield chunk


async def test_rollouts_started_apart_checkpoint_together_on_the_worker_clock(
    real_redis: aredis.Redis,
) -> None:
    # Rollouts that start at different moments must not each keep a timer of their own (one
    # round trip per checkpoint): they share the worker's flush points.
    store = RecordingStore(real_redis)
    n, tokens, interval = 4, 60, 0.1
    for i in range(n):
        await submit(store, f"p{i}", tokens)
    runner = RolloutRunner(
        store,
        Checkpointer(store),
        PacedEngine(0.01),
        "w",
        cadence=Cadence(tokens=10_000, interval_s=interval),  # only the clock flushes
    )

    async def run_later(i: int) -> object:
        await asyncio.sleep(0.033 * i)  # starts a third of an interval apart
        return await runner.run(f"p{i}")

    results = await asyncio.gather(*(run_later(i) for i in range(n)))
    assert all(r.outcome is Outcome.FINISHED for r in results)  # type: ignore[attr-defined]
    # Mid-rollout checkpoints: batches of TokensAppended only (a last chain ends in Finished).
    mid = [b for b in store.batches if {t for _, t in b} == {"TokensAppended"}]
    mid_events = sum(len(b) for b in mid)
    assert mid_events >= 3 * n, store.batches  # the clock flushed each rollout several times
    # Unaligned, each would be a round trip of its own; here most flush points carry them all.
    assert len(mid) * 2 <= mid_events, store.batches
    shared = [b for b in mid if len({rid for rid, _ in b}) > 1]
    assert len(shared) * 4 >= len(mid) * 3, store.batches
    for i in range(n):
        state = await store.load(f"p{i}")
        assert state.num_tokens == tokens and state == await store.replay(f"p{i}")


async def test_checkpoints_follow_the_cadence_and_group_commit(real_redis: aredis.Redis) -> None:
    store = EventStore(real_redis)
    for i in range(4):
        await submit(store, f"c{i}", 40)
    checkpointer = Checkpointer(store)
    runner = RolloutRunner(
        store,
        checkpointer,
        SyntheticEngine(tokens_per_chunk=4, experts=8),
        "w",
        cadence=Cadence(tokens=8, interval_s=60),
    )
    results = await asyncio.gather(*(runner.run(f"c{i}") for i in range(4)))
    assert all(r.outcome is Outcome.FINISHED for r in results)
    for i in range(4):
        events = await store.events(f"c{i}")
        sizes = [len(e) for e in events if hasattr(e, "token_ids")]
        assert sum(sizes) == 40 and all(n >= 8 for n in sizes[:-1])  # >= K tokens per checkpoint
        state = await store.load(f"c{i}")
        assert state.routed_experts is not None and state.routed_experts.shape == (40, 2, 2)
    # A rollout that reaches K tokens starts a flush point and the others join it. (This engine
    # is instantaneous, so whichever rollout's Started landed a round trip before the others'
    # runs a flush point ahead of them; paced engines align fully: the test above.)
    total_appends = 0
    for i in range(4):
        total_appends += len(await store.events(f"c{i}")) - 1  # all but Submitted
    assert checkpointer.round_trips * 2 <= total_appends, (checkpointer.round_trips, total_appends)


async def test_a_live_attempt_is_taken_over_and_fenced_out(real_redis: aredis.Redis) -> None:
    store = EventStore(real_redis)
    s = await store.append(None, f.submitted("t", max_tokens=32))
    s = await store.append(s, f.started(s, worker="old"))
    s = await store.append(s, f.tokens(s, n=5))  # the old worker saved 5 tokens, then vanished
    runner = RolloutRunner(store, Checkpointer(store), SyntheticEngine(), "new")
    result = await runner.run("t")
    assert result.outcome is Outcome.FINISHED
    state = result.state
    assert state.num_tokens == 32 and state.attempt == 2 and state.aborts == 1
    events = await store.events("t")
    assert [type(e).__name__ for e in events[3:5]] == ["Aborted", "Resumed"]
    assert events[3].reason is AbortReason.WORKER_LOST
    # The old attempt's late write is refused.
    with pytest.raises(StaleAttempt):
        await store.append(s, f.tokens(s, n=1))


async def test_staleness_bound_cancels_instead_of_starting(real_redis: aredis.Redis) -> None:
    from store.client import RolloutClient
    from store.weights import WeightRegistry

    pool = real_redis.connection_pool.connection_kwargs
    url = f"redis://{pool['host']}:{pool['port']}/0"
    client = RolloutClient(url)
    await WeightRegistry(real_redis).publish(3, "/ckpt/3")
    tight, loose = await client.submit(
        [
            dataclasses.replace(f.request(max_tokens=8), max_staleness=1),
            dataclasses.replace(f.request(max_tokens=8), max_staleness=2),
        ]
    )
    store = client.store
    engine = SyntheticEngine(weight_version=5)  # two versions ahead of the admitted v3
    runner = RolloutRunner(store, Checkpointer(store), engine, "w")
    stale = await runner.run(tight)
    assert stale.state.status is Status.CANCELLED and stale.state.num_tokens == 0
    assert "stale: weights v5 are more than 1 versions ahead of v3" in (stale.state.error or "")
    ok = await runner.run(loose)
    assert ok.state.status is Status.DONE and (ok.state.weight_versions == 5).all()
    result = await client.result(loose)
    assert result.admitted_version == 3 and not result.stale
    await client.aclose()


async def test_abort_with_no_new_tokens_and_budget_used_up(real_redis: aredis.Redis) -> None:
    store = EventStore(real_redis)
    # An attempt aborted before producing anything leaves no trace but the two events.
    s = await store.append(None, f.submitted("z", max_tokens=6, min_tokens=4))
    s = await store.append(s, f.started(s))
    s = await store.append(s, f.aborted(s, AbortReason.WEIGHT_UPDATE))
    assert s.num_tokens == 0 and s.resume_sampling().max_tokens == 6
    # Its budget is then used up by an attempt that was aborted right at the end ...
    s = await store.append(s, f.resumed(s))
    s = await store.append(s, f.tokens(s, n=6))
    s = await store.append(s, f.aborted(s, AbortReason.WEIGHT_UPDATE))
    assert s.remaining_tokens == 0
    # ... so the next run finishes it with "length" without asking the engine for anything.
    runner = RolloutRunner(store, Checkpointer(store), SyntheticEngine(poison_token=1), "w")
    result = await runner.run("z")
    assert result.outcome is Outcome.FINISHED and result.state.status is Status.DONE
    assert result.state.finish_reason == "length" and result.state.num_tokens == 6
    assert result.state == await store.replay("z")


async def test_a_capped_rollout_aborted_with_its_context_full_finishes_by_length(
    real_redis: aredis.Redis,
) -> None:
    # cap_to_context: generate what fits. An attempt filled the context (8 + 24 = 32) and was
    # aborted before it could record the finish; resuming it leaves no room for a token.
    # Before: the resume was refused as a request error and the rollout failed.
    store = EventStore(real_redis)
    s = await store.append(
        None, f.submitted("full", max_tokens=100, prompt=(1,) * 8, cap_to_context=True)
    )
    s = await store.append(s, f.started(s))
    s = await store.append(s, f.tokens(s, n=24))
    s = await store.append(s, f.aborted(s, AbortReason.WORKER_LOST))
    engine = SyntheticEngine(context_length=32)
    runner = RolloutRunner(store, Checkpointer(store), engine, "w")
    result = await runner.run("full")
    assert result.outcome is Outcome.FINISHED and result.state.status is Status.DONE
    assert result.state.finish_reason == "length" and result.state.num_tokens == 24
    assert result.state == await store.replay("full")


async def test_a_finished_rollout_frees_its_engine_slot_before_its_last_round_trip(
    real_redis: aredis.Redis,
) -> None:
    store = RecordingStore(real_redis)
    await submit(store, "done", 8)
    await submit(store, "stopped", 400)
    runner = RolloutRunner(store, Checkpointer(store), PacedEngine(0.002), "w")
    freed: dict[str, int] = {}

    class Place:
        def __init__(self, rid: str) -> None:
            self.rid = rid

        async def enter(self) -> None:
            pass

        def nearly_free(self) -> None:
            pass

        def free(self) -> None:
            freed.setdefault(self.rid, len(store.batches))  # round trips sent so far

    result = await runner.run("done", place=Place("done"))
    assert result.outcome is Outcome.FINISHED and result.state.status is Status.DONE
    sent_before = [t for b in store.batches[: freed["done"]] for _, t in b]
    assert "Finished" not in sent_before  # freed before its last chain went to Redis
    assert "Finished" in [t for _, t in store.batches[-1]]

    # An abort keeps its slot until saved (a dying engine or a stopping worker must not take
    # another job meanwhile).
    running = asyncio.create_task(runner.run("stopped", place=Place("stopped")))
    while (await store.load("stopped")).num_tokens == 0:
        await asyncio.sleep(0.01)
    await runner.stop("stopped", AbortReason.SHUTDOWN)
    aborted = await running
    assert aborted.outcome is Outcome.ABORTED and "stopped" not in freed


async def test_a_job_delivered_again_to_the_worker_running_it_leaves_the_run_its_lease(
    real_redis: aredis.Redis,
) -> None:
    """The soak's ``lease_expired`` of a live worker (issue 28): rq delivered a rollout's job
    again to the very worker generating it (its execution, stamped by a host clock stepped
    back, looked abandoned to another worker's sweep). The second run found the lease live
    (a duplicate), but had replaced the live run's record on its way in and deleted it on its
    way out: the rollout left ``active``, the heartbeat stopped renewing its lease, and a
    reaper took the live worker's rollout over 5 s later."""
    store = EventStore(real_redis)
    await submit(store, "dup", 400)
    leases = Leases(real_redis, holder="w")
    engine = SyntheticEngine(token_delay_s=0.005)
    runner = RolloutRunner(store, Checkpointer(store), engine, "w", leases=leases)
    live = asyncio.create_task(runner.run("dup"))
    while not (await store.load("dup")).num_tokens:
        await asyncio.sleep(0.01)
    assert runner.active == ["dup"]

    again = await runner.run("dup")

    assert again.outcome is Outcome.DUPLICATE
    assert runner.active == ["dup"]  # the live run's lease is still this worker's to renew
    await runner.stop("dup", AbortReason.WEIGHT_UPDATE)  # reaches the live run, not the copy
    result = await asyncio.wait_for(live, 10)
    assert result.outcome is Outcome.ABORTED and 0 < result.state.num_tokens < 400
    assert runner.active == [] and await leases.expiry("dup") is None


class CountedLeases(Leases):
    """Leases that count the round trips of their own a runner spends on takes."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.takes: list[list[str]] = []

    async def take_many(self, rollout_ids: list[str], ttl_s: float) -> list[None]:
        self.takes.append(list(rollout_ids))
        return await super().take_many(rollout_ids, ttl_s)


async def test_an_attempt_takes_its_lease_in_the_round_trip_that_opens_it(
    redis_client: aredis.Redis,
) -> None:
    """A fresh attempt (or a resume, or an episode's next turn) sends its lease with its
    ``Started`` in one transaction: no round trip of the lease's own. A takeover still takes
    the lease first, on its own (its worker-lost budget may end the rollout instead)."""
    store = EventStore(redis_client)
    await store.append(None, f.submitted("r1", max_tokens=32))
    leases = CountedLeases(redis_client, holder="w1")
    checkpointer = Checkpointer(store)
    engine = SyntheticEngine(tokens_per_chunk=4, token_delay_s=0.05)
    runner = RolloutRunner(store, checkpointer, engine, "w1", leases=leases)
    task = asyncio.create_task(runner.run("r1"))
    for _ in range(500):
        if (await store.head("r1")).status is Status.GENERATING:
            break
        await asyncio.sleep(0.01)
    left = await leases.left_ms("r1")
    assert left is not None and left > 4_000 and await leases.held_by("w1") == ["r1"]
    assert checkpointer.round_trips == 1 and leases.takes == []  # lease and Started together
    await runner.stop("r1", AbortReason.SHUTDOWN)
    assert (await task).outcome is Outcome.ABORTED and await leases.left_ms("r1") is None
    # A takeover: another worker's attempt is live and its lease lapsed.
    await store.append(await store.head("r1"), f.resumed(await store.head("r1"), worker="w9"))
    other = CountedLeases(redis_client, holder="w2")
    result = await RolloutRunner(store, Checkpointer(store), SyntheticEngine(), "w2",
                                 leases=other).run("r1")  # fmt: skip
    assert result.outcome is Outcome.FINISHED and other.takes == [["r1"]]
