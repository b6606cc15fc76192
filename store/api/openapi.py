"""``/openapi.json``: an OpenAPI 3.1 document generated from the route table and the pydantic
models the handlers validate with (``model_json_schema``), never kept by hand."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from . import schemas, wire

if TYPE_CHECKING:
    from .app import Route

REF = "#/components/schemas/{model}"
_STATUS_TEXT = {
    400: "Malformed body (not JSON or msgpack)",
    401: "Missing or wrong bearer token",
    404: "No such rollout, batch or route",
    409: "Conflicts with what is recorded (batch id reused, rollout ended, stale version)",
    413: "Body over --max-body-bytes",
    422: "A field is invalid; error.field names it",
    500: "Unexpected server error (no internals in the body)",
    503: "Redis does not answer",
}


def build(routes: Sequence[Route], *, secured: bool) -> dict[str, Any]:
    models: set[type[BaseModel]] = {schemas.ErrorBody, schemas.StreamError}
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
        op["parameters"].append(
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        )
    if r.query is not None:
        for name, prop in r.query.model_json_schema()["properties"].items():
            op["parameters"].append({"name": name, "in": "query", "required": False,
                                     "schema": prop})  # fmt: skip
    if r.body is not None:
        op["requestBody"] = {"required": True, "content": _content(_ref(r.body))}
    op["responses"] = {"200": _success(r)}
    errors = set(r.errors) | {500}
    if secured and r.path != "/healthz":
        errors.add(401)
        op["security"] = [{"bearer": []}]
    for status in sorted(errors):
        op["responses"][str(status)] = {
            "description": _STATUS_TEXT[status],
            "content": _content(_ref(schemas.ErrorBody)),
        }
    return op


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
    return {"description": "OK", "content": _content(_ref(r.response))}


def _path_params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]
