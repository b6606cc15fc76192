"""Commands: what happened to a rollout, turned into the events that record it.

Callers (the trainer client, the worker's runner, the reaper) say what happened; these
functions number the events (``seq`` follows the state's, in order within a chain), fill in
the attempt and the offset from the state, and leave the legality of each event to
``transitions.apply``, which the store runs before it writes anything. So no caller computes
``state.seq + 1`` or an offset itself, and a chain (the last tokens, then ``Finished``) is
numbered in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

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
)
from statemachine.request import DEFAULT_QUEUE, RolloutRequest
from statemachine.rollout_state import RolloutState
from statemachine.status import LIVE, AbortReason, FailureClass, FinishReason, Status


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class NewTokens:
    """Tokens an attempt produced since its last checkpoint, as arrays of equal length.

    ``logprobs`` are as stored (non-finite values already clamped; ``nonfinite_logprobs``
    counts them); ``weight_versions`` has one entry per token; ``top_token_ids`` and
    ``top_logprobs`` are ``[tokens, k]`` when the request asked for ``logprobs=k``;
    ``observation_routes`` the prefill routes of the observation before them, on an episode
    turn's first tokens only (``TokensAppended.observation_routes``)."""

    token_ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]
    weight_versions: npt.NDArray[np.int64]
    routed_experts: npt.NDArray[Any] | None = None
    nonfinite_logprobs: int = 0
    top_token_ids: npt.NDArray[np.int32] | None = None
    top_logprobs: npt.NDArray[np.float32] | None = None
    observation_routes: npt.NDArray[Any] | None = None

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


def submit(
    rollout_id: str,
    request: RolloutRequest,
    *,
    admitted_version: int = 0,
    queue: str = DEFAULT_QUEUE,
    membership: Membership | None = None,
    at: float | None = None,
) -> Submitted:
    """A new rollout. ``at`` is passed by a caller that must record the same bytes when it
    retries (an idempotent submit); otherwise it is now."""
    extra = {} if at is None else {"at": at}
    return Submitted(
        rollout_id=rollout_id,
        seq=1,
        request=request,
        admitted_version=admitted_version,
        queue=queue,
        membership=membership or Membership(),
        **extra,
    )


def begin(
    state: RolloutState,
    *,
    worker_id: str,
    weight_version: int,
    weight_mode: str,
    model: str,
) -> list[Event]:
    """A worker opens the rollout's next attempt: ``Started`` for the first, ``Resumed`` for a
    later one. A rollout still live (its worker died, or rq delivered the job twice) is first
    taken over: ``aborted(worker_lost)`` fences the old attempt out."""
    events: list[Event] = []
    if state.status in LIVE:
        events.append(
            Aborted(
                rollout_id=state.rollout_id,
                seq=state.seq + 1,
                attempt=state.attempt,
                reason=AbortReason.WORKER_LOST,
                detail=f"taken over by {worker_id}",
            )
        )
    kind = Started if state.status is Status.PENDING else Resumed
    events.append(
        kind(
            rollout_id=state.rollout_id,
            seq=state.seq + 1 + len(events),
            attempt=state.attempt + 1,
            worker_id=worker_id,
            weight_version=weight_version,
            weight_mode=weight_mode,
            model=model,
        )
    )
    return events


def checkpoint(state: RolloutState, tokens: NewTokens) -> TokensAppended:
    """The live attempt's new tokens, appended where the tokens so far end."""
    return _tokens(state, tokens, state.seq + 1)


def finish(
    state: RolloutState,
    reason: FinishReason,
    stop_reason: int | str | None = None,
    *,
    tokens: NewTokens | None = None,
) -> list[Event]:
    """The live attempt ended generation: its last tokens (if any), then ``Finished``."""
    events = _last_tokens(state, tokens)
    events.append(
        Finished(
            rollout_id=state.rollout_id,
            seq=state.seq + 1 + len(events),
            attempt=state.attempt,
            finish_reason=reason,
            stop_reason=stop_reason,
        )
    )
    return events


def abort(
    state: RolloutState,
    reason: AbortReason,
    detail: str = "",
    *,
    tokens: NewTokens | None = None,
) -> list[Event]:
    """The live attempt stopped early: its last tokens (if any) are kept, then ``Aborted``."""
    events = _last_tokens(state, tokens)
    events.append(
        Aborted(
            rollout_id=state.rollout_id,
            seq=state.seq + 1 + len(events),
            attempt=state.attempt,
            reason=reason,
            detail=detail,
        )
    )
    return events


def fail(
    state: RolloutState, error: str, failure: FailureClass = FailureClass.ENGINE_ERROR
) -> Failed:
    """Given up on the rollout after ``state.attempt`` attempts, for a ``failure`` of a kind."""
    return Failed(rollout_id=state.rollout_id, seq=state.seq + 1, error=error,
                  attempts=state.attempt, failure=failure)  # fmt: skip


def cancel(state: RolloutState, reason: str = "") -> Cancelled:
    """No longer wanted; legal from any non-terminal state, and it fences a live attempt."""
    return Cancelled(rollout_id=state.rollout_id, seq=state.seq + 1, reason=reason)


def _last_tokens(state: RolloutState, tokens: NewTokens | None) -> list[Event]:
    return [] if tokens is None or len(tokens) == 0 else [_tokens(state, tokens, state.seq + 1)]


def _tokens(state: RolloutState, tokens: NewTokens, seq: int) -> TokensAppended:
    return TokensAppended(
        rollout_id=state.rollout_id,
        seq=seq,
        attempt=state.attempt,
        offset=state.num_tokens,
        token_ids=tokens.token_ids,
        logprobs=tokens.logprobs,
        weight_versions=tokens.weight_versions,
        routed_experts=tokens.routed_experts,
        nonfinite_logprobs=tokens.nonfinite_logprobs,
        top_token_ids=tokens.top_token_ids,
        top_logprobs=tokens.top_logprobs,
        observation_routes=tokens.observation_routes,
    )
