"""What a worker does of session affinity (``store.affinity``) when it takes jobs: claims the
jobs hinted to it, flags itself waiting while blocked on its queue, gives back a job that
prefers another worker waiting there, and records itself as the session's worker when it
starts one of its calls. Single-queue workers only: rq takes from several queues with a
plain BLPOP (no intermediate list to claim into), and their hints simply expire.

Cost to a session-less job: none in round trips. Only a worker that started a session's call
can be preferred (a session records the worker that started its latest call, and hints go to
that worker only), so until it has started one it sends no command more at all. From then on,
the claim rides in the round trip that reads the queue's length (an empty hint list: one LPOP)
and the waiting flag in the blocking pop's own (a SET before it, a DEL after); the rest costs
only a job that has a session.
"""

from __future__ import annotations

import logging
from typing import Any

from redis import Redis
from redis.client import Pipeline
from rq import Queue
from rq.job import Job

from store import defaults, scripts
from store.affinity import PREFER_FIELD, SESSION_FIELD
from store.errors import InvalidSessionId
from store.keys import Keys

log = logging.getLogger("rollouts.rq")

# The waiting flag outlives the blocking pop by this much at most (a worker killed while
# blocked): a job bounced to a dead worker meanwhile comes back within AFFINITY_BOUNCES.
WAITING_MARGIN_MS = 500


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return value or None


class RolloutJob(Job):
    """rq's job, with the session fields a session's call carries (``store.affinity``)."""

    session: str | None = None
    prefer: str | None = None

    def restore(self, raw_data: Any) -> Any:
        out = super().restore(raw_data)
        get = raw_data.get
        self.session = _text(get(SESSION_FIELD.encode(), get(SESSION_FIELD)))
        self.prefer = _text(get(PREFER_FIELD.encode(), get(PREFER_FIELD)))
        return out


def queue_claim(pipe: Pipeline, keys: Keys, me: str, queue: Queue, n: int) -> None:
    """Queue ``lua/claim_hints.lua`` for up to ``n`` jobs hinted to ``me`` on ``queue``; its
    reply is the claimed job ids, in ``queue``'s intermediate list as rq's dequeue leaves
    them. By its text: it rides in a pipeline, where a NOSCRIPT would fail the others."""
    pipe.execute_command(  # type: ignore[no-untyped-call]
        *scripts.CLAIM_HINTS.invocation(), 3, keys.worker_hints(me), queue.key,
        queue.intermediate_queue_key, n,
    )  # fmt: skip


def block_for_one(
    connection: Redis, keys: Keys, me: str, queue: Queue, timeout: int, *, flagged: bool
) -> tuple[str | None, int]:
    """rq's blocking dequeue of one job id (``Queue.lmove``: BLMOVE to the intermediate list),
    and the jobs left on ``queue`` right after it (``LLEN`` in the same round trip: Redis
    runs it as soon as the pop returns), so that a taker need not ask again whether more are
    queued (``RqBridge._take``). ``flagged``: with this worker flagged waiting on ``queue`` for
    as long as it blocks (the pipeline's DEL runs right after the BLMOVE returns, before any
    other command of this worker): what a worker that took a job preferring this one reads
    (``bounce``)."""
    waiting = keys.worker_waiting(me)
    with connection.pipeline(transaction=False) as pipe:
        if flagged:
            pipe.set(waiting, queue.key, px=timeout * 1000 + WAITING_MARGIN_MS)
        pipe.blmove(queue.key, queue.intermediate_queue_key, timeout)
        pipe.llen(queue.key)
        if flagged:
            pipe.delete(waiting)
        replies = pipe.execute()
    job_id, left = replies[1:3] if flagged else replies[:2]
    return _text(job_id), int(left)


def bounce(
    connection: Redis, keys: Keys, me: str, found: list[tuple[Job, Queue]]
) -> list[tuple[Job, Queue]]:
    """``found`` without the jobs given back for the worker they prefer (``lua/bounce_job.lua``:
    only while it waits on the queue). One round trip, only if a job prefers another worker."""
    away = [(j, q) for j, q in found if getattr(j, "prefer", None) not in (None, me)]
    if not away:
        return found
    try:
        with connection.pipeline(transaction=False) as pipe:
            for job, q in away:
                pipe.execute_command(  # type: ignore[no-untyped-call]
                    *scripts.BOUNCE_JOB.invocation(), 4, keys.worker_waiting(job.prefer),  # type: ignore[attr-defined]
                    job.key, q.intermediate_queue_key, q.key, job.id, defaults.AFFINITY_BOUNCES,
                )  # fmt: skip
            replies = pipe.execute(raise_on_error=False)
    except Exception:
        # Redis unreachable past the client's retries: the jobs are ours to start, never left
        # in the intermediate list for a sweep to find (a give-back that ran unanswered
        # queued the job again too: its second run is fenced out and superseded).
        log.warning("could not give jobs back to their workers; keeping them", exc_info=True)
        return found
    given = set()
    for (job, _), reply in zip(away, replies, strict=True):
        if isinstance(reply, Exception):
            # The job stays taken by this worker, as without affinity.
            log.warning("job %s: could not give it back to its worker (%s)", job.id, reply)
        elif reply == 1:
            given.add(job.id)
    return [(j, q) for j, q in found if j.id not in given]


def record_served(pipe: Pipeline, keys: Keys, me: str, jobs: list[Job]) -> bool:
    """Queue, in the transaction that starts ``jobs``, ``me`` as the worker of each of their
    sessions (``SET XX KEEPTTL``: the session's ``note`` made the record and owns its TTL; an
    expired or acknowledged session stays gone). Whether any of them has a session."""
    recorded = False
    for job in jobs:
        session = getattr(job, "session", None)
        if session is None:
            continue
        try:
            key = keys.session_worker(session)
        except InvalidSessionId:
            continue  # not written by our submit (anyone may enqueue): no session to record
        pipe.set(key, me, xx=True, keepttl=True)
        recorded = True
    return recorded
