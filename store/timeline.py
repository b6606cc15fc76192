"""A rollout's history as an operator reads it: its events folded into a short timeline.

One entry per event that matters (submitted, each attempt's start or resume, aborts, an
episode's tool calls and their claims, the end);
the token chunks of an attempt are summarized in one entry (tokens per weight version, how
many checkpoints), not a line per chunk. Pure: it reads only the events it is given, so the
same log always gives the same timeline, and ``rollouts show`` needs nothing but ``events``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from statemachine import (
    Aborted,
    Cancelled,
    Event,
    Failed,
    Finished,
    Resumed,
    RolloutState,
    Started,
    Submitted,
    TokensAppended,
    ToolCallClaimed,
    ToolCallFailed,
    ToolCallLost,
    ToolCallRequested,
    ToolResultRecorded,
    fold,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One line of the timeline. ``tokens`` is, by kind: ``checkpoints``: tokens saved in
    this run of chunks; ``resumed``: the saved tokens it continued from; ``aborted``: tokens
    saved when it stopped; ``finished``/``failed``/``cancelled``: tokens in total;
    ``tool_requested``: tokens sampled before the call; ``tool_result``: the observation's."""

    # submitted | started | resumed | checkpoints | aborted | finished | failed | cancelled,
    # and an episode's tool_requested | tool_claimed | tool_result | tool_failed | tool_lost
    kind: str
    seq: int  # the (first) event's position in the log
    at: float  # the (first) event's time
    until: float | None = None  # checkpoints: the last chunk's time
    attempt: int | None = None
    worker_id: str | None = None
    weight_version: int | None = None
    tokens: int = 0
    checkpoints: int = 0
    by_version: dict[int, int] = field(default_factory=dict)
    # checkpoints: when each weight version's first token was saved (where a picture of the
    # attempt changes color: `keep` mode swaps weights under a live attempt)
    version_from: dict[int, float] = field(default_factory=dict)
    reason: str = ""  # abort reason, finish reason, failure class, tool name, lost decision
    detail: str = ""  # abort detail, stop reason, error, cancel reason, a call's arguments
    call_id: str | None = None  # an episode's tool events
    claim: int | None = None
    runner_id: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    rollout_id: str
    state: RolloutState  # the state the events fold to
    batch_id: str
    group_index: int
    sample_index: int
    group_size: int
    prompt_tokens: int
    max_tokens: int
    queue: str
    admitted_version: int
    entries: list[Entry]

    @property
    def by_version(self) -> dict[int, int]:
        """Tokens per weight version over the whole rollout."""
        total: dict[int, int] = {}
        for e in self.entries:
            if e.kind == "checkpoints":
                for v, n in e.by_version.items():
                    total[v] = total.get(v, 0) + n
        return dict(sorted(total.items()))

    def to_dict(self) -> dict[str, Any]:
        s = self.state
        return {
            "rollout_id": self.rollout_id,
            "status": s.status.value,
            "tokens": s.num_tokens,
            "tokens_by_weight_version": {str(v): n for v, n in self.by_version.items()},
            "attempts": s.attempt,
            "batch_id": self.batch_id,
            "group_index": self.group_index,
            "sample_index": self.sample_index,
            "group_size": self.group_size,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "queue": self.queue,
            "admitted_version": self.admitted_version,
            "entries": [_entry_dict(e) for e in self.entries],
        }


def build(events: Sequence[Event]) -> Timeline:
    """The timeline of one rollout's events (its whole log, ``Submitted`` first). The events
    are folded too, so a log that breaks a transition rule raises as a replay would."""
    state = fold(events)
    if state is None or not isinstance(events[0], Submitted):
        raise ValueError("a timeline needs the rollout's log, Submitted first")
    sub = events[0]
    entries: list[Entry] = []
    saved = 0  # tokens in the log so far
    for e in events:
        if isinstance(e, TokensAppended):
            saved += len(e)
            _add_chunk(entries, e)
        else:
            entries.append(_entry(e, saved))
    return Timeline(
        rollout_id=sub.rollout_id,
        state=state,
        batch_id=sub.membership.batch_id,
        group_index=sub.membership.group_index,
        sample_index=sub.membership.sample_index,
        group_size=sub.membership.group_size,
        prompt_tokens=len(sub.request.prompt_token_ids),
        max_tokens=sub.request.sampling.max_tokens,
        queue=sub.queue,
        admitted_version=sub.admitted_version,
        entries=entries,
    )


def _add_chunk(entries: list[Entry], e: TokensAppended) -> None:
    """Fold a chunk into the attempt's current ``checkpoints`` entry, or open one."""
    counts: dict[int, int] = {}
    for v in e.weight_versions.tolist():
        counts[int(v)] = counts.get(int(v), 0) + 1
    last = entries[-1] if entries else None
    if last is not None and last.kind == "checkpoints" and last.attempt == e.attempt:
        merged = dict(last.by_version)
        for v, n in counts.items():
            merged[v] = merged.get(v, 0) + n
        entries[-1] = Entry(
            kind="checkpoints", seq=last.seq, at=last.at, until=e.at, attempt=e.attempt,
            tokens=last.tokens + len(e), checkpoints=last.checkpoints + 1,
            by_version=dict(sorted(merged.items())),
            version_from=dict(sorted({**dict.fromkeys(counts, e.at), **last.version_from}.items())),
        )  # fmt: skip
        return
    entries.append(
        Entry(kind="checkpoints", seq=e.seq, at=e.at, until=e.at, attempt=e.attempt,
              tokens=len(e), checkpoints=1, by_version=dict(sorted(counts.items())),
              version_from=dict.fromkeys(sorted(counts), e.at))
    )  # fmt: skip


def _entry(e: Event, saved: int) -> Entry:
    base: dict[str, Any] = {"seq": e.seq, "at": e.at}
    if isinstance(e, Submitted):
        return Entry(kind="submitted", **base)
    if isinstance(e, Started | Resumed):
        return Entry(
            kind="started" if isinstance(e, Started) else "resumed",
            attempt=e.attempt, worker_id=e.worker_id, weight_version=e.weight_version,
            tokens=saved if isinstance(e, Resumed) else 0, **base,
        )  # fmt: skip
    if isinstance(e, Aborted):
        return Entry(kind="aborted", attempt=e.attempt, tokens=saved, reason=e.reason.value,
                     detail=e.detail, **base)  # fmt: skip
    if isinstance(e, Finished):
        stop = "" if e.stop_reason is None else str(e.stop_reason)
        return Entry(kind="finished", attempt=e.attempt, tokens=saved,
                     reason=e.finish_reason.value, detail=stop, **base)  # fmt: skip
    if isinstance(e, Failed):
        return Entry(kind="failed", attempt=e.attempts, tokens=saved, reason=e.failure.value,
                     detail=e.error, **base)  # fmt: skip
    if isinstance(e, Cancelled):
        return Entry(kind="cancelled", tokens=saved, detail=e.reason, **base)
    if isinstance(e, ToolCallRequested | ToolCallClaimed | ToolResultRecorded | ToolCallFailed
                  | ToolCallLost):  # fmt: skip
        return _tool_entry(e, base)
    # An event type added to the domain but not here yet: shown by name, not dropped.
    return Entry(kind=type(e).__name__.lower(), **base)


def _tool_entry(e: Event, base: dict[str, Any]) -> Entry:
    if isinstance(e, ToolCallRequested):
        return Entry(kind="tool_requested", attempt=e.attempt, tokens=e.offset, reason=e.name,
                     detail=e.arguments, call_id=e.call_id, **base)  # fmt: skip
    if isinstance(e, ToolCallClaimed):
        return Entry(kind="tool_claimed", call_id=e.call_id, claim=e.claim,
                     runner_id=e.runner_id, **base)  # fmt: skip
    if isinstance(e, ToolResultRecorded):
        return Entry(kind="tool_result", call_id=e.call_id, claim=e.claim, tokens=len(e),
                     **base)  # fmt: skip
    if isinstance(e, ToolCallFailed):
        return Entry(kind="tool_failed", call_id=e.call_id, claim=e.claim,
                     reason=e.failure.value, detail=e.error, **base)  # fmt: skip
    assert isinstance(e, ToolCallLost)
    return Entry(kind="tool_lost", call_id=e.call_id, claim=e.claim, reason=e.decision.value,
                 detail=e.detail, **base)  # fmt: skip


def _entry_dict(e: Entry) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": e.kind, "seq": e.seq, "at": e.at}
    optional = {
        "until": e.until, "attempt": e.attempt, "worker_id": e.worker_id,
        "weight_version": e.weight_version, "call_id": e.call_id, "claim": e.claim,
        "runner_id": e.runner_id,
    }  # fmt: skip
    out.update({k: v for k, v in optional.items() if v is not None})
    if e.kind not in {"submitted", "started", "tool_claimed", "tool_failed", "tool_lost"}:
        out["tokens"] = e.tokens
    if e.kind == "checkpoints":
        out["checkpoints"] = e.checkpoints
        out["by_version"] = {str(v): n for v, n in e.by_version.items()}
    if e.reason:
        out["reason"] = e.reason
    if e.detail:
        out["detail"] = e.detail
    return out
