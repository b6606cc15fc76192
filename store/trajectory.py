"""A session's calls as one trajectory: what a harness that runs its own tools (chat with
``tools``, or turns of one ``X-Session-ID``) made of the model, ready to train on.

Each call of a session is a rollout of its own, recorded whole (its prompt is the whole
conversation so far). Read in order, they are one trajectory: the first call's prompt, then
per call the tokens its prompt adds beyond the previous call's prompt and response (the tool
results and template tokens the harness appended: ``loss_mask`` 0, logprob 0.0, weight
version -1, as an episode's observation tokens) and its response (``loss_mask`` 1, its
logprobs and per-token weight versions; an episode's response keeps its own mask). ``turns``
are the ``[start, end)`` spans of sampled tokens.

A harness's calls under one session are the turns of one harness-driven episode
(``store.harness_turns``), which records only the tokens each call's prompt adds; each call is
read here as its turn (``store.turn_results``), so a trajectory reads the same either way.

A call whose prompt does not extend the previous call's context (the harness dropped or
rewrote history, retokenized a response differently, or summarized) starts a new ``Segment``
with the reason; nothing is spliced. A call of ``n`` samples is followed through the sample
the next call's prompt extends (the first such), else sample 0; ``TrajectoryCall.sample``
says which. A call still running contributes its tokens so far (the session's ``status`` is
then ``running``); a call whose rollouts were acknowledged or expired is listed in ``gone``,
and the call after it starts a segment saying so (what the gone call sampled is in its
prompt, but could no longer be told from what was fed).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import numpy.typing as npt
from redis.asyncio import Redis

from statemachine import TERMINAL, Status
from store import sessions
from store.batches import BatchInfo
from store.keys import Keys
from store.results import RolloutResult
from store.turn_results import is_harness, turn_result

OBSERVED_VERSION = -1  # the weight version of a token no weights sampled (as an episode's)


class SegmentStart(StrEnum):
    """Why a segment starts where it does."""

    FIRST = "first"  # the session's first call
    NOT_EXTENDED = "not_extended"  # the call's prompt does not extend the previous context
    AFTER_GONE = "after_gone"  # a call before it is gone (acknowledged or expired)


class SessionStatus(StrEnum):
    EMPTY = "empty"  # no call recorded (an unknown session, or every call gone)
    RUNNING = "running"  # some rollout of the session has not ended
    DONE = "done"  # every followed call ended done
    FAILED = "failed"  # some followed call failed or was cancelled


@dataclass(frozen=True, slots=True, kw_only=True)
class TrajectoryCall:
    """One call in its segment: its batch, the rollout followed (``sample``: its index among
    the call's rollouts) and its state; the tokens its prompt added are ``[start,
    response_start)`` of the segment's ``token_ids``, its response ``[response_start, end)``."""

    batch_id: str
    rollout_id: str
    sample: int
    status: str
    start: int
    response_start: int
    end: int


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Segment:
    """Calls that each extend the one before: a prompt and aligned per-token arrays after it."""

    start: SegmentStart
    prompt_token_ids: tuple[int, ...]
    token_ids: npt.NDArray[np.int32]
    loss_mask: npt.NDArray[np.uint8]
    logprobs: npt.NDArray[np.float32]
    weight_versions: npt.NDArray[np.int64]
    turns: tuple[tuple[int, int], ...]  # spans of sampled tokens
    calls: tuple[TrajectoryCall, ...]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Trajectory:
    session_id: str
    status: SessionStatus
    segments: tuple[Segment, ...]
    gone: tuple[str, ...] = ()  # calls (batch ids) acknowledged or expired

    @property
    def breaks(self) -> list[int]:
        """Where a segment after the first starts, as the index of its first call among the
        calls listed (every segment's, in order)."""
        out, at = [], 0
        for seg in self.segments:
            if at:
                out.append(at)
            at += len(seg.calls)
        return out


@dataclass
class _Builder:
    """One segment as it grows."""

    start: SegmentStart
    prompt: list[int]
    parts: dict[str, list[npt.NDArray[np.generic]]] = field(
        default_factory=lambda: {"ids": [], "mask": [], "lps": [], "vs": []}
    )
    turns: list[tuple[int, int]] = field(default_factory=list)
    calls: list[TrajectoryCall] = field(default_factory=list)
    length: int = 0
    context: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.context = list(self.prompt)

    def extends(self, prompt: Sequence[int]) -> bool:
        return len(prompt) >= len(self.context) and list(prompt[: len(self.context)]) == (
            self.context
        )

    def add(self, r: RolloutResult, batch_id: str, sample: int) -> None:
        added = np.asarray(r.prompt_token_ids[len(self.context) :], dtype=np.int32)
        resp = r.response_token_ids.astype(np.int32)
        mask = np.ones(len(resp), np.uint8) if r.loss_mask is None else r.loss_mask
        start, response_start = self.length, self.length + len(added)
        self._put(added, np.zeros(len(added), np.uint8), np.zeros(len(added), np.float32),
                  np.full(len(added), OBSERVED_VERSION, np.int64))  # fmt: skip
        self._put(resp, mask.astype(np.uint8), r.logprobs.astype(np.float32),
                  r.weight_versions.astype(np.int64))  # fmt: skip
        inner = r.turns if r.turns is not None else ((0, len(resp)),) if len(resp) else ()
        self.turns += [(response_start + a, response_start + b) for a, b in inner]
        self.calls.append(TrajectoryCall(
            batch_id=batch_id, rollout_id=r.rollout_id, sample=sample, status=r.status.value,
            start=start, response_start=response_start, end=self.length))  # fmt: skip
        self.context = [*r.prompt_token_ids, *resp.tolist()]

    def _put(self, *arrays: npt.NDArray[np.generic]) -> None:
        for name, a in zip(("ids", "mask", "lps", "vs"), arrays, strict=True):
            self.parts[name].append(a)
        self.length += len(arrays[0])

    def segment(self) -> Segment:
        def cat(name: str, dtype: type) -> npt.NDArray[np.generic]:
            out: npt.NDArray[np.generic] = np.concatenate([np.zeros(0, dtype), *self.parts[name]])
            return out.astype(dtype)

        return Segment(
            start=self.start, prompt_token_ids=tuple(self.prompt),
            token_ids=cat("ids", np.int32), loss_mask=cat("mask", np.uint8),  # type: ignore[arg-type]
            logprobs=cat("lps", np.float32), weight_versions=cat("vs", np.int64),  # type: ignore[arg-type]
            turns=tuple(self.turns), calls=tuple(self.calls),
        )  # fmt: skip


Call = tuple[BatchInfo, list[RolloutResult]]  # a call's record, the results still there


def build(session_id: str, listed: Sequence[str], calls: Mapping[str, Call]) -> Trajectory:
    """The trajectory of the calls ``listed`` in order (batch ids; see the module's
    docstring); ``calls``: those recorded, with the results of their rollouts that are still
    there. A listed call with none is gone."""
    present = [(b, *calls[b]) for b in listed if b in calls and calls[b][1]]
    gone = tuple(b for b in listed if b not in calls or not calls[b][1])
    segments: list[_Builder] = []
    for i, (batch_id, info, results) in enumerate(present):
        nxt = present[i + 1][2][0].prompt_token_ids if i + 1 < len(present) else None
        r = _follow(results, nxt)
        current = segments[-1] if segments else None
        # Calls listed between this one and the previous one present are gone: what they
        # sampled, now in this call's prompt, could no longer be told from what was fed.
        after_gone = current is not None and listed.index(batch_id) - listed.index(
            present[i - 1][0]) > 1  # fmt: skip
        if current is None or after_gone or not current.extends(r.prompt_token_ids):
            start = (SegmentStart.FIRST if current is None else SegmentStart.AFTER_GONE
                     if after_gone else SegmentStart.NOT_EXTENDED)  # fmt: skip
            current = _Builder(start, list(r.prompt_token_ids))
            segments.append(current)
        current.add(r, batch_id, info.ids.index(r.rollout_id))
    every = [r for _, _, results in present for r in results]
    followed = [c for seg in segments for c in seg.calls]
    return Trajectory(session_id=session_id, status=_status(every, followed),
                      segments=tuple(s.segment() for s in segments), gone=gone)  # fmt: skip


def _follow(results: list[RolloutResult], nxt: tuple[int, ...] | None) -> RolloutResult:
    """The sample the next call's prompt extends (the first such), else the first."""
    if nxt is not None:
        for r in results:
            context = (*r.prompt_token_ids, *r.response_token_ids.tolist())
            if nxt[: len(context)] == context:
                return r
    return results[0]


def _status(every: list[RolloutResult], followed: list[TrajectoryCall]) -> SessionStatus:
    if not followed:
        return SessionStatus.EMPTY
    if any(r.status not in TERMINAL for r in every):
        return SessionStatus.RUNNING
    if any(c.status != Status.DONE.value for c in followed):
        return SessionStatus.FAILED
    return SessionStatus.DONE


Results = Callable[..., Awaitable[list[RolloutResult]]]


async def load_trajectory(
    redis: Redis, keys: Keys, session_id: str, results: Results
) -> Trajectory:
    """``RolloutClient.trajectory``: the session's calls and their rollouts' results
    (``results(ids, skip_gone=True)``: those still there), built into one trajectory."""
    # A listed call with no record is gone: acknowledged or expired whole (or noted by a
    # submit that crashed before it recorded the call: store.sessions).
    listed = await sessions.batch_ids(redis, keys, session_id)
    found = await sessions.calls(redis, keys, session_id)
    ids = list(dict.fromkeys(rid for _, _, info in found for rid in info.ids))
    by_id = {r.rollout_id: r for r in await results(ids, skip_gone=True)}
    calls = {b: (info, [_answer(by_id[r], info) for r in info.ids if r in by_id])
             for b, _, info in found}  # fmt: skip
    return build(session_id, listed, calls)


def _answer(r: RolloutResult, info: BatchInfo) -> RolloutResult:
    """What the call ``info`` got: a harness-driven episode's turn (each call of the session
    one turn of it: ``store.harness_turns``), or the rollout's whole result."""
    return turn_result(r, info.turn, info.batch_id) if is_harness(r) else r
