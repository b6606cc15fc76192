"""Episodes and the environment routes refused: an invalid episode at submit, a bad body or
path at a route, an unknown rollout, a missing token. Each gets its documented status, names
the field, and leaves Redis byte for byte as it was; never a 5xx."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from statemachine import EpisodeSpec
from store.api.app import make_app
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.api.conftest import MakeApi
from tests.api.env_helpers import EPISODE, EnvApi
from tests.api.helpers import dump_all

TOKEN = "s3cret-token-value"
GOOD_RESULT = {"claim": 1, "observation_token_ids": [5], "seconds": 0.1}


def submit(episode: Any) -> dict[str, Any]:
    return {"prompts": [{"prompt_token_ids": [1, 2], "episode": episode}],
            "sampling": {"max_tokens": 8}}  # fmt: skip


def ep(**changes: Any) -> dict[str, Any]:
    return {k: v for k, v in {**EPISODE, **changes}.items() if v is not ...}


# (name, path, body, status, error.field)
CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("episode with no way to end a turn", "/v1/batches",
     submit(ep(tool_call_stop_token_ids=...)), 422, "prompts.0.episode"),
    ("episode with an empty stop list", "/v1/batches",
     submit(ep(tool_call_stop_token_ids=[], tool_call_stop_strings=[])), 422, "prompts.0.episode"),
    ("episode with an empty parser", "/v1/batches", submit(ep(parser="")), 422,
     "prompts.0.episode.parser"),
    ("episode tool named twice", "/v1/batches",
     submit(ep(tools=[{"name": "calc"}, {"name": "calc", "effect": "restore"}])), 422,
     "prompts.0.episode.tools"),
    ("episode tool effect unknown", "/v1/batches",
     submit(ep(tools=[{"name": "calc", "effect": "maybe"}])), 422,
     "prompts.0.episode.tools.0.effect"),
    ("episode tool without a name", "/v1/batches", submit(ep(tools=[{"effect": "restart"}])),
     422, "prompts.0.episode.tools.0.name"),
    ("episode queue with a colon", "/v1/batches", submit(ep(env_queue="a:b")), 422,
     "prompts.0.episode.env_queue"),
    ("episode queue with a BOM", "/v1/batches", submit(ep(env_queue="a\ufeff")), 422,
     "prompts.0.episode.env_queue"),
    ("episode max_turns zero", "/v1/batches", submit(ep(max_turns=0)), 422,
     "prompts.0.episode.max_turns"),
    ("episode wall time zero", "/v1/batches", submit(ep(max_wall_seconds=0)), 422,
     "prompts.0.episode.max_wall_seconds"),
    ("episode stop token negative", "/v1/batches", submit(ep(tool_call_stop_token_ids=[-1])),
     422, "prompts.0.episode.tool_call_stop_token_ids.0"),
    ("episode unknown field", "/v1/batches", submit(ep(max_calls=3)), 422,
     "prompts.0.episode.max_calls"),
    ("episode not an object", "/v1/batches", submit([7]), 422, "prompts.0.episode"),
    ("claim without a runner", "/v1/env/box/claim", {}, 422, "runner_id"),
    ("claim waiting over 30 s", "/v1/env/box/claim", {"runner_id": "r", "timeout_s": 31}, 422,
     "timeout_s"),
    ("claim with a zero lease", "/v1/env/box/claim", {"runner_id": "r", "lease_s": 0}, 422,
     "lease_s"),
    ("claim of a queue with a colon", "/v1/env/a:b/claim", {"runner_id": "r"}, 422, "queue"),
    ("claim by a runner with a space", "/v1/env/box/claim", {"runner_id": "a b"}, 422,
     "runner_id"),
    ("heartbeat of claim zero", "/v1/env/calls/ep/call-1/heartbeat", {"claim": 0}, 422, "claim"),
    ("heartbeat of an unknown rollout", "/v1/env/calls/nope/call-1/heartbeat", {"claim": 1},
     404, None),
    ("result with negative seconds", "/v1/env/calls/ep/call-1/result",
     {**GOOD_RESULT, "seconds": -1}, 422, "seconds"),
    ("result with a token id beyond int32", "/v1/env/calls/ep/call-1/result",
     {**GOOD_RESULT, "observation_token_ids": [1, 2**31]}, 422, "observation_token_ids.1"),
    ("result with a negative token id", "/v1/env/calls/ep/call-1/result",
     {**GOOD_RESULT, "observation_token_ids": [-3]}, 422, "observation_token_ids.0"),
    ("result without seconds", "/v1/env/calls/ep/call-1/result",
     {"claim": 1, "observation_token_ids": []}, 422, "seconds"),
    ("result of an unknown rollout", "/v1/env/calls/nope/call-1/result", GOOD_RESULT, 404,
     None),
    ("result of a rollout id with a colon", "/v1/env/calls/a:b/call-1/result", GOOD_RESULT, 422,
     "rollout_id"),
    ("result of a call id with a colon", "/v1/env/calls/ep/c:1/result", GOOD_RESULT, 422,
     "call_id"),
    ("failure of an unknown class", "/v1/env/calls/ep/call-1/failure",
     {"claim": 1, "failure": "env_flaky"}, 422, "failure"),
    ("failure of an unknown rollout", "/v1/env/calls/nope/call-1/failure",
     {"claim": 1, "failure": "env_fatal"}, 404, None),
    ("failure with an error too long", "/v1/env/calls/ep/call-1/failure",
     {"claim": 1, "failure": "env_error", "error": "x" * 5000}, 422, "error"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
async def test_refused_with_its_status_and_nothing_written(
    case: tuple[str, str, Any, int, str | None], env_api: EnvApi
) -> None:
    _, path, body, status, field = case
    await env_api.submit()
    await env_api.at_tool()
    doc = await (await env_api.http.get("/openapi.json")).json()
    before = await dump_all(env_api.redis)
    r = await env_api.http.post(path, data=json.dumps(body).encode(),
                                headers={"Content-Type": "application/json"})  # fmt: skip
    text = await r.text()
    assert r.status == status, text
    error = json.loads(text)["error"]
    assert error["message"] and (field is None or error["field"] == field), error
    assert str(status) in doc["paths"][_template(path)]["post"]["responses"]
    assert await dump_all(env_api.redis) == before


def _template(path: str) -> str:
    if path.startswith("/v1/env/calls/"):
        return "/v1/env/calls/{rollout_id}/{call_id}/" + path.rsplit("/", 1)[1]
    return "/v1/env/{queue}/claim" if path.startswith("/v1/env/") else path


class Templater:
    """A chat template (what ``--tokenizer`` loads): one token per message."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> list[int]:
        return [7 + i for i in range(len(conversation))]


async def test_a_chat_prompt_carries_an_episode_too(
    api_redis: RedisServer, trainer: RolloutClient
) -> None:
    rc = RolloutClient(api_redis.url, tokenizer=Templater())
    http = TestClient(TestServer(make_app(rc)))
    await http.start_server()
    try:
        messages = [{"role": "system", "content": "tools"}, {"role": "user", "content": "2+2"}]
        body = {"prompts": [{"messages": messages, "episode": EPISODE}],
                "sampling": {"max_tokens": 8}, "ids": ["chat-ep"]}  # fmt: skip
        r = await http.post("/v1/batches", json=body)
        assert r.status == 200, await r.text()
        state = await trainer.store.load("chat-ep")
        assert state.request.prompt_token_ids == (7, 8)
        assert state.request.episode == EpisodeSpec.from_dict(EPISODE)
        bad = {**body, "prompts": [{"messages": messages, "episode": ep(max_turns=0)}]}
        r = await http.post("/v1/batches", json={**bad, "ids": ["chat-ep2"]})
        assert r.status == 422 and (await r.json())["error"]["field"] == (
            "prompts.0.episode.max_turns"
        )
    finally:
        await http.close()
        await rc.aclose()


async def test_the_environment_routes_need_the_token(make_api: MakeApi) -> None:
    api = await make_api(token=TOKEN)
    call = "/v1/env/calls/ep/call-1"
    routes = [("/v1/env/box/claim", {"runner_id": "r"}), (f"{call}/heartbeat", {"claim": 1}),
              (f"{call}/result", GOOD_RESULT),
              (f"{call}/failure", {"claim": 1, "failure": "env_error"})]  # fmt: skip
    for path, body in routes:
        r = await api.post(path, json=body)
        assert r.status == 401 and (await r.json())["error"]["type"] == "unauthorized", path
    ok = {"Authorization": f"Bearer {TOKEN}"}
    r = await api.post("/v1/env/box/claim", json={"runner_id": "r"}, headers=ok)
    assert r.status == 204
    for path, body in routes[1:]:
        r = await api.post(path, json=body, headers=ok)
        assert r.status == 404, path  # through auth: no rollout "ep" here
