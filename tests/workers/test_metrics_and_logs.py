"""A worker's /metrics and its JSON logs, checked against the events the run left in Redis.

Real redis-server, real worker processes on the paced synthetic engine (`--metrics-port 0`: the
worker picks a free port and logs it, so no port is guessed), `--log-format json`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from statemachine import (
    Aborted,
    AbortReason,
    Event,
    Finished,
    Resumed,
    RolloutRequest,
    Started,
    Status,
    TokensAppended,
)
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.workers.helpers import SYNTHETIC, greedy, random_prompts, start_worker, stop, until
from workers.worker_cli import command

pytestmark = pytest.mark.redis_server

JSON_LOGS = ("--metrics-port", "0", "--log-format", "json", "--heartbeat", "0.2")
N = 96  # tokens per rollout: ~0.5 s at the synthetic engine's test pace


class Scrape:
    """One /metrics page, parsed by prometheus_client's own parser."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.values = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in self.families.values()
            for s in f.samples
        }

    def __call__(self, name: str, **labels: str) -> float | None:
        return self.values.get((name, tuple(sorted(labels.items()))))

    def by(self, name: str, label: str) -> dict[str, float]:
        return {dict(k)[label]: v for (n, k), v in self.values.items() if n == name}


async def scrape(port: int) -> Scrape:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()

    return Scrape(await asyncio.to_thread(get))


def log_lines(path: Path) -> list[dict[str, Any]]:
    """Every line the worker wrote (logs and its exit summary): each one must be JSON."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def metrics_port(path: Path) -> int:
    async def logged() -> bool:
        return path.exists() and any(e.get("event") == "metrics" for e in log_lines(path))

    await until(logged, 60, "the worker never logged its metrics port")
    return int(next(e["port"] for e in log_lines(path) if e.get("event") == "metrics"))


def by_worker(events: list[Event]) -> dict[str, dict[str, Any]]:
    """What each worker's attempts recorded in one rollout's log: tokens, aborts by reason,
    resumes (attempts begun from saved tokens) and finishes."""
    out: dict[str, dict[str, Any]] = {}
    owner: dict[int, str] = {}
    saved = 0
    for e in events:
        if isinstance(e, Started | Resumed):
            owner[e.attempt] = e.worker_id
            mine = out.setdefault(e.worker_id, {"tokens": 0, "aborts": Counter(), "resumes": 0,
                                                "done": 0, "nonfinite": 0})  # fmt: skip
            mine["resumes"] += 1 if isinstance(e, Resumed) and saved else 0
        elif isinstance(e, TokensAppended):
            out[owner[e.attempt]]["tokens"] += len(e)
            out[owner[e.attempt]]["nonfinite"] += e.nonfinite_logprobs
            saved += len(e)
        elif isinstance(e, Aborted):
            out[owner[e.attempt]]["aborts"][e.reason.value] += 1
        elif isinstance(e, Finished):
            out[owner[e.attempt]]["done"] += 1
    return out


def totals(logs: list[list[Event]], worker: str) -> dict[str, Any]:
    sums: dict[str, Any] = {"tokens": 0, "aborts": Counter(), "resumes": 0, "done": 0,
                            "nonfinite": 0}  # fmt: skip
    for events in logs:
        for key, value in by_worker(events).get(worker, {}).items():
            sums[key] += value
    return sums


def assert_counters_match(m: Scrape, recorded: dict[str, Any]) -> None:
    assert m("rollouts_worker_tokens_generated_total") == recorded["tokens"] > 0
    assert m("rollouts_worker_nonfinite_logprobs_total") == recorded["nonfinite"]
    aborts = m.by("rollouts_worker_aborts_total", "reason")
    assert set(aborts) == {r.value for r in AbortReason}  # every reason, from 0
    assert {r: n for r, n in aborts.items() if n} == dict(recorded["aborts"])
    assert m("rollouts_worker_resumes_total") == recorded["resumes"]
    assert m("rollouts_worker_rollouts_finished_total", outcome="done") == recorded["done"]
    assert m("rollouts_worker_rollouts_finished_total", outcome="failed") == 0
    # Every append round trip is one sample of the checkpoint latency histogram.
    appends = m("rollouts_worker_redis_round_trips_total", operation="append")
    assert appends and m("rollouts_worker_checkpoint_duration_seconds_count") == appends
    assert m("rollouts_worker_redis_round_trips_total", operation="heartbeat")
    assert m("rollouts_worker_in_flight") == 0 and m("rollouts_worker_engine_dead") == 0


async def test_metrics_match_redis_after_a_weight_update_mid_flight(
    server: RedisServer, tmp_path: Path
) -> None:
    client = RolloutClient(server.url)
    ids = await client.submit(
        [RolloutRequest(prompt_token_ids=p, sampling=greedy(N)) for p in random_prompts(3, 4)]
    )
    path = tmp_path / "w.log"
    worker = start_worker(server.url, SYNTHETIC, "obs", path, *JSON_LOGS, concurrency=3)
    try:
        port = await metrics_port(path)

        async def all_generating() -> bool:
            return min([(await client.store.load(r)).num_tokens for r in ids]) >= 8

        await until(all_generating, 60, "the rollouts never started")
        await client.publish_weights(1, str(tmp_path))
        results = await client.wait(ids, timeout=60)
        assert {r.status for r in results} == {Status.DONE}

        async def settled() -> bool:
            m = await scrape(port)
            # Done, and out of the runner: a rollout's lease is dropped after its end is
            # counted, so a scrape in between sees it still in flight.
            return m("rollouts_worker_rollouts_finished_total", outcome="done") == 3 and (
                m("rollouts_worker_weight_version_lag") is not None
                and m("rollouts_worker_in_flight") == 0
            )

        await until(settled, 30, "the metrics never showed the run's end")
        m = await scrape(port)
    finally:
        stop(worker)
    assert worker.returncode == 0
    logs = [await client.store.events(r) for r in ids]
    recorded = totals(logs, "obs")
    assert recorded["aborts"] == {"weight_update": 3} and recorded["resumes"] == 3
    assert_counters_match(m, recorded)
    assert m("rollouts_worker_tokens_generated_total") == 3 * N
    assert m("rollouts_worker_attempts_total", outcome="aborted") == 3
    assert m("rollouts_worker_attempts_total", outcome="finished") == 3
    assert m("rollouts_worker_weight_version") == 1 and m("rollouts_worker_weight_version_lag") == 0
    assert m("rollouts_worker_weight_loads_total") == 1
    assert m("rollouts_worker_queue_depth", queue="rollouts") == 0
    [info] = m.families["rollouts_worker_info"].samples
    assert info.value == 1 and info.labels["worker"] == "obs"
    assert info.labels["engine"] == "synthetic" and info.labels["model"].startswith("synthetic:")
    assert m("process_cpu_seconds_total") is not None

    lines = log_lines(path)
    events = Counter(e.get("event") for e in lines)
    assert events["worker_start"] == 1 and events["weight_load"] == 1
    assert events["rollout_start"] == 3 and events["finish"] == 3
    aborts = [e for e in lines if e.get("event") == "abort"]
    resumes = [e for e in lines if e.get("event") == "resume"]
    for line, rid in zip(sorted(aborts, key=lambda e: e["rollout_id"]), sorted(ids), strict=True):
        assert (line["rollout_id"], line["attempt"], line["worker"]) == (rid, 1, "obs")
        assert line["reason"] == "weight_update" and line["level"] == "info"
    for line in resumes:
        assert line["rollout_id"] in ids and line["attempt"] == 2 and line["worker"] == "obs"
        # The saved tokens it resumed from: what attempt 1 recorded.
        events_of = logs[ids.index(line["rollout_id"])]
        first = sum(len(e) for e in events_of if isinstance(e, TokensAppended) and e.attempt == 1)
        assert line["tokens"] == first > 0
    assert len(resumes) == 3
    [load] = [e for e in lines if e.get("event") == "weight_load"]
    assert load["version"] == 1 and load["worker"] == "obs" and load["seconds"] >= 0
    await client.aclose()


async def test_sigterm_mid_generation_then_another_worker_resumes(
    server: RedisServer, tmp_path: Path
) -> None:
    client = RolloutClient(server.url)
    ids = await client.submit(
        [RolloutRequest(prompt_token_ids=p, sampling=greedy(N)) for p in random_prompts(2, 5)]
    )
    a_log, b_log = tmp_path / "a.log", tmp_path / "b.log"
    a = start_worker(server.url, SYNTHETIC, "a", a_log, *JSON_LOGS, concurrency=2)
    b = None
    try:

        async def both_generating() -> bool:
            return min([(await client.store.load(r)).num_tokens for r in ids]) >= 8

        await until(both_generating, 60, "the rollouts never started")
        stop(a)  # SIGTERM: it aborts both (shutdown), saves their tokens and requeues them
        assert a.returncode == 0
        b = start_worker(server.url, SYNTHETIC, "b", b_log, *JSON_LOGS, concurrency=2)
        port = await metrics_port(b_log)
        await client.wait(ids, timeout=60)

        async def settled() -> bool:
            m = await scrape(port)
            # Done, and out of the runner (see above: the lease drop follows the count).
            done = m("rollouts_worker_rollouts_finished_total", outcome="done") == 2
            return done and m("rollouts_worker_in_flight") == 0

        await until(settled, 30, "the metrics never showed the run's end")
        m = await scrape(port)
    finally:
        stop(a, *(p for p in [b] if p))
    logs = [await client.store.events(r) for r in ids]
    recorded_a, recorded_b = totals(logs, "a"), totals(logs, "b")
    assert recorded_a["aborts"] == {"shutdown": 2} and recorded_b["resumes"] == 2
    # b's counters are b's own: the tokens its attempts recorded, no aborts, two resumes.
    assert_counters_match(m, recorded_b)
    assert recorded_a["tokens"] + recorded_b["tokens"] == 2 * N

    # a's exit summary and its abort lines say what a's attempts recorded.
    a_lines = log_lines(a_log)
    assert a_lines[-1]["tokens"] == recorded_a["tokens"]
    aborts = [e for e in a_lines if e.get("event") == "abort"]
    assert sorted(e["rollout_id"] for e in aborts) == sorted(ids)
    assert all(e["attempt"] == 1 and e["worker"] == "a" and e["reason"] == "shutdown"
               for e in aborts)  # fmt: skip
    resumes = [e for e in log_lines(b_log) if e.get("event") == "resume"]
    assert sorted(e["rollout_id"] for e in resumes) == sorted(ids)
    assert all(e["attempt"] == 2 and e["worker"] == "b" for e in resumes)
    await client.aclose()


def test_a_metrics_port_in_use_is_refused_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A Redis that answers is checked first; the port is refused before any engine loads.
        with RedisServer(tmp_path / "redis") as redis:
            cmd = command(redis.url, "", "w", "--metrics-port", str(port), engine="synthetic")
            done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()[-1:]
    assert line.startswith("rollouts worker: error: cannot serve metrics on 127.0.0.1:")
    assert "Traceback" not in done.stderr


async def test_a_killed_workers_rollout_is_counted_by_the_worker_that_recovers_it(
    server: RedisServer, tmp_path: Path
) -> None:
    # worker_lost aborts are counted by whoever records them: the survivor, not the dead one.
    client = RolloutClient(server.url)
    [rid] = await client.submit([RolloutRequest(prompt_token_ids=(5, 6, 7), sampling=greedy(N))])
    fast = ("--lease-ttl", "1", "--heartbeat", "0.2")
    a = start_worker(server.url, SYNTHETIC, "a", tmp_path / "a.log", *fast, concurrency=1)
    b_log = tmp_path / "b.log"
    b = None
    try:

        async def generating() -> bool:
            return (await client.store.load(rid)).num_tokens >= 8

        await until(generating, 60, "the rollout never started")
        a.kill()  # SIGKILL: its lease lapses, nothing of it is saved beyond its checkpoints
        a.wait(10)
        b = start_worker(server.url, SYNTHETIC, "b", b_log, *JSON_LOGS, "--lease-ttl", "1")
        port = await metrics_port(b_log)
        await client.wait([rid], timeout=60)

        async def settled() -> bool:
            m = await scrape(port)
            # Done, and out of the runner (see above: the lease drop follows the count).
            done = m("rollouts_worker_rollouts_finished_total", outcome="done") == 1
            return done and m("rollouts_worker_in_flight") == 0

        await until(settled, 30, "the metrics never showed the run's end")
        m = await scrape(port)
    finally:
        stop(a, *(p for p in [b] if p))
    events = await client.store.events(rid)
    lost = [e for e in events if isinstance(e, Aborted)]
    assert [e.reason for e in lost] == [AbortReason.WORKER_LOST] and lost[0].attempt == 1
    assert m.by("rollouts_worker_aborts_total", "reason")["worker_lost"] == 1
    # b recorded it, as its reaper (the lease expired) or on taking the job over.
    reaped = m("rollouts_worker_leases_reaped_total")
    assert reaped is not None and reaped + m("rollouts_worker_lease_takeovers_total") == 1
    saved = sum(len(e) for e in events if isinstance(e, TokensAppended) and e.attempt == 1)
    assert m("rollouts_worker_resumes_total") == 1
    assert m("rollouts_worker_tokens_generated_total") == N - saved
    [line] = [e for e in log_lines(b_log) if e.get("event") in ("reaped", "takeover")]
    assert (line["rollout_id"], line["worker"], line["reason"]) == (rid, "b", "worker_lost")
    assert line["attempt"] in (1, 2)  # the lost attempt (reaped), or b's own (takeover)
    [resume] = [e for e in log_lines(b_log) if e.get("event") == "resume"]
    assert (resume["rollout_id"], resume["attempt"], resume["tokens"]) == (rid, 2, saved)
    await client.aclose()
