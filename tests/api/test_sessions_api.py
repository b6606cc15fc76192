"""Sessions over HTTP, in-process against a real redis-server: ``GET /v1/sessions/{id}`` lists a
session's calls in order, and ``/v1/cancel`` and ``/v1/ack`` take a ``session``."""

from __future__ import annotations

from urllib.parse import quote

from aiohttp.test_utils import TestClient

from statemachine import RolloutRequest, SamplingParams
from store.api import schemas
from store.client import RolloutClient
from tests.api.helpers import finish

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
