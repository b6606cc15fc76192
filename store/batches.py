"""Recording a submission: batch record, rollout records and rq jobs, with nothing stranded.

Order and atomicity (the choice issue 13 asks to explain):

1. The batch record is created once (``create_batch.lua``), which refuses a batch id already
   recorded with another submission, and reads the newest published weight version (the
   rollouts' admitted version) in the same step.
2. Rollout ids the caller named are looked up first (pipelined, before step 1): an id already
   holding *another* request refuses the whole submit before anything is written; one holding
   the same request (a retry) is left as it is. Generated ids (``<batch>.<group>.<sample>``)
   are looked up only when step 1 found the batch recorded already (a retry, which has
   written nothing by then); for a batch step 1 created, nothing can hold them (should
   something, step 4 still refuses to overwrite it), and the submit writes them all at once.
   A crash between steps 1 and 3 leaves a batch record without rollouts, which its retry
   completes (it finds the batch, looks its ids up, and writes the missing ones).
3. The new rollouts go in chunks (at most ``SUBMIT_CHUNK`` rollouts and ``SUBMIT_CHUNK_BYTES``
   of records, so that no script holds Redis for long), each chunk one script
   (``submit_chunk.lua``, two in flight at once, see ``scripts.run_windowed_sync``): the
   ``Submitted`` records (the fields ``append.lua`` writes for a first event), their rq jobs
   (the hashes rq's enqueue writes, see ``store.queue.JobWriter``), each job's id beside its
   rollout's snapshot (for ``ack``), and the push onto the queue. A script runs whole or not
   at all, so no failure (Redis gone, the process killed) can leave a rollout recorded but not
   enqueued: the stranding of the old submit, which recorded everything and then enqueued,
   cannot happen. A rollout found already recorded with the same record (a retry) gets no
   second job; one recorded with another record is left untouched, and is reported
   (``RolloutExists``) only if it holds another request: a racing submit of this same
   submission stamped its own time into its records, and recorded (and enqueued) the rollout
   for both.

A retry after a failure between chunks finds the earlier chunks recorded (same requests) and
writes the rest. With the queue on a Redis of its own (``store.queue_redis``), step 3 is two
ordered steps, store first (``store.submit_apart``), and every read of steps 1 and 2 is the
store's connection's, never rq's. One script per chunk rather than a transaction of per-rollout
commands: the client's cost is per reply, and 10,000 rollouts are ~20 replies. On Redis
Cluster (always with the queue apart) step 1 is three steps and step 3's store step is a call
per slot (``store.submit_cluster``).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import msgpack
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from rq import Queue
from rq.job import Job

from statemachine import Submitted, codec
from store import defaults, scripts, submit_apart, submit_cluster
from store.affinity import Affinity
from store.errors import RolloutExists, StoreError
from store.event_store import FIRST, EventStore, submitted_record
from store.keys import Keys
from store.prepared import ARG_RECORD, _Prepared
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
    # > 0: the call is that turn of a harness-driven episode (named_ids: the episode), and
    # has no record of its own (``store.harness_turns``; its first call is its batch).
    turn: int = 0

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
    def turn_of(cls, batch_id: str, at: float, rollout_id: str, turn: int) -> BatchInfo:
        """A later turn's call of a harness session: its episode and turn (the queue and
        retention are its episode's batch's)."""
        return cls(batch_id=batch_id, groups=1, group_size=1, queue="", submitted_at=at,
                   retention_s=0, named_ids=(rollout_id,), turn=turn)  # fmt: skip

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
    chunk_bytes: int = defaults.SUBMIT_CHUNK_BYTES,
    affinity: Affinity | None = None,
    jobs: JobWriter | None = None,
    apart: bool = False,
) -> bool:
    """Record ``submission`` and enqueue its new rollouts (blocking: rq is synchronous).
    ``conn``: the store's (sync) connection; ``apart``: the queue (``queue.connection``) is on
    a Redis of its own, pushed to after the store step (``store.submit_apart``).
    Whether this call created the batch (False: a retry found it recorded). The rollouts'
    admitted weight version is the newest one published when the batch record is written
    (``submission``'s own is replaced). ``affinity``: a session's call, whose jobs carry
    its session and preferred worker and are hinted to that worker (``store.affinity``).
    ``jobs``: the queue's job writer, kept by a caller that submits often."""
    keys = store.keys
    if store.cluster and not apart:  # rq cannot run on a cluster (store.queue_redis)
        raise ValueError("a store on Redis Cluster records submits with the queue apart")
    new: list[Submitted] = []
    if named_ids:
        # Named ids may be held by another submission's rollouts: refused before anything
        # (the batch record included) is written.
        _check_batch(conn, keys, submission)
        new = _new_rollouts(conn, keys, submission, chunk)
    created, version = _create_batch(conn, keys, queue, submission, named_ids, retention_s,
                                     cluster=store.cluster)  # fmt: skip
    submission = replace(submission, admitted_version=version)
    # Generated ids (<batch>.<group>.<sample>) of a batch this call created: nothing can hold
    # them (should something, the chunk's script still refuses to overwrite it), so they
    # are not looked up. A retry's are, before anything more is written.
    fresh = created and not named_ids
    if not named_ids and not created:
        new = _new_rollouts(conn, keys, submission, chunk)
    elif named_ids:  # looked up before the version was read
        new = [replace(e, admitted_version=version) for e in new]
    jobs = jobs or JobWriter(queue)
    _write(conn, store, submission, None if fresh else new, jobs, affinity, chunk, chunk_bytes,
           apart=apart)  # fmt: skip
    if apart and not fresh:  # a retry: those recorded before may lack their job (a crash)
        written = {e.rollout_id for e in new}
        found = [rid for rid in submission.ids if rid not in written]
        submit_apart.repush(conn, jobs, keys, found, affinity, chunk)
    return created


def _write(
    conn: Redis,
    store: EventStore,
    submission: Submission,
    new: Sequence[Submitted] | None,
    jobs: JobWriter,
    affinity: Affinity | None,
    chunk: int = defaults.SUBMIT_CHUNK,
    chunk_bytes: int = defaults.SUBMIT_CHUNK_BYTES,
    *,
    apart: bool = False,
) -> None:
    """Steps 3 and 4: the ``new`` rollouts (all of the submission's, None: a batch this
    submit created) recorded and enqueued, chunk by chunk; ``apart``: every chunk recorded on
    the store (``conn``), then enqueued on the queue's Redis (``store.submit_apart``)."""
    parts: list[list[Submitted]] = []

    def calls() -> Iterator[tuple[list[str], list[Any]]]:
        # A fresh batch's events are made as their chunk is, chunk k+1 while Redis records
        # chunk k (each takes about as long as the other).
        for part in _chunks(store, _events(submission, new), chunk, chunk_bytes):
            parts.append([cast(Submitted, p.event) for p in part])
            if apart:
                yield submit_apart.chunk_call(store.keys, part)
            else:
                yield _chunk_call(store.keys, jobs, part, affinity)

    if store.cluster:  # a call per slot, one round trip per master (store.submit_cluster)
        replies = []
        for part in _chunks(store, _events(submission, new), chunk, chunk_bytes):
            parts.append([cast(Submitted, p.event) for p in part])
            replies.append(submit_cluster.record_chunk(conn, store.keys, part))
    else:
        replies = scripts.run_windowed_sync(conn, scripts.SUBMIT_CHUNK, calls())
    if apart:
        replies = submit_apart.push(jobs, store.keys, parts, replies, affinity)
    raced = [
        e
        for part, statuses in zip(parts, replies, strict=True)
        for e, status in zip(part, statuses, strict=True)
        if status == b"conflict"
    ]
    # Another writer took these ids between the lookup and the write. The script compares
    # record bytes, and every submit stamps its own ``at``: a racing submit of this same
    # submission (two clients retrying one batch at once) is a conflict to the script, and a
    # duplicate here, where the requests are compared. Its rollouts and their jobs are the
    # ones recorded; nothing more to do for them.
    if raced:
        _new_rollouts(conn, store.keys, raced, chunk)
        if apart:  # the racer may have died before its queue step
            submit_apart.repush(conn, jobs, store.keys, [e.rollout_id for e in raced], affinity)


def _events(submission: Submission, new: Sequence[Submitted] | None) -> Iterable[Submitted]:
    """The events to write: ``new``, or (None) every one of the submission's, made as their
    chunk is."""
    return (submission.event(k) for k in range(len(submission))) if new is None else new


def _retry(
    conn: Redis, store: EventStore, submission: Submission, jobs: JobWriter,
    affinity: Affinity | None,
) -> None:  # fmt: skip
    """A batch found recorded (by this same submission): its rollouts looked up, and those
    missing written."""
    new = _new_rollouts(conn, store.keys, submission, defaults.SUBMIT_CHUNK)
    _write(conn, store, submission, new, jobs, affinity)


def _create_batch(
    conn: Redis, keys: Keys, queue: Queue, submission: Submission, named_ids: bool,
    retention_s: int, *, cluster: bool = False,
) -> tuple[bool, int]:  # fmt: skip
    """``create_batch.lua``: whether it created the batch (False: recorded already by this
    same submission), and the newest published weight version (0 before any); refuses
    (``BatchConflict``) a batch recorded by another submission. ``cluster``: in the three
    steps of ``store.submit_cluster``."""
    call = _create_call(keys, queue, submission, named_ids, retention_s)
    if cluster:
        return _created(submission, submit_cluster.create_batch(conn, call))
    return _created(submission, scripts.run_sync(conn, scripts.CREATE_BATCH, *call))


def _create_call(
    keys: Keys, queue: Queue, submission: Submission, named_ids: bool, retention_s: int
) -> tuple[list[str], list[Any]]:
    ids_field = msgpack.packb(submission.ids) if named_ids else b""
    return (
        [keys.batch(submission.batch_id), keys.batches(), keys.weights()],
        [submission.batch_id, submission.fingerprint, len(submission) // submission.group_size,
         submission.group_size, ids_field, queue.name, retention_s, repr(time.time())],
    )  # fmt: skip


def _created(submission: Submission, reply: list[bytes]) -> tuple[bool, int]:
    outcome, latest = reply
    if outcome == b"different":
        raise _conflict(submission)
    return outcome == b"new", int(latest.split(b"-")[1]) if latest else 0


async def record_async(
    redis: AsyncRedis,
    conn: Redis,
    queue: Queue,
    store: EventStore,
    submission: Submission,
    named_ids: bool,
    retention_s: int,
    affinity: Affinity | None,
    jobs: JobWriter,
    apart: bool = False,
) -> bool:
    """``record`` for asyncio code: a submission of generated ids that fits one chunk (a
    harness's call) goes on the client's own connection, one script call after another, with
    no thread (handing a submit to a thread and back cost the API more CPU than the submit's
    own commands); anything else runs ``record`` in a thread. The same steps in the same
    order either way (see the module's docstring). ``conn``: the store's sync connection;
    ``apart``: the queue is on a Redis of its own, whose step is rq's synchronous connection's
    (``store.queue.push_jobs``): all of it in a thread then."""
    if apart or store.cluster or named_ids or len(submission) > defaults.SUBMIT_CHUNK:
        return await asyncio.to_thread(record, conn, queue, store, submission,
                                       named_ids=named_ids, retention_s=retention_s,
                                       affinity=affinity, jobs=jobs, apart=apart)  # fmt: skip
    call = _create_call(store.keys, queue, submission, False, retention_s)
    created, version = _created(submission, await scripts.CREATE_BATCH(redis, *call))
    submission = replace(submission, admitted_version=version)
    if not created:  # a retry: its rollouts looked up before anything more is written
        await asyncio.to_thread(_retry, conn, store, submission, jobs, affinity)
        return False
    events = (submission.event(k) for k in range(len(submission)))
    raced: list[Submitted] = []
    # Usually one chunk; more only for records larger than SUBMIT_CHUNK_BYTES in all.
    for part in _chunks(store, events, defaults.SUBMIT_CHUNK, defaults.SUBMIT_CHUNK_BYTES):
        statuses = await scripts.SUBMIT_CHUNK(redis, *_chunk_call(store.keys, jobs, part, affinity))
        raced += [cast(Submitted, p.event) for p, status in zip(part, statuses, strict=True)
                  if status == b"conflict"]  # fmt: skip
    if raced:  # as in ``record``: a racing submit of this same submission, or a refusal
        await asyncio.to_thread(_new_rollouts, conn, store.keys, raced, defaults.SUBMIT_CHUNK)
    return True


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
    conn: Redis, keys: Keys, submission: Submission | Sequence[Submitted], chunk: int
) -> list[Submitted]:
    """The events whose rollout does not exist yet; refuses if one exists with another request
    (``RolloutExists``, naming the first such id)."""
    new: list[Submitted] = []
    for start in range(0, len(submission), chunk):
        if isinstance(submission, Submission):
            part = submission.events_between(start, start + chunk)
        else:
            part = list(submission[start : start + chunk])
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


def _chunks(
    store: EventStore, events: Iterable[Submitted], count: int, size: int
) -> Iterator[list[_Prepared]]:
    """The events' appends, in chunks of at most ``count`` rollouts and ``size`` bytes of
    records (a record larger than ``size`` goes alone). Bytes count as much as rollouts:
    Redis hashes every byte a script is given, and 1,000 records of a 2,048-token prompt
    (6.5 KB each) held it 40 ms, of an 8,192-token one 240 ms, against 18 ms for short ones."""
    part: list[_Prepared] = []
    held = 0
    for e in events:
        p = store.prepare(None, e)
        weight = len(p.args[ARG_RECORD]) + len(p.args[ARG_RECORD + 1])  # type: ignore[arg-type]
        if part and (len(part) >= count or held + weight > size):
            yield part
            part, held = [], 0
        part.append(p)
        held += weight
    if part:
        yield part


def _chunk_call(
    store_keys: Keys, jobs: JobWriter, part: Sequence[_Prepared], affinity: Affinity | None = None
) -> tuple[list[str], list[Any]]:
    """The keys and arguments of one ``submit_chunk.lua`` call."""
    keys: list[str] = [store_keys.stats(), jobs.queue.key, jobs.queue.redis_queues_keys]
    shared = jobs.shared()
    if affinity is not None:
        shared.update(affinity.job_fields())
    args: list[Any] = [len(part), len(shared)]
    for name, value in shared.items():
        args += [name, value]
    # Job ids as rq makes them (a random UUID), from one urandom call per chunk.
    random = os.urandom(16 * len(part))
    for i, p in enumerate(part):
        e = p.event
        job_id = str(uuid.UUID(bytes=random[16 * i : 16 * i + 16], version=4))
        keys += [p.keys[0], p.keys[1], Job.key_for(job_id)]
        # The record and the head as lua/append.lua would get them (p.args[2:4]).
        args += [p.args[2], p.args[3], job_id, jobs.data(e.rollout_id),
                 jobs.description(e.rollout_id)]  # fmt: skip
    if affinity is not None:
        hint_keys, hint_args = affinity.hint(store_keys)
        keys += hint_keys
        args += hint_args
    return keys, args


def info(conn: Redis, keys: Keys, batch_id: str) -> BatchInfo | None:
    fields = conn.hgetall(keys.batch(batch_id))
    return BatchInfo.parse(batch_id, fields) if fields else None  # type: ignore[arg-type]


async def info_async(redis: AsyncRedis, keys: Keys, batch_id: str) -> BatchInfo | None:
    """``info`` for asyncio code (a worker cancelling a failed sample's group)."""
    fields = await redis.hgetall(keys.batch(batch_id))  # type: ignore[misc]
    return BatchInfo.parse(batch_id, fields) if fields else None
