"""Decoding vLLM's generate wire form; routed experts refused unless shape, bytes and dtype
agree; per-token alignment of routes as vLLM documents them. No vLLM needed."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statemachine.status import FinishReason
from workers.engines.errors import EngineError, WireFormatError
from workers.engines.vllm.translate import routes_for_tokens
from workers.engines.vllm.wire import (
    decode_choice,
    decode_routed_experts,
    encode_routed_experts,
    parse_sse_line,
)


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


# -- every malformed input raises WireFormatError, and only that --------------------------------

SIGNED = (np.int8, np.int16, np.int32, np.int64)
ALLOWED_DTYPES = {np.dtype(t).str for t in (np.uint8, np.uint16, np.uint32, np.uint64, *SIGNED)}


def npy_bytes(arr: np.ndarray) -> bytes:
    return base64.b64decode(npy_b64(arr))


def with_header(arr: np.ndarray, old: bytes, new: bytes) -> str:
    """An `.npy` payload of `arr` whose header has `old` replaced by `new` (same length)."""
    raw = npy_bytes(arr)
    assert old in raw and len(old) == len(new)
    return base64.b64encode(raw.replace(old, new, 1)).decode()


@pytest.mark.parametrize("dtype", SIGNED)
def test_negative_expert_ids_are_refused(dtype: type) -> None:
    routes = ROUTES.astype(dtype)
    routes[1, 0, 1] = -1
    with pytest.raises(WireFormatError, match="negative"):
        decode_routed_experts(encode_routed_experts(routes))
    with pytest.raises(WireFormatError, match="negative"):
        decode_routed_experts(npy_b64(routes))


PACKED = encode_routed_experts(ROUTES)


@pytest.mark.parametrize(
    "value",
    [
        {"data": "AQID", "shape": [1, 1, 3], "dtype": ","},  # numpy: SyntaxError
        {**PACKED, "dtype": "(2,)u1"},  # a sub-array dtype
        {**PACKED, "dtype": "u1,u1"},  # a structured dtype
        {**PACKED, "dtype": "(1000000000000,)u1"},
        {**PACKED, "dtype": "[('a', '<u1')]"},
        {**PACKED, "dtype": "u1\x00"},
        {**PACKED, "dtype": ">i4"},
        {**PACKED, "dtype": "bool"},
        {**PACKED, "shape": [-5, -2, 2]},  # negative dims whose product is right
        {"data": "", "shape": [0, 2**63, 4], "dtype": "uint8"},  # 0 bytes, an absurd dim
        {"data": "", "shape": [2**70, 0, 4], "dtype": "uint8"},
        {**PACKED, "shape": [5.0, 2, 2]},
        {**PACKED, "shape": [[5], 2, 2]},
        {**PACKED, 1: 2},  # a key that is not a string
        {**PACKED, "extra": 1},
        {**PACKED, "data": {"nested": PACKED}},
        {**PACKED, "data": ["AQID"]},
        {**PACKED, "data": "AQ\u00e9D"},  # outside the base64 alphabet, not ASCII
        with_header(ROUTES, b"'|u1'", b"'|O' "),  # object dtype
        with_header(ROUTES, b"'|u1'", b"'|b1'"),  # bool
        with_header(ROUTES.astype(">u2"), b"'>u2'", b"'>u2'"),  # big-endian
        with_header(ROUTES.astype(np.int32), b"'<i4'", b"'>i4'"),
        with_header(ROUTES, b"'|u1'", b"'xyz'"),  # unknown descr
        with_header(ROUTES, b"(5, 2, 2)", b"(5,-2,-2)"),
        with_header(ROUTES[:1], b"(1, 2, 2), }", b"(True,2,2),}"),
        with_header(ROUTES, b"False", b"0    "),
        with_header(ROUTES, b"{'descr'", b"['descr'"),
        base64.b64encode(npy_bytes(ROUTES)[:9]).decode(),  # cut inside the header length
        base64.b64encode(npy_bytes(ROUTES)[:40]).decode(),  # cut inside the header
        base64.b64encode(b"\x93NUMPY\x09\x00" + npy_bytes(ROUTES)[8:]).decode(),  # version 9
        "",
        None,
        [PACKED],
        3.5,
    ],
)
def test_every_malformed_routes_payload_raises_wire_format_error(value: object) -> None:
    with pytest.raises(WireFormatError):
        decode_routed_experts(value)


HUGE = 10**5000  # str() of it raises ValueError (Python's int-to-str digit limit)


@pytest.mark.parametrize(
    "event_",
    [
        [1],  # an event that is not an object
        "choices",
        {"choices": [1]},
        event(token_ids=[True], logprobs={"content": [{"token_id": True, "logprob": -1.0}]}),
        event(token_ids=[1.0], logprobs={"content": [{"token_id": 1.0, "logprob": -1.0}]}),
        event(token_ids=[2**40], logprobs={"content": [{"token_id": 2**40, "logprob": -1.0}]}),
        event(token_ids=[2**80], logprobs={"content": [{"token_id": 2**80, "logprob": -1.0}]}),
        event(token_ids=[1], logprobs={"content": [{"token_id": True, "logprob": -1.0}]}),
        event(token_ids=[1], logprobs={"content": [{"token_id": 1, "logprob": HUGE}]}),
        event(token_ids=[1], logprobs={"content": [{"token_id": 1, "logprob": True}]}),
        event(token_ids=[1], logprobs={"content": [HUGE]}),
        event(token_ids=[1], logprobs=[1]),
        event(token_ids=[1], logprobs="x"),
        event(token_ids=0),
        event(token_ids=False),
        event(token_ids={}),
        event(token_ids="ab"),
        event(token_ids=[], stop_reason=True),
        event(token_ids=[], stop_reason=2**80),
        event(token_ids=[], routed_experts=5),
        {"error": HUGE},
        {"error": {"message": [HUGE]}},
    ],
)
def test_every_malformed_choice_raises_wire_format_error(event_: object) -> None:
    with pytest.raises(WireFormatError):
        decode_choice(event_)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "line",
    [
        b'data: {"choices": \xff}\n',  # not UTF-8
        b"data: " + b"[" * 100_000 + b"\n",  # nested beyond the recursion limit
        b"data: " + b"9" * 5000 + b"\n",  # more digits than Python converts to an int
    ],
)
def test_malformed_sse_lines_raise_wire_format_error(line: bytes) -> None:
    with pytest.raises(WireFormatError):
        parse_sse_line(line)


# -- fuzz: random JSON-like values, random mutations of valid payloads --------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=4)
    ),
    max_leaves=12,
)


def valid_routes() -> st.SearchStrategy[np.ndarray]:
    return st.builds(
        lambda dtype, shape, seed: (
            np.random.default_rng(seed).integers(0, 100, size=shape).astype(dtype)
        ),
        st.sampled_from([np.uint8, np.uint16, np.uint32, np.int32, np.int64]),
        st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)),
        st.integers(0, 2**32 - 1),
    )


@st.composite
def mutated_npy(draw: st.DrawFn) -> str:
    raw = bytearray(npy_bytes(draw(valid_routes())))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "header"]))
        if kind == "flip" and raw:
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] = draw(st.integers(0, 255))
        elif kind == "cut":
            raw = raw[: draw(st.integers(0, len(raw)))]
        elif kind == "insert":
            i = draw(st.integers(0, len(raw)))
            raw[i:i] = draw(st.binary(min_size=1, max_size=4))
        else:  # a header field replaced by other printable text of the same length
            for old in (b"'descr': '", b"'shape': (", b"'fortran_order': "):
                start = raw.find(old)
                if start >= 0 and draw(st.booleans()):
                    end = start + len(old)
                    size = draw(st.integers(1, 6))
                    raw[end : end + size] = draw(
                        st.text("0123456789<>|,()[]'\"ufibOV- ", min_size=size, max_size=size)
                    ).encode()
    return base64.b64encode(bytes(raw)).decode()


@st.composite
def mutated_packed(draw: st.DrawFn) -> dict[object, object]:
    packed: dict[object, object] = dict(encode_routed_experts(draw(valid_routes())))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(["data", "shape", "dtype", "extra", 7]))
        action = draw(st.sampled_from(["replace", "drop", "tweak"]))
        if action == "drop":
            packed.pop(key, None)
        elif action == "replace":
            packed[key] = draw(json_values)
        elif key == "shape" and isinstance(packed.get("shape"), list):
            shape = list(packed["shape"])  # type: ignore[call-overload]
            if shape:
                shape[draw(st.integers(0, len(shape) - 1))] = draw(
                    st.integers(-(2**65), 2**65) | st.sampled_from([-1, 0, 2**31, 2**63])
                )
            packed["shape"] = shape
        elif key == "dtype":
            packed["dtype"] = draw(
                st.sampled_from(["<i2", ">u2", "|b1", "<f4", ",", "(2,)u1", "u1,u1", "O", "V8"])
                | st.text(max_size=6)
            )
        elif key == "data" and isinstance(packed.get("data"), str):
            text = str(packed["data"])
            packed["data"] = text[: draw(st.integers(0, len(text)))] + draw(st.text(max_size=3))
    return packed


def routes_payloads() -> st.SearchStrategy[object]:
    return (
        json_values
        | mutated_npy()
        | mutated_packed()
        | valid_routes().map(npy_b64)
        | valid_routes().map(encode_routed_experts)
    )


def assert_acceptable_routes(arr: np.ndarray) -> None:
    assert arr.ndim == 3
    assert arr.dtype.str in ALLOWED_DTYPES
    assert not arr.size or int(arr.min()) >= 0


@settings(max_examples=400, deadline=None)
@given(routes_payloads())
def test_fuzzed_routes_raise_only_wire_format_errors(value: object) -> None:
    try:
        arr = decode_routed_experts(value)
    except WireFormatError:
        return
    assert_acceptable_routes(arr)


@st.composite
def choice_events(draw: st.DrawFn) -> object:
    n = draw(st.integers(0, 3))
    ids = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    choice: dict[object, object] = {
        "index": 0,
        "token_ids": ids,
        "logprobs": {"content": [{"token_id": t, "logprob": -1.0} for t in ids]},
        "finish_reason": draw(st.sampled_from([None, "stop", "length"])),
        "stop_reason": draw(st.none() | st.integers(0, 10) | st.text(max_size=3)),
        "routed_experts": draw(st.none() | routes_payloads()),
    }
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from([*choice, "logprobs.content", "token_ids[]"]))
        if key == "token_ids[]" and ids:
            ids[draw(st.integers(0, len(ids) - 1))] = draw(json_values)
        elif key == "logprobs.content":
            choice["logprobs"] = {"content": draw(json_values)}
        else:
            choice[key] = draw(json_values)
    event_: object = {"choices": [choice]}
    if draw(st.integers(0, 9)) == 0:
        event_ = draw(json_values | st.just({"error": draw(json_values)}))
    return event_


@settings(max_examples=400, deadline=None)
@given(choice_events())
def test_fuzzed_choices_raise_only_wire_format_errors(event_: object) -> None:
    try:
        piece = decode_choice(event_)  # type: ignore[arg-type]
    except WireFormatError:
        return
    if piece is None:
        return
    assert piece.token_ids.dtype == np.int32 and piece.token_ids.ndim == 1
    assert piece.logprobs.dtype == np.float32 and piece.logprobs.shape == piece.token_ids.shape
    assert piece.stop_reason is None or isinstance(piece.stop_reason, str | int)
    assert not isinstance(piece.stop_reason, bool)
    if piece.routed_experts is not None:
        assert_acceptable_routes(piece.routed_experts)


def _position(token: int, logprob: float, tops: list[tuple[int, float]]) -> dict[str, object]:
    top = [{"token_id": t, "logprob": v, "rank": None} for t, v in tops]
    return {"token_id": token, "logprob": logprob, "top_logprobs": top}


def test_top_k_is_read_from_the_servers_lists_whether_or_not_the_sampled_token_ranks_within_k() -> (
    None
):
    # As vLLM 0.32 sends them when asked for k + 1 = 3: the sampled token first, then the top
    # ranks without it, cut to 3 entries.
    content = [
        _position(7, -0.5, [(7, -0.5), (3, -1.0), (9, -2.0)]),  # sampled is the top-1
        _position(4, -1.5, [(4, -1.5), (2, -0.25), (8, -1.75)]),  # sampled is the top-2
        _position(6, -5.0, [(6, -5.0), (1, -0.125), (5, -0.375)]),  # sampled ranks below 2
    ]
    out = decode_choice(event(token_ids=[7, 4, 6], logprobs={"content": content}), top=2)
    assert out is not None and out.top_token_ids is not None and out.top_logprobs is not None
    assert out.top_token_ids.dtype == np.int32 and out.top_logprobs.dtype == np.float32
    assert out.top_token_ids.tolist() == [[7, 3], [2, 4], [1, 5]]
    assert out.top_logprobs.tolist() == [[-0.5, -1.0], [-0.25, -1.5], [-0.125, -0.375]]
    assert out.logprobs.tolist() == [-0.5, -1.5, -5.0]
    # Not asked: none read, whatever the server sent.
    plain = decode_choice(event(token_ids=[7, 4, 6], logprobs={"content": content}))
    assert plain is not None and plain.top_token_ids is None and plain.top_logprobs is None


@pytest.mark.parametrize(
    ("tops", "message"),
    [
        (None, "has no top-2"),
        ([{"token_id": 7, "logprob": -0.5}], "has no top-2"),
        ([{"token_id": 7, "logprob": -0.5}, {"token_id": -1, "logprob": -1.0}], "malformed top"),
        ([{"token_id": 7, "logprob": -0.5}, {"token_id": 1, "logprob": True}], "malformed top"),
        ([{"token_id": 7, "logprob": -0.5}, {"token_id": 1, "logprob": 10**400}], "out of range"),
    ],
)
def test_malformed_top_logprobs_are_refused(tops: object, message: str) -> None:
    content = [{"token_id": 7, "logprob": -0.5, "top_logprobs": tops}]
    with pytest.raises(WireFormatError, match=message):
        decode_choice(event(token_ids=[7], logprobs={"content": content}), top=2)


def test_top_k_from_vllms_flat_logprobs_whole_and_merged() -> None:
    """``flat_top``: a position as vLLM's sampler fills it (sampled entry, then the top-k), and
    as its collector leaves it after merging outputs (one entry per token: the sampled one
    first even when it is also a top one), read by rank."""
    from types import SimpleNamespace

    from workers.engines.vllm.translate import flat_top

    flat = SimpleNamespace(
        # position 0 unmerged: sampled 7 (rank 2), then ranks 1, 2; position 1 merged: sampled
        # 4 is the top-1 and stands once; position 2 merged, sampled 6 ranks 9: k + 1 entries.
        start_indices=[0, 3, 5],
        end_indices=[3, 5, 8],
        token_ids=[7, 3, 7, 4, 2, 6, 1, 5],
        logprobs=[-1.0, -0.5, -1.0, -0.25, -2.0, -9.0, -0.125, -0.375],
        ranks=[2, 1, 2, 1, 2, 9, 1, 2],
    )
    ids, lps = flat_top(flat, 3, 2)
    assert ids.tolist() == [[3, 7], [4, 2], [1, 5]]
    assert lps.tolist() == [[-0.5, -1.0], [-0.25, -2.0], [-0.125, -0.375]]
    short = SimpleNamespace(**{**vars(flat), "ranks": [2, 1, 2, 1, 3, 9, 1, 2]})
    with pytest.raises(EngineError, match="without the top-2 of position 1"):
        flat_top(short, 3, 2)
