"""A job that comes back to the worker whose attempt its rollout still is, with no run of that
worker carrying it: the attempt goes on from its saved tokens, in place.

That is what a run that failed leaves (Redis unreachable past the client's retries: a failover
before ``store.cluster_client``, a restart replaying a long AOF): the worker gives the job back
after a backoff, its attempt still open and its lease held (nothing could be written to close
them). Met again by the same worker, the job was dropped as a duplicate of that very attempt,
and the reaper took the rollout over only when the lease lapsed: a lease TTL stalled and a
``worker_lost`` charged, with no worker lost (seen in CI, a cluster's master killed mid-run).
Another worker still leaves a live lease alone (``test_clock_skew``)."""

from __future__ import annotations

import redis.asyncio as aredis

from statemachine import Aborted, AbortReason, Resumed, Started, Status
from store import EventStore
from store.leases import Leases
from tests import factories as f
from tests.store.trainer import checkpoint, start
from workers.checkpoint import Checkpointer
from workers.engines.synthetic import SyntheticEngine
from workers.outcomes import Outcome
from workers.runner import RolloutRunner


def _runner(store: EventStore, client: aredis.Redis, name: str, weights: int = 0) -> RolloutRunner:
    leases = Leases(client, store.keys, holder=name)
    engine = SyntheticEngine(weight_version=weights)
    return RolloutRunner(store, Checkpointer(store), engine, name, leases=leases)


async def test_its_own_workers_job_carries_the_attempt_on(redis_client: aredis.Redis) -> None:
    store = EventStore(redis_client)
    await store.append(None, f.submitted("r1", max_tokens=32))
    saved = await checkpoint(store, await start(store, "r1", "a"), 8)
    await Leases(redis_client, store.keys, holder="a").take("r1", 5.0)  # still held

    result = await _runner(store, redis_client, "a").run("r1")

    assert result.outcome is Outcome.FINISHED
    done = await store.load("r1")
    assert done.status is Status.DONE and done.num_tokens == 32
    assert done.attempt == 1 and done.worker_id == "a"  # the same attempt, no takeover
    assert list(done.token_ids[:8]) == list(saved.token_ids)  # what was saved, kept
    events = await store.events("r1")
    assert not [e for e in events if isinstance(e, (Aborted, Resumed))]
    assert sum(isinstance(e, Started) for e in events) == 1
    assert await Leases(redis_client, store.keys).held_by("a") == []  # dropped at its end


async def test_on_newer_weights_it_is_taken_over_as_a_new_attempt(
    redis_client: aredis.Redis,
) -> None:
    """The attempt began on weights v0 and the worker has v1 now: the attempt is not carried
    on across weights (its start names them); it ends as a weight update ends one, and a new
    one begins from the saved tokens."""
    store = EventStore(redis_client)
    await store.append(None, f.submitted("r1", max_tokens=32))
    await checkpoint(store, await start(store, "r1", "a"), 8)
    await Leases(redis_client, store.keys, holder="a").take("r1", 5.0)
    result = await _runner(store, redis_client, "a", weights=1).run("r1")

    assert result.outcome is Outcome.FINISHED
    done = await store.load("r1")
    assert done.status is Status.DONE and done.num_tokens == 32 and done.attempt == 2
    aborts = [e.reason for e in await store.events("r1") if isinstance(e, Aborted)]
    assert aborts == [AbortReason.WEIGHT_UPDATE]  # as a weight update ends one: no charge
