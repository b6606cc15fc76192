"""What an operator asks of a deployment, read straight from Redis: no API, no worker needed.

Pure reads. ``cluster_status`` is the trainer's ``stats`` plus the weights and the leases;
``rollouts_now`` is what holds one rollout right now (its lease, its rq jobs, the quarantine);
``find_stuck`` lists the rollouts nothing will move on by itself:

- waiting (pending or aborted) with no rq job that would run it (its job was deleted or lost);
- quarantined by a reaper (``Leases.quarantine``: it could not be read), with the reason;
- live with an expired lease (its worker is gone and no reaper is running to notice), or live
  with no lease at all (nothing would ever notice), and no job waiting to take it over.

Every read of the cluster is a snapshot of a moving system: a reaper aborts a rollout, then
enqueues it, a few milliseconds apart. ``find_stuck`` therefore looks twice, ``RECHECK_S``
apart, and reports a rollout only if it was stuck the same way both times at the same seq.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis import Redis as SyncRedis
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job
from rq.queue import Queue

from statemachine import LIVE, TERMINAL, WAITING, RolloutState, Status
from store import bulk, defaults, scripts, writable
from store.client import RolloutClient
from store.errors import StoreUnwritable
from store.event_store import FIRST, HEAD, JOB, STATUS, EventStore, submitted_record
from store.keys import Keys
from store.leases import Leases
from store.pause import Pause, PauseFlag
from store.queue import fetch_each, rollout_queue
from store.stats import WorkerBeat
from store.weights import WeightVersion

# Seconds between the two looks of ``find_stuck``: far longer than the gap between a reaper's
# abort and its enqueue (one round trip), short enough for a command someone waits on.
RECHECK_S = 0.5
_SCAN_COUNT = 1000  # keys per SCAN step: one round trip per thousand keys of the keyspace
_FETCH_CHUNK = 500  # rq jobs decoded per round trip when a job's rollout must be read


# -- the cluster ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkerView:
    beat: WorkerBeat
    lag: int | None  # weight versions behind the latest published (None: unknown)
    heartbeat_age_s: float


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    by_state: dict[Status, int]  # live states: now; terminal states: ever
    tokens: int
    queues: dict[str, int]
    workers: list[WorkerView]
    latest: WeightVersion | None
    leases: int  # leases held (generating rollouts)
    expired_leases: int  # of which expired (by Redis's clock): a reaper takes them back soon
    quarantined: int
    # Why Redis refuses writes right now (out of memory, a failed disk write, a read-only
    # replica), or None if it accepts them (``store.writable``).
    refusal: StoreUnwritable | None = None
    # The deployment's pause (a harness's /pause; workers take no new job), or None.
    paused: Pause | None = None


async def cluster_status(client: RolloutClient) -> ClusterStatus:
    stats = await client.stats()
    latest = await client.weights.latest()
    keys = client.keys
    leases = await Leases(client.redis, keys).read()
    quarantined = await client.redis.hlen(keys.quarantine())  # type: ignore[misc]
    now = stats.now  # Redis's clock, as the workers' heartbeats are stamped
    refused = await writable.refusal(client.redis, keys)
    paused = await PauseFlag(client.redis, keys).current()
    workers = [
        WorkerView(
            beat=w,
            lag=None
            if latest is None or w.weight_version is None
            else max(0, latest.version - w.weight_version),
            heartbeat_age_s=max(0.0, w.age_s(now)),
        )
        for w in stats.workers
    ]
    return ClusterStatus(
        by_state=stats.by_state,
        tokens=stats.tokens,
        queues=stats.queues,
        workers=workers,
        latest=latest,
        leases=leases.held,
        expired_leases=leases.expired,
        quarantined=int(quarantined),
        refusal=refused,
        paused=paused,
    )


# -- rq jobs ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class JobView:
    job_id: str
    queue: str
    where: str  # queued | dequeuing (taken off the queue, not started yet) | started
    alive: bool  # started: its execution's heartbeat is current; otherwise True
    worker: str | None = None  # started: the rq worker running it


def jobs_by_rollout(
    conn: SyncRedis, recorded: Mapping[str, str | None]
) -> dict[str, list[JobView]]:
    """The rq jobs, on any queue, that would run each rollout of ``recorded`` (rollout id ->
    the job ids its snapshot lists, space-separated, if any). Blocking: rq is synchronous.

    Every queue, its dequeue list and its started registry are read in one MULTI, so a job
    moving between them (a requeue, a dequeue) is seen exactly once. A job the reaper or an
    operator enqueued later has an id no snapshot records: such jobs are decoded (rq's own
    ``Job.fetch_many``) only while some rollout is still without a recorded job."""
    prefix = Queue.redis_queue_namespace_prefix  # the set holds queue keys, not names
    keys = conn.smembers(Queue.redis_queues_keys)
    names = sorted(k.decode().removeprefix(prefix) for k in keys)  # type: ignore[union-attr]
    queues = [rollout_queue(conn, n) for n in names]
    with conn.pipeline(transaction=True) as pipe:
        for q in queues:
            pipe.lrange(q.key, 0, -1)
            pipe.lrange(IntermediateQueue(q.key, conn).key, 0, -1)
            pipe.zrange(q.started_job_registry.key, 0, -1, withscores=True)
        replies = pipe.execute()
    # rq scores its started registry by the running worker's host clock (rq's own code), so
    # its "alive" is judged on a host clock too: skew beyond ~12 s shows a running job lapsed.
    now = time.time()
    seen: list[JobView] = []
    for i, q in enumerate(queues):
        queued, dequeuing, started = replies[3 * i : 3 * i + 3]
        seen += [JobView(j.decode(), q.name, "queued", True) for j in queued]
        seen += [JobView(j.decode(), q.name, "dequeuing", True) for j in dequeuing]
        for member, score in started:
            job_id = q.started_job_registry.parse_job_id(member)
            seen.append(JobView(job_id, q.name, "started", float(score) > now))
    # A snapshot lists every job made for its rollout, space-separated (lua/ack.lua).
    owner = {job: rid for rid, jobs in recorded.items() if jobs for job in jobs.split()}
    found = _match(seen, owner, recorded)
    unknown = {v.job_id for v in seen if v.job_id not in owner}
    if unknown and not all(found.values()):
        owner.update(_rollouts_of(conn, unknown))
        found = _match(seen, owner, recorded)
    return {rid: _with_workers(conn, jobs) for rid, jobs in found.items()}


def _match(
    seen: Iterable[JobView], owner: Mapping[str, str], wanted: Iterable[str]
) -> dict[str, list[JobView]]:
    found: dict[str, list[JobView]] = {rid: [] for rid in wanted}
    for v in seen:
        rid = owner.get(v.job_id)
        if rid is not None and rid in found:
            found[rid].append(v)
    return found


def _rollouts_of(conn: SyncRedis, job_ids: Iterable[str]) -> dict[str, str]:
    """job id -> the rollout id its payload names, for rollout jobs (anything else is left
    out: anyone who can write to Redis can enqueue anything)."""
    ids = sorted(job_ids)
    out: dict[str, str] = {}
    for start in range(0, len(ids), _FETCH_CHUNK):
        chunk = ids[start : start + _FETCH_CHUNK]
        for job in fetch_each(conn, chunk):
            if job is None:
                continue
            try:
                rid = job.kwargs.get("rollout_id")
            except Exception:
                # An undecodable payload: not one of ours (the worker refuses it too).
                continue
            if isinstance(rid, str):
                out[job.id] = rid
    return out


def _with_workers(conn: SyncRedis, jobs: list[JobView]) -> list[JobView]:
    started = [j for j in jobs if j.where == "started"]
    if not started:
        return jobs
    with conn.pipeline(transaction=False) as pipe:
        for j in started:
            pipe.hget(Job.key_for(j.job_id), "worker_name")
        names = dict(zip((j.job_id for j in started), pipe.execute(), strict=True))
    return [
        j
        if j.where != "started" or not names[j.job_id]
        else JobView(j.job_id, j.queue, j.where, j.alive, names[j.job_id].decode())
        for j in jobs
    ]


# -- one rollout, now -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RolloutNow:
    rollout_id: str
    state: RolloutState | None  # None: no such rollout, or ``problem`` says why unreadable
    problem: str | None
    lease_expiry_ms: int | None  # unix ms by Redis's clock
    quarantine: str | None  # the reason a reaper set it aside
    jobs: list[JobView]
    clock_ms: int  # Redis's clock when the lease was read: what judges it, never this host's

    @property
    def live_jobs(self) -> list[JobView]:
        return [j for j in self.jobs if j.alive]

    def lease_left_s(self) -> float | None:
        """How long the lease has left (<= 0: expired), None when nobody holds one."""
        if self.lease_expiry_ms is None:
            return None
        return (self.lease_expiry_ms - self.clock_ms) / 1000


async def rollouts_now(store: EventStore, conn: SyncRedis, ids: Sequence[str]) -> list[RolloutNow]:
    """What each rollout of ``ids`` is and what holds it, in a few round trips."""
    keys = store.keys
    replies: list[Any] = []
    reasons: list[Any] = []
    clocks: list[int] = []
    expiries: list[Any] = []
    # A MULTI per chunk (store/bulk.py): what holds one rollout is read at one instant; a
    # MULTI of every candidate at once (``find_stuck`` of a 100,000-rollout batch) would hold
    # Redis for all of them.
    for part in bulk.chunks(ids):
        if store.cluster:
            found, leases, quarantined = await _read_on_cluster(store, part)
            clock, _, _, their, _ = leases
            replies += found
            clocks += [int(clock)] * len(part)
            expiries += their
            reasons += quarantined
            continue
        async with store.redis.pipeline(transaction=True) as pipe:
            for rid in part:
                pipe.hmget(keys.snapshot(rid), [HEAD, JOB])
                pipe.xrange(keys.log(rid), FIRST, FIRST)
            # Their leases and Redis's clock, in the same MULTI as their states. By its text: a
            # NOSCRIPT inside a MULTI would spoil the whole read.
            read, grace = scripts.READ_LEASES, int(defaults.STORE_REAP_GRACE_S * 1000)
            pipe.execute_command(
                "EVAL", read.text, 2, keys.leases(), keys.lease_refusals(), grace, *part
            )
            pipe.hmget(keys.quarantine(), list(part))
            *found, leases, quarantined = await pipe.execute()
        clock, _, _, their, _ = leases
        replies += found
        clocks += [int(clock)] * len(part)
        expiries += their
        reasons += quarantined
    heads: dict[str, RolloutState | None] = {}
    problems: dict[str, str] = {}
    recorded: dict[str, str | None] = {}
    for i, rid in enumerate(ids):
        (head, job), sub = replies[2 * i], submitted_record(replies[2 * i + 1])
        recorded[rid] = job.decode() if job else None
        heads[rid] = None
        if head is not None and sub is not None:
            try:
                heads[rid] = store.decode_head(rid, head, sub)
            except Exception as exc:
                # Damaged or from newer code: shown with the reason, never a crash of the list.
                problems[rid] = f"{type(exc).__name__}: {exc}"
    jobs = await asyncio.to_thread(jobs_by_rollout, conn, recorded)
    out = []
    for i, rid in enumerate(ids):
        score = expiries[i]
        reason = reasons[i]
        out.append(
            RolloutNow(
                rollout_id=rid,
                state=heads[rid],
                problem=problems.get(rid),
                lease_expiry_ms=None if score is None else int(score),
                quarantine=None if reason is None else reason.decode(errors="replace"),
                jobs=jobs[rid],
                clock_ms=clocks[i],
            )
        )
    return out


async def _read_on_cluster(store: EventStore, part: Sequence[str]) -> tuple[list[Any], Any, Any]:
    """``rollouts_now``'s reads of one chunk on Redis Cluster, where each rollout, the lease
    index and the quarantine are in slots of their own: each rollout's snapshot and first
    entry (pipelined, a batch per master), then the leases and the quarantine. Not one
    instant: ``find_stuck`` looks twice, and a rollout that moved meanwhile is not stuck."""
    keys = store.keys
    async with store.redis.pipeline(transaction=False) as pipe:
        for rid in part:
            pipe.hmget(keys.snapshot(rid), [HEAD, JOB])
            pipe.xrange(keys.log(rid), FIRST, FIRST)
        found = await pipe.execute()
    view = await Leases(store.redis, keys).read(part)  # the shards', on one clock
    leases = (view.now_ms, 0, 0, [view.expiries.get(rid) for rid in part], 0)
    quarantined = await store.redis.hmget(keys.quarantine(), list(part))  # type: ignore[misc]
    return found, leases, quarantined


# -- stuck rollouts ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StuckRollout:
    rollout_id: str
    status: str  # a Status value, or "unreadable" / "missing" (quarantined ones only)
    kind: str  # quarantined | lease_expired | no_lease | no_job
    why: str
    seq: int  # the log position it was seen stuck at (0 when unreadable)
    queue: str | None
    worker_id: str | None
    tokens: int


def stuck_reason(now: RolloutNow) -> StuckRollout | None:
    """Why the rollout will not move on by itself, or None. Pure."""
    s = now.state
    if now.quarantine is not None:
        return _stuck(now, "quarantined", f"quarantined: {now.quarantine}")
    if s is None or s.status in TERMINAL:
        return None
    if s.status in LIVE:
        left = now.lease_left_s()
        if any(j.where != "started" for j in now.jobs):
            return None  # a job waits: whoever takes it takes the attempt over
        if left is None:
            why = (
                f"attempt {s.attempt} on worker {s.worker_id} is live but nobody holds its "
                "lease: no reaper will notice if that worker is gone"
            )
            return _stuck(now, "no_lease", why)
        if left <= 0:
            why = (
                f"lease of worker {s.worker_id} (attempt {s.attempt}) expired {-left:.1f} s "
                "ago and no reaper took it back (no worker running?)"
            )
            return _stuck(now, "lease_expired", why)
        return None
    if s.status in WAITING and not now.live_jobs:
        gone = [f"{j.job_id} ({j.where} on {j.queue}, heartbeat lapsed)" for j in now.jobs]
        why = f"{s.status.value} with {s.num_tokens} saved tokens and no rq job to run it"
        return _stuck(now, "no_job", why + (f"; only {', '.join(gone)}" if gone else ""))
    return None


def _stuck(now: RolloutNow, kind: str, why: str) -> StuckRollout:
    s = now.state
    if s is None:
        status = "unreadable" if now.problem else "missing"
        return StuckRollout(now.rollout_id, status, kind, why, 0, None, None, 0)
    return StuckRollout(
        now.rollout_id, s.status.value, kind, why, s.seq, s.queue, s.worker_id, s.num_tokens
    )


async def find_stuck(
    store: EventStore, conn: SyncRedis, *, recheck_s: float = RECHECK_S
) -> list[StuckRollout]:
    """Every stuck rollout, by rollout id (see the module docstring for what counts)."""
    first = await _stuck_of(store, conn, await _candidates(store))
    if not first:
        return []
    await asyncio.sleep(recheck_s)
    second = {s.rollout_id: s for s in await _stuck_of(store, conn, [s.rollout_id for s in first])}
    return [
        again
        for s in first
        if (again := second.get(s.rollout_id)) is not None
        and (again.kind, again.seq) == (s.kind, s.seq)
    ]


async def _stuck_of(store: EventStore, conn: SyncRedis, ids: Sequence[str]) -> list[StuckRollout]:
    found = [stuck_reason(n) for n in await rollouts_now(store, conn, ids)]
    return [s for s in found if s is not None]


async def _candidates(store: EventStore) -> list[str]:
    """Rollouts that have not ended (their snapshot's status), the quarantined and the
    leased ones."""
    ids = [rid async for part in with_status(store, UNENDED, unknown=True) for rid in part]
    ids += (await Leases(store.redis, store.keys).quarantined()).keys()
    for shard in range(store.keys.lease_shards):
        ids += [m.decode() for m in await store.redis.zrange(store.keys.leases(shard), 0, -1)]
    return sorted(set(ids))


UNENDED = frozenset(Status) - TERMINAL


async def with_status(
    store: EventStore, statuses: frozenset[Status], per: int = _SCAN_COUNT, *, unknown: bool = False
) -> AsyncIterator[list[str]]:
    """The rollouts whose snapshot's status is one of ``statuses`` (and with ``unknown``, those
    whose snapshot has none: damaged, for a reader to say why), at most ``per`` at a time and
    each once: a SCAN of the snapshots, never a KEYS, so that what the store alone says (no rq
    key read) is found in a deployment of any size without holding it all at once."""
    keys: Keys = store.keys
    wanted = {s.value.encode() for s in statuses}
    seen: set[str] = set()  # SCAN may return a key twice (a rehash between two steps)
    names: list[str] = []
    glob = keys.snapshots_glob()
    async for key in store.redis.scan_iter(match=glob, count=_SCAN_COUNT, _type="hash"):
        rid = keys.rollout_of_snapshot(key.decode())
        if rid not in seen:
            seen.add(rid)
            names.append(rid)
        if len(names) >= per:
            yield await _having(store, names, wanted, unknown)
            names = []
    if names:
        yield await _having(store, names, wanted, unknown)


async def _having(
    store: EventStore, names: list[str], wanted: set[bytes], unknown: bool
) -> list[str]:
    async with store.redis.pipeline(transaction=False) as pipe:
        for rid in names:
            pipe.hget(store.keys.snapshot(rid), STATUS)
        statuses = await pipe.execute()
    return [
        rid
        for rid, st in zip(names, statuses, strict=True)
        if st in wanted or (unknown and st is None)
    ]
