"""Every invalid input gets its documented 4xx, names the field, and leaves Redis byte for byte
as it was (DUMP of every key before and after; nothing excluded: no worker runs here, so
nothing else writes). Never a 5xx."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
import redis.asyncio as aredis
from aiohttp.test_utils import TestClient

from store.client import RolloutClient
from tests.api.conftest import MakeApi
from tests.api.helpers import MSGPACK, dump_all, finish

OK_PROMPT = {"prompt_token_ids": [1, 2, 3]}
SAMPLING = {"max_tokens": 8}


def submit(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"prompts": [OK_PROMPT], "n": 2, "sampling": SAMPLING}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not ...}


def _deep(levels: int) -> Any:
    value: Any = None
    for _ in range(levels):
        value = [value]
    return value


# (name, method, path, body (dict: JSON; bytes: raw), content type, status, error.field)
CASES: list[tuple[str, str, str, Any, str | None, int, str | None]] = [
    ("malformed json", "POST", "/v1/batches", b'{"prompts": [', None, 400, None),
    ("json NaN", "POST", "/v1/batches", b'{"prompts": [], "n": NaN}', None, 400, None),
    ("not utf-8", "POST", "/v1/batches", b'{"a": "\xff"}', None, 400, None),
    ("malformed msgpack", "POST", "/v1/batches", b"\xc1\x00", MSGPACK, 400, None),
    ("truncated msgpack", "POST", "/v1/batches", msgpack.packb(submit())[:-3], MSGPACK, 400,
     None),
    ("empty body", "POST", "/v1/ack", b"", None, 400, None),
    ("text, not JSON", "POST", "/v1/batches", b"hello", "text/plain", 400, None),
    ("body not an object", "POST", "/v1/batches", [1, 2], None, 422, None),
    ("unknown field", "POST", "/v1/batches", submit(extra=1), None, 422, "extra"),
    ("unknown sampling field", "POST", "/v1/batches",
     submit(sampling={"max_tokens": 8, "best_of": 2}), None, 422, "sampling.Sampling.best_of"),
    ("n as string", "POST", "/v1/batches", submit(n="2"), None, 422, "n"),
    # 2.0 is the integer 2 to JSON (and to the document): only a fraction is refused.
    ("n as fraction", "POST", "/v1/batches", submit(n=2.5), None, 422, "n"),
    ("n zero", "POST", "/v1/batches", submit(n=0), None, 422, "n"),
    ("no prompts", "POST", "/v1/batches", submit(prompts=[]), None, 422, "prompts"),
    ("token id negative", "POST", "/v1/batches",
     submit(prompts=[{"prompt_token_ids": [1, -2]}]), None, 422, "prompts.0.prompt_token_ids.1"),
    ("token id a bool", "POST", "/v1/batches",
     submit(prompts=[{"prompt_token_ids": [True]}]), None, 422, "prompts.0.prompt_token_ids.0"),
    ("token ids and messages", "POST", "/v1/batches",
     submit(prompts=[{**OK_PROMPT, "messages": [{"role": "user", "content": "x"}]}]), None,
     422, "prompts.0.messages"),  # this API has no tokenizer: messages are refused by name
    ("no sampling anywhere", "POST", "/v1/batches", submit(sampling=...), None, 422,
     "prompts.0.sampling"),
    ("sampling per prompt, wrong count", "POST", "/v1/batches",
     submit(sampling=[SAMPLING, SAMPLING]), None, 422, "sampling"),
    ("max_tokens over the cap", "POST", "/v1/batches",
     submit(sampling={"max_tokens": 2**21}), None, 422, "sampling.Sampling.max_tokens"),
    ("min over max tokens", "POST", "/v1/batches",
     submit(sampling={"max_tokens": 2, "min_tokens": 5}), None, 422, "sampling.min_tokens"),
    ("logprobs over 20", "POST", "/v1/batches", submit(sampling={"max_tokens": 2, "logprobs": 21}),
     None, 422, "sampling.Sampling.logprobs"),
    ("metadata too large", "POST", "/v1/batches",
     submit(prompts=[{**OK_PROMPT, "metadata": {"x": "y" * 5000}}]), None, 422,
     "prompts.0.metadata"),
    ("metadata int beyond 64 bits", "POST", "/v1/batches",
     submit(prompts=[{**OK_PROMPT, "metadata": {"x": 2**70}}]), None, 422,
     "prompts.0.metadata.x"),
    ("chat without a tokenizer", "POST", "/v1/batches",
     submit(prompts=[{"messages": [{"role": "user", "content": "hi"}]}]), None, 422,
     "prompts.0.messages"),
    ("ids of the wrong count", "POST", "/v1/batches", submit(ids=["a"]), None, 422, "ids"),
    ("duplicate ids", "POST", "/v1/batches", submit(ids=["a", "a"]), None, 422, "ids"),
    ("id with a brace", "POST", "/v1/batches", submit(ids=["a{", "b"]), None, 422, "ids.0"),
    ("batch id with a colon", "POST", "/v1/batches", submit(batch_id="a:b"), None, 422,
     "batch_id"),
    ("group policy unknown", "POST", "/v1/batches", submit(group_policy="all"), None, 422,
     "group_policy"),
    ("msgpack bytes for a string", "POST", "/v1/batches",
     msgpack.packb(submit(batch_id=b"raw"), use_bin_type=True), MSGPACK, 422, "batch_id"),
    ("msgpack extension type", "POST", "/v1/batches",
     msgpack.packb(submit(prompts=[{**OK_PROMPT, "metadata": {"x": msgpack.ExtType(5, b"z")}}])),
     MSGPACK, 400, None),
    ("msgpack nested 5,000 deep", "POST", "/v1/batches", b"\x91" * 5000 + b"\xc0", MSGPACK,
     400, None),
    ("json nested 100,000 deep", "POST", "/v1/batches", b"[" * 100_000, None, 400, None),
    ("metadata nested 900 deep", "POST", "/v1/batches",
     msgpack.packb(submit(prompts=[{**OK_PROMPT, "metadata": {"x": _deep(900)}}])), MSGPACK,
     422, "prompts.0.metadata.x.0.0.0.0.0.0.0.0"),
    ("batch reused for another submission", "POST", "/v1/batches",
     submit(batch_id="taken", n=3), None, 409, None),
    ("named ids held by another request", "POST", "/v1/batches",
     submit(batch_id="other", ids=["taken.0.0", "x.1"]), None, 409, None),
    ("unknown rollout", "GET", "/v1/rollouts/nope", None, None, 404, None),
    ("unknown rollout events", "GET", "/v1/rollouts/nope/events", None, None, 404, None),
    ("rollout id with a colon", "GET", "/v1/rollouts/a:b", None, None, 422, "rollout_id"),
    ("rollout id with a brace", "GET", "/v1/rollouts/a{b", None, None, 404, None),
    ("unknown batch", "GET", "/v1/batches/nope", None, None, 404, None),
    ("results of an unknown batch", "GET", "/v1/batches/nope/results", None, None, 404, None),
    # take cancels the rest of the batch: a GET (which retries repeat) refuses it by name.
    ("take on a GET", "GET", "/v1/batches/taken/results?take=1", None, None, 422, "take"),
    ("take with after on a GET", "GET", "/v1/batches/taken/results?take=1&after=1-0", None,
     None, 422, "take"),
    ("take zero", "POST", "/v1/batches/taken/take", {"groups": 0}, None, 422, "groups"),
    ("take with after", "POST", "/v1/batches/taken/take", {"groups": 1, "after": "1-0"}, None,
     422, "after"),
    ("take of an unknown batch", "POST", "/v1/batches/nope/take", {"groups": 1}, None, 404,
     None),
    ("position beyond 64 bits", "GET", "/v1/batches/taken/results?after=99999999999999999999-0",
     None, None, 422, "after"),
    ("position in other digits", "GET", "/v1/batches/taken/results?after=%D9%A1-0", None, None,
     422, "after"),
    ("bad position", "GET", "/v1/batches/taken/results?after=x", None, None, 422, "after"),
    ("position of no result", "GET", "/v1/batches/taken/results?after=1-0", None, None, 404,
     "after"),
    ("position past the stream", "GET", "/v1/batches/taken/results?after=99999999999999-0",
     None, None, 404, "after"),
    ("unknown query parameter", "GET", "/v1/batches/taken/results?limit=3", None, None, 422,
     "limit"),
    ("timeout not a number", "GET", "/v1/batches/taken/results?timeout=soon", None, None, 422,
     "timeout"),
    ("cancel neither ids nor batch", "POST", "/v1/cancel", {"reason": "x"}, None, 422, None),
    ("cancel both ids and batch", "POST", "/v1/cancel", {"ids": ["a"], "batch_id": "taken"},
     None, 422, None),
    ("cancel unknown rollout", "POST", "/v1/cancel", {"ids": ["taken.0.1", "nope"]}, None, 404,
     None),
    ("cancel an ended rollout", "POST", "/v1/cancel", {"ids": ["taken.0.1", "taken.0.0"]}, None,
     409, None),
    # Not found, like a rollout named by an id the batch does not have.
    ("cancel a group out of range", "POST", "/v1/cancel", {"batch_id": "taken", "group": 5},
     None, 404, None),
    ("cancel an unknown batch", "POST", "/v1/cancel", {"batch_id": "nope"}, None, 404, None),
    ("ack a group of ids", "POST", "/v1/ack", {"ids": ["a"], "group": 0}, None, 422, None),
    ("ack an unknown batch", "POST", "/v1/ack", {"batch_id": "nope"}, None, 404, None),
    ("publish an older version", "POST", "/v1/weights", {"version": 2, "path": "/w"}, None,
     409, None),
    ("publish version zero", "POST", "/v1/weights", {"version": 0, "path": "/w"}, None, 422,
     "version"),
    ("publish without a path", "POST", "/v1/weights", {"version": 9, "path": ""}, None, 422,
     "path"),
    ("unknown route", "GET", "/v1/nothing", None, None, 404, None),
    ("wrong method", "DELETE", "/v1/batches", None, None, 405, None),
]  # fmt: skip


async def _setup(trainer: RolloutClient) -> None:
    """A batch 'taken' (one rollout done), weights at version 2: what the conflicts hit."""
    from statemachine import RolloutRequest, SamplingParams

    req = RolloutRequest(prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=8))
    await trainer.submit([req], n=2, batch_id="taken")
    await finish(trainer.store, "taken.0.0", 3)
    await trainer.publish_weights(2, "/w2")


async def _send(api: TestClient, method: str, path: str, body: Any, ctype: str | None) -> Any:
    headers = {"Content-Type": ctype or "application/json"}
    data = json.dumps(body).encode() if isinstance(body, dict | list) else body
    return await api.request(method, path, data=data, headers=headers)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
async def test_refused_with_its_status_and_nothing_written(
    case: tuple[Any, ...], api: TestClient, trainer: RolloutClient, redis: aredis.Redis
) -> None:
    _, method, path, body, ctype, status, field = case
    await _setup(trainer)
    before = await dump_all(redis)
    r = await _send(api, method, path, body, ctype)
    text = await r.text()
    assert r.status == status, text
    error = json.loads(text)["error"]
    assert set(error) == {"type", "message", "field"} and error["message"]
    if field is not None:
        assert error["field"] == field, error
    assert await dump_all(redis) == before


async def test_body_over_the_limit_is_413(make_api: MakeApi, redis: aredis.Redis) -> None:
    api = await make_api(max_body_bytes=2048)
    before = await dump_all(redis)
    big = {"prompts": [{"prompt_token_ids": list(range(2000))}], "sampling": SAMPLING}
    r = await api.post("/v1/batches", json=big)
    assert r.status == 413
    assert (await r.json())["error"]["type"] == "request_entity_too_large"
    assert await dump_all(redis) == before


async def test_errors_in_msgpack_when_asked(api: TestClient) -> None:
    r = await api.get("/v1/rollouts/nope", headers={"Accept": MSGPACK})
    assert r.status == 404 and r.content_type == MSGPACK
    assert msgpack.unpackb(await r.read())["error"]["type"] == "not_found"


async def test_an_unexpected_error_is_a_500_without_internals(
    api: TestClient, trainer: RolloutClient, redis: aredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    await _setup(trainer)
    # A damaged snapshot head: not the caller's fault, and nothing the API names.
    await redis.hset(trainer.keys.snapshot("taken.0.1"), "head", b"garbage")
    r = await api.get("/v1/rollouts/taken.0.1")
    assert r.status == 500
    assert (await r.json()) == {"error": {"type": "internal", "message": "internal error",
                                          "field": None}}  # fmt: skip
    assert "unexpected error" in caplog.text
