"""The served /openapi.json drives a property-based run: request bodies drawn from its own
request schemas (``schema_strategy``: hypothesis-jsonschema is broken with this hypothesis,
see there) and from arbitrary JSON, path ids from arbitrary text;
no response is a 5xx, and every response (status, content type, body; each line of a result
stream) is one the document declares for that operation.

The examples are drawn first (a ``@given`` function collects them; hypothesis runs sync) and
then sent to the in-process app, whose client lives on the test's event loop: no shrinking,
so an assertion prints the failing example itself.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import jsonschema
from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store.api.app import ROUTES
from store.api.harness.routes import routes as harness_routes
from store.client import RolloutClient
from tests.api.helpers import finish
from tests.api.schema_strategy import from_schema

EXAMPLES = 40  # per operation
HARNESS = {r.path for r in harness_routes()}
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def draw(strategy: st.SearchStrategy[Any], n: int) -> list[Any]:
    out: list[Any] = []

    @settings(max_examples=n, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(strategy)
    def collect(x: Any) -> None:
        out.append(x)

    collect()
    return out


def checker(doc: dict[str, Any]) -> Any:
    def check(schema: dict[str, Any], instance: Any, where: str) -> None:
        full = {**schema, "components": doc["components"]}
        errors = list(jsonschema.Draft202012Validator(full).iter_errors(instance))
        assert not errors, f"{where}: {errors[0].message} in {json.dumps(instance)[:500]}"

    return check


def check_response(doc: dict[str, Any], op: dict[str, Any], status: int, ctype: str,
                   body: bytes, where: str) -> None:  # fmt: skip
    assert status < 500, f"{where}: {status} {body[:300]!r}"
    declared = op["responses"].get(str(status))
    assert declared is not None, f"{where}: status {status} is not documented"
    assert ctype in declared["content"], f"{where}: {ctype} not documented for {status}"
    schema = declared["content"][ctype]["schema"]
    check = checker(doc)
    if ctype == "application/x-ndjson":
        for line in body.decode().splitlines():
            check(schema, json.loads(line), where)
    elif ctype == "application/json":
        check(schema, json.loads(body), where)


async def test_no_5xx_and_every_response_as_documented(
    api: TestClient, trainer: RolloutClient
) -> None:
    doc = await (await api.get("/openapi.json")).json()
    jsonschema.Draft202012Validator.check_schema({"$defs": doc["components"]["schemas"]})
    # Something for the generated requests to find: a batch with ended and pending rollouts.
    seed = {"prompts": [{"prompt_token_ids": [3, 4]}], "n": 2, "sampling": {"max_tokens": 4},
            "batch_id": "seed"}  # fmt: skip
    assert (await api.post("/v1/batches", json=seed)).status == 200
    await finish(trainer.store, "seed.0.0", 3)
    ids = st.sampled_from(["seed", "seed.0.0", "seed.0.1", "nope"]) | st.text(min_size=1)
    statuses: dict[str, list[int]] = {}
    for route in ROUTES:
        op = doc["paths"][route.path][route.method.lower()]
        where = f"{route.method} {route.path}"
        if route.body is not None:
            schema = op["requestBody"]["content"]["application/json"]["schema"]
            many = 3 * EXAMPLES if route.name == "submit" else EXAMPLES
            bodies = draw(from_schema(schema, doc), many) + draw(JSON_VALUES, EXAMPLES // 4)
            for body in bodies:
                r = await api.request(route.method, route.path, json=body)
                check_response(doc, op, r.status, r.content_type, await r.read(),
                               f"{where} {json.dumps(body)[:300]}")  # fmt: skip
                statuses.setdefault(route.name, []).append(r.status)
        else:
            for rid in draw(ids, EXAMPLES // 2):
                path = route.path.replace("{batch_id}", quote(rid, safe="")).replace(
                    "{rollout_id}", quote(rid, safe="")).replace(
                    "{session_id}", quote(rid, safe=""))  # fmt: skip
                params = {"timeout": "0.2"} if route.stream else None
                r = await api.request(route.method, path, params=params)
                check_response(doc, op, r.status, r.content_type, await r.read(),
                               f"{where} {rid!r}")  # fmt: skip
                statuses.setdefault(route.name, []).append(r.status)
    print({name: sorted(set(s)) for name, s in statuses.items()})
    # The drawn bodies reach the trainer API, and are refused too: both sides were explored.
    assert 200 in statuses["submit"] and 422 in statuses["submit"]
    assert 200 in statuses["publish"] and 200 in statuses["rollout"]


async def test_every_route_is_documented(api: TestClient) -> None:
    doc = await (await api.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    served = {(r.method.lower(), r.resource.canonical) for r in api.app.router.routes()
              if r.method != "HEAD"}  # fmt: skip
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert served == documented
    for path, ops in doc["paths"].items():
        for op in ops.values():
            if path not in ("/openapi.json", "/metrics"):
                assert "500" in op["responses"]
                # Harness routes (store.api.harness) answer in OpenAI's/vLLM's error body.
                body = "OpenAIErrorBody" if path in HARNESS else "ErrorBody"
                assert op["responses"]["500"]["content"]["application/json"]["schema"] == {
                    "$ref": f"#/components/schemas/{body}"}  # fmt: skip
    submit = doc["paths"]["/v1/batches"]["post"]
    # Without a tokenizer the API cannot apply a chat template: token ids only, and it says so.
    assert submit["requestBody"]["content"]["application/msgpack"]["schema"] == {
        "$ref": "#/components/schemas/SubmitTokensRequest"}  # fmt: skip
    assert "messages" not in doc["components"]["schemas"]["TokensPrompt"]["properties"]
    assert {"400", "413", "422", "409"} <= set(submit["responses"])
