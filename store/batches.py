"""Recording a submission: batch record, rollout records and rq jobs, with nothing stranded.

Order and atomicity (the choice issue 13 asks to explain):

1. A batch id already recorded with another submission refuses the submit.
2. Every rollout id is looked up (pipelined): an id already holding *another* request refuses
   the whole submit before anything is written; one holding the same request (a retry) is
   left as it is. Skipped for a batch not recorded yet whose ids it generates
   (``<batch>.<group>.<sample>``): nothing can hold them (should something, step 4 still
   refuses to overwrite it).
3. The batch record is created once (``create_batch.lua``).
4. The new rollouts go in chunks of 1,000, each chunk one script (``submit_chunk.lua``, two in
   flight at once, see ``scripts.run_windowed_sync``): the
   ``Submitted`` records (the fields ``append.lua`` writes for a first event), their rq jobs
   (the hashes rq's enqueue writes, see ``store.queue.JobWriter``), each job's id beside its
   rollout's snapshot (for ``ack``), and the push onto the queue. A script runs whole or not
   at all, so no failure (Redis gone, the process killed) can leave a rollout recorded but not
   enqueued: the stranding of the old submit, which recorded everything and then enqueued,
   cannot happen. A rollout found already recorded with the same record (a retry, or a
   racing identical submit) gets no second job; one recorded with another is left untouched
   and reported.

A retry after a failure between chunks finds the earlier chunks recorded (same requests) and
writes the rest. One script per chunk rather than a transaction of per-rollout commands: the
client's cost is per reply, and 10,000 rollouts are ~10 replies.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from rq import Queue
from rq.job import Job

from statemachine import Submitted, codec
from store import defaults, scripts
from store.errors import RolloutExists, StoreError
from store.event_store import FIRST, EventStore, submitted_record
from store.keys import Keys
from store.queue import JobWriter
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
    recorded = _check_batch(conn, keys, submission)
    fresh = not recorded and not named_ids
    # A retry's or named ids' rollouts are looked up before anything is written.
    new = [] if fresh else _new_rollouts(conn, keys, submission, chunk)
    ids_field = msgpack.packb(submission.ids) if named_ids else b""
    reply = scripts.run_sync(
        conn,
        scripts.CREATE_BATCH,
        [keys.batch(submission.batch_id), keys.batches()],
        [submission.batch_id, submission.fingerprint, len(submission) // submission.group_size,
         submission.group_size, ids_field, queue.name, retention_s, repr(time.time())],
    )  # fmt: skip
    if reply == b"different":  # recorded by a racing submit since the check
        raise _conflict(submission)
    jobs = JobWriter(queue)
    parts: list[list[Submitted]] = []

    def calls() -> Iterator[tuple[list[str], list[Any]]]:
        # A fresh batch's events are made chunk by chunk, chunk k+1 while Redis records chunk
        # k (each takes about as long as the other).
        if fresh:
            n = len(submission)
            chunks = (submission.events_between(i, i + chunk) for i in range(0, n, chunk))
        else:
            chunks = (new[i : i + chunk] for i in range(0, len(new), chunk))
        for part in chunks:
            parts.append(part)
            yield _chunk_call(store, jobs, part)

    replies = scripts.run_windowed_sync(conn, scripts.SUBMIT_CHUNK, calls())
    raced = [
        RolloutExists(e.rollout_id, 1, 1)
        for part, statuses in zip(parts, replies, strict=True)
        for e, status in zip(part, statuses, strict=True)
        if status == b"conflict"
    ]
    if raced:
        # Another writer took an id between the lookup and the write: those ids hold its
        # rollouts; everything else of this submission is recorded and enqueued.
        raise raced[0]


def _check_batch(conn: Redis, keys: Keys, submission: Submission) -> bool:
    """Whether the batch is recorded already (by this same submission: a retry)."""
    recorded = conn.hget(keys.batch(submission.batch_id), "fp")
    if recorded is not None and recorded.decode() != submission.fingerprint:  # type: ignore[union-attr]
        raise _conflict(submission)
    return recorded is not None


def _conflict(submission: Submission) -> BatchConflict:
    return BatchConflict(
        f"batch {submission.batch_id!r} was submitted with other requests; nothing written"
    )


def _new_rollouts(
    conn: Redis, keys: Keys, submission: Submission, chunk: int
) -> list[Submitted]:
    """The events whose rollout does not exist yet; refuses if one exists with another request."""
    new: list[Submitted] = []
    for start in range(0, len(submission), chunk):
        part = submission.events_between(start, start + chunk)
        with conn.pipeline(transaction=False) as pipe:
            for e in part:
                pipe.xrange(keys.log(e.rollout_id), FIRST, FIRST)
            found = pipe.execute()
        for e, entries in zip(part, found, strict=True):
            record = submitted_record(entries)
            if record is None:
                new.append(e)
                continue
            old = codec.decode(record, rollout_id=e.rollout_id, seq=1)
            if not isinstance(old, Submitted) or not same_submission(old, e):
                raise RolloutExists(e.rollout_id, 1, 1)
    return new


def _chunk_call(
    store: EventStore, jobs: JobWriter, events: Sequence[Submitted]
) -> tuple[list[str], list[Any]]:
    """The keys and arguments of one ``submit_chunk.lua`` call."""
    keys: list[str] = [store.keys.stats(), jobs.queue.key, jobs.queue.redis_queues_keys]
    shared = jobs.shared()
    args: list[Any] = [len(events), len(shared)]
    for name, value in shared.items():
        args += [name, value]
    # Job ids as rq makes them (a random UUID), from one urandom call per chunk.
    random = os.urandom(16 * len(events))
    for i, e in enumerate(events):
        p = store.prepare(None, e)
        job_id = str(uuid.UUID(bytes=random[16 * i : 16 * i + 16], version=4))
        keys += [p.keys[0], p.keys[1], Job.key_for(job_id)]
        # The record and the head as lua/append.lua would get them (p.args[2:4]).
        args += [p.args[2], p.args[3], job_id, jobs.data(e.rollout_id),
                 jobs.description(e.rollout_id)]  # fmt: skip
    return keys, args


def info(conn: Redis, keys: Keys, batch_id: str) -> BatchInfo | None:
    fields = conn.hgetall(keys.batch(batch_id))
    return BatchInfo.parse(batch_id, fields) if fields else None  # type: ignore[arg-type]


async def info_async(redis: AsyncRedis, keys: Keys, batch_id: str) -> BatchInfo | None:
    """``info`` for asyncio code (a worker cancelling a failed sample's group)."""
    fields = await redis.hgetall(keys.batch(batch_id))  # type: ignore[misc]
    return BatchInfo.parse(batch_id, fields) if fields else None
