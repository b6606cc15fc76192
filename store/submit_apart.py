"""A submit's chunks with the queue on a Redis of its own (``--queue-redis``,
``store.queue_redis``): two ordered steps per chunk instead of one script, store first.

1. The store step (``submit_chunk.lua`` given no rq key): each rollout's log and snapshot, its
   job id on the snapshot (``job``, where ``ack`` finds it), the ``pending`` counter. No rq key:
   the store's Redis may be a cluster, and rq's keys are not there.
2. The queue step (``store.queue.push_jobs``, ``lua/push_jobs.lua``): the jobs of the rollouts
   the store step recorded, under the ids it recorded, and a session's hints. Repeatable: a
   job whose hash exists is not pushed again.

A crash between the two leaves rollouts recorded with a job id that no queue holds. The same
submit retried repairs it: the rollouts it finds recorded already (``store.batches`` looks them
up, or the store step answers "dup") are read again (status, jobs), and one still pending none
of whose jobs is on the queue gets its first one pushed then (the one its snapshot names, so
that ``ack`` deletes it): ``repush``. Without a retry, the workers' stranded sweep or
``rollouts requeue --all-waiting`` gives it a job. The other order (push, then record) would
leave jobs of rollouts that do not exist, and nothing to find them by.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis import Redis
from rq.job import Job

from statemachine import Submitted
from store import defaults
from store import queue as rq_queue
from store.affinity import Affinity
from store.keys import Keys
from store.prepared import _Prepared
from store.queue import JobWriter, new_job_ids

PENDING = b"pending"


def chunk_call(store_keys: Keys, part: Sequence[_Prepared]) -> tuple[list[str], list[Any]]:
    """The keys and arguments of one store-only ``submit_chunk.lua`` call (no rq key, no job
    field: those are the queue step's)."""
    keys: list[str] = [store_keys.stats()]
    args: list[Any] = [len(part), 0]
    for p, job_id in zip(part, new_job_ids(len(part)), strict=True):
        keys += [p.keys[0], p.keys[1]]
        # The record and the head as lua/append.lua would get them (p.args[2:4]).
        args += [p.args[2], p.args[3], job_id]
    return keys, args


def push(
    jobs: JobWriter,
    keys: Keys,
    parts: Sequence[Sequence[Submitted]],
    replies: Sequence[Sequence[list[bytes]]],
    affinity: Affinity | None,
) -> list[list[bytes]]:
    """The queue step after every chunk's store step (``replies``, per chunk): a job for each
    rollout recorded now, and for each one found recorded and still pending with none of its
    jobs on the queue. One ``push_jobs`` per chunk (bounded as the chunk is). Returns each
    chunk's statuses as the one-script step gives them (``ok``, ``dup``, ``conflict``)."""
    fields, hint = _session(keys, affinity)
    statuses: list[list[bytes]] = []
    for part, reply in zip(parts, replies, strict=True):
        named: list[tuple[str, str]] = []
        recorded: list[tuple[list[str], str]] = []  # a retry's: (its jobs, its rollout)
        for e, (status, *seen) in zip(part, reply, strict=True):
            if status == b"ok":
                named.append((seen[1].decode(), e.rollout_id))
            elif status == b"dup" and seen[0] == PENDING and seen[1]:
                recorded.append((seen[1].decode().split(), e.rollout_id))
        named += _missing(jobs, recorded)
        # Pushed in the chunk's order: the queue serves them as the one-script step would.
        order = {e.rollout_id: i for i, e in enumerate(part)}
        named.sort(key=lambda jr: order[jr[1]])
        rq_queue.push_jobs(jobs, named, hint=hint, fields=fields)
        statuses.append([status for status, *_ in reply])
    return statuses


def repush(
    conn: Redis, jobs: JobWriter, keys: Keys, ids: Sequence[str], affinity: Affinity | None,
    chunk: int = defaults.SUBMIT_CHUNK,
) -> None:  # fmt: skip
    """The queue step again for rollouts of ``ids`` a retry found recorded (with this same
    request): each one still pending none of whose jobs is on the queue gets its first
    recorded job pushed. Two round trips per ``chunk`` (the store's, the queue's), and a third
    to push when one is missing."""
    fields, hint = _session(keys, affinity)
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        with conn.pipeline(transaction=False) as pipe:
            for rid in part:
                pipe.hmget(keys.snapshot(rid), ["st", "job"])
            found = pipe.execute()
        recorded = [(job.decode().split(), rid) for rid, (st, job) in zip(part, found, strict=True)
                    if st == PENDING and job]  # fmt: skip
        named = _missing(jobs, recorded)
        if named:
            rq_queue.push_jobs(jobs, named, hint=hint, fields=fields)


def _session(
    keys: Keys, affinity: Affinity | None
) -> tuple[dict[str, Any], tuple[list[str], list[Any]]]:
    """A session's call's job fields and hint (none without)."""
    if affinity is None:
        return {}, ([], [])
    return affinity.job_fields(), affinity.hint(keys)


def _missing(jobs: JobWriter, recorded: list[tuple[list[str], str]]) -> list[tuple[str, str]]:
    """The first job of each rollout none of whose jobs is on the queue (a crash came before
    the queue step), in one round trip. A rollout given another job since (the stranded
    sweep's, an operator's) has one: none is added beside it."""
    if not recorded:
        return []
    with jobs.queue.connection.pipeline(transaction=False) as pipe:
        for job_ids, _ in recorded:
            pipe.exists(*(Job.key_for(j) for j in job_ids))
        found = pipe.execute()
    return [(job_ids[0], rid) for (job_ids, rid), n in zip(recorded, found, strict=True) if not n]
