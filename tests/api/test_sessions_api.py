"""Sessions over HTTP, in-process against a real redis-server: ``GET /v1/sessions/{id}`` lists a
session's calls in order, ``/v1/sessions/{id}/trajectory`` gives them as one trajectory (and
``RolloutClient.trajectory`` the same), and ``/v1/cancel`` and ``/v1/ack`` take a
``session``."""

from __future__ import annotations

from urllib.parse import quote

from aiohttp.test_utils import TestClient

from statemachine import RolloutRequest, SamplingParams
from store.api import schemas, trajectory_schemas
from store.client import RolloutClient
from tests.api.helpers import array, finish

S = "env:42/{episode}"  # a harness's id: colons, braces and a slash, quoted in the path


def request(first: int) -> RolloutRequest:
    return RolloutRequest(prompt_token_ids=(first, 6, 7), sampling=SamplingParams(max_tokens=8))


async def test_list_cancel_and_ack_a_session(api: TestClient, trainer: RolloutClient) -> None:
    await trainer.submit([request(1)], n=2, batch_id="t1", session=S)
    await trainer.submit([request(2)], batch_id="t2", session=S)
    await finish(trainer.store, "t1.0.0", 4)
    r = await api.get(f"/v1/sessions/{quote(S, safe='')}")
    assert r.status == 200, await r.text()
    body = schemas.Session.model_validate(await r.json()).model_dump()
    assert body["session_id"] == S
    assert [(c["batch_id"], c["ids"], c["states"], c["group_size"]) for c in body["calls"]] == [
        ("t1", ["t1.0.0", "t1.0.1"], ["done", "pending"], 2),
        ("t2", ["t2.0.0"], ["pending"], 1),
    ]
    assert body["calls"][0]["at"] <= body["calls"][1]["at"]

    r = await api.post("/v1/cancel", json={"session": S, "reason": "episode over"})
    assert (await r.json()) == {"cancelled": ["t1.0.1", "t2.0.0"]}
    r = await api.post("/v1/ack", json={"session": S})
    assert (await r.json()) == {"acked": ["t1.0.0", "t1.0.1", "t2.0.0"], "live": [],
                                "missing": []}  # fmt: skip
    r = await api.get(f"/v1/sessions/{quote(S, safe='')}")
    assert (await r.json()) == {"session_id": S, "calls": []}
    assert await trainer.batches() == []


async def test_refusals_name_the_field(api: TestClient, trainer: RolloutClient) -> None:
    await trainer.submit([request(1)], batch_id="t1", session="s")
    for body, field in (({"session": "s", "batch_id": "t1"}, None),
                        ({"session": "s", "group": 0}, None),
                        ({"session": ""}, "session"),
                        ({"session": "a\nb"}, "session")):  # fmt: skip
        for route in ("/v1/cancel", "/v1/ack"):
            r = await api.post(route, json=body)
            assert r.status == 422, (route, body)
            error = (await r.json())["error"]
            assert field is None or error["field"] == field, error
    r = await api.get("/v1/sessions/a%0Ab")
    assert r.status == 422
    assert (await r.json())["error"]["field"] == "session_id"
    assert await trainer.statuses(["t1.0.0"]) == ["pending"]  # nothing was cancelled


async def test_a_sessions_trajectory_over_http_and_the_client(
    api: TestClient, trainer: RolloutClient
) -> None:
    first = request(1)
    await trainer.submit([first], batch_id="t1", session=S)
    await finish(trainer.store, "t1.0.0", 3)  # tokens 100, 101, 102
    # The harness's next call: the context so far and a tool result (two tokens).
    second = RolloutRequest(prompt_token_ids=(1, 6, 7, 100, 101, 102, 40, 41),
                            sampling=SamplingParams(max_tokens=8))  # fmt: skip
    await trainer.submit([second], n=2, batch_id="t2", session=S)
    await finish(trainer.store, "t2.0.0", 2, version=1)
    path = f"/v1/sessions/{quote(S, safe='')}/trajectory"
    r = await api.get(path)
    assert r.status == 200, await r.text()
    body = trajectory_schemas.Trajectory.model_validate(await r.json()).model_dump()
    assert (body["session_id"], body["status"], body["breaks"], body["gone"]) == (
        S, "running", [], [])  # t2.0.1 is still pending  # fmt: skip
    [seg] = body["segments"]
    assert array(seg["prompt_token_ids"]).tolist() == [1, 6, 7]
    assert array(seg["token_ids"]).tolist() == [100, 101, 102, 40, 41, 100, 101]
    assert array(seg["loss_mask"]).tolist() == [1, 1, 1, 0, 0, 1, 1]
    assert array(seg["weight_versions"]).tolist() == [0, 0, 0, -1, -1, 1, 1]
    assert seg["turns"] == [[0, 3], [5, 7]]
    assert [(c["rollout_id"], c["sample"], c["status"], c["start"], c["response_start"],
             c["end"]) for c in seg["calls"]] == [
        ("t1.0.0", 0, "done", 0, 0, 3), ("t2.0.0", 0, "done", 3, 5, 7)]  # fmt: skip
    t = await trainer.trajectory(S)
    assert t.status.value == "running" and len(t.segments) == 1
    assert t.segments[0].token_ids.tolist() == array(seg["token_ids"]).tolist()
    # The session's own route still answers its listing (the trajectory route is matched
    # first only for a path that ends with /trajectory).
    listing = await (await api.get(f"/v1/sessions/{quote(S, safe='')}")).json()
    assert [c["batch_id"] for c in listing["calls"]] == ["t1", "t2"]
    unknown = await (await api.get("/v1/sessions/nobody/trajectory")).json()
    assert unknown == {"session_id": "nobody", "status": "empty", "segments": [],
                       "breaks": [], "gone": []}  # fmt: skip
    r = await api.get("/v1/sessions/a%0Ab/trajectory")
    assert r.status == 422 and (await r.json())["error"]["field"] == "session_id"
