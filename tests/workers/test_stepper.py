"""The runner on a ``StepEngine`` (``workers.stepper``): the same rollouts, events and
guarantees as with per-rollout streams: tokens, offsets and routes exact, resume-exact after
an abort at any step, checkpoints grouped within the cadence, fencing, a dead engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aredis

from statemachine import AbortReason, FinishReason, Status, TokensAppended
from store import EventStore, SequenceConflict
from tests import factories as f
from workers.checkpoint import Cadence, Checkpointer
from workers.engines.base import Chunk, EngineRequest, Step
from workers.engines.errors import EngineDead
from workers.engines.synthetic import SyntheticEngine
from workers.generation import offers_steps
from workers.outcomes import Outcome
from workers.runner import RolloutRunner

PROMPT = (1, 2, 3)  # tests.factories' default prompt


def expected(n: int, vocab: int = 32_000) -> list[int]:
    """The synthetic engine's tokens for PROMPT: resume-exact by construction."""
    return [(sum(PROMPT) + i) % vocab for i in range(n)]


def runner(store: EventStore, engine: Any, worker: str = "w", **kw: Any) -> RolloutRunner:
    r = RolloutRunner(store, Checkpointer(store), engine, worker, stepped=True, **kw)
    assert r.stepper is not None
    return r


async def submit(store: EventStore, rids: list[str], n: int) -> None:
    for rid in rids:
        await store.append(None, f.submitted(rid, max_tokens=n))


def token_events(events: list[Any]) -> list[TokensAppended]:
    return [e for e in events if isinstance(e, TokensAppended)]


@pytest.mark.parametrize("tokens_per_chunk", [1, 5])
async def test_rollouts_through_steps_are_exact_grouped_and_within_the_cadence(
    real_redis: aredis.Redis, tokens_per_chunk: int
) -> None:
    store = EventStore(real_redis)
    rids = [f"s{i}" for i in range(12)]
    n = 100
    await submit(store, rids, n)
    engine = SyntheticEngine(tokens_per_chunk=tokens_per_chunk, experts=16, token_delay_s=0.002)
    run = runner(store, engine, cadence=Cadence(tokens=16, interval_s=60))
    stepper = run.stepper
    assert stepper is not None
    # Engine steps that came while a checkpoint was in flight, per round trip: what arrives
    # then goes in the rollout's next checkpoint, on top of the cadence.
    in_flight_steps = [0]
    append_many = store.append_many

    async def counted(chains: Any) -> Any:
        before = stepper.steps
        try:
            return await append_many(chains)
        finally:
            in_flight_steps.append(stepper.steps - before)

    store.append_many = counted  # type: ignore[method-assign]
    results = await asyncio.gather(*(run.run(rid) for rid in rids))
    assert all(r.outcome is Outcome.FINISHED for r in results)
    # At most the cadence plus the step that came with the flush point's joiners, plus the
    # steps of the slowest round trip (none when round trips are shorter than a step, as they
    # are on a quiet machine; a loaded one has taken 3 steps of 1 token).
    assert len(in_flight_steps) > 1  # the checkpoints went through the counted call
    bound = 16 + tokens_per_chunk * (1 + max(in_flight_steps))
    appends = 0
    for rid in rids:
        state = await store.load(rid)
        assert state.status is Status.DONE and state == await store.replay(rid)
        assert state.token_ids.tolist() == expected(n)
        assert state.routed_experts is not None and state.routed_experts.shape == (n, 2, 2)
        # Row t of the routes is the synthetic engine's (t + [0..4)) % 16: aligned by offset.
        want = (np.arange(n)[:, None] + np.arange(4)[None, :]) % 16
        np.testing.assert_array_equal(state.routed_experts.reshape(n, 4), want)
        events = await store.events(rid)
        chunks = token_events(events)
        offsets = [e.offset for e in chunks]
        assert offsets == list(np.cumsum([0] + [len(e) for e in chunks[:-1]]))  # exactly once
        assert all(len(e) <= bound for e in chunks[:-1]), ([len(e) for e in chunks], bound)
        appends += len(events) - 1
    # Grouped: far fewer round trips than appends.
    assert run.checkpointer.round_trips * 3 <= appends, (run.checkpointer.round_trips, appends)
    assert run.stats.checkpoints > 0


@pytest.mark.parametrize("stop_after_steps", [1, 3, 8, 17])
async def test_an_abort_at_any_step_then_a_resume_gives_the_uninterrupted_rollout(
    real_redis: aredis.Redis, stop_after_steps: int
) -> None:
    store = EventStore(real_redis)
    rids = ["a", "b", "c"]
    n = 90  # 30 steps of 3 tokens: every rollout is still generating when the stop comes
    await submit(store, rids, n)
    engine = SyntheticEngine(tokens_per_chunk=3, experts=8)
    first = runner(store, engine, worker="w1", cadence=Cadence(tokens=4))
    stepper = first.stepper
    assert stepper is not None

    async def stop_later() -> None:
        while stepper.steps < stop_after_steps:
            await asyncio.sleep(0)
        for rid in rids:
            await first.stop(rid, AbortReason.WEIGHT_UPDATE, "v0 -> v1")

    stopping = asyncio.create_task(stop_later())
    results = await asyncio.gather(*(first.run(rid) for rid in rids))
    await stopping
    assert all(r.outcome is Outcome.ABORTED for r in results)
    for r in results:
        assert r.state.status is Status.ABORTED and r.state.num_tokens < n
        assert r.state.token_ids.tolist() == expected(r.state.num_tokens)
    second = runner(store, SyntheticEngine(tokens_per_chunk=3, experts=8), worker="w2")
    done = await asyncio.gather(*(second.run(rid) for rid in rids))
    for rid, r in zip(rids, done, strict=True):
        assert r.outcome is Outcome.FINISHED and r.state.attempt == 2
        state = await store.load(rid)
        assert state.token_ids.tolist() == expected(n) and state == await store.replay(rid)
        chunks = token_events(await store.events(rid))
        assert [e.offset for e in chunks] == list(np.cumsum([0] + [len(e) for e in chunks[:-1]]))


async def test_a_rollout_taken_over_while_stepping_is_fenced_out(
    real_redis: aredis.Redis,
) -> None:
    store = EventStore(real_redis)
    await submit(store, ["t"], 10_000)
    engine = SyntheticEngine(tokens_per_chunk=1, token_delay_s=0.001)
    run = runner(store, engine, worker="old", cadence=Cadence(tokens=8))
    task = asyncio.create_task(run.run("t"))
    while (await store.load("t")).num_tokens < 16:
        await asyncio.sleep(0.01)
    # Another worker takes it over (its lease lapsed, say): the old attempt is fenced.
    while True:
        s = await store.load("t")
        try:
            s = await store.append(s, f.aborted(s))
            break
        except SequenceConflict:
            continue  # a checkpoint of "old" landed in between: take the newer state
    s = await store.append(s, f.resumed(s, worker="new"))
    result = await asyncio.wait_for(task, 10)
    assert result.outcome is Outcome.LOST
    assert engine._ids == []  # its engine request was aborted
    final = await store.load("t")
    assert final.attempt == 2 and final.num_tokens == s.num_tokens  # nothing of "old" after
    assert final == await store.replay("t")


class DyingEngine(SyntheticEngine):
    """Its core dies after a few steps (what the CPU engine's steps raise then)."""

    def __init__(self, die_after: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.die_after = die_after

    async def steps(self) -> AsyncIterator[Step]:
        n = 0
        async for step in super().steps():
            n += 1
            if n > self.die_after:
                raise EngineDead("the engine core died")
            yield step


async def test_a_dead_engine_saves_every_rollout_and_reports_it(real_redis: aredis.Redis) -> None:
    store = EventStore(real_redis)
    rids = ["d1", "d2"]
    await submit(store, rids, 100)
    run = runner(store, DyingEngine(5, tokens_per_chunk=2), cadence=Cadence(tokens=4))
    results = await asyncio.gather(*(run.run(rid) for rid in rids))
    for rid, r in zip(rids, results, strict=True):
        assert r.outcome is Outcome.ENGINE_DEAD and r.error and "EngineDead" in r.error
        state = await store.load(rid)
        assert state.status is Status.ABORTED and state.abort_reason is AbortReason.ENGINE_DEAD
        # Every token it got is kept (d2 may have joined a step or two after d1).
        assert state.token_ids.tolist() == expected(state.num_tokens)
        assert state == await store.replay(rid)
    assert (await store.load("d1")).num_tokens == 10  # all 5 steps of 2 tokens


async def test_a_refused_request_fails_the_rollout_through_steps(
    real_redis: aredis.Redis,
) -> None:
    store = EventStore(real_redis)
    await submit(store, ["x"], 8)
    run = runner(store, SyntheticEngine(reject_rollouts=["x"]))
    result = await run.run("x")
    assert result.outcome is Outcome.FAILED and result.state.status is Status.FAILED


class PacedGenerate(SyntheticEngine):
    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        async for chunk in super().generate(request):
            yield chunk


def test_engines_whose_generate_was_changed_keep_per_rollout_streams() -> None:
    assert offers_steps(SyntheticEngine())
    assert not offers_steps(PacedGenerate())  # its steps would not show its change


async def test_the_same_rollout_finishes_alike_on_both_paths(real_redis: aredis.Redis) -> None:
    store = EventStore(real_redis)
    await submit(store, ["p", "q"], 33)
    engine = SyntheticEngine(tokens_per_chunk=4, experts=8)
    per_rollout = RolloutRunner(store, Checkpointer(store), engine, "w", stepped=False)
    assert per_rollout.stepper is None
    a = await per_rollout.run("p")
    b = await runner(store, engine).run("q")
    assert a.outcome is b.outcome is Outcome.FINISHED
    assert a.state.token_ids.tolist() == b.state.token_ids.tolist() == expected(33)
    np.testing.assert_array_equal(a.state.logprobs, b.state.logprobs)
    assert a.state.finish_reason is b.state.finish_reason is FinishReason.LENGTH
