"""The pure domain of one rollout: states, events, transitions and their stored form.

Imports only the standard library, numpy and msgpack; no I/O happens here.
"""

from __future__ import annotations

from statemachine import commands
from statemachine.errors import (
    AttemptMismatch,
    BudgetExceeded,
    CodecError,
    CorruptRecord,
    IllegalTransition,
    InvalidEvent,
    InvalidRequest,
    ModelMismatch,
    OffsetMismatch,
    SequenceGap,
    StateMachineError,
    TopLogprobsMismatch,
    TransitionError,
    UnknownEventType,
    UnsupportedSchema,
)
from statemachine.events import (
    Aborted,
    Cancelled,
    Event,
    Failed,
    Finished,
    Membership,
    Resumed,
    Started,
    Submitted,
    TokensAppended,
    fence_of,
)
from statemachine.request import DEFAULT_QUEUE, MAX_LOGPROBS, RolloutRequest, SamplingParams
from statemachine.rollout_state import RolloutState
from statemachine.status import (
    LIVE,
    TERMINAL,
    WAITING,
    AbortReason,
    FailureClass,
    FinishReason,
    GroupPolicy,
    Status,
)
from statemachine.transitions import EVENT_TYPES, TRANSITIONS, apply, fold

__all__ = [
    "DEFAULT_QUEUE",
    "EVENT_TYPES",
    "LIVE",
    "MAX_LOGPROBS",
    "TERMINAL",
    "TRANSITIONS",
    "WAITING",
    "AbortReason",
    "Aborted",
    "AttemptMismatch",
    "BudgetExceeded",
    "Cancelled",
    "CodecError",
    "CorruptRecord",
    "Event",
    "Failed",
    "FailureClass",
    "FinishReason",
    "Finished",
    "GroupPolicy",
    "IllegalTransition",
    "InvalidEvent",
    "InvalidRequest",
    "Membership",
    "ModelMismatch",
    "OffsetMismatch",
    "Resumed",
    "RolloutRequest",
    "RolloutState",
    "SamplingParams",
    "SequenceGap",
    "Started",
    "StateMachineError",
    "Status",
    "Submitted",
    "TokensAppended",
    "TopLogprobsMismatch",
    "TransitionError",
    "UnknownEventType",
    "UnsupportedSchema",
    "apply",
    "commands",
    "fence_of",
    "fold",
]
