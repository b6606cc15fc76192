"""The served document says exactly what the handlers accept: a request the document allows is
never refused as invalid (400/422), and a request refused as invalid is one the document does
not allow. Each case below is a drift schemathesis found against ``/openapi.json`` (issue 28)
or a sibling of one.

The document is read as a client reads it: with ``jsonschema_rs`` (the validator schemathesis
uses), whose ``pattern`` follows ECMA-262 like any JSON Schema client's, not Python's ``re``
(their ``\\s`` differ on \\x1c-\\x1f, \\x85 and \\ufeff). A query parameter the document does
not list is a request it does not describe: not allowed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import jsonschema_rs
import pytest
from aiohttp.test_utils import TestClient, TestServer

from statemachine import RolloutRequest, SamplingParams
from store.api.app import make_app
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.api.helpers import finish

SAMPLING = {"max_tokens": 4}
TOKENS = {"prompts": [{"prompt_token_ids": [1, 2]}], "sampling": SAMPLING}
CHAT = {"prompts": [{"messages": [{"role": "user", "content": "hi"}]}], "sampling": SAMPLING}


class Templater:
    """A chat template (what ``--tokenizer`` loads): one token per message."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> list[int]:
        return [7] * len(conversation)


# (name, method, path template, path params, query, body, with a tokenizer)
CASES: list[tuple[str, str, str, dict[str, str], dict[str, Any], Any, bool]] = [
    ("rollout id with a unit separator", "GET", "/v1/rollouts/{rollout_id}",
     {"rollout_id": "a\x1fb"}, {}, None, False),
    ("rollout id with an escape", "GET", "/v1/rollouts/{rollout_id}/events",
     {"rollout_id": "a\x1b[31mb"}, {}, None, False),
    ("batch id with a NEL", "GET", "/v1/batches/{batch_id}", {"batch_id": "a\x85b"}, {}, None,
     False),
    ("batch id with a colon", "GET", "/v1/batches/{batch_id}/results", {"batch_id": "a:b"},
     {"timeout": 0.1}, None, False),
    ("a plain batch id", "GET", "/v1/batches/{batch_id}", {"batch_id": "b.-_~!é"}, {}, None,
     False),
    ("acked id with a record separator", "POST", "/v1/ack", {}, {}, {"ids": ["a\x1eb"]}, False),
    ("acked id with a BOM", "POST", "/v1/ack", {}, {}, {"ids": ["a\ufeffb"]}, False),
    ("submitted id with a DEL", "POST", "/v1/batches", {}, {},
     {**TOKENS, "ids": ["x\x7fy"]}, False),
    ("take together with after", "GET", "/v1/batches/{batch_id}/results", {"batch_id": "b"},
     {"take": 1, "after": "0-0"}, None, False),
    ("take on a GET", "GET", "/v1/batches/{batch_id}/results", {"batch_id": "b"},
     {"take": 1, "timeout": 0.1}, None, False),
    ("ack naming nothing", "POST", "/v1/ack", {}, {}, {"ids": None, "batch_id": None}, False),
    ("cancel naming nothing", "POST", "/v1/cancel", {}, {},
     {"ids": None, "batch_id": None, "group": None}, False),
    ("cancel a group without its batch", "POST", "/v1/cancel", {}, {}, {"group": 0}, False),
    ("ack a group of ids", "POST", "/v1/ack", {}, {}, {"ids": ["b.0.0"], "group": 0}, False),
    ("cancel ids with a null batch", "POST", "/v1/cancel", {}, {},
     {"ids": ["b.0.0"], "batch_id": None}, False),
    ("cancel a group out of range", "POST", "/v1/cancel", {}, {}, {"batch_id": "b", "group": 9},
     False),
    ("chat without a tokenizer", "POST", "/v1/batches", {}, {}, CHAT, False),
    ("chat with a tokenizer", "POST", "/v1/batches", {}, {}, CHAT, True),
    ("tokens with a tokenizer", "POST", "/v1/batches", {}, {}, TOKENS, True),
    ("tokens and messages with a tokenizer", "POST", "/v1/batches", {}, {},
     {"prompts": [{"prompt_token_ids": [1], "messages": [{"role": "user", "content": "hi"}]}],
      "sampling": SAMPLING}, True),
    ("sampling as a list", "POST", "/v1/batches", {}, {},
     {"prompts": [{"prompt_token_ids": [1]}], "sampling": [SAMPLING]}, False),
    ("submitted ids repeated", "POST", "/v1/batches", {}, {},
     {**TOKENS, "n": 2, "ids": ["r1", "r1"]}, False),
    ("position in Arabic-Indic digits", "GET", "/v1/batches/{batch_id}/results",
     {"batch_id": "b"}, {"after": "\u0661-0", "timeout": 0.1}, None, False),
    ("position beyond 64 bits", "GET", "/v1/batches/{batch_id}/results", {"batch_id": "b"},
     {"after": "99999999999999999999-0", "timeout": 0.1}, None, False),
    ("take of a batch", "POST", "/v1/batches/{batch_id}/take", {"batch_id": "b"}, {},
     {"groups": 1, "timeout": 0.1}, False),
    ("take with after", "POST", "/v1/batches/{batch_id}/take", {"batch_id": "b"}, {},
     {"groups": 1, "after": "0-0"}, False),
    ("metadata nested 9 deep", "POST", "/v1/batches", {}, {},
     {"prompts": [{"prompt_token_ids": [1], "metadata": {"k": [[[[[[[[1]]]]]]]]}}],
      "sampling": SAMPLING}, False),
    ("metadata nested 8 deep", "POST", "/v1/batches", {}, {},
     {"prompts": [{"prompt_token_ids": [1], "metadata": {"k": [[[[[[[1]]]]]]]}}],
      "sampling": SAMPLING}, False),
    ("metadata with a float beyond 64 bits", "POST", "/v1/batches", {}, {},
     {"prompts": [{"prompt_token_ids": [1], "metadata": {"k": 1e300}}], "sampling": SAMPLING},
     False),
    ("no sampling anywhere", "POST", "/v1/batches", {}, {},
     {"prompts": [{"prompt_token_ids": [1]}]}, False),
    ("sampling on every prompt", "POST", "/v1/batches", {}, {},
     {"prompts": [{"prompt_token_ids": [1], "sampling": SAMPLING}], "sampling": None}, False),
    ("sampling on some prompts only", "POST", "/v1/batches", {}, {},
     {"prompts": [{"prompt_token_ids": [1], "sampling": SAMPLING},
                  {"prompt_token_ids": [1]}]}, False),
    ("version as 1362.0", "POST", "/v1/weights", {}, {}, {"version": 1362.0, "path": "/w"},
     False),
    ("version 2**53", "POST", "/v1/weights", {}, {}, {"version": 2**53, "path": "/w"}, False),
    ("version 1.5", "POST", "/v1/weights", {}, {}, {"version": 1.5, "path": "/w"}, False),
    ("max_tokens as 4.0, token ids as 1.0", "POST", "/v1/batches", {}, {},
     {"prompts": [{"prompt_token_ids": [1.0, 2]}], "sampling": {"max_tokens": 4.0}}, False),
    ("n as true", "POST", "/v1/batches", {}, {}, {**TOKENS, "n": True}, False),
    ("metadata with an integer beyond 64 bits", "POST", "/v1/batches", {}, {},
     {"prompts": [{"prompt_token_ids": [1], "metadata": {"k": 2**64}}], "sampling": SAMPLING},
     False),
    ("metadata with a lone surrogate", "POST", "/v1/batches", {}, {},
     {"prompts": [{"prompt_token_ids": [1], "metadata": {"k": "\ud800"}}],
      "sampling": SAMPLING}, False),
    ("episode ending turns at one stop string", "POST", "/v1/batches", {}, {},
     {"prompts": [{"prompt_token_ids": [1], "episode": {"tool_call_stop_strings": "</call>"}}],
      "sampling": SAMPLING}, False),
    ("episode with a parser only", "POST", "/v1/batches", {}, {},
     {"prompts": [{"prompt_token_ids": [1], "episode": {"parser": "hermes"}}],
      "sampling": SAMPLING}, False),
    ("episode with no way to end a turn", "POST", "/v1/batches", {}, {},
     {"prompts": [{"prompt_token_ids": [1], "episode": {"tool_call_stop_token_ids": []}}],
      "sampling": SAMPLING}, False),
    ("chat episode with a queue with a BOM", "POST", "/v1/batches", {}, {},
     {"prompts": [{"messages": [{"role": "user", "content": "hi"}],
                   "episode": {"parser": "p", "env_queue": "q\ufeff"}}],
      "sampling": SAMPLING}, True),
    ("episode wall time 1e300", "POST", "/v1/batches", {}, {},
     {"prompts": [{"prompt_token_ids": [1], "episode": {"parser": "p",
                                                       "max_wall_seconds": 1e300}}],
      "sampling": SAMPLING}, False),
    ("claim waiting 30.5 s", "POST", "/v1/env/{queue}/claim", {"queue": "q"}, {},
     {"runner_id": "r", "timeout_s": 30.5}, False),
    ("claim of a queue with a unit separator", "POST", "/v1/env/{queue}/claim",
     {"queue": "a\x1fb"}, {}, {"runner_id": "r"}, False),
    ("heartbeat of claim 1.0", "POST", "/v1/env/calls/{rollout_id}/{call_id}/heartbeat",
     {"rollout_id": "nope", "call_id": "call-1"}, {}, {"claim": 1.0}, False),
    ("result with a token id beyond int32", "POST",
     "/v1/env/calls/{rollout_id}/{call_id}/result", {"rollout_id": "b.0.0", "call_id": "c"}, {},
     {"claim": 1, "observation_token_ids": [2**31], "seconds": 0}, False),
    ("result of a call id with a NEL", "POST", "/v1/env/calls/{rollout_id}/{call_id}/result",
     {"rollout_id": "b.0.0", "call_id": "c\x85"}, {},
     {"claim": 1, "observation_token_ids": [], "seconds": 0}, False),
]  # fmt: skip


@pytest.fixture
async def apis(api_redis: RedisServer, trainer: RolloutClient) -> AsyncIterator[dict[bool, Any]]:
    """The API without and with a tokenizer, over one batch ``b`` of 2 groups."""
    await trainer.submit(
        [RolloutRequest(prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=4))] * 2,
        batch_id="b",
    )
    await finish(trainer.store, "b.0.0", 2)
    out: dict[bool, Any] = {}
    for chat in (False, True):
        rc = RolloutClient(api_redis.url, tokenizer=Templater() if chat else None)
        tc = TestClient(TestServer(make_app(rc)))
        await tc.start_server()
        out[chat] = (tc, rc)
    yield {chat: tc for chat, (tc, _) in out.items()}
    for tc, rc in out.values():
        await tc.close()
        await rc.aclose()


def allowed(doc: dict[str, Any], method: str, template: str, params: dict[str, str],
            query: dict[str, Any], body: Any) -> list[str]:  # fmt: skip
    """What the document finds wrong with the request ([]: it allows it)."""
    op = doc["paths"][template][method.lower()]
    components = {"components": doc["components"]}
    wrong: list[str] = []

    def check(schema: dict[str, Any], value: Any, where: str) -> None:
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError as exc:  # a lone surrogate: no JSON text holds it
            wrong.append(f"{where}: {exc}")
            return
        validator = jsonschema_rs.validator_for({**schema, **components})
        wrong.extend(f"{where}: {e.message}" for e in validator.iter_errors(value))

    declared = {p["name"]: p for p in op.get("parameters", [])}
    for name, value in [*params.items(), *query.items()]:
        if name not in declared:
            wrong.append(f"{name}: not a parameter of {method} {template}")
        else:
            check(declared[name]["schema"], value, name)
    if body is not None:
        check(op["requestBody"]["content"]["application/json"]["schema"], body, "body")
    return wrong


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
async def test_the_document_allows_exactly_what_the_handlers_accept(
    case: tuple[str, str, str, dict[str, str], dict[str, Any], Any, bool],
    apis: dict[bool, TestClient],
) -> None:
    _, method, template, params, query, body, chat = case
    api = apis[chat]
    doc = await (await api.get("/openapi.json")).json()
    wrong = allowed(doc, method, template, params, query, body)
    path = template.format(**{k: quote(v, safe="") for k, v in params.items()})
    data = None if body is None else json.dumps(body).encode()
    r = await api.request(method, path, params={k: str(v) for k, v in query.items()},
                          data=data, headers={"Content-Type": "application/json"})  # fmt: skip
    text = await r.text()
    assert r.status < 500, text
    refused = r.status in (400, 422)
    if refused:
        assert wrong, f"the document allows what the handler refused: {r.status} {text}"
    else:
        assert not wrong, f"the handler answered {r.status} to what the document refuses: {wrong}"
