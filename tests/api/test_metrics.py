"""/metrics parses with prometheus_client's own parser; its cluster figures match Redis."""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from statemachine import Status
from store.client import RolloutClient
from store.stats import WorkerBeat, beat
from tests.api.helpers import finish


async def scrape(api: TestClient) -> dict[str, Any]:
    r = await api.get("/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(await r.text())}


def value(family: Any, suffix: str = "", **labels: str) -> float:
    for s in family.samples:
        if s.name == family.name + suffix and all(s.labels.get(k) == v
                                                   for k, v in labels.items()):  # fmt: skip
            return float(s.value)
    raise AssertionError(f"no {family.name}{suffix} {labels}")


async def test_cluster_figures_match_redis(api: TestClient, trainer: RolloutClient) -> None:
    body = {"prompts": [{"prompt_token_ids": [1, 2]}] * 3, "n": 2,
            "sampling": {"max_tokens": 50}, "batch_id": "m"}  # fmt: skip
    ids = (await (await api.post("/v1/batches", json=body)).json())["ids"]
    await api.post("/v1/weights", json={"version": 4, "path": "/w4"})
    for i, rid in enumerate(ids[:4]):
        await finish(trainer.store, rid, 10 + i, version=4)
    await api.post("/v1/cancel", json={"ids": [ids[4]]})
    await beat(
        trainer.redis,
        trainer.keys,
        WorkerBeat("w1", in_flight=2, weight_version=3, queues=("rollouts",), model="m"),
    )
    families = await scrape(api)

    stats = await trainer.stats()
    # Every event in Redis, counted from the logs themselves.
    tokens = 0
    finished = 0
    for rid in ids:
        events = await trainer.store.events(rid)
        tokens += sum(len(e.token_ids) for e in events if hasattr(e, "token_ids"))
        finished += any(type(e).__name__ == "Finished" for e in events)
    assert value(families["rollouts_tokens_generated"], "_total") == tokens == stats.tokens == 46
    by_state = families["rollouts_rollouts"]
    assert value(by_state, state="done") == finished == 4
    assert value(by_state, state="cancelled") == 1
    assert value(by_state, state="pending") == 1
    for s in Status:
        assert value(by_state, state=s.value) == stats.by_state[s]
    # Submit enqueued 6 jobs; rq keeps the ended ones' jobs queued (no worker took them).
    assert value(families["rollouts_queue_depth"], queue="rollouts") == stats.queues["rollouts"]
    assert value(families["rollouts_worker_in_flight"], worker="w1") == 2
    assert value(families["rollouts_worker_weight_version"], worker="w1") == 3
    assert value(families["rollouts_worker_weight_version_lag"], worker="w1") == 1
    assert value(families["rollouts_weight_version_latest"]) == 4
    assert 0 <= value(families["rollouts_worker_heartbeat_age_seconds"], worker="w1") < 15


async def test_requests_counted_by_route_template(api: TestClient) -> None:
    await api.get("/v1/rollouts/a")
    await api.get("/v1/rollouts/b")
    await api.get("/v1/stats")
    await api.get("/no/such/path")
    families = await scrape(api)
    requests = families["rollouts_api_requests"]
    assert value(requests, "_total", route="/v1/rollouts/{rollout_id}", method="GET",
                 status="404") == 2  # fmt: skip
    assert value(requests, "_total", route="/v1/stats", method="GET", status="200") == 1
    assert value(requests, "_total", route="unmatched", method="GET", status="404") == 1
    duration = families["rollouts_api_request_duration_seconds"]
    assert value(duration, "_count", route="/v1/rollouts/{rollout_id}", method="GET") == 2
    assert duration.type == "histogram"
