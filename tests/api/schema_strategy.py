"""Values valid against a JSON Schema, for the subset pydantic emits for our request models.

hypothesis-jsonschema 0.23.1 (the newest) fails on every object schema with the installed
hypothesis (6.170): its object strategy calls ``many.more()``, a private Hypothesis API that
no longer exists ("'many' object has no attribute 'more'"). This covers what the API's
request schemas use: ``$ref``, ``anyOf``/``oneOf``, objects with ``properties``/``required``/
``additionalProperties``, arrays with ``minItems``/``maxItems``, bounded integers and numbers,
strings with lengths and ``pattern``, ``const``/``enum``, booleans, null, ``{}`` (any), and
an object's ``oneOf`` of ``required`` branches (exactly one of some properties).
Optional properties are left out or drawn at random, so both defaults and values are tried.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


def from_schema(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Any]:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: from_schema(root["components"]["schemas"][name], root))
    if schema.get("type") == "object":
        return _object(schema, root)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, root) for s in schema[key]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if schema.get("type") == "array":
        items = from_schema(schema.get("items", {}), root)
        return st.lists(items, min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 6), 6))  # fmt: skip
    return _scalar(schema)


def _scalar(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    kind = schema.get("type")
    if kind == "integer":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -(2**70) - 1) + 1)
        high = schema.get("maximum", schema.get("exclusiveMaximum", 2**70 + 1) - 1)
        return st.integers(low, high)
    if kind == "number":
        return st.floats(
            schema.get("minimum", schema.get("exclusiveMinimum", -math.inf)),
            schema.get("maximum", schema.get("exclusiveMaximum", math.inf)),
            exclude_min="exclusiveMinimum" in schema,
            exclude_max="exclusiveMaximum" in schema,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "string":
        if "pattern" in schema:
            strings = st.from_regex(schema["pattern"], fullmatch=True)
        else:
            strings = st.text()
        low, high = schema.get("minLength", 0), schema.get("maxLength", 300)
        return strings.filter(lambda s: low <= len(s) <= high)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return ANY


def _object(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Any]:
    # A oneOf of {"required": [...], "not": ...} branches: exactly one of those properties.
    branches = schema.get("oneOf", [])
    if branches and all("required" in b for b in branches):
        names = {n for b in branches for n in b["required"]}
        return st.one_of([
            _object({**schema, "oneOf": [],
                     "required": [*schema.get("required", ()), *b["required"]],
                     "properties": {k: v for k, v in schema["properties"].items()
                                    if k not in names - set(b["required"])}}, root)
            for b in branches
        ])  # fmt: skip
    props = schema.get("properties", {})
    required = set(schema.get("required", ()))
    fixed = {k: from_schema(v, root) for k, v in props.items() if k in required}
    optional = {k: from_schema(v, root) for k, v in props.items() if k not in required}
    base = st.fixed_dictionaries(fixed, optional=optional)
    if schema.get("additionalProperties") is not False and not props:
        return st.dictionaries(st.text(max_size=8), ANY, max_size=3)
    return base
