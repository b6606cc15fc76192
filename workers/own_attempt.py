"""A job that comes back to the worker whose live attempt its rollout still is, with no run of
that worker carrying it (``RolloutRunner.run`` lets no second run of a rollout in).

A run that failed on Redis (unreachable past the client's retries: a restart replaying a long
AOF, a failover before ``store.cluster_client``) leaves exactly that: the worker gives the job
back after a backoff with the attempt open and its lease held, since nothing could be written
to close them. Met again by the same worker, the job was dropped as a duplicate of that very
attempt, and the rollout waited for its lease to lapse and a reaper: a lease TTL stalled and a
``worker_lost`` charged, with no worker lost (seen in CI, a cluster's master killed mid-run).
Now the attempt goes on in place, from its saved tokens; or, begun on weights the worker no
longer has, it ends as a weight update ends one (no charge) and a new attempt begins."""

from __future__ import annotations

import logging
from typing import Protocol

from statemachine import AbortReason, RolloutState, commands
from store import AppendRefused, EventStore
from store.coalesce import Coalescer
from store.logs import log_event
from workers.checkpoint import Checkpointer
from workers.engines.base import Engine
from workers.generation import Attempt
from workers.outcomes import Outcome, RunResult, Stats
from workers.store_condition import StoreCondition

log = logging.getLogger("rollouts.runner")


class Runner(Protocol):
    """What of ``workers.runner.RolloutRunner`` this takes (it imports this module)."""

    store: EventStore
    checkpointer: Checkpointer
    engine: Engine
    worker_id: str
    stats: Stats
    condition: StoreCondition
    take_lease: Coalescer[str, None]

    async def generate_or_end(self, state: RolloutState, attempt: Attempt) -> RunResult: ...


async def take_back(
    runner: Runner, state: RolloutState, attempt: Attempt
) -> RunResult | RolloutState:
    """The run's result when the attempt went on in place; else the state its ending left,
    from which the runner begins a new attempt. A reaper that took the attempt over
    meanwhile (its lease had lapsed) fences our first write out: ``LOST``."""
    rid = state.rollout_id
    try:
        if state.weight_version != runner.engine.weight_version:
            now = runner.engine.weight_version
            detail = f"its run on {runner.worker_id} failed; weights v{now} since"
            ended = await runner.checkpointer.append(
                state, commands.abort(state, AbortReason.WEIGHT_UPDATE, detail)
            )
            runner.stats.aborted(AbortReason.WEIGHT_UPDATE)
            return ended
        # The lease taken again (it may have lapsed): our heartbeat renews it from now on.
        await runner.condition.until_written(lambda: runner.take_lease(rid), "lease")
        log_event(
            log, logging.INFO, "carry_on",
            f"rollout {rid} attempt {state.attempt}: carried on from {state.num_tokens} saved "
            f"tokens after a failed run",
            rollout_id=rid, attempt=state.attempt, worker=runner.worker_id,
            tokens=state.num_tokens, weight_version=runner.engine.weight_version,
        )  # fmt: skip
        return await runner.generate_or_end(state, attempt)
    except AppendRefused:
        return RunResult(Outcome.LOST, await runner.store.load(rid))
