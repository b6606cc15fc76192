"""Every endpoint in-process against a real redis-server, in JSON and in msgpack; results
checked against what the Python client reads from the same server."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from store.api.app import make_app
from store.client import RolloutClient
from store.redis_server import RedisServer, free_port
from tests.api.helpers import MSGPACK, array, finish, msgpack_seq, ndjson
from tests.store.trainer import ack_before_the_load

SUBMIT = {
    "prompts": [{"prompt_token_ids": [5, 6, 7], "metadata": {"task": "a"}},
                {"prompt_token_ids": [8, 9]}],
    "n": 2,
    "sampling": {"max_tokens": 16, "temperature": 0},
    "batch_id": "b1",
}  # fmt: skip


async def test_submit_read_stream_ack_in_json(api: TestClient, trainer: RolloutClient) -> None:
    r = await api.post("/v1/batches", json=SUBMIT)
    assert r.status == 200, await r.text()
    body = await r.json()
    assert body == {"batch_id": "b1", "group_size": 2,
                    "ids": ["b1.0.0", "b1.0.1", "b1.1.0", "b1.1.1"]}  # fmt: skip
    # A retry under the same batch id is the same submit: same ids, nothing new enqueued.
    again = await api.post("/v1/batches", json=SUBMIT)
    assert (await again.json()) == body
    assert (await trainer.stats()).queues == {"rollouts": 4}

    info = await (await api.get("/v1/batches/b1")).json()
    assert info["groups"] == 2 and info["ids"] == body["ids"]
    assert (await (await api.get("/v1/batches")).json()) == {"batches": ["b1"]}

    one = await (await api.get("/v1/rollouts/b1.0.1")).json()
    assert one["status"] == "pending" and one["metadata"] == {"task": "a"}
    assert array(one["prompt_token_ids"]).tolist() == [5, 6, 7]
    assert one["sampling"]["max_tokens"] == 16

    await finish(trainer.store, "b1.1.0", 5, version=0)
    await finish(trainer.store, "b1.0.1", 3, version=0)
    mid = await (await api.get("/v1/rollouts/b1.1.0")).json()
    assert mid["status"] == "done" and mid["finish_reason"] == "length"
    assert array(mid["response_token_ids"]).tolist() == [100, 101, 102, 103, 104]
    assert array(mid["logprobs"]).dtype == np.float32
    events = (await (await api.get("/v1/rollouts/b1.1.0/events")).json())["events"]
    assert [e["type"] for e in events] == ["submitted", "started", "tokens_appended", "finished"]
    assert [e["seq"] for e in events] == [1, 2, 3, 4]
    assert array(events[2]["fields"]["token_ids"]).tolist() == [100, 101, 102, 103, 104]

    # The first two results, in the order they ended, then resume after the first.
    stream = await api.get("/v1/batches/b1/results", params={"timeout": "0.5"})
    assert stream.status == 200 and stream.content_type == "application/x-ndjson"
    lines = ndjson(await stream.text())
    assert [x["rollout_id"] for x in lines[:2]] == ["b1.1.0", "b1.0.1"]
    assert lines[-1]["error"]["type"] == "timeout"
    expected = [r async for r in _first(trainer.results("b1"), 2)]
    assert [x["position"] for x in lines[:2]] == [r.position for r in expected]
    resumed = await api.get("/v1/batches/b1/results",
                            params={"after": lines[0]["position"], "timeout": "0.3"})  # fmt: skip
    assert [x.get("rollout_id") for x in ndjson(await resumed.text())] == ["b1.0.1", None]

    # Ack the finished ones; the live ones are kept and named.
    ack = await api.post("/v1/ack", json={"ids": ["b1.1.0", "b1.0.1", "b1.0.0", "nope"]})
    assert (await ack.json()) == {"acked": ["b1.1.0", "b1.0.1"], "live": ["b1.0.0"],
                                  "missing": ["nope"]}  # fmt: skip
    assert (await api.get("/v1/rollouts/b1.1.0")).status == 404


async def test_top_logprobs_are_returned_with_the_result_only_when_asked(
    api: TestClient, trainer: RolloutClient
) -> None:
    body = {**SUBMIT, "n": 1, "sampling": {"max_tokens": 16, "temperature": 0, "logprobs": 3}}
    r = await api.post("/v1/batches", json=body)
    assert r.status == 200, await r.text()
    asked, _ = (await r.json())["ids"]
    await finish(trainer.store, asked, 4, top=3)
    one = await (await api.get(f"/v1/rollouts/{asked}")).json()
    assert one["sampling"]["logprobs"] == 3
    ids, lps = array(one["top_token_ids"]), array(one["top_logprobs"])
    assert ids.dtype == np.int32 and lps.dtype == np.float32 and ids.shape == lps.shape == (4, 3)
    assert ids.tolist() == [[100 + t + j for j in range(3)] for t in range(4)]
    assert lps.tolist() == [[0.0, -1.0, -2.0]] * 4
    # The same in the result stream, in msgpack, and what the Python client reads.
    stream = await api.get(
        "/v1/batches/b1/results", params={"timeout": "0.3"}, headers={"Accept": MSGPACK}
    )
    [line, *_] = msgpack_seq(await stream.read())
    [mine] = [x async for x in _first(trainer.results("b1"), 1)]
    assert mine.top_token_ids is not None and mine.top_logprobs is not None
    assert array(line["top_token_ids"]).tobytes() == mine.top_token_ids.tobytes()
    assert array(line["top_logprobs"]).tobytes() == mine.top_logprobs.tobytes()
    # A rollout that asked for none has none.
    await api.post("/v1/batches", json={**SUBMIT, "batch_id": "b2"})
    await finish(trainer.store, "b2.0.0", 4)
    plain = await (await api.get("/v1/rollouts/b2.0.0")).json()
    assert plain["top_token_ids"] is None and plain["top_logprobs"] is None


async def test_msgpack_bodies_and_packed_bytes(api: TestClient, trainer: RolloutClient) -> None:
    headers = {"Content-Type": MSGPACK, "Accept": MSGPACK}
    r = await api.post("/v1/batches", data=msgpack.packb(SUBMIT), headers=headers)
    assert r.status == 200 and r.content_type == MSGPACK
    ids = msgpack.unpackb(await r.read())["ids"]
    for rid in ids:
        await finish(trainer.store, rid, 4)
    stream = await api.get("/v1/batches/b1/results", headers={"Accept": MSGPACK})
    assert stream.content_type == MSGPACK
    results = msgpack_seq(await stream.read())
    assert sorted(x["rollout_id"] for x in results) == sorted(ids)
    tokens = results[0]["response_token_ids"]
    # Raw little-endian bytes in a msgpack bin, not a list and not base64.
    assert isinstance(tokens["data"], bytes) and tokens["dtype"] == "int32"
    assert array(tokens).tolist() == [100, 101, 102, 103]
    mine = {r.rollout_id: r async for r in trainer.results("b1")}
    for x in results:
        ref = mine[x["rollout_id"]]
        assert x["position"] == ref.position
        assert array(x["logprobs"]).tobytes() == ref.logprobs.tobytes()
        assert array(x["weight_versions"]).tolist() == ref.weight_versions.tolist()
    ack = await api.post("/v1/ack", data=msgpack.packb({"batch_id": "b1"}), headers=headers)
    assert msgpack.unpackb(await ack.read())["acked"] == ids
    assert (await (await api.get("/v1/batches")).json()) == {"batches": []}


async def test_take_streams_whole_groups_and_cancels_the_rest(
    api: TestClient, trainer: RolloutClient
) -> None:
    await api.post("/v1/batches", json=SUBMIT)
    for rid in ("b1.1.1", "b1.1.0"):
        await finish(trainer.store, rid, 2)
    r = await api.post("/v1/batches/b1/take", json={"groups": 1})
    assert r.status == 200 and r.content_type == "application/x-ndjson"
    lines = ndjson(await r.text())
    assert sorted(x["rollout_id"] for x in lines) == ["b1.1.0", "b1.1.1"]
    assert await trainer.statuses(["b1.0.0", "b1.0.1"]) == ["cancelled", "cancelled"]


async def test_a_get_of_results_has_no_side_effect(api: TestClient, trainer: RolloutClient) -> None:
    """GETs are repeated at will (retries, prefetchers, a browser): take=k, which cancels the
    rest of the batch, is refused there with the form that does it, and nothing changes."""
    await api.post("/v1/batches", json=SUBMIT)
    for rid in ("b1.1.1", "b1.1.0"):
        await finish(trainer.store, rid, 2)
    r = await api.get("/v1/batches/b1/results", params={"take": "1", "timeout": "0.2"})
    assert r.status == 422
    error = (await r.json())["error"]
    assert error["field"] == "take"
    assert 'POST /v1/batches/b1/take with {"groups": k}' in error["message"]
    assert await trainer.statuses(["b1.0.0", "b1.0.1"]) == ["pending", "pending"]


async def test_stream_delivers_a_completion_while_open(
    api: TestClient, trainer: RolloutClient
) -> None:
    await api.post("/v1/batches", json={**SUBMIT, "n": 1})
    r = await api.get("/v1/batches/b1/results", params={"timeout": "30"})
    await finish(trainer.store, "b1.1.0", 2)
    first = await asyncio.wait_for(r.content.readline(), 10)
    assert b'"rollout_id":"b1.1.0"' in first
    await finish(trainer.store, "b1.0.0", 2)
    rest = ndjson((await asyncio.wait_for(r.content.read(), 10)).decode())
    assert [x["rollout_id"] for x in rest] == ["b1.0.0"]  # ends when the batch is delivered


async def test_rollouts_acknowledged_while_the_stream_reads_them_are_skipped(
    api: TestClient, trainer: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28: an ack between a block's XREAD and its load ended the stream with a
    not_found error line instead of skipping the acknowledged rollouts."""
    await api.post("/v1/batches", json=SUBMIT)
    for rid in ("b1.0.0", "b1.0.1", "b1.1.0", "b1.1.1"):
        await finish(trainer.store, rid, 2)
    ack_before_the_load(monkeypatch, trainer, ids=["b1.0.1", "b1.1.0"])
    r = await api.get("/v1/batches/b1/results", params={"timeout": "10"})
    assert r.status == 200
    assert [x.get("rollout_id") for x in ndjson(await r.text())] == ["b1.0.0", "b1.1.1"]


async def test_cancel_by_ids_batch_and_group(api: TestClient, trainer: RolloutClient) -> None:
    await api.post("/v1/batches", json=SUBMIT)
    r = await api.post("/v1/cancel", json={"ids": ["b1.0.0"], "reason": "not needed"})
    assert (await r.json()) == {"cancelled": ["b1.0.0"]}
    r = await api.post("/v1/cancel", json={"batch_id": "b1", "group": 1})
    assert (await r.json()) == {"cancelled": ["b1.1.0", "b1.1.1"]}
    r = await api.post("/v1/cancel", json={"batch_id": "b1"})  # ended ones skipped
    assert (await r.json()) == {"cancelled": ["b1.0.1"]}
    events = (await (await api.get("/v1/rollouts/b1.0.0/events")).json())["events"]
    assert events[-1]["type"] == "cancelled"
    assert events[-1]["fields"] == {"reason": "not needed"}


async def test_weights_and_stats(api: TestClient, trainer: RolloutClient) -> None:
    r = await api.post("/v1/weights", json={"version": 3, "path": "/ckpt/3"})
    assert r.status == 200 and (await r.json())["version"] == 3
    assert (await trainer.weights.latest()).path == "/ckpt/3"  # type: ignore[union-attr]
    await api.post("/v1/batches", json=SUBMIT)
    await finish(trainer.store, "b1.0.0", 7, version=3)
    stats = await (await api.get("/v1/stats")).json()
    assert stats["by_state"]["done"] == 1 and stats["by_state"]["pending"] == 3
    assert stats["tokens"] == 7 and stats["latest_weight_version"] == 3
    assert stats["queues"] == {"rollouts": 4}


async def test_the_largest_version_the_schema_allows_then_an_older_one_is_a_409(
    api: TestClient, trainer: RolloutClient
) -> None:
    """Issue 28: version 2**63 - 1 made every later publish a 500 (the script compared and
    answered versions as doubles)."""
    top = 2**63 - 1
    r = await api.post("/v1/weights", json={"version": top, "path": "/top"})
    assert r.status == 200, await r.text()
    assert (await r.json())["version"] == top
    for older in (top, 2**53 + 1, 5):
        r = await api.post("/v1/weights", json={"version": older, "path": "/old"})
        assert r.status == 409, await r.text()
        error = (await r.json())["error"]
        assert error["type"] == "stale_weight_version" and str(top) in error["message"]
    r = await api.post("/v1/weights", json={"version": top + 1, "path": "/beyond"})
    assert r.status == 422 and (await r.json())["error"]["field"] == "version"
    stats = await (await api.get("/v1/stats")).json()
    assert stats["latest_weight_version"] == top
    assert [w.version for w in await trainer.weights.history()] == [top]


async def test_healthz(api: TestClient) -> None:
    r = await api.get("/healthz")
    assert r.status == 200 and (await r.json()) == {"status": "ok", "redis": "ok"}


async def test_healthz_503_when_redis_is_gone() -> None:
    rc = RolloutClient(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    async with TestClient(TestServer(make_app(rc))) as c:
        r = await c.get("/healthz")
        assert r.status == 503 and (await r.json())["status"] == "unavailable"
    await rc.aclose()


async def _first(agen, n):  # type: ignore[no-untyped-def]
    got = 0
    async for x in agen:
        yield x
        got += 1
        if got == n:
            return


class _Templater:
    """A chat template as a tokenizer applies it: fixed ids per role, then the content's."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> list[int]:
        ids = []
        for m in conversation:
            ids += [1 if m["role"] == "user" else 2, *[ord(c) % 50 for c in m["content"]]]
        return [*ids, 3]


async def test_chat_messages_with_a_tokenizer(api_redis: RedisServer, redis: object) -> None:
    rc = RolloutClient(api_redis.url, tokenizer=_Templater())  # type: ignore[arg-type]
    async with TestClient(TestServer(make_app(rc))) as c:
        body = {"prompts": [{"messages": [{"role": "user", "content": "hi"}],
                             "metadata": {"id": 7}}], "sampling": {"max_tokens": 4}}  # fmt: skip
        r = await c.post("/v1/batches", json=body)
        assert r.status == 200, await r.text()
        rid = (await r.json())["ids"][0]
        one = await (await c.get(f"/v1/rollouts/{rid}")).json()
        assert array(one["prompt_token_ids"]).tolist() == [1, ord("h") % 50, ord("i") % 50, 3]
        assert one["metadata"] == {"id": 7}
    await rc.aclose()


async def test_a_consumer_leaving_mid_stream_is_no_error(
    api: TestClient, trainer: RolloutClient, caplog: Any
) -> None:
    await api.post("/v1/batches", json=SUBMIT)
    await finish(trainer.store, "b1.0.0", 2)
    r = await api.get("/v1/batches/b1/results", params={"timeout": "30"})
    assert b"b1.0.0" in await asyncio.wait_for(r.content.readline(), 10)
    r.close()  # gone, with three rollouts still to come
    for rid in ("b1.0.1", "b1.1.0", "b1.1.1"):
        await finish(trainer.store, rid, 2)
    await asyncio.sleep(0.3)
    again = await api.get("/v1/batches/b1/results")
    assert len(ndjson(await again.text())) == 4
    assert "unexpected error" not in caplog.text and "failed" not in caplog.text
