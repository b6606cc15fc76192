"""An episode's tool calls as the state keeps them: one record per call, folded from its
events by ``record``. The transitions use it after checking an event, and a snapshot's
reader uses it over the log's tool events, so both build the very same records."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum

from statemachine.episode import ToolEffect
from statemachine.episode_events import (
    ToolCallClaimed,
    ToolCallFailed,
    ToolCallLost,
    ToolCallRequested,
    ToolEvent,
    ToolResultRecorded,
    TurnRequested,
)
from statemachine.status import ToolFailure


class ClaimEnd(StrEnum):
    RESULT = "result"
    FAILED = "failed"
    LOST = "lost"  # its runner was lost with no result: the effect is unverified


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    """One runner's hold on a call. ``end`` is None while it is live."""

    claim: int
    runner_id: str
    claimed_at: float
    end: ClaimEnd | None = None
    ended_at: float | None = None
    seconds: float = 0.0  # its run time as its runner reported it (0 when lost)
    failure: ToolFailure | None = None
    error: str = ""
    decision: ToolEffect | None = None  # what recovery decided, for a lost claim


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """A call the model made, everything that happened to it, and its observation.

    ``offset`` is the number of sampled tokens before it; ``turn`` its turn (0-based: the
    turn that ended at it). ``result`` is the ``ToolResultRecorded`` event itself, so its
    observation tokens are one copy shared with the log (as ``RolloutState.chunks`` are)."""

    call_id: str
    name: str
    arguments: str
    idempotency_key: str
    turn: int
    attempt: int
    offset: int
    requested_at: float
    claims: tuple[Claim, ...] = ()
    # A harness-driven episode's next call (``TurnRequested``) is its turn-end's "result".
    result: ToolResultRecorded | TurnRequested | None = None

    __hash__ = None  # type: ignore[assignment]  # holds an event with an array

    @property
    def live_claim(self) -> int:
        """The claim allowed to record an outcome now, 0 when none is live."""
        last = self.claims[-1] if self.claims else None
        return last.claim if last is not None and last.end is None else 0

    @property
    def seconds(self) -> float:
        """Run time over all its claims, as their runners reported it."""
        return sum(c.seconds for c in self.claims)

    @property
    def observation_tokens(self) -> int:
        return 0 if self.result is None else len(self.result)

    @property
    def unverified(self) -> int:
        """How many of its claims ended with their runner lost and no result."""
        return sum(c.end is ClaimEnd.LOST for c in self.claims)


def record(calls: tuple[ToolCall, ...], event: ToolEvent) -> tuple[ToolCall, ...]:
    """``calls`` after ``event``, which ``transitions`` has checked: a request adds a call;
    every other tool event is about the last one (an episode has one call pending at most)."""
    if isinstance(event, ToolCallRequested):
        call = ToolCall(
            call_id=event.call_id,
            name=event.name,
            arguments=event.arguments,
            idempotency_key=event.idempotency_key,
            turn=len(calls),
            attempt=event.attempt,
            offset=event.offset,
            requested_at=event.at,
        )
        return (*calls, call)
    last = calls[-1]
    if isinstance(event, TurnRequested):
        return (*calls[:-1], replace(last, result=event))
    if isinstance(event, ToolCallClaimed):
        claim = Claim(claim=event.claim, runner_id=event.runner_id, claimed_at=event.at)
        return (*calls[:-1], replace(last, claims=(*last.claims, claim)))
    live = last.claims[-1]
    if isinstance(event, ToolResultRecorded):
        ended = replace(live, end=ClaimEnd.RESULT, ended_at=event.at, seconds=event.seconds)
        return (*calls[:-1], replace(last, claims=(*last.claims[:-1], ended), result=event))
    if isinstance(event, ToolCallFailed):
        ended = replace(
            live,
            end=ClaimEnd.FAILED,
            ended_at=event.at,
            seconds=event.seconds,
            failure=event.failure,
            error=event.error,
        )
    else:
        assert isinstance(event, ToolCallLost)
        ended = replace(
            live, end=ClaimEnd.LOST, ended_at=event.at, error=event.detail, decision=event.decision
        )
    return (*calls[:-1], replace(last, claims=(*last.claims[:-1], ended)))


def replay(events: Iterable[ToolEvent]) -> tuple[ToolCall, ...]:
    """The calls of a rollout's tool events, in log order (a snapshot's reader)."""
    calls: tuple[ToolCall, ...] = ()
    for event in events:
        calls = record(calls, event)
    return calls
