"""The state of one rollout: a fold of its events. Derived values are computed, never stored."""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from statemachine.arrays import LOGPROB_DTYPE, TOKEN_DTYPE, VERSION_DTYPE, concat
from statemachine.events import Membership, TokensAppended
from statemachine.request import DEFAULT_QUEUE, RolloutRequest, SamplingParams
from statemachine.status import LIVE, TERMINAL, AbortReason, FailureClass, FinishReason, Status
from statemachine.tool_calls import ToolCall

# Frozen, so one instance may be every legacy state's default.
_NO_BATCH = Membership()


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutState:
    rollout_id: str
    seq: int
    status: Status
    request: RolloutRequest
    submitted_at: float = 0.0
    admitted_version: int = 0  # newest published weights when it was submitted
    queue: str = DEFAULT_QUEUE  # the rq queue it was submitted to; every requeue goes there
    membership: Membership = _NO_BATCH  # its batch, group and sample
    model: str = ""  # the model its attempts run ("" until one starts, or if unrecorded)
    attempt: int = 0  # number of the latest attempt; 0 until the first start
    worker_id: str | None = None  # worker of the latest attempt
    weight_version: int | None = None  # weights the latest attempt started on
    num_tokens: int = 0
    # The appended chunks themselves: one copy of the token data, shared with the events.
    chunks: tuple[TokensAppended, ...] = ()
    # An episode's tool calls, each placed after the sampled tokens before it (``offset``),
    # with its claims, outcome and observation (episode.py, tool_calls.py). () for a plain one.
    calls: tuple[ToolCall, ...] = ()
    aborts: int = 0
    abort_reason: AbortReason | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    failure: FailureClass | None = None  # set when failed

    __hash__ = None  # type: ignore[assignment]  # holds a request with a metadata dict

    def evolve(self, **changes: Any) -> RolloutState:
        """``dataclasses.replace`` without its per-call introspection: ``apply`` runs once per
        appended chunk on the worker's hot path, where replace() measured 2x slower."""
        values = list(_VALUES(self))
        for name, value in changes.items():
            index = _INDEX.get(name)
            if index is None:
                raise TypeError(f"RolloutState has no field {name!r}")
            values[index] = value
        new = object.__new__(RolloutState)
        # The slots' own setters: a frozen dataclass's __setattr__ refuses, and these are what
        # object.__setattr__ would look up for every field (3.2-4.4 -> 3.0 us a call, measured).
        for put, value in zip(_SETTERS, values, strict=True):
            put(new, value)
        return new

    # -- status -----------------------------------------------------------------------------
    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def live_attempt(self) -> int:
        """The attempt allowed to write now, or 0 when no attempt is running."""
        return self.attempt if self.status in LIVE else 0

    # -- derived token data -------------------------------------------------------------------
    @property
    def token_ids(self) -> npt.NDArray[np.int32]:
        result: npt.NDArray[np.int32] = concat([c.token_ids for c in self.chunks], TOKEN_DTYPE)
        return result

    @property
    def logprobs(self) -> npt.NDArray[np.float32]:
        result: npt.NDArray[np.float32] = concat([c.logprobs for c in self.chunks], LOGPROB_DTYPE)
        return result

    @property
    def weight_versions(self) -> npt.NDArray[np.int64]:
        parts = [c.weight_versions for c in self.chunks]
        result: npt.NDArray[np.int64] = concat(parts, VERSION_DTYPE)
        return result

    @property
    def routed_experts(self) -> npt.NDArray[Any] | None:
        """``[tokens, layers, top_k]`` for MoE rollouts, None when no chunk carried routes."""
        routes = [c.routed_experts for c in self.chunks if c.routed_experts is not None]
        if not routes:
            return None
        widest = max((r.dtype for r in routes), key=lambda d: d.itemsize)
        result: npt.NDArray[Any] = np.concatenate([r.astype(widest, copy=False) for r in routes])
        return result

    @property
    def top_token_ids(self) -> npt.NDArray[np.int32] | None:
        """``[tokens, k]``: each token's k most likely tokens, most likely first; None when the
        request asked for none (``logprobs=0``). Every chunk of a rollout that asked carries
        them (``transitions`` refuses one that does not)."""
        k = self.request.sampling.logprobs
        if not k:
            return None
        result: npt.NDArray[np.int32] = concat(
            [c.top_token_ids for c in self.chunks if c.top_token_ids is not None], TOKEN_DTYPE, (k,)
        )
        return result

    @property
    def top_logprobs(self) -> npt.NDArray[np.float32] | None:
        """``[tokens, k]``: the raw logprobs of ``top_token_ids``; None when none were asked."""
        k = self.request.sampling.logprobs
        if not k:
            return None
        result: npt.NDArray[np.float32] = concat(
            [c.top_logprobs for c in self.chunks if c.top_logprobs is not None], LOGPROB_DTYPE, (k,)
        )
        return result

    @property
    def nonfinite_logprobs(self) -> int:
        """How many logprobs were NaN/inf from the engine and stored as the floor."""
        return sum(c.nonfinite_logprobs for c in self.chunks)

    def too_stale(self, weight_version: int) -> bool:
        """Whether weights ``weight_version`` are beyond the request's ``max_staleness``."""
        bound = self.request.max_staleness
        return bound is not None and weight_version - self.admitted_version > bound

    # -- an episode's context: sampled and observation tokens in the order fed to the engine ---
    @property
    def pending_call(self) -> ToolCall | None:
        """The call the episode waits on (requested, its result not recorded), if any."""
        last = self.calls[-1] if self.calls else None
        return last if last is not None and last.result is None else None

    @property
    def observation_tokens(self) -> int:
        return sum(c.observation_tokens for c in self.calls)

    @property
    def context_tokens(self) -> int:
        """Sampled plus observation tokens: what ``max_total_tokens`` bounds."""
        return self.num_tokens + self.observation_tokens

    @property
    def tool_seconds(self) -> float:
        """Run time of every claim of every call, as their runners reported it."""
        return sum(c.seconds for c in self.calls)

    @property
    def context_token_ids(self) -> npt.NDArray[np.int32]:
        """Every sampled and observation token (prompt excluded), in the order fed to the
        engine: each observation right after the sampled tokens of the turn that called it."""
        ids = self.token_ids
        return ids if not self.calls else self._interleave(ids, None, TOKEN_DTYPE)

    @property
    def loss_mask(self) -> npt.NDArray[np.uint8]:
        """Aligned with ``context_token_ids``: 1 for a sampled token, 0 for an observation's."""
        ones = np.ones(self.num_tokens, dtype=np.uint8)
        return ones if not self.calls else self._interleave(ones, 0, np.dtype(np.uint8))

    @property
    def context_weight_versions(self) -> npt.NDArray[np.int64]:
        """Aligned with ``context_token_ids``: the weights that sampled each token; -1 for an
        observation's (no weights sampled it)."""
        vers = self.weight_versions
        return vers if not self.calls else self._interleave(vers, -1, VERSION_DTYPE)

    @property
    def context_logprobs(self) -> npt.NDArray[np.float32]:
        """Aligned with ``context_token_ids``: each sampled token's logprob; 0.0 for an
        observation's (masked out by ``loss_mask``; 0 is what trainers pad with)."""
        lps = self.logprobs
        return lps if not self.calls else self._interleave(lps, 0.0, LOGPROB_DTYPE)

    @property
    def sampled_positions(self) -> npt.NDArray[np.int64]:
        """Where each sampled token sits in ``context_token_ids``: after every observation
        recorded at or before its offset (calls are in offset order; a turn's tokens follow
        its observation)."""
        positions = np.arange(self.num_tokens, dtype=np.int64)
        for call in self.calls:
            if call.observation_tokens:
                positions[call.offset :] += call.observation_tokens
        return positions

    def context_routes(self) -> tuple[npt.NDArray[Any] | None, npt.NDArray[np.bool_] | None]:
        """The routed experts aligned with ``context_token_ids`` ``[tokens, layers, top_k]``
        (in the widest dtype any chunk used), and which rows are present: a sampled token's
        when its chunk carried routes, an observation's when the next turn's first chunk
        carried the turn's prefill routes (``TokensAppended.observation_routes``). Absent rows
        are zero. Placed chunk by chunk (not through ``routed_experts``' concatenation), so a
        chunk without routes leaves its rows absent instead of shifting the rows after it.
        ``(None, None)`` when no chunk carried routes (a dense model)."""
        routed = [c for c in self.chunks if c.routed_experts is not None]
        observed = [c for c in self.chunks if c.observation_routes is not None]
        arrays = [c.routed_experts for c in routed] + [c.observation_routes for c in observed]
        if not arrays:
            return None, None
        widest = max((a.dtype for a in arrays), key=lambda d: d.itemsize)  # type: ignore[union-attr]
        length = self.context_tokens
        routes = np.zeros((length, *arrays[0].shape[1:]), dtype=widest)  # type: ignore[union-attr]
        present = np.zeros(length, dtype=np.bool_)
        positions = self.sampled_positions
        for chunk in routed:
            at = positions[chunk.offset : chunk.offset + len(chunk)]
            routes[at] = chunk.routed_experts
            present[at] = True
        for chunk in observed:
            # The observation ends right where the chunk's first token sits.
            end = int(positions[chunk.offset])
            rows = chunk.observation_routes
            assert rows is not None
            routes[end - len(rows) : end] = rows
            present[end - len(rows) : end] = True
        return routes, present

    @property
    def turns(self) -> tuple[tuple[int, int], ...]:
        """Each turn's sampled tokens as ``[start, end)`` of ``context_token_ids``: one per
        call (the turn that ended at it), then the turn after the last call if it is under way
        or produced tokens. A turn that ended without a token (failed or cancelled at once) is
        not listed."""
        spans: list[tuple[int, int]] = []
        start = sampled = 0
        for call in self.calls:
            end = start + call.offset - sampled
            spans.append((start, end))
            start, sampled = end + call.observation_tokens, call.offset
        if self.num_tokens > sampled or (self.status in LIVE or self.status is Status.ABORTED):
            spans.append((start, start + self.num_tokens - sampled))
        return tuple(spans)

    def _interleave(
        self, sampled: npt.NDArray[Any], fill: float | None, dtype: np.dtype[Any]
    ) -> Any:
        parts: list[npt.NDArray[Any]] = []
        done = 0
        for call in self.calls:
            if call.result is None:
                continue
            parts.append(sampled[done : call.offset])
            obs = call.result.observation_token_ids
            parts.append(obs if fill is None else np.full(len(obs), fill, dtype=dtype))
            done = call.offset
        parts.append(sampled[done:])
        return concat(parts, dtype).astype(dtype, copy=False)

    # -- what a resume needs ------------------------------------------------------------------
    @property
    def harness(self) -> bool:
        """Whether it is a harness-driven episode (``EpisodeSpec.harness``)."""
        episode = self.request.episode
        return episode is not None and episode.harness

    @property
    def turn_sampled(self) -> int:
        """Sampled tokens of the turn under way (since the last call; all of a plain one's)."""
        return self.num_tokens - (self.calls[-1].offset if self.calls else 0)

    @property
    def turn_sampling(self) -> SamplingParams:
        """The sampling the turn under way asked for: a harness-driven episode's turn has its
        call's own (``TurnRequested.sampling``; the first turn's is the request's); every
        other rollout has the request's for its whole length."""
        last = self.calls[-1] if self.calls else None
        if self.harness and last is not None and last.result is not None:
            return last.result.sampling  # type: ignore[union-attr]  # a TurnRequested
        return self.request.sampling

    @property
    def remaining_tokens(self) -> int:
        """Sampled tokens the rollout may still produce: ``max_tokens`` less those so far (for
        a harness-driven episode, the turn's own ``max_tokens`` less the turn's tokens), and
        for an episode no more than its context leaves (``max_total_tokens``)."""
        if self.harness:
            remaining = self.turn_sampling.max_tokens - self.turn_sampled
        else:
            remaining = self.request.sampling.max_tokens - self.num_tokens
        episode = self.request.episode
        if episode is not None and episode.max_total_tokens is not None:
            remaining = min(remaining, episode.max_total_tokens - self.context_tokens)
        return remaining

    def resume_prompt(self) -> tuple[int, ...]:
        """The prompt to send on a resume (or an episode's next turn): the original prompt
        followed by the context so far, observations included, byte for byte as fed before."""
        return self.request.prompt_token_ids + tuple(self.context_token_ids.tolist())

    def resume_sampling(self) -> SamplingParams:
        """Sampling params for the rest of the rollout: budgets count over the whole rollout
        (over the turn, for a harness-driven episode's turn)."""
        s = self.turn_sampling
        remaining = self.remaining_tokens
        if remaining < 1:
            raise ValueError(f"rollout {self.rollout_id!r} has no token budget left")
        sampled = self.turn_sampled if self.harness else self.num_tokens
        return replace(
            s,
            max_tokens=remaining,
            min_tokens=min(remaining, max(0, s.min_tokens - sampled)),
        )


_FIELDS = tuple(f.name for f in fields(RolloutState))
_VALUES = operator.attrgetter(*_FIELDS)
_SETTERS = tuple(getattr(RolloutState, name).__set__ for name in _FIELDS)
_INDEX = {name: i for i, name in enumerate(_FIELDS)}
