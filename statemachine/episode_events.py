"""The events of an episode's tool calls. Past tense, frozen, each with its rollout id and seq,
like ``events``; whether one may follow the current state is decided in ``transitions``.

A call's life: the generation worker records ``ToolCallRequested`` (ending its attempt, before
any side effect can happen); an environment runner claims it (``ToolCallClaimed``, claim
numbers 1, 2, ... fenced like attempts); the live claim ends with a result
(``ToolResultRecorded``), a failure (``ToolCallFailed``) or, when its runner is lost with no
result, ``ToolCallLost``, which records what recovery decided about its unverified effect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from statemachine.arrays import TOKEN_DTYPE, frozen
from statemachine.episode import ToolEffect
from statemachine.errors import InvalidEvent
from statemachine.events import Event
from statemachine.request import SamplingParams
from statemachine.status import ToolFailure


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallRequested(Event):
    """The model's turn ended at a tool call. Written by the generation worker after the turn's
    last ``TokensAppended``, in its attempt ``attempt``, which it ends. ``offset`` is the number
    of sampled tokens before the call (as ``TokensAppended.offset``): with it any reader places
    the call's observation in the context without reading the token log. ``arguments`` is the
    call's arguments as the model wrote them (JSON, usually; the domain does not parse it).
    ``idempotency_key`` is the same for every claim of the call, so an environment can tell a
    rerun from a new call."""

    attempt: int
    offset: int
    call_id: str
    name: str
    arguments: str
    idempotency_key: str

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        _count("attempt", self.attempt, 1)
        _count("offset", self.offset, 0)
        for name in ("call_id", "name", "idempotency_key"):
            _text(name, getattr(self, name))
        if not isinstance(self.arguments, str):
            raise InvalidEvent(f"arguments must be a string, got {type(self.arguments).__name__}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallClaimed(Event):
    """Runner ``runner_id`` took the pending call under claim number ``claim`` (the previous
    claim's + 1): only this claim may record the call's outcome from now on."""

    call_id: str
    runner_id: str
    claim: int

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        _text("call_id", self.call_id)
        _text("runner_id", self.runner_id)
        _count("claim", self.claim, 1)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ToolResultRecorded(Event):
    """The live claim's result. ``observation_token_ids`` are the tokens the engine is fed
    before the next turn: the tool's output with the chat template's tokens around it, so a
    resume sends byte-identical context. ``env_handle``/``env_revision`` name the environment's
    state after the call (what a ``restore`` goes back to); the sandbox itself is never stored.
    ``seconds`` is how long the call ran, as its runner measured it."""

    call_id: str
    claim: int
    observation_token_ids: npt.NDArray[np.int32]
    env_handle: str = ""
    env_revision: str = ""
    seconds: float = 0.0

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        _text("call_id", self.call_id)
        _count("claim", self.claim, 1)
        ids = frozen(self.observation_token_ids, TOKEN_DTYPE, "observation_token_ids")
        if ids.size and int(ids.min()) < 0:
            raise InvalidEvent("observation token ids must be >= 0")
        object.__setattr__(self, "observation_token_ids", ids)
        for name in ("env_handle", "env_revision"):
            if not isinstance(getattr(self, name), str):
                raise InvalidEvent(f"{name} must be a string")
        object.__setattr__(self, "seconds", _seconds(self.seconds))

    def __len__(self) -> int:
        return int(self.observation_token_ids.shape[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ToolResultRecorded):
            return NotImplemented
        fields = ("rollout_id", "seq", "at", "call_id", "claim", "env_handle", "env_revision")
        return all(getattr(self, f) == getattr(other, f) for f in fields) and (
            self.seconds == other.seconds
            and self.observation_token_ids.tobytes() == other.observation_token_ids.tobytes()
        )

    __hash__ = None  # type: ignore[assignment]  # holds an array


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallFailed(Event):
    """The live claim failed; the call waits for a new claim. For ``env_fatal`` (or an
    ``env_error`` beyond its retry budget) the command layer appends ``Failed`` after it.
    ``seconds`` is how long the failing run took (it counts against ``max_tool_seconds``)."""

    call_id: str
    claim: int
    failure: ToolFailure
    error: str = ""
    seconds: float = 0.0

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        _text("call_id", self.call_id)
        _count("claim", self.claim, 1)
        object.__setattr__(self, "failure", _enum(ToolFailure, "failure", self.failure))
        if not isinstance(self.error, str):
            raise InvalidEvent("error must be a string")
        object.__setattr__(self, "seconds", _seconds(self.seconds))


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallLost(Event):
    """The live claim's runner was lost with no result: whether the call took effect is
    unknown. ``decision`` is what recovery does about it, the tool's declared effect: run it
    again (``idempotent``), restore the last recorded revision and run it (``restore``), or
    give up (``restart``: the command layer appends ``Failed(effect_unverified)`` after it)."""

    call_id: str
    claim: int
    decision: ToolEffect
    detail: str = ""

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        _text("call_id", self.call_id)
        _count("claim", self.claim, 1)
        object.__setattr__(self, "decision", _enum(ToolEffect, "decision", self.decision))
        if not isinstance(self.detail, str):
            raise InvalidEvent("detail must be a string")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TurnRequested(Event):
    """A harness-driven episode's next turn (``EpisodeSpec.harness``): its harness called
    again with a prompt that extends the episode's context. ``observation_token_ids`` are the
    tokens that prompt adds (tool results, template tokens: fed, never sampled), recorded as
    the pending call's observation; ``sampling`` is the call's own (its ``max_tokens`` bounds
    this turn alone); ``call_batch`` names the call (its batch record, where a retry of the
    call finds it). No claim: the caller is the environment, and the append's seq fences it."""

    call_id: str
    call_batch: str
    observation_token_ids: npt.NDArray[np.int32]
    sampling: SamplingParams

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        _text("call_id", self.call_id)
        _text("call_batch", self.call_batch)
        ids = frozen(self.observation_token_ids, TOKEN_DTYPE, "observation_token_ids")
        if ids.size and int(ids.min()) < 0:
            raise InvalidEvent("observation token ids must be >= 0")
        object.__setattr__(self, "observation_token_ids", ids)
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidEvent("sampling must be SamplingParams")

    # Read where a tool's result is (``ToolCall.result``): a harness keeps no environment state.
    @property
    def env_handle(self) -> str:
        return ""

    @property
    def env_revision(self) -> str:
        return ""

    @property
    def seconds(self) -> float:
        return 0.0

    def __len__(self) -> int:
        return int(self.observation_token_ids.shape[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TurnRequested):
            return NotImplemented
        fields = ("rollout_id", "seq", "at", "call_id", "call_batch", "sampling")
        return all(getattr(self, f) == getattr(other, f) for f in fields) and (
            self.observation_token_ids.tobytes() == other.observation_token_ids.tobytes()
        )

    __hash__ = None  # type: ignore[assignment]  # holds an array


# Events that carry a call's claim: transitions accept them only for the live claim.
CLAIM_SCOPED = (ToolResultRecorded, ToolCallFailed, ToolCallLost)
TOOL_EVENTS = (ToolCallRequested, ToolCallClaimed, *CLAIM_SCOPED, TurnRequested)
ToolEvent = (
    ToolCallRequested
    | ToolCallClaimed
    | ToolResultRecorded
    | ToolCallFailed
    | ToolCallLost
    | TurnRequested
)
# What a harness-driven episode's turn end records as its "call" (``ToolCallRequested.name``):
# the harness decides what follows, from the answer it was given.
HARNESS_CALL = "harness"


def _text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidEvent(f"{name} must be a non-empty string, got {value!r}")


def _count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidEvent(f"{name} must be an int >= {minimum}, got {value!r}")


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidEvent(f"seconds must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise InvalidEvent(f"seconds must be finite and >= 0, got {value!r}")
    return float(value)


def _enum(cls: Any, name: str, value: object) -> Any:
    try:
        return cls(value)
    except ValueError:
        raise InvalidEvent(
            f"{name} must be one of {[v.value for v in cls]}, got {value!r}"
        ) from None
