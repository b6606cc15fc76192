"""Decoding vLLM's generate wire form; routed experts refused unless shape, bytes and dtype
agree; per-token alignment of routes as vLLM documents them. No vLLM needed."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from statemachine.states import FinishReason
from workers.engines.vllm_local import routes_for_tokens
from workers.engines.vllm_wire import (
    decode_choice,
    decode_routed_experts,
    encode_routed_experts,
    parse_sse_line,
)
from workers.errors import EngineError, WireFormatError


def npy_b64(arr: np.ndarray) -> str:
    """Exactly vLLM 0.32's `numpy2base64` (vllm/utils/serial_utils.py)."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


ROUTES = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2) % 8


def event(**choice: object) -> dict[str, object]:
    return {"request_id": "generate-tokens-r", "choices": [{"index": 0, **choice}]}


def test_vllm_npy_form_round_trips_for_every_dtype_vllm_sends() -> None:
    for dtype in (np.uint8, np.uint16, np.int32):
        arr = ROUTES.astype(dtype)
        out = decode_routed_experts(npy_b64(arr))
        assert out.dtype == arr.dtype
        np.testing.assert_array_equal(out, arr)


def test_packed_form_round_trips() -> None:
    arr = (np.arange(3 * 48 * 8) % 300).astype(np.uint16).reshape(3, 48, 8)
    np.testing.assert_array_equal(decode_routed_experts(encode_routed_experts(arr)), arr)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: {**p, "shape": [5, 2]}, "shape"),
        (lambda p: {**p, "shape": [5, 2, 3]}, "bytes"),
        (lambda p: {**p, "shape": [5, 2, -2]}, "shape"),
        (lambda p: {**p, "shape": [5, 2, True]}, "shape"),
        (lambda p: {**p, "dtype": "float32"}, "dtype"),
        (lambda p: {**p, "dtype": "object"}, "dtype"),
        (lambda p: {**p, "dtype": ">u2"}, "dtype"),
        (lambda p: {**p, "dtype": "nonsense"}, "dtype"),
        (lambda p: {**p, "data": p["data"][:-4]}, "bytes"),
        (lambda p: {**p, "data": "!!not base64!!"}, "base64"),
        (lambda p: {k: v for k, v in p.items() if k != "shape"}, "shape"),
    ],
)
def test_malformed_packed_routes_are_refused(mutate, message: str) -> None:
    packed = encode_routed_experts(ROUTES)
    with pytest.raises(WireFormatError, match=message):
        decode_routed_experts(mutate(packed))


def test_malformed_npy_routes_are_refused() -> None:
    good = base64.b64decode(npy_b64(ROUTES))
    for bad, message in [
        (good[:-3], "bytes"),  # truncated payload
        (good + b"\x00", "bytes"),  # trailing garbage
        (b"not an npy file at all", "npy"),
        (base64.b64decode(npy_b64(ROUTES.astype(np.float32))), "dtype"),
        (base64.b64decode(npy_b64(ROUTES[0])), "shape"),  # 2-D
        (base64.b64decode(npy_b64(np.asfortranarray(ROUTES.astype(np.uint16)))), "Fortran"),
    ]:
        with pytest.raises(WireFormatError, match=message):
            decode_routed_experts(base64.b64encode(bad).decode())
    with pytest.raises(WireFormatError):
        decode_routed_experts(12)


def test_choice_decoding() -> None:
    piece = decode_choice(
        event(
            token_ids=[7, 9],
            logprobs={
                "content": [{"token_id": 7, "logprob": -0.5}, {"token_id": 9, "logprob": -1.25}]
            },
            finish_reason="stop",
            stop_reason=9,
            routed_experts=npy_b64(ROUTES[:2]),
        )
    )
    assert piece is not None
    assert piece.token_ids.tolist() == [7, 9]
    assert piece.token_ids.dtype == np.int32
    assert piece.logprobs.dtype == np.float32
    np.testing.assert_array_equal(piece.logprobs, [-0.5, -1.25])
    assert piece.finish is FinishReason.STOP
    assert piece.stop_reason == 9
    np.testing.assert_array_equal(piece.routed_experts, ROUTES[:2])
    with pytest.raises(AttributeError):
        piece.token_ids = np.zeros(1)  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    "choice",
    [
        {"token_ids": [7], "logprobs": {"content": []}},
        {"token_ids": [7], "logprobs": {"content": [{"token_id": 8, "logprob": -1.0}]}},
        {"token_ids": [7], "logprobs": {"content": [{"token_id": 7, "logprob": "x"}]}},
        {"token_ids": [-1], "logprobs": None},
        {"token_ids": [7], "logprobs": None},
        {"token_ids": [], "finish_reason": 3},
        {"token_ids": [], "stop_reason": [1]},
    ],
)
def test_malformed_choices_are_refused(choice: dict[str, object]) -> None:
    with pytest.raises(WireFormatError):
        decode_choice(event(**choice))


def test_sse_lines() -> None:
    assert parse_sse_line(b"\n") is None
    assert parse_sse_line(b": keep-alive\n") is None
    assert parse_sse_line(b"data: [DONE]\n") is None
    assert parse_sse_line(b'data: {"choices": []}\n') == {"choices": []}
    assert decode_choice({"choices": [], "usage": {}}) is None  # usage-only event
    with pytest.raises(WireFormatError):
        parse_sse_line(b"data: {cut")
    with pytest.raises(WireFormatError):
        parse_sse_line(b"event: x\n")
    with pytest.raises(WireFormatError, match="error"):
        decode_choice(json.loads('{"error": {"message": "boom", "code": 500}}'))


def test_routes_align_one_row_per_token() -> None:
    """vLLM's rows run from routed_experts_prompt_start (set to the last prompt position) to
    the last token excluded: n rows for n tokens, row t = the forward that produced token t."""
    prompt_len, n = 6, 4
    positions = np.arange(prompt_len - 1, prompt_len - 1 + n)  # what vLLM would cover
    vllm_rows = np.stack([np.full((2, 2), p % 8) for p in positions]).astype(np.int32)
    rows = routes_for_tokens(vllm_rows, n, np.dtype(np.uint8))
    assert rows.dtype == np.uint8
    assert rows.shape == (n, 2, 2)
    assert rows[0, 0, 0] == (prompt_len - 1) % 8  # token 0 came from the last prompt position
    with pytest.raises(EngineError, match="shape"):
        routes_for_tokens(vllm_rows[:-1], n, np.dtype(np.uint8))  # a missing row
    with pytest.raises(EngineError, match="shape"):
        routes_for_tokens(np.concatenate([vllm_rows, vllm_rows[:1]]), n, np.dtype(np.uint8))
    with pytest.raises(EngineError, match="outside"):
        routes_for_tokens(vllm_rows + 300, n, np.dtype(np.uint8))
    with pytest.raises(EngineError, match="none"):
        routes_for_tokens(None, n, np.dtype(np.uint8))
