"""Requests and sampling params: what vLLM accepts is accepted (and normalised to plain Python
values the codec can store), everything else is refused with an error that names the field."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statemachine import (
    MAX_LOGPROBS,
    InvalidRequest,
    RolloutRequest,
    SamplingParams,
    Submitted,
    codec,
)
from tests import factories as f

BIG = 2**63  # beyond int64: no token id, seed or budget is ever this large


def test_a_single_stop_string_is_one_stop_string() -> None:
    assert SamplingParams(max_tokens=4, stop="abc").stop == ("abc",)
    assert SamplingParams(max_tokens=4, stop=["ab", "c"]).stop == ("ab", "c")
    assert SamplingParams(max_tokens=4, stop=("ab",)).stop == ("ab",)
    assert SamplingParams(max_tokens=4, stop=[]).stop == ()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop", None),
        ("stop", 5),
        ("stop", b"abc"),
        ("stop", {"a": 1}),
        ("stop", ""),
        ("stop", ["a", ""]),
        ("stop", ["a", 3]),
        ("stop", [b"a"]),
        ("stop_token_ids", 5),
        ("stop_token_ids", None),
        ("stop_token_ids", "12"),
        ("stop_token_ids", b"\x01"),
        ("stop_token_ids", {1: 2}),
        ("stop_token_ids", [1, True]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [np.bool_(True)]),
        ("stop_token_ids", [np.float64(2.0)]),
        ("stop_token_ids", [BIG]),
        ("stop_token_ids", [-1]),
        ("seed", BIG),
        ("max_tokens", BIG),
        ("min_tokens", BIG),
        ("top_k", BIG),
        ("logprobs", BIG),
        ("temperature", float("inf")),
        ("temperature", float("-inf")),
        ("temperature", float("nan")),
        ("temperature", 10**400),
        ("top_p", float("inf")),
    ],
)
def test_bad_sampling_values_are_refused_by_name(field: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"max_tokens": 4, field: value}
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**kwargs)
    # The same refusal when the params arrive as a dict (the stored form).
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams.from_dict(kwargs)


def test_largest_int64_values_are_accepted() -> None:
    top = BIG - 1
    sp = SamplingParams(max_tokens=top, seed=top, top_k=top, stop_token_ids=[top])
    assert sp.stop_token_ids == (top,)


def test_logprobs_up_to_vllms_default_max_are_accepted_and_beyond_refused() -> None:
    assert SamplingParams(max_tokens=1, logprobs=MAX_LOGPROBS).logprobs == 20
    with pytest.raises(InvalidRequest, match="logprobs must be <= 20, got 21"):
        SamplingParams(max_tokens=1, logprobs=MAX_LOGPROBS + 1)


@pytest.mark.parametrize(
    "dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
)
def test_numpy_token_ids_become_python_ints(dtype: type) -> None:
    ids = np.array([3, 1, 2], dtype=dtype)
    req = RolloutRequest(
        prompt_token_ids=ids, sampling=SamplingParams(max_tokens=4, stop_token_ids=ids[:2])
    )
    assert req.prompt_token_ids == (3, 1, 2)
    assert all(type(t) is int for t in req.prompt_token_ids)
    assert all(type(t) is int for t in req.sampling.stop_token_ids)
    # A list of numpy scalars (what iterating an array gives) is the same.
    assert RolloutRequest(prompt_token_ids=list(ids), sampling=req.sampling) == req


@pytest.mark.parametrize(
    "value",
    [
        5,
        None,
        3.0,
        "abc",
        b"\x01\x02",
        {1: 2},
        [1, True],
        [1, 2.0],
        np.array([1.0, 2.0]),
        np.array([True, False]),
        [np.uint64(BIG)],
        [BIG],
        [1, -1],
    ],
)
def test_bad_prompts_are_refused_by_name(value: Any) -> None:
    sp = SamplingParams(max_tokens=4)
    with pytest.raises(InvalidRequest, match="prompt_token_ids"):
        RolloutRequest(prompt_token_ids=value, sampling=sp)
    with pytest.raises(InvalidRequest, match="prompt_token_ids"):
        RolloutRequest.from_dict({"prompt_token_ids": value, "sampling": {"max_tokens": 4}})


def test_a_request_with_numpy_ids_and_a_stop_string_survives_the_codec() -> None:
    req = RolloutRequest(
        prompt_token_ids=np.arange(5, dtype=np.int64),
        sampling=SamplingParams(
            max_tokens=8,
            stop="</s>",
            stop_token_ids=np.array([2], dtype=np.int32),
            seed=BIG - 1,
        ),
    )
    event = Submitted(rollout_id="r1", seq=1, request=req)
    back = codec.decode(codec.encode(event))
    assert isinstance(back, Submitted)
    assert back.request == req
    assert back.request.sampling.stop == ("</s>",)


token_ids = st.lists(st.integers(0, BIG - 1), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(
    prompt=token_ids,
    stop=st.one_of(st.text(min_size=1), st.lists(st.text(min_size=1), max_size=4)),
    stop_ids=st.lists(st.integers(0, BIG - 1), max_size=4),
    seed=st.none() | st.integers(0, BIG - 1),
    temperature=st.floats(0, 1e6, allow_nan=False, allow_infinity=False),
)
def test_every_valid_request_round_trips_through_the_codec(
    prompt: list[int],
    stop: str | list[str],
    stop_ids: list[int],
    seed: int | None,
    temperature: float,
) -> None:
    req = f.request(
        4,
        prompt=tuple(prompt),
        stop=stop,
        stop_token_ids=stop_ids,
        seed=seed,
        temperature=temperature,
    )
    back = codec.decode(codec.encode(Submitted(rollout_id="r1", seq=1, request=req)))
    assert isinstance(back, Submitted)
    assert back.request == req
