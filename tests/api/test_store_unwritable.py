"""A write Redis refuses for a condition of its own (out of memory, a failed RDB save, a
read-only replica) is a 503 with the reason and a ``Retry-After``, not ``500 internal error``;
the Python client raises ``StoreUnwritable``, not redis-py's error; /healthz says why. Nothing
is written, reads still answer, and the same calls succeed once the condition is lifted.

Each test runs a redis-server of its own (the conditions change the server's configuration).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aredis
from aiohttp.test_utils import TestClient, TestServer
from redis import Redis

from statemachine import RolloutRequest, SamplingParams
from store import defaults
from store.api.app import make_app
from store.client import RolloutClient, StoreUnwritable
from store.errors import Refusal
from store.redis_server import RedisServer
from store.sync_client import SyncRolloutClient
from tests.api.helpers import dump_all
from tests.unwritable import REFUSALS, conditions, oom_hold, wait_accepting, wait_refusing

pytestmark = pytest.mark.redis_server

WORDS = {"oom": "maxmemory", "misconf": "MISCONF", "readonly": "READONLY"}


def submit(batch_id: str) -> dict[str, Any]:
    return {"prompts": [{"prompt_token_ids": [5, 6, 7]}], "n": 2, "batch_id": batch_id,
            "sampling": {"max_tokens": 8}}  # fmt: skip


class Condition:
    """One refusal on a server of the test's own: ``on()`` (refusing from then on, for sure),
    ``off()`` (accepting again)."""

    def __init__(self, refusal: str, server: RedisServer, tmp_path: Path) -> None:
        self.refusal, self.server = refusal, server
        self.sync = Redis.from_url(server.url)
        self._on, self._off = conditions(tmp_path)[refusal]
        self.held = False

    def on(self) -> None:
        self.held = True
        self._on(self.sync, self.server)
        if self.refusal == "oom":
            oom_hold(self.sync)
        wait_refusing(self.sync)

    def off(self) -> None:
        if self.held:
            self._off(self.sync, self.server)
            wait_accepting(self.sync)
            self.held = False


@pytest.fixture(params=REFUSALS)
async def condition(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Condition]:
    with RedisServer(tmp_path / "redis") as server:
        c = Condition(request.param, server, tmp_path)
        try:
            yield c
        finally:
            c.off()  # a server left refusing could not even shut down (it saves on the way)
            c.sync.close()


def _refused(body: dict[str, Any], refusal: str) -> None:
    error = body["error"]
    assert error["type"] == "store_unwritable", body
    assert f"Redis refuses writes ({refusal})" in error["message"], body
    assert WORDS[refusal] in error["message"], body  # Redis's own words


async def test_the_api_answers_503_with_why_and_writes_nothing(condition: Condition) -> None:
    refusal = condition.refusal
    rc = RolloutClient(condition.server.url)
    async with TestClient(TestServer(make_app(rc))) as api:
        # A replica holds its primary's data (none), so only the others have a batch to cancel.
        existing = refusal != "readonly"
        if existing:
            assert (await api.post("/v1/batches", json=submit("b0"))).status == 200
        condition.on()
        aioredis = aredis.Redis.from_url(condition.server.url)
        before = await dump_all(aioredis)
        calls: list[tuple[str, str, dict[str, Any]]] = [
            ("POST", "/v1/batches", submit("b1")),
            ("POST", "/v1/weights", {"version": 1, "path": "/ckpt/1"}),
        ]
        if existing:
            calls.append(("POST", "/v1/cancel", {"batch_id": "b0"}))
        for method, path, body in calls:
            r = await api.request(method, path, json=body)
            assert r.status == 503, (path, r.status, await r.text())
            assert r.headers["Retry-After"] == str(defaults.STORE_RETRY_AFTER_S)
            _refused(await r.json(), refusal)
        health = await api.get("/healthz")
        assert health.status == 503
        assert health.headers["Retry-After"] == str(defaults.STORE_RETRY_AFTER_S)
        why = await health.json()
        assert why["status"] == "unavailable" and why["reason"] == refusal, why
        assert WORDS[refusal] in why["redis"], why
        metrics = await api.get("/metrics")
        assert metrics.status == 200
        text = await metrics.text()
        for other in REFUSALS:
            held = 1.0 if other == refusal else 0.0
            assert f'rollouts_store_unwritable{{reason="{other}"}} {held}' in text
        if existing:
            # Reads still answer (under MISCONF even PING is refused: see store.connection).
            r = await api.get("/v1/batches/b0")
            assert r.status == 200 and len((await r.json())["ids"]) == 2
        assert await dump_all(aioredis) == before  # nothing written
        condition.off()
        assert (await api.post("/v1/batches", json=submit("b1"))).status == 200
        health = await api.get("/healthz")
        assert health.status == 200 and await health.json() == {"status": "ok", "redis": "ok"}
        text = await (await api.get("/metrics")).text()
        assert f'rollouts_store_unwritable{{reason="{refusal}"}} 0.0' in text
        await aioredis.aclose()
    await rc.aclose()


async def test_the_client_raises_store_unwritable(condition: Condition) -> None:
    refusal = Refusal(condition.refusal)
    url = condition.server.url
    client = RolloutClient(url)
    request = RolloutRequest(prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=4))
    existing = refusal is not Refusal.READONLY
    if existing:
        [rid] = await client.submit([request], batch_id="b0")
    condition.on()
    if refusal is Refusal.OOM:
        # Out of memory Redis refuses whatever is queued in a MULTI, reads included, and a
        # rollout is read in one: named the same way (under MISCONF reads answer).
        with pytest.raises(StoreUnwritable):
            await client.result(rid)
    elif existing:
        assert (await client.result(rid)).rollout_id == rid
    calls: list[Callable[[], Any]] = [
        lambda: client.submit([request], batch_id="b1"),
        lambda: client.publish_weights(1, "/ckpt/1"),
    ]
    if existing:
        calls.append(lambda: client.cancel(batch_id="b0"))
    for call in calls:
        with pytest.raises(StoreUnwritable) as raised:
            await call()
        assert raised.value.refusal is refusal
    sync = SyncRolloutClient(url)
    try:
        with pytest.raises(StoreUnwritable):
            sync.submit([request], batch_id="b2")
    finally:
        sync.close()
    condition.off()
    assert len(await client.submit([request], batch_id="b1")) == 1
    await client.aclose()


async def test_acknowledging_frees_memory_when_redis_is_full(tmp_path: Path) -> None:
    """Out of memory, Redis still runs deletes: a trainer that acknowledges what it consumed
    is how a full Redis gets room again (an ack only deletes). Under MISCONF it cannot."""
    with RedisServer(tmp_path / "redis") as server:
        c = Condition("oom", server, tmp_path)
        client = RolloutClient(server.url)
        request = RolloutRequest(prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=4))
        batch = await client.submit([request] * 50, batch_id="b0")
        await client.cancel(batch_id="b0")  # ended, so acknowledgeable
        try:
            c.on()
            used = int(c.sync.info("memory")["used_memory"])
            report = await client.ack(batch_id="b0")
            assert sorted(report.acked) == sorted(batch) and not report.live
            assert int(c.sync.info("memory")["used_memory"]) < used
        finally:
            c.off()
            c.sync.close()
            await client.aclose()
