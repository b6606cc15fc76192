"""``/openapi.json``: an OpenAPI 3.1 document generated from the route table and the pydantic
models the handlers validate with (``model_json_schema``), never kept by hand."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import models_json_schema

from . import fields, schemas, wire

if TYPE_CHECKING:
    from .route import Route

REF = "#/components/schemas/{model}"
_STATUS_TEXT = {
    400: "Malformed body (not JSON or msgpack)",
    401: "Missing or wrong bearer token",
    404: "No such rollout, batch or route",
    409: "Conflicts with what is recorded (batch id reused, rollout ended, stale version, a "
    "tool call's claim that is not live any more)",
    413: "Body over --max-body-bytes",
    422: "A field is invalid; error.field names it",
    429: "More harness calls wait on this API than --max-waiting: nothing was recorded; "
    "retry after Retry-After seconds",
    500: "Unexpected server error (no internals in the body)",
    503: "Redis does not answer, or refuses writes (out of memory, a failed disk write, a "
    "read-only replica): nothing was written; retry after Retry-After seconds",
    504: "The call did not end in time; its rollouts go on, and a retry under the same key "
    "attaches to them",
}

_HARNESS_STATUS_TEXT = {
    404: "No such model (a configured --served-model-name differs), or no such route",
    503: "Over --max-waiting calls (plain text, Retry-After), or Redis does not answer",
    504: "The call outlived the API's wait (plain text, Retry-After); a retry attaches",
}


# What a submit's answer leads to (OpenAPI links): its batch and its rollouts, by the ids in it.
_BATCH = {"batch_id": "$response.body#/batch_id"}
_FIRST_ROLLOUT = {"rollout_id": "$response.body#/ids/0"}
LINKS: dict[str, dict[str, dict[str, Any]]] = {
    "submit": {
        "Batch": {"operationId": "batch", "parameters": _BATCH},
        "Results": {"operationId": "results", "parameters": _BATCH},
        "Take": {"operationId": "take", "parameters": _BATCH},
        "FirstRollout": {"operationId": "rollout", "parameters": _FIRST_ROLLOUT},
        "FirstRolloutEvents": {"operationId": "events", "parameters": _FIRST_ROLLOUT},
    },
}


def build(routes: Sequence[Route], *, secured: bool) -> dict[str, Any]:
    models: set[type[BaseModel]] = {schemas.ErrorBody, schemas.StreamError}
    if any(r.harness for r in routes):
        models.add(schemas.OpenAIErrorBody)
    for r in routes:
        models.update(m for m in (r.body, r.response) if m is not None)
    ordered = sorted(models, key=lambda m: m.__name__)
    _, top = models_json_schema([(m, "validation") for m in ordered], ref_template=REF)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "durable-rollouts trainer API",
            "version": "1",
            "description": "Every call is one of store.client.RolloutClient's. Bodies are "
            f"JSON, or msgpack with Content-Type/Accept {wire.MSGPACK}; arrays are "
            "{dtype, shape, data} with data the little-endian bytes (base64 in JSON).",
        },
        "paths": {},
        "components": {"schemas": top.get("$defs", {})},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for r in routes:
        doc["paths"].setdefault(r.path, {})[r.method.lower()] = _operation(r, secured)
    doc["paths"]["/openapi.json"] = {"get": {
        "operationId": "openapi", "summary": "This document (no auth)",
        "responses": {"200": {"description": "OpenAPI 3.1",
                              "content": {wire.JSON: {"schema": {"type": "object"}}}}},
    }}  # fmt: skip
    return doc


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _content(schema: dict[str, Any]) -> dict[str, Any]:
    return {wire.JSON: {"schema": schema}, wire.MSGPACK: {"schema": schema}}


def _operation(r: Route, secured: bool) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": r.name, "summary": r.summary, "parameters": []}
    for name in _path_params(r.path):
        schema = TypeAdapter(fields.PATH_PARAMS[name]).json_schema()
        op["parameters"].append({"name": name, "in": "path", "required": True, "schema": schema})
    if r.query is not None:
        query = r.query.model_json_schema()
        needed = set(query.get("required", ()))  # fields without a default
        for name, prop in query["properties"].items():
            op["parameters"].append({"name": name, "in": "query", "required": name in needed,
                                     "schema": _absent_not_null(prop)})  # fmt: skip
    if r.body is not None:
        op["requestBody"] = {"required": True, "content": _content(_ref(r.body))}
    op["responses"] = {"200": _success(r)}
    if r.empty is not None:
        op["responses"]["204"] = {"description": r.empty}
    if r.name in LINKS:
        op["responses"]["200"]["links"] = LINKS[r.name]
    errors = set(r.errors) | {500}
    if secured and r.path != "/healthz":
        errors.add(401)
        op["security"] = [{"bearer": []}]
    for status in sorted(errors):
        op["responses"][str(status)] = _error(r, status)
    return op


def _error(r: Route, status: int) -> dict[str, Any]:
    if not r.harness:
        return {"description": _STATUS_TEXT[status], "content": _content(_ref(schemas.ErrorBody))}
    # Harness routes answer JSON only, in OpenAI's/vLLM's error body; a generate route's
    # overload (503) and outlived wait (504) are plain text, which SkyRL's client retries.
    text = _HARNESS_STATUS_TEXT.get(status, _STATUS_TEXT.get(status, ""))
    content: dict[str, Any] = {wire.JSON: {"schema": _ref(schemas.OpenAIErrorBody)}}
    # (The OpenAI routes answer overload with a JSON 429 instead, which openai retries.)
    if status in (503, 504) and 429 not in r.errors:
        content = {**content, "text/plain": {"schema": {"type": "string"}}}
    return {"description": text, "content": content}


_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string", "contentMediaType": wire.JSON,
                 "description": "One chunk of the answer as JSON; the last event is [DONE]."},
        "event": {"type": "string"},
        "id": {"type": "string"},
    },
}  # fmt: skip


def _success(r: Route) -> dict[str, Any]:
    if r.text:
        return {"description": "Prometheus text exposition format 0.0.4",
                "content": {"text/plain": {"schema": {"type": "string"}}}}  # fmt: skip
    assert r.response is not None
    if r.stream:
        line = {"oneOf": [_ref(r.response), _ref(schemas.StreamError)]}
        return {
            "description": "One result per line (NDJSON; with Accept msgpack, a sequence of "
            "msgpack maps), each with its position. A stream that ends before the batch "
            "(timeout) ends with a StreamError line.",
            "content": {wire.NDJSON: {"schema": line}, wire.MSGPACK: {"schema": line}},
        }
    if r.harness:
        content: dict[str, Any] = {wire.JSON: {"schema": _ref(r.response)}}
        if r.body is not None and "stream" in r.body.model_fields:
            # stream: true answers server-sent events of the same choices. Before OpenAPI 3.2
            # (itemSchema), an event stream's `schema` describes one event, as an object of
            # its fields (schemathesis checks each event so).
            content["text/event-stream"] = {"schema": _SSE_EVENT}
        return {"description": "OK", "content": content}
    return {"description": "OK", "content": _content(_ref(r.response))}


def _absent_not_null(prop: dict[str, Any]) -> dict[str, Any]:
    """A query parameter is left out, never null: ``X | None`` is documented as ``X``."""
    branches = [b for b in prop.get("anyOf", ()) if b != {"type": "null"}]
    if "anyOf" in prop and len(branches) == 1:
        rest = {k: v for k, v in prop.items() if k not in ("anyOf", "default")}
        return {**branches[0], **rest}
    return prop


def _path_params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]
