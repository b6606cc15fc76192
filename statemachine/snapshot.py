"""Stored form of a snapshot head: the mutable scalars of a state, framed like an event.

The request lives in the Submitted record, the token data in the log's TokensAppended records
and an episode's calls in its tool-call records, so nothing is stored twice and a snapshot
update stays a few dozen bytes however long the prompt, the rollout or the episode.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack

from statemachine.episode_events import ToolEvent
from statemachine.errors import CorruptRecord, UnsupportedSchema
from statemachine.events import Submitted, TokensAppended
from statemachine.framing import SNAPSHOT_MAGIC, frame, unframe, unpack
from statemachine.rollout_state import RolloutState
from statemachine.status import AbortReason, FailureClass, FinishReason, Status
from statemachine.tool_calls import replay

# v2 appends the model of the rollout's attempts; a v1 head decodes with model "" (unknown).
# v3 appends the failure class of a failed rollout; a v2 head infers it (``legacy_failure``).
# v4 is v3's layout, written only for a head whose abort reason is ``paused`` (``encode_snapshot``):
# code that predates the reason refuses such a head as newer (``UnsupportedSchema``, left to a
# newer worker) instead of calling it corrupt; every other head is still written as v3.
# v5 is v3's layout too, written for every head of an episode (its states, finish reasons and
# failure classes are newer than v4): code that predates episodes leaves it to a newer worker.
SNAPSHOT_SCHEMA = 5
_SNAPSHOT_READ = frozenset({3, 4, 5})


def legacy_failure(error: str | None) -> FailureClass:
    """The failure class of a failure recorded before classes were: the worker wrote
    "unreadable record: ..." for records it could not decode; every other failure then was a
    rollout that used up its engine-error budget."""
    if (error or "").startswith("unreadable record"):
        return FailureClass.UNREADABLE
    return FailureClass.ENGINE_ERROR


def _version(state: RolloutState) -> int:
    if state.request.episode is not None:
        return 5
    return 4 if state.abort_reason is AbortReason.PAUSED else 3


def encode_snapshot(state: RolloutState) -> bytes:
    body = msgpack.packb(
        [
            _version(state),
            state.rollout_id,
            state.seq,
            state.status.value,
            state.attempt,
            state.worker_id,
            state.weight_version,
            state.num_tokens,
            state.aborts,
            None if state.abort_reason is None else state.abort_reason.value,
            None if state.finish_reason is None else state.finish_reason.value,
            state.stop_reason,
            state.error,
            state.model,
            None if state.failure is None else state.failure.value,
        ],
        use_bin_type=True,
    )
    return frame(SNAPSHOT_MAGIC, body)


def decode_snapshot(
    record: bytes,
    submitted: Submitted,
    chunks: tuple[TokensAppended, ...] = (),
    tool_events: Sequence[ToolEvent] = (),
) -> RolloutState:
    """The state a snapshot head describes, completed by the rollout's Submitted event and
    (when the caller wants token data) its TokensAppended events and, for an episode, its
    tool-call events in log order (without them the state has no ``calls``)."""
    rollout_id = submitted.rollout_id
    body = unframe(SNAPSHOT_MAGIC, record, rollout_id, None)
    try:
        fields = unpack(body)
        if isinstance(fields, list) and len(fields) == 13 and fields[0] == 1:
            fields = [2, *fields[1:], ""]  # v1 -> v2: the model was not recorded
        if isinstance(fields, list) and len(fields) == 14 and fields[0] == 2:
            # v2 -> v3: the failure class was not recorded.
            legacy = legacy_failure(fields[12]).value if fields[3] == "failed" else None
            fields = [3, *fields[1:], legacy]
        (
            version,
            rid,
            seq,
            status,
            attempt,
            worker_id,
            weight_version,
            num_tokens,
            aborts,
            abort_reason,
            finish_reason,
            stop_reason,
            error,
            model,
            failure,
        ) = fields
    except (TypeError, ValueError):
        # Wrong arity: the head was not written by this code.
        raise CorruptRecord("bad snapshot layout", rollout_id=rollout_id) from None
    if version not in _SNAPSHOT_READ:
        raise UnsupportedSchema(f"snapshot schema v{version}", rollout_id=rollout_id, seq=seq)
    if rid != rollout_id:
        raise CorruptRecord(f"snapshot says rollout {rid!r}", rollout_id=rollout_id)
    try:
        calls = replay(tool_events)
    except IndexError:
        # A claim's event with no call before it, or an outcome with no claim: not a log
        # the transitions accepted.
        raise CorruptRecord("tool-call records out of order", rollout_id=rollout_id) from None
    try:
        return RolloutState(
            rollout_id=rid,
            seq=seq,
            status=Status(status),
            request=submitted.request,
            submitted_at=submitted.at,
            admitted_version=submitted.admitted_version,
            queue=submitted.queue,
            membership=submitted.membership,
            model=model,
            attempt=attempt,
            worker_id=worker_id,
            weight_version=weight_version,
            num_tokens=num_tokens,
            chunks=chunks,
            calls=calls,
            aborts=aborts,
            abort_reason=None if abort_reason is None else AbortReason(abort_reason),
            finish_reason=None if finish_reason is None else FinishReason(finish_reason),
            stop_reason=stop_reason,
            error=error,
            failure=None if failure is None else FailureClass(failure),
        )
    except ValueError as exc:
        # An enum value this code does not know.
        raise CorruptRecord(f"bad snapshot: {exc}", rollout_id=rollout_id, seq=seq) from None


def snapshot_status(record: bytes, *, rollout_id: str | None = None) -> str:
    """Just the status of a snapshot head, without building the state (for cheap polling)."""
    body = unframe(SNAPSHOT_MAGIC, record, rollout_id, None)
    try:
        status = unpack(body)[3]
        return Status(status).value
    except (TypeError, ValueError, IndexError):
        # Not a head this code wrote.
        raise CorruptRecord("bad snapshot layout", rollout_id=rollout_id) from None
