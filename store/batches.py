"""Recording a submission: batch record, rollout records and rq jobs, with nothing stranded.

Order and atomicity (the choice issue 13 asks to explain):

1. Every rollout id is looked up first (pipelined): an id already holding *another* request
   refuses the whole submit before anything is written; one holding the same request (a
   retry) is left as it is.
2. The batch record is created once (``create_batch.lua``); a different submission under the
   same batch id is refused, still before any rollout is written.
3. The new rollouts go in chunks, each chunk one ``MULTI``/``EXEC``: the ``Submitted`` appends,
   their rq jobs, and each job's id beside its rollout's snapshot (``job``, for ``ack``). A
   transaction is applied whole or not at all, so no failure (Redis gone, the process killed)
   can leave a rollout recorded but not enqueued: the stranding of the old submit, which
   recorded everything and then enqueued, cannot happen. The script is loaded inside the same
   transaction, so a Redis restart that emptied the script cache cannot fail the appends while
   the jobs go in.

A retry after a failure between chunks finds the earlier chunks recorded (same requests) and
writes the rest. The one duplicate left possible is two identical submits racing each other,
both past step 1: both enqueue a job for the rollout; the worker's fencing runs it once and
reports the other job superseded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from rq import Queue

from statemachine import Submitted, codec
from store import defaults, scripts
from store.errors import RolloutExists, StoreError
from store.event_store import JOB, SUBMITTED, EventStore
from store.keys import Keys
from store.queue import JOB_FUNC, JOB_RESULT_TTL_S
from store.submission import Submission, same_submission


class BatchConflict(StoreError, ValueError):
    """Another submission was already recorded under this batch id; nothing was written."""


@dataclass(frozen=True, slots=True)
class BatchInfo:
    """A batch as recorded at submit."""

    batch_id: str
    groups: int
    group_size: int
    queue: str
    submitted_at: float
    retention_s: int
    named_ids: tuple[str, ...]  # empty when the ids are <batch>.<group>.<sample>

    @property
    def ids(self) -> list[str]:
        if self.named_ids:
            return list(self.named_ids)
        return [f"{self.batch_id}.{g}.{s}" for g in range(self.groups)
                for s in range(self.group_size)]  # fmt: skip

    def group_ids(self, group_index: int) -> list[str]:
        n = self.group_size
        return self.ids[group_index * n : (group_index + 1) * n]

    @classmethod
    def parse(cls, batch_id: str, fields: dict[bytes, bytes]) -> BatchInfo:
        raw = fields.get(b"ids") or b""
        return cls(
            batch_id=batch_id,
            groups=int(fields[b"groups"]),
            group_size=int(fields[b"n"]),
            queue=fields[b"queue"].decode(),
            submitted_at=float(fields[b"at"]),
            retention_s=int(fields[b"ttl"]),
            named_ids=tuple(msgpack.unpackb(raw)) if raw else (),
        )


def record(
    conn: Redis,
    queue: Queue,
    store: EventStore,
    submission: Submission,
    *,
    named_ids: bool,
    retention_s: int,
    chunk: int = defaults.SUBMIT_CHUNK,
) -> None:
    """Record ``submission`` and enqueue its new rollouts (blocking: rq is synchronous)."""
    keys = store.keys
    events = submission.events
    _check_batch(conn, keys, submission)
    new = _new_rollouts(conn, keys, events, chunk)
    ids_field = msgpack.packb(submission.ids) if named_ids else b""
    reply = scripts.run_sync(
        conn,
        scripts.CREATE_BATCH,
        [keys.batch(submission.batch_id), keys.batches()],
        [submission.batch_id, submission.fingerprint, len(events) // submission.group_size,
         submission.group_size, ids_field, queue.name, retention_s, repr(time.time())],
    )  # fmt: skip
    if reply == b"different":  # recorded by a racing submit since the check
        raise _conflict(submission)
    raced: list[RolloutExists] = []
    for start in range(0, len(new), chunk):
        raced += _record_chunk(conn, queue, store, new[start : start + chunk])
    if raced:
        # Another writer took an id between the lookup and the write: those ids hold its
        # rollouts; everything else of this submission is recorded and enqueued.
        raise raced[0]


def _check_batch(conn: Redis, keys: Keys, submission: Submission) -> None:
    recorded = conn.hget(keys.batch(submission.batch_id), "fp")
    if recorded is not None and recorded.decode() != submission.fingerprint:  # type: ignore[union-attr]
        raise _conflict(submission)


def _conflict(submission: Submission) -> BatchConflict:
    return BatchConflict(
        f"batch {submission.batch_id!r} was submitted with other requests; nothing written"
    )


def _new_rollouts(
    conn: Redis, keys: Keys, events: Sequence[Submitted], chunk: int
) -> list[Submitted]:
    """The events whose rollout does not exist yet; refuses if one exists with another request."""
    new: list[Submitted] = []
    for start in range(0, len(events), chunk):
        part = events[start : start + chunk]
        with conn.pipeline(transaction=False) as pipe:
            for e in part:
                pipe.hget(keys.snapshot(e.rollout_id), SUBMITTED)
            found = pipe.execute()
        for e, record in zip(part, found, strict=True):
            if record is None:
                new.append(e)
                continue
            old = codec.decode(record, rollout_id=e.rollout_id, seq=1)
            if not isinstance(old, Submitted) or not same_submission(old, e):
                raise RolloutExists(e.rollout_id, 1, 1)
    return new


def _record_chunk(
    conn: Redis, queue: Queue, store: EventStore, events: Sequence[Submitted]
) -> list[RolloutExists]:
    prepared = [store.prepare(None, e) for e in events]
    script = scripts.APPEND
    with conn.pipeline(transaction=True) as pipe:
        pipe.multi()  # explicitly, before anything: rq's enqueue starts one unless it is on
        pipe.execute_command("SCRIPT", "LOAD", script.text)  # type: ignore[no-untyped-call]
        for p in prepared:
            pipe.execute_command("EVALSHA", script.sha, len(p.keys), *p.keys, *p.args)  # type: ignore[no-untyped-call]
        for e in events:
            job = queue.enqueue_call(
                JOB_FUNC,
                kwargs={"rollout_id": e.rollout_id},
                description=f"rollout {e.rollout_id}",
                result_ttl=JOB_RESULT_TTL_S,
                failure_ttl=7 * 86400,
                pipeline=pipe,
            )
            # The first job's id stays: a duplicate job (a racing identical submit) is not
            # the one to delete at ack; it ends superseded and expires.
            pipe.hsetnx(store.keys.snapshot(e.rollout_id), JOB, job.id)
        replies: list[Any] = pipe.execute()
    raced = []
    for e, reply in zip(events, replies[1 : 1 + len(events)], strict=True):
        if reply[0] == b"conflict":
            raced.append(RolloutExists(e.rollout_id, 1, int(reply[1])))
    return raced


def info(conn: Redis, keys: Keys, batch_id: str) -> BatchInfo | None:
    fields = conn.hgetall(keys.batch(batch_id))
    return BatchInfo.parse(batch_id, fields) if fields else None  # type: ignore[arg-type]


async def info_async(redis: AsyncRedis, keys: Keys, batch_id: str) -> BatchInfo | None:
    """``info`` for asyncio code (a worker cancelling a failed sample's group)."""
    fields = await redis.hgetall(keys.batch(batch_id))  # type: ignore[misc]
    return BatchInfo.parse(batch_id, fields) if fields else None
