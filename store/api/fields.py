"""The field types the API's bodies are made of (``schemas``): integers as JSON means them,
ids and their patterns, weight versions, and metadata with the named schema per nesting level
that the document shows. Apart from the bodies so that each reads in one sitting."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic.config import JsonDict
from pydantic.json_schema import JsonSchemaValue
from typing_extensions import TypeAliasType

from statemachine.request import METADATA_DEPTH
from store import defaults
from store.keys import (
    ID_PATTERN,
    MAX_BATCH_ID_LEN,
    MAX_ID_LEN,
    MAX_SESSION_ID_LEN,
    SESSION_ID_PATTERN,
)
from store.weights import MAX_VERSION

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
# Weight versions: what the store takes (int64, the tokens' weight_versions dtype), compared
# exactly (publish_weights.lua). A client whose JSON parser holds numbers as doubles (I-JSON,
# RFC 7493) holds them exactly only below 2^53.
VERSION_MAX = MAX_VERSION


class Strict(BaseModel):
    """Every body's base: no "1" for 1, no true for 1, no unknown field (as the domain does)."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _integral(value: Any) -> Any:
    """JSON has one number type: to every JSON Schema validator 1362.0 *is* the integer 1362,
    so an integer field takes it (a strict model alone would refuse a float)."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def _integral_items(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    # The same for a list of integers, converted only when the strict check failed: a
    # validator per item costs 8x the list's validation (measured: 0.2 s for 640k token ids).
    try:
        return handler(value)
    except ValidationError:
        if not isinstance(value, list):
            raise
        return handler([_integral(v) for v in value])


Integral = BeforeValidator(_integral)


def _a_number(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} is a boolean, not a number")
    return value


def _a_boolean(value: Any) -> Any:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} is not a boolean")
    return value


# One value of a type: pydantic matches a Literal by equality, and in Python False == 0 and
# True == 1, so a bare Literal[0] takes false and Literal[False] takes 0, where the document's
# ``const`` (JSON Schema) refuses them (schemathesis found ``priority: false`` served).
ConstZero = Annotated[Literal[0], BeforeValidator(_a_number)]
ConstOne = Annotated[Literal[1], BeforeValidator(_a_number)]
ConstFalse = Annotated[Literal[False], BeforeValidator(_a_boolean)]
ConstTrue = Annotated[Literal[True], BeforeValidator(_a_boolean)]
NonNegInt = Annotated[int, Field(ge=0, le=INT64_MAX), Integral]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]  # in lists: see TokenIds
TokenIds = Annotated[list[TokenId], WrapValidator(_integral_items)]
# Token ids the store keeps as int32 (an observation's: statemachine.arrays.TOKEN_DTYPE); one
# beyond would wrap, silently, when stored.
INT32_MAX = 2**31 - 1
Int32TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]],
                          WrapValidator(_integral_items)]  # fmt: skip
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LEN, pattern=ID_PATTERN)]
BatchId = Annotated[str, Field(min_length=1, max_length=MAX_BATCH_ID_LEN, pattern=ID_PATTERN)]
SessionId = Annotated[
    str, Field(min_length=1, max_length=MAX_SESSION_ID_LEN, pattern=SESSION_ID_PATTERN)
]
# An environment queue: it names a key, as a batch id does (``Keys.env_queue``), with its rules.
EnvQueue = BatchId
# The path parameters' schemas, by name. A call id (the generation worker's ``call-1``, ...)
# follows an id's rules, as every id in a path does.
PATH_PARAMS: dict[str, Any] = {"batch_id": BatchId, "rollout_id": Id, "session_id": SessionId,
                               "queue": EnvQueue, "call_id": Id}  # fmt: skip
GroupPolicyName = Literal["sample", "group"]
# Every statemachine.Status (a test holds them equal), an episode's states between turns too.
StateName = Literal[
    "pending", "generating", "aborted", "resumed", "done", "failed", "cancelled",
    "awaiting_tool", "running_tool", "next_turn",
]  # fmt: skip

NOT_NULL: JsonDict = {"not": {"type": "null"}}


class PackedArray(Strict):
    """An array as raw little-endian bytes: msgpack bin in msgpack bodies, base64 in JSON."""

    dtype: Literal["int32", "int64", "float32", "uint8", "uint16", "uint32"]
    shape: list[NonNegInt]
    data: Annotated[
        str | bytes,
        Field(json_schema_extra={"contentEncoding": "base64"}),
    ]


# Metadata as ``statemachine.request`` takes it: string keys; values null, booleans, strings,
# numbers within 64 bits, and lists and maps of them nested at most METADATA_DEPTH deep, a
# value that deep being a scalar or an empty container. The document says so with one named
# schema per level, each naming the one below (written inline, lists and maps would double it
# at every level). Validation stays ``dict[str, Any]`` plus the domain's own check, which
# names the value at fault (``prompts.0.metadata.x``) and is 5x cheaper than this union.
_Scalar = (
    None | bool | Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
    | Annotated[float, Field(ge=INT64_MIN, le=INT64_MAX)] | str
)  # fmt: skip
_level: Any = TypeAliasType(
    "MetadataLeaf",
    _Scalar | Annotated[list[Any], Field(max_length=0)]
    | Annotated[dict[str, Any], Field(max_length=0)],
)  # fmt: skip
for _depth in range(1, METADATA_DEPTH):
    # mypy wants a literal name: these are made one per level, for the document only.
    _level = TypeAliasType(f"MetadataValue{_depth}", _Scalar | list[_level] | dict[str, _level])  # type: ignore[misc]
_METADATA_CORE = TypeAdapter(dict[str, _level]).core_schema


class _MetadataSchema:
    @classmethod
    def __get_pydantic_json_schema__(cls, _: Any, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        schema = handler(_METADATA_CORE)
        return {**schema, "description": "At most "
                f"{defaults.MAX_METADATA_BYTES} bytes once packed (msgpack)."}  # fmt: skip


def _floats_within_64_bits(value: Any, where: str = "metadata", depth: int = 0) -> Any:
    """JSON cannot tell 1e300 from an integer: a float is bounded as the document bounds every
    number (the domain refuses integers beyond 64 bits itself, non-finite floats, and values
    nested too deep, which this leaves to it)."""
    if depth > METADATA_DEPTH:
        return value
    if isinstance(value, dict):
        for k, v in value.items():
            _floats_within_64_bits(v, f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _floats_within_64_bits(v, f"{where}[{i}]", depth + 1)
    elif isinstance(value, float) and not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{where}: {value!r} is beyond 64 bits")
    return value


Metadata = Annotated[dict[str, Any], BeforeValidator(_floats_within_64_bits), _MetadataSchema]
