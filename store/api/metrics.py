"""The API's Prometheus metrics, in a registry of its own (not the process-global one).

HTTP metrics are counted per route template (``/v1/rollouts/{rollout_id}``), never per path,
so their label sets stay bounded. Cluster metrics are read from Redis at scrape time
(``RolloutClient.stats`` and the newest published weight version, one round trip each): the
``/metrics`` handler refreshes ``ClusterCollector`` before rendering, since a collector's
``collect`` is synchronous and cannot await Redis itself.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from statemachine import Status
from store.errors import Refusal, StoreUnwritable
from store.stats import Stats
from store.weights import WeightVersion

# Seconds; most calls take a few ms; a result stream lasts as long as its batch.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                   30, 60, 300)  # fmt: skip


class ClusterCollector(Collector):
    """The cluster as Redis last told it (``refresh`` before each scrape)."""

    def __init__(self) -> None:
        self.stats: Stats | None = None
        self.latest: WeightVersion | None = None
        self.now = 0.0
        self.refusal: StoreUnwritable | None = None

    def refresh(
        self,
        stats: Stats,
        latest: WeightVersion | None,
        now: float,
        refusal: StoreUnwritable | None = None,
    ) -> None:
        """``refusal``: why Redis refuses writes now (``store.writable``), or None."""
        self.stats, self.latest, self.now, self.refusal = stats, latest, now, refusal

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        by_state = GaugeMetricFamily(
            "rollouts_rollouts",
            "Rollouts by state: states that have not ended (pending, generating, aborted, "
            "resumed, awaiting_tool, running_tool, next_turn) count "
            "those in it now, terminal states (done, failed, cancelled) every one that ended so",
            labels=["state"],
        )
        for status in Status:
            by_state.add_metric([status.value], s.by_state.get(status, 0))
        yield by_state
        yield CounterMetricFamily(
            "rollouts_tokens_generated",
            "Tokens appended by workers, ever (regenerated ones after a crash count again)",
            value=s.tokens,
        )
        depth = GaugeMetricFamily(
            "rollouts_queue_depth", "Jobs waiting in each rq queue", labels=["queue"]
        )
        for queue, n in sorted(s.queues.items()):
            depth.add_metric([queue], n)
        yield depth
        yield GaugeMetricFamily(
            "rollouts_workers", "Workers with a heartbeat younger than 15 s", value=len(s.workers)
        )
        latest = 0 if self.latest is None else self.latest.version
        yield GaugeMetricFamily(
            "rollouts_weight_version_latest", "Newest published weight version (0: none)",
            value=latest,
        )  # fmt: skip
        refused = GaugeMetricFamily(
            "rollouts_store_unwritable", "1 while Redis refuses writes, by why (oom: out of "
            "memory, misconf: a failed disk write, readonly: a replica)", labels=["reason"],
        )  # fmt: skip
        held = None if self.refusal is None else self.refusal.refusal
        for refusal in Refusal:
            refused.add_metric([refusal.value], 1 if refusal is held else 0)
        yield refused
        yield from self._workers(s, latest)

    def _workers(self, s: Stats, latest: int) -> Iterator[Metric]:
        labels = ["worker"]
        in_flight = GaugeMetricFamily(
            "rollouts_worker_in_flight", "Rollouts a worker is generating now", labels=labels
        )
        version = GaugeMetricFamily(
            "rollouts_worker_weight_version", "Weight version a worker runs", labels=labels
        )
        lag = GaugeMetricFamily(
            "rollouts_worker_weight_version_lag",
            "Published versions a worker's weights are behind the newest",
            labels=labels,
        )
        age = GaugeMetricFamily(
            "rollouts_worker_heartbeat_age_seconds",
            "Seconds since a worker's last heartbeat",
            labels=labels,
        )
        for w in s.workers:
            in_flight.add_metric([w.worker_id], w.in_flight)
            if w.weight_version is not None:
                version.add_metric([w.worker_id], w.weight_version)
                lag.add_metric([w.worker_id], max(0, latest - w.weight_version))
            age.add_metric([w.worker_id], max(0.0, w.age_s(self.now)))
        yield from (in_flight, version, lag, age)


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "rollouts_api_requests",
            "HTTP requests answered, by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "rollouts_api_request_duration_seconds",
            "Time from a request's arrival to its response's end (a stream: its whole life)",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.cluster = ClusterCollector()
        self.registry.register(self.cluster)

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.duration.labels(route, method).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
