"""Checks of the values a submission carries: each refuses a bad value with an
``InvalidRequest`` that names the field. Shared by the request and the episode spec."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Set
from typing import cast

import numpy as np

from statemachine.errors import InvalidRequest

# Largest int a request field may hold. msgpack could store up to 2**64 - 1, but no token id,
# seed or token budget beyond int64 means anything, and numpy/torch/vLLM hold them as int64.
INT_MAX = 2**63 - 1


def stop_strings(value: object) -> tuple[str, ...]:
    # vLLM takes `stop: str | list[str]`: a lone string is one stop string, never its letters.
    strings = (value,) if isinstance(value, str) else value
    if not isinstance(strings, list | tuple) or not all(isinstance(s, str) and s for s in strings):
        raise InvalidRequest(f"stop must be a string or a list of non-empty strings, got {value!r}")
    return tuple(strings)


def token_ids(name: str, value: object) -> tuple[int, ...]:
    """Token ids as a tuple of plain ints. numpy integer scalars (a trainer's arrays) become
    ints so msgpack can store them; numpy bools and floats are refused like Python's."""
    # A string, bytes, a mapping or a set iterates, but into characters, byte values, keys or
    # no defined order: never what a caller meant by token ids.
    if isinstance(value, str | bytes | bytearray | memoryview | Mapping | Set):
        raise InvalidRequest(f"{name} must be a list of ints, got {type(value).__name__}")
    if not isinstance(value, Iterable):
        # Not iterable at all: a bare int, None, a float.
        raise InvalidRequest(f"{name} must be a list of ints, got {value!r}")
    try:
        items: tuple[object, ...] = tuple(value)
    except TypeError:
        # Iterable by type yet not by value: a 0-d numpy array.
        raise InvalidRequest(f"{name} must be a list of ints, got {value!r}") from None
    # The common case, checked in bulk (a submit checks millions of ids): plain ints in range.
    if all(type(t) is int for t in items):
        ints = cast(tuple[int, ...], items)
        if not ints or (min(ints) >= 0 and max(ints) <= INT_MAX):
            return ints
    return tuple(
        check_int(f"{name}[]", int(t) if isinstance(t, np.integer) else t, minimum=0) for t in items
    )


def check_int(name: str, value: object, *, minimum: int) -> int:
    # bool is an int subclass; True as a token id or a budget is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidRequest(f"{name} must be >= {minimum}, got {value}")
    if value > INT_MAX:
        raise InvalidRequest(f"{name} must be < 2**63, got {value}")
    return value


def check_float(
    name: str, value: object, *, low: float, high: float | None, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{name} must be a number, got {value!r}")
    try:
        v = float(value)
    except OverflowError:
        # An int beyond the float range (10**400): as meaningless as inf.
        v = math.inf
    # An infinite temperature would be accepted by vLLM, yet it only samples uniform noise.
    if not math.isfinite(v):
        raise InvalidRequest(f"{name} must be finite, got {value!r}")
    if (low_open and v <= low) or v < low or (high is not None and v > high):
        bound = (
            f"({low}, {high}]" if low_open else f"[{low}, {high if high is not None else 'inf'})"
        )
        raise InvalidRequest(f"{name} must be in {bound}, got {value!r}")
