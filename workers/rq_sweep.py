"""The sweep that gives back the jobs a dead worker held on this worker's queues.

A worker that dies leaves its jobs where rq last saw them: started, with an execution whose
heartbeat lapses (``RqBridge.heartbeat`` stops), or taken off the queue into rq's intermediate
list and never started (killed mid-dequeue); and rq's own cleanup (which ``rq info``, any stock
rq worker and the started registry's ``count()`` run) moves a lapsed execution's job to the
failed registry. rq never gives those back; nothing would run their rollouts again, which would
wait forever (their leases, if any, were already dropped or reaped). Every worker's reaper runs
this sweep (``RqBridge.requeue_abandoned``) over its own queues.

Each job goes back in one atomic step (``lua/requeue_abandoned.lua``, ``lua/requeue_dequeued.lua``)
that leaves it where it was if the push fails (Redis out of memory, a damaged queue key): a later
sweep finds it there again, after a backoff of its own, and the jobs and queues behind it are
swept meanwhile. Before, rq's cleanup moved it to the failed registry and rq's requeue then took
it out of there before pushing it, and the intermediate list's sweep removed it before pushing
it: a failure in between left the job in no registry and on no queue.

A job whose rollout has ended meanwhile runs, finds it ended, and reports success; one swept
back twice (two sweeps racing, a slow worker's start) is a duplicate delivery, which the fencing
turns into a superseded job.
"""

from __future__ import annotations

import base64
import logging
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from redis import Redis
from rq import Queue
from rq.exceptions import AbandonedJobError
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job
from rq.results import Result
from rq.utils import now, utcformat

from store import defaults, scripts
from store.errors import unwritable
from store.keys import Keys
from workers.backoff import Backoff
from workers.rq_jobs import delete_job
from workers.rq_mirror import rollout_of

log = logging.getLogger("rollouts.rq")

# How long rq keeps a job's first-seen mark in its intermediate queue (IntermediateQueue).
FIRST_SEEN_TTL_S = 3600 * 24
# Entries of a queue's failed registry looked at per sweep (each sweep the next page, in turn):
# one ZRANGE, and a read of the latest rq result of those not looked at before.
FAILED_PAGE = 500


class StuckJobs:
    """``execution_ttl()``: seconds without a heartbeat after which rq calls a job abandoned
    (also how long a job may sit in the intermediate list before it counts as stuck)."""

    def __init__(
        self,
        connection: Redis,
        queues: list[Queue],
        execution_ttl: Callable[[], float],
        keys: Keys | None = None,
        store: Redis | None = None,
    ) -> None:
        self.connection = connection
        self.queues = queues
        self.execution_ttl = execution_ttl
        self.keys = keys or Keys()  # where the rollouts' snapshots are: on ``store``
        self.store = store or connection  # None: the queue's Redis is the store's
        # Stuck jobs whose give back failed: retried by a later sweep, after a backoff.
        self._retry = Backoff(defaults.REAP_RETRY_S, defaults.REAP_RETRY_MAX_S)
        self._swept: set[str] = set()  # the stuck jobs one sweep saw
        self._failed_scans: dict[str, _FailedScan] = {}  # per queue

    def sweep(self) -> list[str]:
        """One sweep of every queue: the requeued job ids. Blocking (rq is synchronous)."""
        requeued = []
        self._swept.clear()
        listed = True
        for q in self.queues:
            try:
                requeued += self._requeue_stuck_dequeues(q)
                requeued += self._requeue_lapsed(q)
                requeued += self._requeue_failed_as_abandoned(q)
            except Exception:
                # Listing this queue's jobs failed (Redis away): the others are swept, and
                # whatever is stuck here is still there next sweep.
                listed = False
                log.warning("sweep of queue %s failed; retrying next sweep", q.name,
                            exc_info=_worth_a_traceback())  # fmt: skip
        if listed:
            self._retry.keep_only(self._swept)  # the others are no longer stuck
        return requeued

    def _requeue_lapsed(self, q: Queue) -> list[str]:
        """Jobs whose execution's heartbeat lapsed (their worker died): back on ``q``. Judged
        by Redis's clock, which stamps the heartbeats (``lua/stamp_executions.lua``): by this
        host's, a worker 30 s behind (or this one 30 s ahead) had its running jobs given back
        and delivered again."""
        cutoff = redis_now(self.connection)
        started = q.started_job_registry
        members: list[bytes] = self.connection.zrangebyscore(started.key, 0, cutoff)  # type: ignore[assignment]
        requeued = []
        for raw in members:
            member = raw.decode()
            job_id = started.parse_job_id(member)

            def back(member: str = member, job_id: str = job_id) -> bool:
                return self._requeue_from(started.key, q, member, cutoff, job_id, "started")

            if self._sweep_one(f"{started.key} {member}", back):
                requeued.append(job_id)
        return requeued

    def _requeue_failed_as_abandoned(self, q: Queue) -> list[str]:
        """Jobs rq's own maintenance failed as abandoned: back on ``q``.

        ``rq info`` (which the README suggests), any stock rq worker and ``count()`` of the
        started registry run rq's cleanup, which moves a lapsed execution's job to the failed
        registry before our sweep sees it lapse; nothing looked there, and its rollout waited
        forever (certain when the dead worker was the only one, and the operator looked with
        ``rq info`` before starting another). A page of ``FAILED_PAGE`` of the failed
        registry per sweep, in turn; only the failures not looked at before cost a read (of
        their latest rq result, which says who failed them and why)."""
        failed = q.failed_job_registry
        scan = self._failed_scans.setdefault(q.name, _FailedScan())
        rows: list[tuple[bytes, float]] = self.connection.zrange(  # type: ignore[assignment]
            failed.key, scan.start, scan.start + FAILED_PAGE - 1, withscores=True
        )
        ids = [(m.decode(), score) for m, score in rows]
        scan.turn([job_id for job_id, _ in ids], last=len(rows) < FAILED_PAGE)
        new = [(job_id, score) for job_id, score in ids if job_id not in scan.own]
        if not new:
            return []
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id, _ in new:
                pipe.xrevrange(Result.get_key(job_id), "+", "-", count=1)  # type: ignore[no-untyped-call]
            latest = pipe.execute()
        requeued = []
        own = []
        for (job_id, score), result in zip(new, latest, strict=True):
            if not _failed_as_abandoned(result):
                own.append(job_id)
                continue

            def back(job_id: str = job_id, score: float = score) -> bool:
                return self._requeue_from(failed.key, q, job_id, score, job_id, "failed")

            if self._sweep_one(f"{failed.key} {job_id}", back):
                requeued.append(job_id)
                log.warning("job %s: failed as abandoned by rq's own maintenance, requeued",
                            job_id)  # fmt: skip
        # Failures of their own: kept for an operator to read (not read again), but for
        # those whose rollout is gone, which nobody will read: deleted.
        scan.own.update(set(own) - set(self._delete_acknowledged(q, own)))
        return requeued

    def _delete_acknowledged(self, q: Queue, job_ids: list[str]) -> list[str]:
        """Of ``job_ids`` (failed jobs of ``q``), delete those whose rollout is gone (it was
        acknowledged): a worker refusing such a job deletes it once the failure is written,
        but one that died in between (or earlier code, which raised there) left it failed
        for rq's 7 days. Returns the deleted ones."""
        if not job_ids:
            return []
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(Job.key_for(job_id), "data")
            payloads = pipe.execute()
        ours = [(job_id, rid) for job_id, data in zip(job_ids, payloads, strict=True)
                if (rid := rollout_of(self.connection, job_id, data))]  # fmt: skip
        if not ours:
            return []
        with self.store.pipeline(transaction=False) as pipe:
            for _, rid in ours:
                pipe.exists(self.keys.snapshot(rid))
            alive = pipe.execute()
        gone = [job_id for (job_id, _), there in zip(ours, alive, strict=True) if not there]
        if gone:
            with self.connection.pipeline() as pipe:
                for job_id in gone:
                    delete_job(pipe, job_id, q)
                pipe.execute()
            log.info("deleted %d failed jobs of acknowledged rollouts from %s", len(gone), q.name)
        return gone

    def _requeue_from(
        self, registry: str, q: Queue, member: str, cutoff: float, job_id: str, status: str
    ) -> bool:
        """``lua/requeue_abandoned.lua``: ``member`` of ``registry`` back on ``q``, if its
        score is at most ``cutoff`` and its job's status is ``status``."""
        keys = [registry, q.key, Job.key_for(job_id)]
        tidy = "1" if status == "started" else "0"  # as rq's cleanup of the started registry
        args: list[scripts.Arg] = [member, repr(cutoff), job_id, utcformat(now()), status, tidy]
        return bool(scripts.run_sync(self.connection, scripts.REQUEUE_ABANDONED, keys, args))

    def _sweep_one(self, item: str, back: Callable[[], bool]) -> bool:
        """``back()`` for one stuck job, unless it waits out a backoff after failing."""
        self._swept.add(item)
        if not self._retry.due(item):
            return False
        try:
            done = back()
        except Exception:
            # Its push refused (Redis out of memory, a damaged queue key): it stays where it
            # is stuck, so a later sweep finds it; the jobs behind it are not held up.
            delay = self._retry.failed(item)
            log.warning("giving back job %s failed; retrying in %.1f s", item, delay,
                        exc_info=_worth_a_traceback())  # fmt: skip
            return False
        self._retry.done(item)
        return done

    def _requeue_stuck_dequeues(self, q: Queue) -> list[str]:
        """Jobs a worker took off ``q`` (into rq's intermediate list) and never started: it
        died in between. rq's own cleanup fails them after a minute; these go back to the
        front of the queue once seen stuck for an execution TTL. A worker that is merely
        slow to start one (a sub-second step) at worst gets a duplicate delivery, which the
        fencing turns into a superseded job."""
        intermediate = IntermediateQueue(q.key, connection=self.connection)
        stuck = intermediate.get_job_ids()
        if not stuck:
            return []
        live = set(q.started_job_registry.get_job_ids(cleanup=False))
        stuck = [job_id for job_id in stuck if job_id not in live]
        if not stuck:
            return []
        # Pipelined, as every list is long while a worker takes a batch of jobs (it pops
        # them all, then starts them all): one round trip per job here cost that worker
        # more than its dequeue did.
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id in stuck:
                pipe.hexists(Job.key_for(job_id), "data")
            there = pipe.execute()
        # A job whose hash is gone was deleted (its rollout acknowledged while the job still
        # waited): rq's dequeue skipped it but left it here. Nothing to run: drop it. So is
        # a hash without a payload (fields written back after its job was deleted, by
        # earlier workers' bare HSETs), which rq's dequeue skips too: deleted with it.
        gone = [job_id for job_id, e in zip(stuck, there, strict=True) if not e]
        present = [job_id for job_id, e in zip(stuck, there, strict=True) if e]
        stamp = redis_now(self.connection)  # one clock for every sweep's first-seen marks
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id in gone:
                pipe.lrem(intermediate.key, 1, job_id)
                pipe.delete(Job.key_for(job_id), intermediate.get_first_seen_key(job_id))
            for job_id in present:
                # rq's set_first_seen (NX: the first sweep that saw it) and get_first_seen,
                # only while the job is still in the list (a start since would leave the mark
                # for 24 h). By its text: it rides in a pipeline (a NOSCRIPT would fail it).
                pipe.execute_command(  # type: ignore[no-untyped-call]
                    *scripts.MARK_FIRST_SEEN.invocation(), 2, intermediate.key,
                    intermediate.get_first_seen_key(job_id), job_id, stamp, FIRST_SEEN_TTL_S,
                )  # fmt: skip
            seen = pipe.execute()[2 * len(gone) :]
        requeued = []
        for job_id, first in zip(present, seen, strict=True):
            if first is None or stamp - float(first) < self.execution_ttl():
                continue

            def back(job_id: str = job_id) -> bool:
                # The script's LREM decides the race between sweeps: only the one that
                # removed it pushes it, in the same step.
                keys = [intermediate.key, q.key, intermediate.get_first_seen_key(job_id)]
                return bool(scripts.run_sync(self.connection, scripts.REQUEUE_DEQUEUED, keys,
                                             [job_id]))  # fmt: skip

            if self._sweep_one(f"{intermediate.key} {job_id}", back):
                requeued.append(job_id)
        return requeued


@dataclass(slots=True)
class _FailedScan:
    """A sweep's walk through one queue's failed registry, a page per sweep, round after round;
    ``own``: the failures found to be failures of their own (not rq's abandoned-job cleanup),
    not read again; forgotten once a round no longer sees them (expired, or requeued)."""

    start: int = 0
    own: set[str] = field(default_factory=set)
    seen: set[str] = field(default_factory=set)  # this round's

    def turn(self, page: list[str], *, last: bool) -> None:
        self.seen.update(page)
        if last:
            self.own &= self.seen
            self.start, self.seen = 0, set()
        else:
            self.start += len(page)


def _failed_as_abandoned(latest: list[tuple[bytes, dict[bytes, bytes]]]) -> bool:
    """Whether a job's latest rq result (an XREVRANGE reply) is rq's cleanup failing it as
    abandoned: a failure with no worker named (``record_job_failure``), for AbandonedJobError."""
    if not latest:
        return False
    payload = latest[0][1]
    failure = str(Result.Type.FAILED.value).encode()
    if payload.get(b"worker_name") or payload.get(b"type") != failure:
        return False
    try:
        why = zlib.decompress(base64.b64decode(payload.get(b"exc_string", b""))).decode()
    except (ValueError, zlib.error):
        # Not rq's encoding (anyone can write anything): not rq's cleanup.
        return False
    return AbandonedJobError.__name__ in why


def redis_now(connection: Redis) -> int:
    """Redis's clock, unix s (whole, as rq's ``current_timestamp``)."""
    seconds, _ = connection.time()  # type: ignore[misc]
    return int(seconds)


def _worth_a_traceback() -> bool:
    """For the error being handled: a traceback, unless Redis refused a write for a condition
    of its own (out of memory, a failed disk write), which the worker logs once per episode
    (``workers.store_condition``) and which says nothing about this code."""
    return unwritable(sys.exc_info()[1] or Exception()) is None
