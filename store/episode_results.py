"""An episode's part of its result: the context it grew, what of it the model sampled, its turns
and its tool calls with everything that happened to each.

A plain rollout's result is its sampled tokens. An episode's is the whole context after the
prompt, in the order the engine was fed it: each turn's sampled tokens, then the observation of
the call that ended the turn. Every per-token array is aligned with that context, so a trainer
slices one index space: ``loss_mask`` says which tokens were sampled (1) and which were fed
(0); observation tokens carry logprob 0.0 and weight version -1 (no weights sampled them). Their
routed-experts rows come from the next turn's prefill where the engine returned them (the CPU
engine does), and are absent otherwise (``routes_present`` False, the row zero): see
``RolloutState.context_routes``. ``RolloutResult.from_state`` takes these fields for an
episode only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt

from statemachine import RolloutState, Status, ToolEffect, ToolFailure
from statemachine.tool_calls import Claim, ClaimEnd, ToolCall


class CallOutcome(StrEnum):
    """Where a call stands in its result."""

    RESULT = "result"  # its observation is recorded
    PENDING = "pending"  # the episode goes on and waits for it (unclaimed, or a claim is live)
    FAILED = "failed"  # the episode failed before the call had a result (env_fatal, retries
    #  spent, effect unverified with a ``restart`` tool)
    ABANDONED = "abandoned"  # the episode ended otherwise first (cancelled, or a budget)


class ClaimOutcome(StrEnum):
    """How one claim of a call ended (None in ``EpisodeClaim.outcome`` while it is live)."""

    RESULT = "result"
    ENV_ERROR = "env_error"  # failed, retried within the call's budget
    ENV_FATAL = "env_fatal"  # failed for good: the episode failed
    LOST = "lost"  # its runner was lost with no result: the effect is unverified


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeClaim:
    """One runner's hold on a call. ``decision`` is what recovery decided for a lost claim, the
    tool's declared effect: ``idempotent`` (run it again), ``restore`` (restore the revision of
    the last result, then run it again), ``restart`` (the episode failed, effect_unverified)."""

    claim: int
    runner_id: str
    outcome: ClaimOutcome | None
    seconds: float  # its run time as its runner reported it (0 when lost or live)
    error: str  # a failure's message, or what a lost claim's sweeper recorded
    decision: ToolEffect | None
    claimed_at: float
    ended_at: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "claim": self.claim, "runner_id": self.runner_id, "outcome": _value(self.outcome),
            "seconds": self.seconds, "error": self.error, "decision": _value(self.decision),
            "claimed_at": self.claimed_at, "ended_at": self.ended_at,
        }  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeCall:
    """A tool call as the trainer reads it. ``offset`` is where its observation starts in
    ``response_token_ids`` (the end of the turn that called it); ``observation_tokens`` its
    length (0 without a result). ``env_handle``/``env_revision`` are the result's ("" without).
    ``seconds`` is the run time over all its claims."""

    call_id: str
    name: str
    arguments: str
    idempotency_key: str
    turn: int
    offset: int
    observation_tokens: int
    env_handle: str
    env_revision: str
    seconds: float
    outcome: CallOutcome
    claims: tuple[EpisodeClaim, ...]
    requested_at: float

    @property
    def unverified(self) -> int:
        """How many of its claims were lost with no result (their effect unverified)."""
        return sum(c.outcome is ClaimOutcome.LOST for c in self.claims)

    def to_dict(self) -> dict[str, Any]:
        """As the HTTP API and ``rollouts show --json`` give it (enums as their values)."""
        return {
            "call_id": self.call_id, "name": self.name, "arguments": self.arguments,
            "idempotency_key": self.idempotency_key, "turn": self.turn, "offset": self.offset,
            "observation_tokens": self.observation_tokens, "env_handle": self.env_handle,
            "env_revision": self.env_revision, "seconds": self.seconds,
            "outcome": self.outcome.value, "claims": [c.to_dict() for c in self.claims],
            "requested_at": self.requested_at,
        }  # fmt: skip


def fields(state: RolloutState) -> dict[str, Any]:
    """The ``RolloutResult`` fields of episode ``state``: every per-token array over the whole
    context, and the episode's own (loss mask, turns, tool calls, routes present)."""
    ids = state.context_token_ids
    positions = state.sampled_positions
    routes, present = state.context_routes()
    top_ids, top_lps = state.top_token_ids, state.top_logprobs
    return {
        "response_token_ids": ids,
        "logprobs": state.context_logprobs,
        "weight_versions": state.context_weight_versions,
        "routed_experts": routes,
        "routes_present": present,
        "loss_mask": state.loss_mask,
        "turns": state.turns,
        "tool_calls": calls(state),
        # Rows of observation tokens zero, like their logprobs: loss_mask tells them apart.
        "top_token_ids": None if top_ids is None else _spread(top_ids, positions, len(ids)),
        "top_logprobs": None if top_lps is None else _spread(top_lps, positions, len(ids)),
    }


def calls(state: RolloutState) -> tuple[EpisodeCall, ...]:
    out = []
    fed = 0  # observation tokens before the call's, in the context
    for call in state.calls:
        out.append(_call(state, call, call.offset + fed))
        fed += call.observation_tokens
    return tuple(out)


def _call(state: RolloutState, call: ToolCall, offset: int) -> EpisodeCall:
    result = call.result
    return EpisodeCall(
        call_id=call.call_id,
        name=call.name,
        arguments=call.arguments,
        idempotency_key=call.idempotency_key,
        turn=call.turn,
        offset=offset,
        observation_tokens=call.observation_tokens,
        env_handle="" if result is None else result.env_handle,
        env_revision="" if result is None else result.env_revision,
        seconds=call.seconds,
        outcome=_outcome(state, call),
        claims=tuple(_claim(c) for c in call.claims),
        requested_at=call.requested_at,
    )


def _value(v: StrEnum | None) -> str | None:
    return None if v is None else v.value


def _outcome(state: RolloutState, call: ToolCall) -> CallOutcome:
    if call.result is not None:
        return CallOutcome.RESULT
    if not state.terminal:
        return CallOutcome.PENDING
    return CallOutcome.FAILED if state.status is Status.FAILED else CallOutcome.ABANDONED


def _claim(c: Claim) -> EpisodeClaim:
    if c.end is ClaimEnd.FAILED:
        fatal = c.failure is ToolFailure.ENV_FATAL
        outcome: ClaimOutcome | None = ClaimOutcome.ENV_FATAL if fatal else ClaimOutcome.ENV_ERROR
    else:
        outcome = None if c.end is None else ClaimOutcome(c.end.value)
    return EpisodeClaim(claim=c.claim, runner_id=c.runner_id, outcome=outcome,
                        seconds=c.seconds, error=c.error, decision=c.decision,
                        claimed_at=c.claimed_at, ended_at=c.ended_at)  # fmt: skip


def _spread(sampled: npt.NDArray[Any], positions: npt.NDArray[np.int64], length: int) -> Any:
    """Rows of a per-sampled-token array placed at their context positions; zero elsewhere."""
    out = np.zeros((length, *sampled.shape[1:]), dtype=sampled.dtype)
    out[positions] = sampled
    return out
