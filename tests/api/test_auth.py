"""Bearer-token authentication: on and off."""

from __future__ import annotations

import logging

import pytest
from aiohttp.test_utils import TestClient

from store.api.app import ROUTES
from tests.api.conftest import MakeApi

TOKEN = "s3cret-token-value"
PATHS = [(r.method, r.path.replace("{batch_id}", "b").replace("{rollout_id}", "r"))
         for r in ROUTES if r.path != "/healthz"]  # fmt: skip


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {TOKEN}", "Bearer",
                                    f"Bearer {TOKEN}x", "Bearer s3cret-token-valu€"])  # fmt: skip
async def test_every_route_but_health_and_openapi_needs_the_token(
    make_api: MakeApi, header: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    api = await make_api(token=TOKEN)
    headers = {} if header is None else {"Authorization": header}
    for method, path in PATHS:
        r = await api.request(method, path, headers=headers, json={})
        assert r.status == 401, (method, path, await r.text())
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert (await r.json())["error"]["type"] == "unauthorized"
    assert (await api.get("/healthz", headers=headers)).status == 200
    assert (await api.get("/openapi.json", headers=headers)).status == 200
    assert TOKEN not in caplog.text


async def test_the_right_token_lets_every_route_through(
    make_api: MakeApi, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    api = await make_api(token=TOKEN)
    ok = {"Authorization": f"Bearer {TOKEN}"}
    r = await api.post("/v1/batches", headers=ok,
                       json={"prompts": [{"prompt_token_ids": [1]}], "sampling": {"max_tokens": 2},
                             "batch_id": "b"})  # fmt: skip
    assert r.status == 200
    for method, path in PATHS:
        if method == "GET":
            r = await api.get(path, headers=ok, params={"timeout": "0.1"} if "results" in path
                              else None)  # fmt: skip
            assert r.status in (200, 404), (path, r.status)  # 404: rollout "r" does not exist
    assert (await api.get("/v1/stats", headers=ok)).status == 200
    assert TOKEN not in caplog.text


async def test_without_a_token_nothing_is_asked(api: TestClient) -> None:
    assert (await api.get("/v1/stats")).status == 200
    assert (await api.get("/metrics")).status == 200


async def test_the_document_names_the_scheme_only_when_on(make_api: MakeApi) -> None:
    on = await (await (await make_api(token=TOKEN)).get("/openapi.json")).json()
    off = await (await (await make_api()).get("/openapi.json")).json()
    assert on["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert on["paths"]["/v1/stats"]["get"]["security"] == [{"bearer": []}]
    assert "401" in on["paths"]["/v1/batches"]["post"]["responses"]
    assert "security" not in on["paths"]["/healthz"]["get"]
    assert "securitySchemes" not in off["components"]
