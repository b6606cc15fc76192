"""What a trainer gets back for a rollout: a finished trajectory, as plain arrays."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from statemachine import FailureClass, FinishReason, RolloutState, Status
from store import episode_results
from store.episode_results import EpisodeCall


def version_segments(versions: npt.NDArray[np.int64]) -> list[tuple[int, int, int]]:
    if len(versions) == 0:
        return []
    cuts = np.flatnonzero(np.diff(versions)) + 1
    starts = [0, *cuts.tolist()]
    ends = [*cuts.tolist(), len(versions)]
    return [(int(versions[s]), s, e) for s, e in zip(starts, ends, strict=True)]


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RolloutResult:
    rollout_id: str
    status: Status
    prompt_token_ids: tuple[int, ...]
    response_token_ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]
    weight_versions: npt.NDArray[np.int64]
    routed_experts: npt.NDArray[Any] | None  # [tokens, moe_layers, top_k], or None if dense
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    text: str | None  # decoded from all response ids at once, never from chunk texts
    error: str | None
    attempts: int
    aborts: int
    nonfinite_logprobs: int
    group_id: str | None
    metadata: dict[str, Any]
    admitted_version: int = 0
    max_staleness: int | None = None
    failure: FailureClass | None = None  # why it failed (request_error, engine_error, ...)
    batch_id: str = ""
    group_index: int = 0
    sample_index: int = 0
    group_size: int = 1
    # Where its completion sits in its batch's completion stream: pass it as ``after=`` to
    # re-attach after it ("" when the result was not read from a stream).
    position: str = ""
    # ``[tokens, k]`` for a request with ``logprobs=k``: each token's k most likely tokens,
    # most likely first (the sampled one among them when it ranks within k), and their raw
    # logprobs; None when the request asked for none.
    top_token_ids: npt.NDArray[np.int32] | None = None
    top_logprobs: npt.NDArray[np.float32] | None = None
    # An episode's own (None for a plain rollout; store/episode_results.py): every array above
    # then spans the whole context after the prompt, sampled and observation tokens in the
    # order the engine was fed them. ``loss_mask`` (uint8) is 1 for a sampled token, 0 for an
    # observation's; ``turns`` the ``[start, end)`` spans of each turn's sampled tokens;
    # ``tool_calls`` each call with its claims, outcome and where its observation starts;
    # ``routes_present`` (bool, with ``routed_experts``) which rows hold routes.
    loss_mask: npt.NDArray[np.uint8] | None = None
    turns: tuple[tuple[int, int], ...] | None = None
    tool_calls: tuple[EpisodeCall, ...] | None = None
    routes_present: npt.NDArray[np.bool_] | None = None

    @property
    def stale(self) -> bool:
        """Policy "keep and flag": True when some token was sampled by weights more than
        ``max_staleness`` versions ahead of the admitted version (e.g. a ``keep``-mode update
        landed mid-generation). The tokens are kept; the trainer decides."""
        if self.max_staleness is None or len(self.weight_versions) == 0:
            return False
        return int(self.weight_versions.max()) - self.admitted_version > self.max_staleness

    @property
    def version_segments(self) -> list[tuple[int, int, int]]:
        """``(version, start, end)`` runs of response tokens sampled by one weight version,
        ``end`` exclusive: ``[(3, 0, 120), (4, 120, 256)]`` for an update after token 120.
        An episode's observation tokens (version -1) are in no segment: a segment is sampled."""
        segments = version_segments(self.weight_versions)
        return segments if self.loss_mask is None else [s for s in segments if s[0] >= 0]

    @classmethod
    def unreadable(cls, rollout_id: str, error: str, position: str = "") -> RolloutResult:
        """A rollout whose records cannot be decoded: reported as that rollout's failure, so
        one damaged record never hides a whole batch's results."""
        return cls(
            rollout_id=rollout_id,
            status=Status.FAILED,
            prompt_token_ids=(),
            response_token_ids=np.zeros(0, np.int32),
            logprobs=np.zeros(0, np.float32),
            weight_versions=np.zeros(0, np.int64),
            routed_experts=None,
            finish_reason=None,
            stop_reason=None,
            text=None,
            error=f"unreadable record: {error}",
            attempts=0,
            aborts=0,
            nonfinite_logprobs=0,
            group_id=None,
            metadata={},
            failure=FailureClass.UNREADABLE,
            position=position,
        )

    @classmethod
    def from_state(
        cls, state: RolloutState, tokenizer: Tokenizer | None = None, position: str = ""
    ) -> RolloutResult:
        # An episode's arrays span its whole context, with its own fields beside them.
        per_token: dict[str, Any] = (
            episode_results.fields(state)
            if state.request.episode is not None
            else {
                "response_token_ids": state.token_ids,
                "logprobs": state.logprobs,
                "weight_versions": state.weight_versions,
                "routed_experts": state.routed_experts,
                "top_token_ids": state.top_token_ids,
                "top_logprobs": state.top_logprobs,
            }
        )
        ids = per_token["response_token_ids"]
        # Decoding all ids at once (not joining per-chunk texts) keeps multi-byte characters
        # and merges across checkpoint or resume boundaries intact.
        text = tokenizer.decode(ids.tolist(), skip_special_tokens=True) if tokenizer else None
        return cls(
            rollout_id=state.rollout_id,
            status=state.status,
            prompt_token_ids=state.request.prompt_token_ids,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            text=text,
            error=state.error,
            attempts=state.attempt,
            aborts=state.aborts,
            nonfinite_logprobs=state.nonfinite_logprobs,
            group_id=state.request.group_id,
            metadata=dict(state.request.metadata),
            admitted_version=state.admitted_version,
            max_staleness=state.request.max_staleness,
            failure=state.failure,
            batch_id=state.membership.batch_id,
            group_index=state.membership.group_index,
            sample_index=state.membership.sample_index,
            group_size=state.membership.group_size,
            position=position,
            **per_token,
        )


@dataclass(frozen=True, slots=True)
class GroupResult:
    """The samples of one prompt, in sample order, once every one of them ended."""

    batch_id: str
    group_index: int
    results: list[RolloutResult]
    group_size: int

    @property
    def complete(self) -> bool:
        """False only for a group some of whose samples were acknowledged or expired before
        they could be delivered (it is yielded last, with what is left)."""
        return len(self.results) == self.group_size

    @property
    def rollout_ids(self) -> list[str]:
        return [r.rollout_id for r in self.results]
