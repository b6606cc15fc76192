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

from statemachine.states import FinishReason
from workers.errors import WireFormatError

# What vLLM 0.32 sends for routed experts (`numpy2base64`: uint8/uint16/int32 by expert
# count) plus the wider unsigned types our own packed form may use. Never object/float.
ROUTE_DTYPES = frozenset(
    np.dtype(t).str for t in ("<u1", "<u2", "<u4", "<u8", "<i1", "<i2", "<i4", "<i8")
)


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
    text = line.decode("utf-8", errors="strict").strip()
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
        # A cut or corrupted event: refuse it rather than guess.
        raise WireFormatError(f"event is not JSON: {payload[:80]!r}") from exc
    if not isinstance(event, dict):
        raise WireFormatError("event is not a JSON object")
    return event


def decode_choice(event: dict[str, Any]) -> GenerateResult | None:
    """The first choice of a response or stream event; None for a usage-only event.

    Raises WireFormatError for malformed input, EngineError-compatible "error" events too.
    """
    if "error" in event:
        raise WireFormatError(f"server reported an error: {event['error']}")
    choices = event.get("choices")
    if not isinstance(choices, list):
        raise WireFormatError("response has no choices list")
    if not choices:
        return None
    choice = choices[0]
    if not isinstance(choice, dict):
        raise WireFormatError("choice is not an object")
    ids = choice.get("token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise WireFormatError("token_ids must be a list of non-negative ints")
    logprobs = _sampled_logprobs(choice.get("logprobs"), ids)
    routed = choice.get("routed_experts")
    stop = choice.get("stop_reason")
    if stop is not None and not isinstance(stop, int | str):
        raise WireFormatError("stop_reason must be an int, a string or null")
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise WireFormatError("finish_reason must be a string or null")
    return GenerateResult(
        token_ids=np.asarray(ids, dtype=np.int32),
        logprobs=logprobs,
        finish_reason=finish,
        stop_reason=stop,
        routed_experts=None if routed is None else decode_routed_experts(routed),
    )


def _sampled_logprobs(logprobs: Any, ids: list[int]) -> np.ndarray:
    """`logprobs.content[i].logprob` of the sampled token at each position (sent first)."""
    if not ids:
        return np.zeros(0, dtype=np.float32)
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or len(content) != len(ids):
        raise WireFormatError(f"expected {len(ids)} logprob entries, got {content!r:.80}")
    out = np.empty(len(ids), dtype=np.float32)
    for i, (entry, token) in enumerate(zip(content, ids, strict=True)):
        if not isinstance(entry, dict) or entry.get("token_id") != token:
            raise WireFormatError(f"logprob entry {i} is not for the sampled token {token}")
        value = entry.get("logprob")
        if not isinstance(value, int | float):
            raise WireFormatError(f"logprob entry {i} has no numeric logprob")
        # Non-finite values pass through: the worker clamps and counts them.
        out[i] = value
    return out


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


def _check(shape: tuple[int, ...], dtype: np.dtype, nbytes: int) -> None:
    if dtype.str not in ROUTE_DTYPES:
        raise WireFormatError(f"routed_experts dtype {dtype.str!r} is not an integer type")
    if len(shape) != 3 or any(d < 0 for d in shape):
        raise WireFormatError(f"routed_experts shape {shape} is not [positions, layers, top_k]")
    expected = math.prod(shape) * dtype.itemsize
    if nbytes != expected:
        raise WireFormatError(
            f"routed_experts has {nbytes} bytes; shape {shape} of {dtype.str} needs {expected}"
        )


def _from_npy(raw: bytes) -> np.ndarray:
    buf = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(buf)  # type: ignore[no-untyped-call]
        read_header = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = read_header(buf)  # type: ignore[no-untyped-call]
    except (ValueError, OSError, SyntaxError) as exc:
        # Not an .npy header (numpy raises ValueError for bad magic or header text).
        raise WireFormatError(f"routed_experts is not an .npy array: {exc}") from exc
    if fortran:
        raise WireFormatError("routed_experts in Fortran order is not accepted")
    _check(tuple(shape), np.dtype(dtype), len(raw) - buf.tell())
    return np.frombuffer(raw, dtype=dtype, offset=buf.tell()).reshape(shape)


def _from_packed(value: dict[str, Any]) -> np.ndarray:
    data, shape, dtype = value.get("data"), value.get("shape"), value.get("dtype")
    if not isinstance(data, str) or not isinstance(shape, list) or not isinstance(dtype, str):
        raise WireFormatError("packed routed_experts needs data (str), shape (list), dtype (str)")
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise WireFormatError(f"routed_experts shape {shape} is not a list of ints")
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        # np.dtype raises TypeError for names it does not know.
        raise WireFormatError(f"routed_experts dtype {dtype!r} is unknown") from exc
    raw = _b64(data)
    _check(tuple(shape), dt, len(raw))
    return np.frombuffer(raw, dtype=dt).reshape(shape)
