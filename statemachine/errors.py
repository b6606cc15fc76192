"""Every error the pure domain raises. One base class so callers can catch the domain as a whole."""

from __future__ import annotations


class StateMachineError(Exception):
    """Base of every error raised by ``statemachine``."""


class InvalidRequest(StateMachineError, ValueError):
    """A rollout request (prompt or sampling params) is malformed; nothing was recorded."""


class InvalidEvent(StateMachineError, ValueError):
    """An event is malformed on its own (e.g. arrays of different lengths)."""


class TransitionError(StateMachineError):
    """An event cannot be applied to the current state. The state is left unchanged."""

    def __init__(self, rollout_id: str, seq: int, message: str) -> None:
        super().__init__(f"rollout {rollout_id!r} event #{seq}: {message}")
        self.rollout_id = rollout_id
        self.seq = seq


class IllegalTransition(TransitionError):
    """The ``(state, event type)`` pair is not in the transition table."""


class SequenceGap(TransitionError):
    """The event's sequence number is not exactly ``state.seq + 1``."""


class AttemptMismatch(TransitionError):
    """The event belongs to an attempt other than the one it must continue or open."""


class OffsetMismatch(TransitionError):
    """Appended tokens do not start where the tokens so far end."""


class ModelMismatch(TransitionError):
    """An attempt would run another model than the rollout's earlier attempts did: its
    trajectory would mix two models' tokens, so the attempt is refused."""


class BudgetExceeded(TransitionError):
    """Appended tokens would exceed the request's ``max_tokens`` (or an episode's
    ``max_total_tokens``), or an episode would begin a step its budgets leave no room for
    (a turn beyond ``max_turns``, a claim once ``max_tool_seconds`` is used up)."""


class NotAnEpisode(TransitionError):
    """A tool-call event for a rollout whose request has no ``episode``."""


class CallMismatch(TransitionError):
    """A tool-call event names a call other than the pending one (or reuses a call's id)."""


class ClaimMismatch(TransitionError):
    """A runner's event names a claim that is not the live one: a zombie runner's late
    result or failure, or a claim that skips a number. Claims are fenced as attempts are."""


class DecisionMismatch(TransitionError):
    """A lost call's recorded decision is not the effect its tool declared."""


class TopLogprobsMismatch(TransitionError):
    """Appended tokens carry top-k logprobs of another width than the request's ``logprobs``
    (or carry them when it asked for none, or lack them when it asked)."""


class RoutesMismatch(TransitionError):
    """Appended tokens carry observation routes that belong to no observation: the chunk does
    not begin the turn right after a recorded result, or its rows are not one per token of
    that observation."""


class CodecError(StateMachineError):
    """A stored record cannot be decoded. Names the rollout and sequence number when known."""

    def __init__(self, message: str, *, rollout_id: str | None = None, seq: int | None = None):
        where = f"rollout {rollout_id!r} event #{seq}: " if rollout_id is not None else ""
        super().__init__(f"{where}{message}")
        self.rollout_id = rollout_id
        self.seq = seq


class CorruptRecord(CodecError):
    """The record's checksum, framing or fields are wrong: it was damaged or truncated."""


class UnknownEventType(CodecError):
    """The record names an event type that is not registered."""


class UnsupportedSchema(CodecError):
    """The record's schema version is newer than this code, or has no upcaster."""
