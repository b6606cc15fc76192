"""A field documented as one number (``const: 0``) refuses ``false``, and one documented as one
boolean (``const: false``) refuses ``0``: JSON Schema tells them apart, and so must the
handlers, or a body the document calls invalid is served (schemathesis found ``priority:
false`` accepted: pydantic matches a ``Literal`` by equality, and in Python ``False == 0``).
Every field of every body model of the API, found by walking them, not listed by hand."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, ConfigDict, PydanticUserError, TypeAdapter, ValidationError
from pydantic_core import PydanticOmit

import store.api

STRICT = ConfigDict(strict=True)


def _models() -> list[type[BaseModel]]:
    for info in pkgutil.walk_packages(store.api.__path__, "store.api."):
        importlib.import_module(info.name)
    out: list[type[BaseModel]] = []
    todo = [BaseModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("store.api.") and sub not in out:
                out.append(sub)
    return out


def _constants(schema: Any) -> Iterator[Any]:
    """The booleans, 0s and 1s a field's schema names as ``const`` or ``enum``, anywhere."""
    if isinstance(schema, dict):
        for key in ("const", "enum"):
            if key in schema:
                values = schema[key] if key == "enum" else [schema[key]]
                # Only 0, 1 and the booleans have a twin of the other type.
                yield from (v for v in values if isinstance(v, int) and v in (0, 1))
        for value in schema.values():
            yield from _constants(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _constants(value)


def _fields() -> list[tuple[str, Any, Any]]:
    out = []
    for model in _models():
        for name, field in model.model_fields.items():
            annotated = (
                Annotated[(field.annotation, *field.metadata)]
                if field.metadata
                else (field.annotation)
            )
            strict = model.model_config.get("strict", False)
            try:
                adapter = TypeAdapter(annotated, config=STRICT if strict else None)
            except PydanticUserError:  # a model: its own config, its own fields walked
                adapter = TypeAdapter(annotated)
            try:
                schema = adapter.json_schema()
            except PydanticOmit:  # left out of the document (SkipJsonSchema)
                continue
            for value in set(_constants(schema)):
                out.append((f"{model.__name__}.{name}", adapter, value))
    return out


FIELDS = _fields()


def test_the_walk_finds_the_fields_schemathesis_found() -> None:
    names = {(name, value) for name, _, value in FIELDS}
    assert ("_Sampling.priority", 0) in names and ("GenerateRequest.priority", 0) in names
    assert ("_Sampling.echo", False) in names and ("_Sampling.skip_special_tokens", True) in names


@pytest.mark.parametrize(
    ("name", "adapter", "value"), FIELDS, ids=[f"{n}={v}" for n, _, v in FIELDS]
)
def test_a_constant_refuses_the_other_json_type(name: str, adapter: Any, value: Any) -> None:
    adapter.validate_json(_json(value))  # the constant itself is taken
    other = int(value) if isinstance(value, bool) else value == 1
    with pytest.raises(ValidationError):
        adapter.validate_json(_json(other))
    with pytest.raises(ValidationError):
        adapter.validate_python(other)


def _json(value: Any) -> str:
    return "true" if value is True else "false" if value is False else str(value)
