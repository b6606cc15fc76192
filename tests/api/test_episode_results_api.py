"""An episode's result over HTTP (a real redis-server, the app in-process): the rollout view and
the result stream carry ``loss_mask``, ``turns``, ``tool_calls`` and ``routes_present`` beside
the context-wide arrays, in JSON and msgpack, each body as the served document declares it; a
plain rollout's body has none of these keys; the document says so."""

from __future__ import annotations

import json
from typing import Any, get_args

import msgpack
import numpy as np
from aiohttp.test_utils import TestClient

from statemachine import RolloutRequest, SamplingParams, Status
from store.api.fields import StateName
from store.client import RolloutClient
from store.results import RolloutResult
from tests.api.helpers import MSGPACK, array, finish, msgpack_seq, ndjson
from tests.api.test_openapi import check_response
from tests.store.episode_play import Play, episode_request

EPISODE_KEYS = {"loss_mask", "turns", "tool_calls", "routes_present"}
# A plain rollout's result body, key for key, as it was before episodes.
PLAIN_KEYS = [
    "rollout_id", "status", "prompt_token_ids", "response_token_ids", "logprobs",
    "weight_versions", "routed_experts", "finish_reason", "stop_reason", "text", "error",
    "failure", "attempts", "aborts", "nonfinite_logprobs", "stale", "group_id", "metadata",
    "admitted_version", "max_staleness", "batch_id", "group_index", "sample_index", "group_size",
    "position", "top_token_ids", "top_logprobs",
]  # fmt: skip
ROLLOUT_KEYS = ["seq", "worker_id", "weight_version", "model", "queue", "submitted_at",
                "abort_reason", "sampling"]  # fmt: skip


async def _episodes(trainer: RolloutClient) -> None:
    """eps.0.0: 3 turns with MoE routes, its second call lost once and run again; eps.0.1:
    waiting on its environment after one turn."""
    await trainer.submit([episode_request()], n=2, batch_id="eps")
    play = await Play.load(trainer.store, "eps.0.0")
    await play.turn(3, version=0, tool="calc", routes=True)
    await play.claim()
    await play.result(2, seconds=0.5)
    await play.turn(2, version=1, tool="calc", routes=True)
    await play.claim("env1")
    await play.lose()
    await play.claim("env2")
    await play.result(3)
    await play.last_turn(2, version=1, routes=True)
    other = await Play.load(trainer.store, "eps.0.1")
    await other.turn(2, tool="edit")


async def _doc(api: TestClient) -> dict[str, Any]:
    doc: dict[str, Any] = await (await api.get("/openapi.json")).json()
    return doc


def _op(doc: dict[str, Any], path: str, method: str = "get") -> dict[str, Any]:
    op: dict[str, Any] = doc["paths"][path][method]
    return op


def _same_as_result(body: dict[str, Any], r: RolloutResult) -> None:
    """The body's arrays and episode fields are the trainer API's result, value for value."""
    assert array(body["response_token_ids"]).tolist() == r.response_token_ids.tolist()
    assert array(body["loss_mask"]).tolist() == r.loss_mask.tolist()  # type: ignore[union-attr]
    assert body["loss_mask"]["dtype"] == "uint8"
    assert array(body["weight_versions"]).tolist() == r.weight_versions.tolist()
    assert np.array_equal(array(body["logprobs"]), r.logprobs)
    assert np.array_equal(array(body["routed_experts"]), r.routed_experts)  # type: ignore[arg-type]
    present = array(body["routes_present"])
    assert body["routes_present"]["dtype"] == "uint8"
    assert present.astype(bool).tolist() == r.routes_present.tolist()  # type: ignore[union-attr]
    assert body["turns"] == [list(t) for t in r.turns or ()]
    assert body["tool_calls"] == [c.to_dict() for c in r.tool_calls or ()]


async def test_an_episodes_rollout_view_in_json_and_msgpack(
    api: TestClient, trainer: RolloutClient
) -> None:
    await _episodes(trainer)
    doc = await _doc(api)
    op = _op(doc, "/v1/rollouts/{rollout_id}")
    resp = await api.get("/v1/rollouts/eps.0.0")
    raw = await resp.read()
    check_response(doc, op, resp.status, resp.content_type, raw, "episode rollout")
    body = json.loads(raw)
    assert list(body) == [*PLAIN_KEYS, *sorted(EPISODE_KEYS, key=_order), *ROLLOUT_KEYS]
    r = await trainer.result("eps.0.0")
    _same_as_result(body, r)
    assert body["turns"] == [[0, 3], [5, 7], [10, 12]]
    assert array(body["loss_mask"]).tolist() == [1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    calls = body["tool_calls"]
    assert [(c["call_id"], c["offset"], c["observation_tokens"], c["outcome"]) for c in calls] == [
        ("call-1", 3, 2, "result"), ("call-2", 7, 3, "result")]  # fmt: skip
    assert [(k["runner_id"], k["outcome"], k["decision"]) for k in calls[1]["claims"]] == [
        ("env1", "lost", "idempotent"), ("env2", "result", None)]  # fmt: skip
    # msgpack: the same, arrays as raw little-endian bytes.
    packed = await api.get("/v1/rollouts/eps.0.0", headers={"Accept": MSGPACK})
    mp = msgpack.unpackb(await packed.read())
    assert isinstance(mp["loss_mask"]["data"], bytes)
    _same_as_result(mp, r)
    # A live episode between turns: its state is one the document names.
    waiting = await api.get("/v1/rollouts/eps.0.1")
    raw = await waiting.read()
    check_response(doc, op, waiting.status, waiting.content_type, raw, "waiting episode")
    body = json.loads(raw)
    assert body["status"] == "awaiting_tool" and body["tool_calls"][0]["outcome"] == "pending"
    events = await api.get("/v1/rollouts/eps.0.0/events")
    raw = await events.read()
    check_response(doc, _op(doc, "/v1/rollouts/{rollout_id}/events"), events.status,
                   events.content_type, raw, "episode events")  # fmt: skip


def _order(key: str) -> int:
    return ["loss_mask", "turns", "tool_calls", "routes_present"].index(key)


async def test_the_result_stream_carries_episodes_and_plain_results_unchanged(
    api: TestClient, trainer: RolloutClient
) -> None:
    await _episodes(trainer)
    await trainer.cancel(["eps.0.1"])  # its pending call is abandoned
    plain_request = RolloutRequest(prompt_token_ids=(5, 6), sampling=SamplingParams(max_tokens=8))
    await trainer.submit([plain_request], batch_id="plain")
    await finish(trainer.store, "plain.0.0", 3)
    doc = await _doc(api)
    op = _op(doc, "/v1/batches/{batch_id}/results")
    stream = await api.get("/v1/batches/eps/results", params={"timeout": "5"})
    raw = await stream.read()
    check_response(doc, op, stream.status, stream.content_type, raw, "episode stream")
    lines = {line["rollout_id"]: line for line in ndjson(raw.decode())}
    assert set(lines) == {"eps.0.0", "eps.0.1"}
    _same_as_result(lines["eps.0.0"], await trainer.result("eps.0.0"))
    cancelled = lines["eps.0.1"]
    assert cancelled["status"] == "cancelled" and cancelled["routes_present"] is None
    assert [c["outcome"] for c in cancelled["tool_calls"]] == ["abandoned"]
    mp = await api.get("/v1/batches/eps/results", params={"timeout": "5"},
                       headers={"Accept": MSGPACK})  # fmt: skip
    assert {line["rollout_id"] for line in msgpack_seq(await mp.read())} == set(lines)
    # A plain rollout: not one key more, in the order it always had.
    stream = await api.get("/v1/batches/plain/results", params={"timeout": "5"})
    raw = await stream.read()
    check_response(doc, op, stream.status, stream.content_type, raw, "plain stream")
    [plain] = ndjson(raw.decode())
    assert list(plain) == PLAIN_KEYS
    view = await (await api.get("/v1/rollouts/plain.0.0")).json()
    assert list(view) == [*PLAIN_KEYS, *ROLLOUT_KEYS]


async def test_the_document_declares_the_episode_fields(api: TestClient) -> None:
    doc = await _doc(api)
    schemas = doc["components"]["schemas"]
    result = schemas["Result"]
    assert set(result["properties"]) >= EPISODE_KEYS
    assert not EPISODE_KEYS & set(result["required"])  # absent from a plain rollout's
    # Never null when present, but routes_present (null for a dense model).
    assert result["properties"]["loss_mask"]["$ref"].endswith("/PackedArray")
    assert result["properties"]["tool_calls"]["items"]["$ref"].endswith("/EpisodeToolCall")
    assert "null" in json.dumps(result["properties"]["routes_present"])
    call = schemas["EpisodeToolCall"]
    assert set(call["required"]) == set(call["properties"])
    assert call["properties"]["claims"]["items"]["$ref"].endswith("/EpisodeToolClaim")
    assert set(get_args(StateName)) == {s.value for s in Status}
    assert set(result["properties"]["status"]["enum"]) == {s.value for s in Status}
