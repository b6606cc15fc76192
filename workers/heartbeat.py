"""The worker's heartbeat: its leases renewed, rq told its jobs are alive, and its line in the
fleet's stats, on one timer.

Every lease the worker holds is renewed in one command every ``heartbeat_s``; rq's heartbeat
of its jobs goes out every few of those (``RQ_HEARTBEAT_S``, or a third of rq's execution TTL),
as a task of its own, so that a busy bookkeeping thread never holds up a lease renewal;
the stats beat is stamped with Redis's clock and brings back the deployment's pause
(``workers.pausing``). A missed beat is survivable (the TTLs span
several); a beat Redis refuses counts in the store condition's episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

from redis.asyncio import Redis

from store import EventStore, defaults
from store import stats as fleet
from store.errors import unwritable
from store.leases import Leases
from store.weights import WeightRegistry
from workers.engines.base import Engine
from workers.metrics import WorkerMetrics
from workers.pausing import DeploymentPause
from workers.rq_bridge import RqBridge
from workers.runner import RolloutRunner
from workers.store_condition import StoreCondition

log = logging.getLogger("rollouts.worker")


class BeatConfig(Protocol):
    """What the heartbeat reads of the worker's configuration (``WorkerConfig``)."""

    @property
    def name(self) -> str: ...
    @property
    def queues(self) -> tuple[str, ...]: ...
    @property
    def lease_ttl_s(self) -> float: ...
    @property
    def heartbeat_s(self) -> float: ...
    @property
    def rq_execution_ttl_s(self) -> float: ...


class Beating(Protocol):
    """What the heartbeat reads of its worker (``workers.worker.Worker``), named here so that
    this module need not import the worker, which imports it."""

    heartbeat_round_trips: int  # counted here: the metrics serve it

    @property
    def config(self) -> BeatConfig: ...
    @property
    def runner(self) -> RolloutRunner: ...
    @property
    def store(self) -> EventStore: ...
    @property
    def engine(self) -> Engine: ...
    @property
    def condition(self) -> StoreCondition: ...
    @property
    def metrics(self) -> WorkerMetrics: ...
    @property
    def weights_registry(self) -> WeightRegistry: ...
    @property
    def pause(self) -> DeploymentPause: ...
    @property
    def queue_keys(self) -> dict[str, str]: ...  # queue name -> its rq list (for its depth)
    @property
    def queue_redis(self) -> Redis | None: ...  # where those lists are (None: the store's)


async def heartbeat(worker: Beating, rq: RqBridge, leases: Leases, stop: asyncio.Event) -> None:
    """Until ``stop``: every ``heartbeat_s`` the worker's leases renewed and its stats beat
    sent; every few beats, rq's heartbeat of its jobs (``RqBridge.heartbeat``)."""
    beats = 0
    rq_s = min(defaults.RQ_HEARTBEAT_S, worker.config.rq_execution_ttl_s / 3)
    rq_every = max(1, round(rq_s / worker.config.heartbeat_s))
    rq_beat: asyncio.Task[None] | None = None
    last: float | None = None
    while not stop.is_set():
        sent = time.monotonic()
        if last is not None and sent - last > worker.config.lease_ttl_s / 2:
            # The loop was held up (a long step on it, a paused process, an overloaded host):
            # said, because the leases may lapse and a reaper take the rollouts over.
            log.warning(
                "heartbeat late: %.1f s since the last (every %.2f s; leases last %.1f s)",
                sent - last, worker.config.heartbeat_s, worker.config.lease_ttl_s,
            )  # fmt: skip
        last = sent
        try:
            # Every lease this worker holds, renewed in one command; it reads Redis's clock,
            # which stamps the stats heartbeat below (host clocks may disagree).
            redis_ms = await leases.renew(worker.runner.active, worker.config.lease_ttl_s)
            if beats % rq_every == 0 and (rq_beat is None or rq_beat.done()):
                # Beside the leases, never before them: rq's heartbeat waits for the
                # bookkeeping thread, behind whatever is queued there (a sweep, starts,
                # ends); awaited here, a few busy seconds there lapsed every lease this
                # worker held, and reapers took its rollouts over (the soak's live workers).
                # rq's execution TTL spans several of its beats; one still going is enough.
                rq_beat = asyncio.create_task(_rq_beat(worker, rq, sent), name="rq heartbeat")
            # The deployment's pause comes back with the beat, in the same round trip.
            paused = await fleet.beat(
                worker.store.redis, worker.store.keys, beat(worker, redis_ms / 1000)
            )
            worker.pause.follow(paused, worker.runner)
            # A write Redis refuses under every condition: it ends an episode, if one held.
            worker.condition.accepted(sent)
            worker.heartbeat_round_trips += 2
            if worker.metrics.served:
                # Queue depth and weight lag: only for a scraper, and never per token.
                await worker.metrics.refresh(
                    worker.queue_redis or worker.store.redis,
                    worker.queue_keys,
                    worker.weights_registry,
                )
        except Exception as exc:
            refused = unwritable(exc)
            if refused is not None:
                # Redis refuses writes: one line per episode, not one per beat. The leases
                # may lapse meanwhile; the reapers leave them be until they are renewed.
                worker.condition.refused(refused, "heartbeat", sent)
            else:
                # A missed beat is survivable (the TTLs span several); keep beating.
                log.warning("heartbeat failed", exc_info=True)
        beats += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), worker.config.heartbeat_s)
    if rq_beat is not None:
        await asyncio.wait([rq_beat])  # its outcome is its own to report


async def _rq_beat(worker: Beating, rq: RqBridge, sent: float) -> None:
    """rq's heartbeat of the worker's jobs, reported as the lease renewal's would be."""
    try:
        await rq.heartbeat()
        worker.heartbeat_round_trips += 1
    except Exception as exc:
        refused = unwritable(exc)
        if refused is not None:
            worker.condition.refused(refused, "heartbeat", sent)
        else:
            log.warning("rq heartbeat failed", exc_info=True)  # survivable: its TTL spans several


def beat(worker: Beating, at: float) -> fleet.WorkerBeat:
    """What ``client.stats()`` shows of this worker: rollouts on its engine right now (inside
    the runner: opening, generating or saving), its weights and what it serves; ``at``:
    Redis's clock (unix s), by which readers judge the beat's age."""
    return fleet.WorkerBeat(
        worker_id=worker.config.name,
        in_flight=len(worker.runner.active),
        weight_version=worker.engine.weight_version,
        queues=worker.config.queues,
        model=worker.runner.model_id,
        at=at,
        paused=worker.pause.since,
    )
