"""What a trainer asks for: a prompt given as token ids and vLLM-style sampling parameters."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field, fields
from typing import Any, cast

import numpy as np

from statemachine.errors import InvalidRequest

# Largest int a request field may hold. msgpack could store up to 2**64 - 1, but no token id,
# seed or token budget beyond int64 means anything, and numpy/torch/vLLM hold them as int64.
INT_MAX = 2**63 - 1

# Most top-k alternatives a request may ask per token (``SamplingParams.logprobs``): vLLM's
# default ``max_logprobs``, so every engine serves any k a request may hold.
MAX_LOGPROBS = 20

# The rq queue a rollout goes to when the submitter names none (``store.defaults.QUEUE_NAME``).
DEFAULT_QUEUE = "rollouts"

# Metadata is stored verbatim in the log and comes back with every result: plain msgpack data
# (strings, numbers, booleans, None, lists and string-keyed maps of them), so it can never
# smuggle objects (and so never needs pickle). Its size is capped at submit.
MetadataValue = Any
METADATA_DEPTH = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    max_tokens: int
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k (vLLM accepts 0 or -1; we normalise to 0)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # vLLM's ``logprobs=k``: besides the sampled token's logprob (always kept), the k most
    # likely tokens at each position and their logprobs, recorded per token (0: none).
    logprobs: int = 0
    # What to do when prompt + max_tokens exceeds the model's context (known only on the
    # worker): False fails the rollout at once with request_error; True generates what fits,
    # and the rollout may end with ``length`` before max_tokens.
    cap_to_context: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(
            self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids)
        )
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        _check_float("temperature", self.temperature, low=0.0, high=None)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, minimum=0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest("ignore_eos must be a bool")
        if not isinstance(self.cap_to_context, bool):
            raise InvalidRequest("cap_to_context must be a bool")
        _check_int("logprobs", self.logprobs, minimum=0)
        if self.logprobs > MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be <= {MAX_LOGPROBS}, got {self.logprobs}")

    def to_dict(self) -> dict[str, Any]:
        # cap_to_context only when set: records (and submit fingerprints) of requests that do
        # not use it stay byte for byte what they were before the field existed.
        capped = {"cap_to_context": True} if self.cap_to_context else {}
        return {
            "max_tokens": self.max_tokens,
            "min_tokens": self.min_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
            **capped,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {sorted(unknown)}")
        if "max_tokens" not in data:
            raise InvalidRequest("sampling params need max_tokens")
        return cls(**data)


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutRequest:
    """One generation: a tokenized prompt and how to sample its continuation."""

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    group_id: str | None = None
    metadata: dict[str, MetadataValue] = field(default_factory=dict)
    # Do not start (or resume) this rollout once the weights are more than this many versions
    # ahead of the version it was admitted under; None: no bound.
    max_staleness: int | None = None

    def __post_init__(self) -> None:
        ids = _token_ids("prompt_token_ids", self.prompt_token_ids)
        object.__setattr__(self, "prompt_token_ids", ids)
        if not ids:
            raise InvalidRequest("prompt_token_ids must not be empty")
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidRequest("sampling must be SamplingParams")
        if self.group_id is not None and not isinstance(self.group_id, str):
            raise InvalidRequest("group_id must be a string")
        if self.max_staleness is not None:
            _check_int("max_staleness", self.max_staleness, minimum=0)
        if not isinstance(self.metadata, dict):
            raise InvalidRequest("metadata must be a dict")
        _check_metadata("metadata", self.metadata, 0)
        # As stored and read back: tuples become lists, so a retried submit compares equal.
        object.__setattr__(self, "metadata", _as_stored(self.metadata))

    __hash__ = None  # type: ignore[assignment]  # metadata is a dict: not hashable, by design

    def in_group(self, group_id: str) -> RolloutRequest:
        """This request with ``group_id``, without checking the rest again (it was checked when
        this one was built; a submit of 10,000 rollouts would check 640,000 token ids twice)."""
        if not isinstance(group_id, str):
            raise InvalidRequest("group_id must be a string")
        new = object.__new__(RolloutRequest)
        for f in fields(RolloutRequest):
            object.__setattr__(new, f.name, getattr(self, f.name))
        object.__setattr__(new, "group_id", group_id)
        return new

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_token_ids": list(self.prompt_token_ids),
            "sampling": self.sampling.to_dict(),
            "group_id": self.group_id,
            "metadata": dict(self.metadata),
            "max_staleness": self.max_staleness,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutRequest:
        unknown = set(data) - {
            "prompt_token_ids",
            "sampling",
            "group_id",
            "metadata",
            "max_staleness",
        }
        if unknown:
            raise InvalidRequest(f"unknown request field(s): {sorted(unknown)}")
        try:
            sampling = SamplingParams.from_dict(dict(data["sampling"]))
            return cls(
                prompt_token_ids=data["prompt_token_ids"],
                sampling=sampling,
                group_id=data.get("group_id"),
                metadata=dict(data.get("metadata") or {}),
                max_staleness=data.get("max_staleness"),
            )
        except KeyError as exc:
            raise InvalidRequest(f"request is missing {exc.args[0]!r}") from None
        except TypeError as exc:
            # A wrong container type (e.g. a number where a list belongs) surfaces here.
            raise InvalidRequest(f"malformed request: {exc}") from None


def _stop_strings(value: object) -> tuple[str, ...]:
    # vLLM takes `stop: str | list[str]`: a lone string is one stop string, never its letters.
    strings = (value,) if isinstance(value, str) else value
    if not isinstance(strings, list | tuple) or not all(isinstance(s, str) and s for s in strings):
        raise InvalidRequest(f"stop must be a string or a list of non-empty strings, got {value!r}")
    return tuple(strings)


def _token_ids(name: str, value: object) -> tuple[int, ...]:
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
        _check_int(f"{name}[]", int(t) if isinstance(t, np.integer) else t, minimum=0)
        for t in items
    )


def _check_int(name: str, value: object, *, minimum: int) -> int:
    # bool is an int subclass; True as a token id or a budget is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidRequest(f"{name} must be >= {minimum}, got {value}")
    if value > INT_MAX:
        raise InvalidRequest(f"{name} must be < 2**63, got {value}")
    return value


def _check_float(
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


def _check_metadata(where: str, value: object, depth: int) -> None:
    if depth > METADATA_DEPTH:
        raise InvalidRequest(f"{where}: nested deeper than {METADATA_DEPTH} levels")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidRequest(f"{where}: keys must be strings, got {k!r}")
            _check_metadata(f"{where}.{k}", v, depth + 1)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_metadata(f"{where}[{i}]", v, depth + 1)
    elif (
        isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value <= INT_MAX
    ):
        raise InvalidRequest(f"{where}: {value} does not fit in 64 bits")
    elif isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"{where}: {value!r} is not finite")
    elif not isinstance(value, str | int | float | bool | None):
        raise InvalidRequest(
            f"{where}: must be str/int/float/bool/None or lists and maps of them, "
            f"got {type(value).__name__}"
        )


def _as_stored(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _as_stored(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_as_stored(v) for v in value]
    return value
