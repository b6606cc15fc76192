"""Bodies on the wire: JSON by default, msgpack when the client asks for it.

A request body is msgpack when its ``Content-Type`` is ``application/msgpack`` (or
``application/x-msgpack``), JSON otherwise (whatever else it is labelled); a response is
msgpack when ``Accept`` names msgpack, JSON otherwise. Arrays travel as
``{"dtype", "shape", "data"}`` with ``data`` the raw little-endian bytes: a msgpack bin, or
base64 in JSON (``json.dumps`` meets ``bytes`` only there, in ``_json_default``). Never
nested lists, never pickle.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from store.api.errors import ApiError

JSON = "application/json"
MSGPACK = "application/msgpack"
NDJSON = "application/x-ndjson"
_MSGPACK_TYPES = frozenset({MSGPACK, "application/x-msgpack", "application/vnd.msgpack"})


def packed(arr: npt.NDArray[Any]) -> dict[str, Any]:
    """An array as ``{"dtype": "int32", "shape": [n], "data": <little-endian bytes>}``."""
    le = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
    return {
        "dtype": le.name,
        "shape": list(arr.shape),
        "data": np.ascontiguousarray(arr, dtype=le).tobytes(),
    }


def wants_msgpack(accept: str) -> bool:
    return any(part.split(";")[0].strip() in _MSGPACK_TYPES for part in accept.split(","))


def is_msgpack(content_type: str) -> bool:
    return content_type.split(";", maxsplit=1)[0].strip().lower() in _MSGPACK_TYPES


def decode_body(raw: bytes, content_type: str) -> Any:
    """The request body as plain data; ``ApiError`` 400 if it does not parse."""
    if not raw:
        raise ApiError(400, "empty_body", "the request needs a body")
    if is_msgpack(content_type):
        try:
            value = msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=_no_ext)
        except Exception as exc:
            # msgpack raises several unrelated types for bad input; its C unpacker refuses
            # nesting deeper than 1,024 (StackError) without recursing, so no depth check here.
            raise ApiError(400, "malformed_msgpack", f"the body is not msgpack: {exc}") from None
        return value
    # Anything else is read as JSON, whatever it is labelled: `curl -d` labels its body
    # application/x-www-form-urlencoded, and a body that is not JSON is refused just the same.
    try:
        value = json.loads(raw, parse_constant=_no_constant)
        if _SURROGATE_ESCAPE.search(raw):
            _no_lone_surrogate(value)
    except (ValueError, RecursionError) as exc:
        # UnicodeDecodeError and JSONDecodeError are ValueErrors; NaN lands here too.
        raise ApiError(400, "malformed_json", f"the body is not JSON: {exc}") from None
    return value


# A \uD800-\uDFFF escape: half of a pair, or a lone surrogate, which json.loads lets through
# although it is no character (RFC 8259 8.2) and no UTF-8 can hold it: a string field would
# fail deep inside (msgpack, Redis) as a 500. Checked only when such an escape is in the body.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _no_lone_surrogate(value: Any) -> None:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"a lone surrogate (\\u{ord(exc.object[exc.start]):04x}) is not a character"
        ) from None


def encode(value: Any, msgpack_out: bool) -> bytes:
    if msgpack_out:
        out: bytes = msgpack.packb(value, use_bin_type=True)
        return out
    return json.dumps(value, default=_json_default, separators=(",", ":")).encode()


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(value).decode("ascii")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _no_ext(code: int, data: bytes) -> Any:
    # Extension types (msgpack timestamps included) have no meaning in any request field.
    raise ValueError(f"extension type {code} is not accepted")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
