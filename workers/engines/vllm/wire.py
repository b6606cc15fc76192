"""The wire form of vLLM's token-in/token-out generate API (`POST /inference/v1/generate`),
decoded strictly: anything malformed raises WireFormatError, nothing is half-used.

Pure functions and a frozen result type; no aiohttp here, so it is tested without a server.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from statemachine.status import FinishReason
from workers.engines.errors import WireFormatError

# What vLLM 0.32 sends for routed experts (`numpy2base64`: uint8/uint16/int32 by expert
# count) plus the wider unsigned types our own packed form may use. Never object/float, never
# big-endian (the wire is little-endian throughout).
_ROUTE_TYPES = ("<u1", "<u2", "<u4", "<u8", "<i1", "<i2", "<i4", "<i8")
ROUTE_DTYPES = frozenset(np.dtype(t).str for t in _ROUTE_TYPES)
# The spellings the packed form's "dtype" may use: "|u1"/"<u2" (`dtype.str`, what
# encode_routed_experts writes), "<u1", "u1" and "uint8". A fixed table, not np.dtype(text):
# numpy's dtype parser takes arbitrary text and fails with SyntaxError, ValueError or TypeError.
_PACKED_DTYPES = {
    spelling: np.dtype(t)
    for t in _ROUTE_TYPES
    for spelling in (np.dtype(t).str, t, t[1:], np.dtype(t).name)
}
# Token ids are int32 on every layer (statemachine.arrays.TOKEN_DTYPE); expert ids and array
# dimensions are bounded the same way, which also keeps an empty array's shape sane.
_INT32_LIMIT = 2**31


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateResult:
    """One generate answer (or the concatenation of a stream's pieces), decoded.

    `routed_experts` as vLLM sends it: [positions, moe_layers, top_k] over prompt positions
    from `routed_experts_prompt_start` to the last token excluded; None when disabled.
    """

    token_ids: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n]
    finish_reason: str | None  # vLLM's string: "stop", "length", "abort", ...
    stop_reason: int | str | None
    routed_experts: np.ndarray | None = None
    top_token_ids: np.ndarray | None = None  # int32 [n, k] when asked (``decode_choice``)
    top_logprobs: np.ndarray | None = None  # float32 [n, k]

    @property
    def finish(self) -> FinishReason | None:
        return {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}.get(
            self.finish_reason or ""
        )


def generate_body(
    request_id: str,
    prompt: list[int],
    sampling: dict[str, Any],
    *,
    cache_salt: str | None,
    stream: bool,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "request_id": request_id,
        "token_ids": prompt,
        "sampling_params": sampling,
        "stream": stream,
        "output_mode": "tokens",
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def server_request_id(request_id: str) -> str:
    """The id the server registers a generate request under (its abort endpoint needs it)."""
    return f"generate-tokens-{request_id}"


def parse_sse_line(line: bytes) -> dict[str, Any] | None:
    """One `data: {...}` event as a dict; None for blank lines, comments and `[DONE]`."""
    try:
        text = line.decode("utf-8", errors="strict").strip()
    except UnicodeDecodeError as exc:
        # A corrupted stream: the server only ever sends UTF-8 JSON.
        raise WireFormatError(f"event stream line is not UTF-8: {exc}") from exc
    if not text or text.startswith(":"):
        return None
    if not text.startswith("data:"):
        raise WireFormatError(f"unexpected line in the event stream: {text[:80]!r}")
    payload = text[len("data:") :].strip()
    if payload == "[DONE]":
        return None
    try:
        event = json.loads(payload)
    except ValueError as exc:
        # A cut or corrupted event (or an int of more digits than Python converts): refuse it.
        raise WireFormatError(f"event is not JSON: {payload[:80]!r}") from exc
    except RecursionError as exc:
        # Arrays nested thousands deep: no answer of ours looks like that.
        raise WireFormatError("event is nested too deeply") from exc
    if not isinstance(event, dict):
        raise WireFormatError("event is not a JSON object")
    return event


def decode_choice(event: dict[str, Any], top: int = 0) -> GenerateResult | None:
    """The first choice of a response or stream event; None for a usage-only event.

    ``top``: the top-k to read of each position (``top_logprobs``), for a request that asked
    the server for more than k (``top_k_of``). Raises WireFormatError for malformed input,
    EngineError-compatible "error" events too.
    """
    if not isinstance(event, dict):
        raise WireFormatError(f"event is not an object: {_describe(event)}")
    if "error" in event:
        raise WireFormatError(f"server reported an error: {_describe(event['error'])}")
    choices = event.get("choices")
    if not isinstance(choices, list):
        raise WireFormatError("response has no choices list")
    if not choices:
        return None
    choice = choices[0]
    if not isinstance(choice, dict):
        raise WireFormatError("choice is not an object")
    ids = _token_ids(choice.get("token_ids"))
    logprobs = _sampled_logprobs(choice.get("logprobs"), ids)
    routed = choice.get("routed_experts")
    stop = choice.get("stop_reason")
    if not (stop is None or isinstance(stop, str) or _is_token_id(stop)):
        raise WireFormatError("stop_reason must be a token id, a string or null")
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise WireFormatError("finish_reason must be a string or null")
    top_ids, top_lps = top_k_of(choice.get("logprobs"), len(ids), top) if top else (None, None)
    return GenerateResult(
        token_ids=np.asarray(ids, dtype=np.int32),
        logprobs=logprobs,
        finish_reason=finish,
        stop_reason=stop,
        routed_experts=None if routed is None else decode_routed_experts(routed),
        top_token_ids=top_ids,
        top_logprobs=top_lps,
    )


def top_k_of(logprobs: Any, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens of each of ``n`` positions, most likely first, from
    ``logprobs.content[i].top_logprobs``.

    vLLM 0.32's server sends, per position, the first ``logprobs`` entries of its top map in
    the engine's order: the sampled token first, then the top ranks without it
    (``_create_tokens_logprobs``). Asked for k + 1 (``http.py``), those entries always hold the
    true top-k whether or not the sampled token ranks within k; sorted by logprob (stable, so
    rank order breaks ties), the first k are vLLM's top-k.
    """
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or len(content) != n:
        raise WireFormatError(f"expected {n} logprob entries, got {_describe(content)}")
    ids = np.empty((n, k), dtype=np.int32)
    lps = np.empty((n, k), dtype=np.float32)
    for i, entry in enumerate(content):
        tops = entry.get("top_logprobs") if isinstance(entry, dict) else None
        if not isinstance(tops, list) or len(tops) < k:
            raise WireFormatError(f"logprob entry {i} has no top-{k}: {_describe(tops)}")
        pairs = [_candidate(i, t) for t in tops]
        pairs.sort(key=lambda p: -p[1])
        ids[i] = [t for t, _ in pairs[:k]]
        with np.errstate(over="ignore"):
            lps[i] = [v for _, v in pairs[:k]]
    return ids, lps


def _candidate(i: int, entry: Any) -> tuple[int, float]:
    token = entry.get("token_id") if isinstance(entry, dict) else None
    value = entry.get("logprob") if isinstance(entry, dict) else None
    if not _is_token_id(token) or isinstance(value, bool) or not isinstance(value, int | float):
        raise WireFormatError(f"logprob entry {i} has a malformed top candidate {_describe(entry)}")
    try:
        return int(token), float(value)  # type: ignore[arg-type]
    except OverflowError as exc:
        # An int beyond the float range: no log-probability is that large.
        raise WireFormatError(f"logprob entry {i} has a top logprob out of range") from exc


def _is_token_id(value: Any) -> bool:
    # bool is an int subclass: `true` is never a token id.
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _INT32_LIMIT


def _token_ids(value: Any) -> list[int]:
    # A choice without tokens (null or absent) carries none; any other non-list is malformed.
    ids = [] if value is None else value
    if not isinstance(ids, list) or not all(_is_token_id(t) for t in ids):
        raise WireFormatError(f"token_ids must be a list of int32 token ids: {_describe(value)}")
    return ids


def _sampled_logprobs(logprobs: Any, ids: list[int]) -> np.ndarray:
    """`logprobs.content[i].logprob` of the sampled token at each position (sent first)."""
    if not ids:
        return np.zeros(0, dtype=np.float32)
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or len(content) != len(ids):
        raise WireFormatError(f"expected {len(ids)} logprob entries, got {_describe(content)}")
    out = np.empty(len(ids), dtype=np.float32)
    for i, (entry, token) in enumerate(zip(content, ids, strict=True)):
        found = entry.get("token_id") if isinstance(entry, dict) else None
        if not _is_token_id(found) or found != token:
            raise WireFormatError(f"logprob entry {i} is not for the sampled token {token}")
        value = entry.get("logprob")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise WireFormatError(f"logprob entry {i} has no numeric logprob")
        try:
            as_float = float(value)
        except OverflowError as exc:
            # An int beyond the float range: no log-probability is that large.
            raise WireFormatError(f"logprob entry {i} is out of range") from exc
        # Non-finite values (and floats beyond float32, which become inf) pass through: the
        # worker clamps and counts them.
        with np.errstate(over="ignore"):
            out[i] = as_float
    return out


def _describe(value: Any) -> str:
    """A short text of a wire value for an error message, for any value at all."""
    try:
        return f"{value!r:.80}"
    except ValueError:
        # repr() of an int of more than 4,300 digits raises (Python's int-to-str limit).
        return f"<unprintable {type(value).__name__}>"


def decode_routed_experts(value: Any) -> np.ndarray:
    """Routed experts from the wire, as a [positions, layers, top_k] integer array.

    Two forms: vLLM's (a base64 string of `.npy` bytes, whose header carries shape and
    dtype) and the explicit packed form `{"data": base64 raw bytes, "shape": [...],
    "dtype": "uint8"}`. Both must agree exactly: 3 dimensions, an integer dtype, and a byte
    count equal to prod(shape) * itemsize.
    """
    if isinstance(value, str):
        return _from_npy(_b64(value))
    if isinstance(value, dict):
        return _from_packed(value)
    raise WireFormatError(f"routed_experts must be a string or an object, not {type(value)}")


def encode_routed_experts(arr: np.ndarray) -> dict[str, Any]:
    """The explicit packed form (little-endian raw bytes + shape + dtype)."""
    arr = np.ascontiguousarray(arr)
    le = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    return {
        "data": base64.b64encode(le.tobytes()).decode("ascii"),
        "shape": list(arr.shape),
        "dtype": le.dtype.str,
    }


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        # validate=True: characters outside the alphabet are an error, not skipped.
        raise WireFormatError(f"routed_experts is not valid base64: {exc}") from exc


def _check(shape: tuple[Any, ...], dtype: np.dtype, nbytes: int) -> None:
    if dtype.str not in ROUTE_DTYPES:
        raise WireFormatError(f"routed_experts dtype {dtype.str!r} is not an integer type")
    if len(shape) != 3 or not all(_is_token_id(d) for d in shape):
        # Dimensions are bounded like ids: an empty array may not claim 2**63 layers.
        raise WireFormatError(
            f"routed_experts shape {_describe(shape)} is not [positions, layers, top_k]"
        )
    expected = math.prod(shape) * dtype.itemsize
    if nbytes != expected:
        raise WireFormatError(
            f"routed_experts has {nbytes} bytes; shape {shape} of {dtype.str} needs {expected}"
        )


def _from_npy(raw: bytes) -> np.ndarray:
    buf = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(buf)  # type: ignore[no-untyped-call]
        read_header = _NPY_HEADER_READERS[version]
        shape, fortran, dtype = read_header(buf)  # type: ignore[no-untyped-call]
    except KeyError as exc:
        # A format version numpy never wrote (1.0 is what np.save writes for our arrays).
        raise WireFormatError(f"routed_experts .npy version {exc} is unknown") from exc
    except Exception as exc:
        # numpy evaluates the header text as a Python literal and raises whatever that raises
        # (ValueError, SyntaxError, TypeError, tokenize.TokenError, ...): any failure means
        # the bytes are not an .npy header we take.
        raise WireFormatError(f"routed_experts is not an .npy array: {exc}") from exc
    if fortran is not False:
        raise WireFormatError("routed_experts in Fortran order is not accepted")
    return _array(raw[buf.tell() :], tuple(shape), dtype)


_NPY_HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def _from_packed(value: dict[Any, Any]) -> np.ndarray:
    if set(value) != {"data", "shape", "dtype"}:
        keys = sorted(map(_describe, value))
        raise WireFormatError(f"packed routed_experts has keys {keys}, not data, shape, dtype")
    data, shape, dtype = value["data"], value["shape"], value["dtype"]
    if not isinstance(data, str) or not isinstance(shape, list) or not isinstance(dtype, str):
        raise WireFormatError("packed routed_experts needs data (str), shape (list), dtype (str)")
    dt = _PACKED_DTYPES.get(dtype)
    if dt is None:
        raise WireFormatError(f"routed_experts dtype {dtype!r} is unknown or not an integer type")
    return _array(_b64(data), tuple(shape), dt)


def _array(raw: bytes, shape: tuple[Any, ...], dtype: np.dtype) -> np.ndarray:
    """The checked [positions, layers, top_k] array over `raw`; expert ids are never negative."""
    _check(shape, dtype, len(raw))
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        # vLLM's ids index the expert table; SkyRL's decoder refuses negatives too.
        raise WireFormatError("routed_experts holds a negative expert id")
    return arr
