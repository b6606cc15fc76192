"""Prometheus metrics of one worker process, served on ``rollouts worker --metrics-port``.

Why a collector that reads the worker's own counters at scrape time: the worker already counts
what it does (``runner.Stats``: tokens, checkpoints, aborts by reason, resumes, takeovers,
rollouts ended; the Checkpointer's round trips; the reaper's recoveries), each at the one place
the event is recorded. Reading those when Prometheus scrapes costs the hot path nothing (no
per-chunk metric call, no lock), and the figures can never drift from the ``Stats`` the worker
prints when it exits. The checkpoint latency histogram is the exception: a latency is a sample,
not a count, so the Checkpointer observes each round trip (one ``observe`` per group commit,
~1 us, not per token).

Every counter counts what *this process recorded* in Redis, so summed over the fleet each
matches the events in the rollouts' logs exactly once: an ``Aborted`` event is counted by the
worker that appended it (its own attempt stopping, or a dead worker's attempt that it took over
or whose expired lease its reaper turned into ``aborted(worker_lost)``).

Why ``prometheus_client.start_http_server`` (a thread) rather than an aiohttp route on the
worker's event loop: the worker needs no web framework, a scrape never competes with the loop
that feeds the engine, and it still answers while the loop is blocked, which is when an
operator most wants to look. The collector only reads numbers (no Redis, no await), so it is
safe from that thread; the Redis-backed gauges (queue depth, weight lag) are refreshed by the
worker's heartbeat (``refresh``), once per ``HEARTBEAT_S``, and only when metrics are served.

Each ``Worker`` has a registry of its own, so several workers in one process (tests, benches)
never collide.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis

from statemachine import AbortReason, FailureClass, Status
from store.errors import Refusal
from store.pause import MODES
from store.weights import WeightRegistry
from workers.outcomes import Outcome

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from workers.checkpoint import Checkpointer
    from workers.engines.base import Engine
    from workers.outcomes import Stats
    from workers.pausing import DeploymentPause
    from workers.reaper import Reaper
    from workers.store_condition import StoreCondition
    from workers.weight_updates import WeightFollower

PREFIX = "rollouts_worker_"

# One group commit with AOF ``appendfsync always``: ~0.3 ms on an idle local Redis, tens of
# ms on a loaded or remote one; above a second something is wrong.
CHECKPOINT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# The ends a worker records for a rollout (the label values of ``rollouts_finished_total``).
ENDED = (Status.DONE, Status.FAILED, Status.CANCELLED)


class Observed(Protocol):
    """What the collector reads of its worker (``workers.worker.Worker``), named here so that
    this module need not import the worker, which imports it."""

    stats: Stats
    engine: Engine
    heartbeat_round_trips: int
    reaper: Reaper | None
    weights: WeightFollower | None
    checkpointer: Checkpointer | None
    condition: StoreCondition
    pause: DeploymentPause

    @property
    def config(self) -> Any: ...  # WorkerConfig: name, model_id, max_concurrency


class WorkerMetrics:
    """The metrics of one worker: its registry, and what the heartbeat refreshes."""

    def __init__(self, *, engine: str = "") -> None:
        self.engine = engine  # the engine kind (cpu, vllm, vllm-http, synthetic)
        self.registry = CollectorRegistry(auto_describe=False)
        self.checkpoint_seconds = Histogram(
            f"{PREFIX}checkpoint_duration_seconds",
            "Time of one checkpoint round trip to Redis (a group commit of the worker's "
            "rollouts: their tokens, logprobs and routes, AOF-fsynced)",
            buckets=CHECKPOINT_BUCKETS,
            registry=self.registry,
        )
        ProcessCollector(registry=self.registry)  # CPU, memory, open files of this process
        self.worker: Observed | None = None
        # Refreshed by the heartbeat while served (``refresh``); None/empty until then.
        self.queue_depth: dict[str, int] = {}
        self.latest_weight_version: int | None = None  # None: none published (yet)
        self.refreshed = False
        self.refresh_round_trips = 0
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.registry.register(_WorkerCollector(self))

    @property
    def served(self) -> bool:
        return self._server is not None

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the bound port
        (``port`` 0 picks a free one). Raises ``OSError`` if it cannot bind."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    async def refresh(
        self, redis: Redis, queue_keys: dict[str, str], weights: WeightRegistry
    ) -> None:
        """Read the depth of the worker's queues and the newest published weight version (one
        pipelined round trip plus one read), from the worker's heartbeat, never per token."""
        pipe = redis.pipeline(transaction=False)
        for key in queue_keys.values():
            pipe.llen(key)
        depths = await pipe.execute()
        latest = await weights.latest()
        self.queue_depth = dict(zip(queue_keys, (int(d) for d in depths), strict=True))
        self.latest_weight_version = None if latest is None else latest.version
        self.refresh_round_trips += 2
        self.refreshed = True


class _WorkerCollector(Collector):
    """Reads the worker's counters when scraped (see the module docstring for why)."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m, worker = self.metrics, self.metrics.worker
        if worker is None:
            return
        stats, runner = worker.stats, getattr(worker, "runner", None)
        model = runner.model_id if runner is not None else (worker.config.model_id or "")
        info = GaugeMetricFamily(
            f"{PREFIX}info", "This worker: its name, model and engine kind (always 1)",
            labels=["worker", "model", "engine"],
        )  # fmt: skip
        info.add_metric([worker.config.name, model, m.engine], 1)
        yield info
        yield _counter("tokens_generated", "Tokens generated and handed to Redis", stats.tokens)
        yield _counter(
            "checkpoints", "Checkpoints of generating rollouts (flush points)", stats.checkpoints
        )
        trips = CounterMetricFamily(
            f"{PREFIX}redis_round_trips", "Redis round trips by operation: append (group "
            "commits of every event: checkpoints, starts, finishes, aborts), heartbeat (lease "
            "renewal and the stats beat), metrics (queue depth and weight version reads)",
            labels=["operation"],
        )  # fmt: skip
        checkpointer = worker.checkpointer
        trips.add_metric(["append"], checkpointer.round_trips if checkpointer else 0)
        trips.add_metric(["heartbeat"], worker.heartbeat_round_trips)
        trips.add_metric(["metrics"], m.refresh_round_trips)
        yield trips
        yield _by(
            "aborts", "Aborted events this worker recorded, by reason (its own attempts "
            "stopping; worker_lost: attempts of dead workers it took over or reaped)",
            "reason", [r.value for r in AbortReason], stats.aborts,
        )  # fmt: skip
        yield _counter("resumes", "Attempts started from saved tokens", stats.resumes)
        yield _counter(
            "lease_takeovers",
            "Rollouts taken over from a worker whose lease lapsed while its attempt was live",
            stats.takeovers,
        )
        reaper = worker.reaper
        yield _counter(
            "leases_reaped", "Expired leases this worker's reaper aborted and requeued",
            reaper.recovered if reaper else 0,
        )  # fmt: skip
        yield _counter(
            "quarantined", "Unreadable rollouts this worker's reaper quarantined",
            reaper.quarantined if reaper else 0,
        )  # fmt: skip
        yield _by(
            "rollouts_finished", "Rollouts this worker ended, by outcome",
            "outcome", [s.value for s in ENDED], stats.ended,
        )  # fmt: skip
        yield _by(
            "failures", "Rollouts this worker recorded as failed, by failure class",
            "failure", [f.value for f in FailureClass], stats.failures,
        )  # fmt: skip
        yield _by(
            "attempts", "Jobs this worker ran, by how the attempt ended (runner outcomes; "
            "refused: not a runnable rollout job)",
            "outcome", [*(o.value for o in Outcome), "refused"], stats.outcomes,
        )  # fmt: skip
        yield _counter(
            "nonfinite_logprobs", "Logprobs the engine returned as NaN/inf, stored clamped",
            stats.nonfinite_logprobs,
        )  # fmt: skip
        yield _counter(
            "weight_loads", "Weight versions loaded into the engine",
            len(worker.weights.updates) if worker.weights else 0,
        )  # fmt: skip
        yield from self._gauges(worker)

    def _gauges(self, worker: Observed) -> Iterator[Metric]:
        m, runner = self.metrics, getattr(worker, "runner", None)
        depth = GaugeMetricFamily(
            f"{PREFIX}queue_depth", "Jobs waiting in each queue this worker serves (refreshed "
            "on its heartbeat)", labels=["queue"],
        )  # fmt: skip
        for queue, n in dict(m.queue_depth).items():
            depth.add_metric([queue], n)
        yield depth
        yield GaugeMetricFamily(
            f"{PREFIX}in_flight", "Rollouts this worker runs now (opening, waiting for one of "
            "the engine's places while the rollouts there finish, generating or saving)",
            value=len(runner.active) if runner is not None else 0,
        )  # fmt: skip
        yield GaugeMetricFamily(
            f"{PREFIX}max_concurrency", "Rollouts this worker generates at once at most",
            value=worker.config.max_concurrency,
        )  # fmt: skip
        version = worker.engine.weight_version
        yield GaugeMetricFamily(
            f"{PREFIX}weight_version", "Weight version the engine serves", value=version
        )
        if m.refreshed:  # absent, not a made-up 0, until the heartbeat has read it
            latest = m.latest_weight_version
            yield GaugeMetricFamily(
                f"{PREFIX}weight_version_lag", "Published weight versions the engine is behind "
                "the newest (refreshed on its heartbeat; 0 while none is published)",
                value=0 if latest is None else max(0, latest - version),
            )  # fmt: skip
        yield GaugeMetricFamily(
            f"{PREFIX}engine_dead", "1 once the engine died (the worker then stops)",
            value=1 if worker.stats.engine_dead is not None else 0,
        )  # fmt: skip
        paused = GaugeMetricFamily(
            f"{PREFIX}paused", "1 while the deployment's pause (a harness's /pause) holds on "
            "this worker, by mode: it takes no new job (abort: its running rollouts were given "
            "back with their progress)", labels=["mode"],
        )  # fmt: skip
        held = worker.pause.current
        for mode in MODES:
            paused.add_metric([mode], 1 if held is not None and held.mode == mode else 0)
        yield paused
        yield from _store_condition(worker)


def _store_condition(worker: Observed) -> Iterator[Metric]:
    """Redis refusing this worker's writes for a condition of its own (out of memory, a failed
    disk write, a read-only replica): from the worker's own view, so it shows while Redis
    takes no heartbeat (``workers.store_condition``)."""
    condition = worker.condition
    held = condition.refusal.refusal if condition.refusal is not None else None
    gauge = GaugeMetricFamily(
        f"{PREFIX}store_unwritable", "1 while Redis refuses this worker's writes, by why "
        "(oom, misconf, readonly): the worker keeps its rollouts and retries each refused "
        "write, and takes no new job", labels=["reason"],
    )  # fmt: skip
    for refusal in Refusal:
        gauge.add_metric([refusal.value], 1 if refusal is held else 0)
    yield gauge
    yield _counter(
        "store_unwritable_episodes", "Times Redis began refusing this worker's writes",
        condition.episodes,
    )  # fmt: skip
    yield _counter(
        "store_refused_writes", "Writes Redis refused for a condition of its own (each retried)",
        condition.refused_writes,
    )  # fmt: skip


def _counter(name: str, doc: str, value: int) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}{name}", doc, value=value)


def _by(
    name: str, doc: str, label: str, known: list[str], counts: dict[str, int]
) -> CounterMetricFamily:
    """A counter by ``label``: every ``known`` value present from the start (at 0), so that
    ``rate()`` sees the first event; ``dict(counts)`` is one atomic copy under the GIL."""
    family = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=[label])
    values = dict.fromkeys(known, 0) | dict(counts)
    for key, n in values.items():
        family.add_metric([str(key)], n)
    return family
