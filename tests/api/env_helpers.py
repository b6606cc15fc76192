"""Helpers of the environment-route tests: the API over fakeredis or a real redis-server with
an ``EnvironmentClient`` of known retries, an episode submitted over HTTP, and its turn ended
at a tool call without a worker (the events a worker would append, through the store)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import fakeredis
import jsonschema
import numpy as np
import pytest
import redis.asyncio as aredis
from aiohttp.test_utils import TestClient, TestServer

from statemachine import RolloutState, commands, episode_commands
from statemachine.commands import NewTokens
from store.api.app import make_app
from store.client import RolloutClient
from store.environment import EnvironmentClient
from store.queue import rollout_queue
from store.redis_server import RedisServer

EPISODE = {
    "tool_call_stop_token_ids": [7],
    "tools": [{"name": "calc", "effect": "idempotent"}, {"name": "send", "effect": "restart"}],
    "env_queue": "box",
}
RETRIES = 1  # the API's env_error budget here: one retry, then the episode fails


@dataclass
class EnvApi:
    http: TestClient
    client: RolloutClient
    env: EnvironmentClient
    redis: aredis.Redis  # raw, for dumps

    async def submit(self, rid: str = "ep", **episode: Any) -> str:
        body = {"prompts": [{"prompt_token_ids": [1, 2, 3], "episode": {**EPISODE, **episode}}],
                "sampling": {"max_tokens": 32}, "ids": [rid]}  # fmt: skip
        r = await self.http.post("/v1/batches", json=body)
        assert r.status == 200, await r.text()
        return rid

    async def at_tool(self, rid: str = "ep", tool: str = "calc") -> RolloutState:
        """What a generation worker records when the episode's turn stops at a call of
        ``tool``: its attempt begins, 3 tokens (the last the stop token 7), the request."""
        store = self.env.store
        s = await store.head(rid)
        for e in commands.begin(s, worker_id="w1", weight_version=0, weight_mode="abort",
                                model="test"):  # fmt: skip
            s = await store.append(s, e)
        tokens = NewTokens(token_ids=np.array([40, 41, 7], dtype=np.int32),
                           logprobs=np.full(3, -0.5, dtype=np.float32),
                           weight_versions=np.zeros(3, dtype=np.int64))  # fmt: skip
        chain = episode_commands.request_call(s, name=tool, arguments='{"x": 1}', tokens=tokens)
        return await store.append_chain(s, chain)

    def jobs(self, state: RolloutState) -> list[str]:
        return list(rollout_queue(self.client.sync_redis, state.queue).get_job_ids())

    async def claim(self, runner: str = "r1", status: int = 200, **body: Any) -> Any:
        r = await self.http.post("/v1/env/box/claim", json={"runner_id": runner, **body})
        assert r.status == status, await r.text()
        return None if status == 204 else await r.json()

    async def report(self, rid: str, call: str, what: str, body: dict[str, Any]) -> Any:
        r = await self.http.post(f"/v1/env/calls/{rid}/{call}/{what}", json=body)
        return r.status, await r.json()


@pytest.fixture(params=["fakeredis", "redis-server"])
async def env_api(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[EnvApi]:
    if request.param == "fakeredis":
        server = fakeredis.FakeServer()
        # RolloutClient connects by URL: here, to the fake server instead.
        fake, fake_sync = fakeredis.FakeAsyncRedis, fakeredis.FakeRedis
        monkeypatch.setattr("store.client.connect_store", lambda url, **_: fake(server=server))
        monkeypatch.setattr("store.client.connect_sync", lambda url: fake_sync(server=server))
        raw: Any = fakeredis.FakeAsyncRedis(server=server)
        url = "redis://fake"
    else:
        real: RedisServer = request.getfixturevalue("api_redis")
        raw = aredis.Redis.from_url(real.url)
        await raw.flushall()
        url = real.url
    client = RolloutClient(url)
    env = EnvironmentClient(client.store, client.sync_redis, retries=RETRIES)
    http = TestClient(TestServer(make_app(client, environment=env)))
    await http.start_server()
    yield EnvApi(http, client, env, raw)
    await http.close()
    await client.aclose()
    await raw.aclose()


def documented(
    doc: dict[str, Any], path: str, status: int, body: Any, method: str = "post"
) -> None:
    """``body`` (JSON) is what the served document declares for ``path`` and ``status``."""
    declared = doc["paths"][path][method]["responses"][str(status)]
    if status == 204:
        assert body is None and "content" not in declared
        return
    schema = {**declared["content"]["application/json"]["schema"],
              "components": doc["components"]}  # fmt: skip
    jsonschema.Draft202012Validator(schema).validate(body)
