"""The body of ``GET /v1/sessions/{session_id}/trajectory`` (``store.trajectory``): a session's
calls as one trajectory, in segments that never splice a call whose prompt does not extend the
one before. Apart from ``schemas`` so that module stays readable in one sitting."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .fields import NonNegInt, PackedArray, StateName, Strict


class TrajectoryCall(Strict):
    """A call in its segment: the rollout followed (``sample``: its index among the call's
    rollouts), its state, and where its tokens sit in the segment's ``token_ids``."""

    batch_id: str
    rollout_id: str
    sample: NonNegInt
    status: StateName
    start: NonNegInt = Field(description="where the tokens its prompt added begin (loss 0)")
    response_start: NonNegInt = Field(description="where its response begins (loss 1)")
    end: NonNegInt


class TrajectorySegment(Strict):
    """Calls that each extend the one before: a prompt, then per call the tokens its prompt
    added (loss_mask 0, logprob 0.0, weight version -1) and its response."""

    start: Literal["first", "not_extended", "after_gone"] = Field(
        description="why it starts: the first call; a call whose prompt does not extend the "
        "previous context; a call after one acknowledged or expired"
    )
    prompt_token_ids: PackedArray
    token_ids: PackedArray = Field(description="int32: every token after the prompt")
    loss_mask: PackedArray = Field(description="uint8: 1 for a sampled token, 0 otherwise")
    logprobs: PackedArray = Field(description="float32, 0.0 where not sampled")
    weight_versions: PackedArray = Field(description="int64, -1 where not sampled")
    turns: list[Annotated[list[NonNegInt], Field(min_length=2, max_length=2)]] = Field(
        description="[start, end) of each span of sampled tokens"
    )
    calls: list[TrajectoryCall]


class Trajectory(Strict):
    """A session's calls as one trajectory; ``breaks``: the index (among the calls of every
    segment, in order) of each call that starts a segment after the first."""

    session_id: str
    status: Literal["empty", "running", "done", "failed"]
    segments: list[TrajectorySegment]
    breaks: list[NonNegInt]
    gone: list[str] = Field(description="calls (batch ids) acknowledged or expired")
