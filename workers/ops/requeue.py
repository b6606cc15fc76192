"""``rollouts requeue``: give rollouts a job again, named by id or every one waiting for a worker
with none (``--all-waiting``).

Each job goes at the front of the rollout's own queue, as the reaper gives a lost worker's
rollout back (``store.queue.enqueue_rollouts``), listed on its snapshot so that its ack deletes
it. Neither form ever gives a second job to a rollout that has one, or a job to a rollout that
is generating under a valid lease: that would start a second run.

``--all-waiting`` is the rebuild after the queue's Redis is lost (docs/cluster-plan.md §6, 14):
nothing durable lives only in rq, so the waiting rollouts are found from the store alone (a SCAN
of the snapshots, ``store.inspect.with_status``) and each is looked at twice, ``RECHECK_S``
apart, as ``rollouts stuck`` looks (a reaper aborts, then enqueues, a few milliseconds apart).
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from typing import Any

from statemachine import LIVE, WAITING
from store import bulk
from store.client import RolloutClient
from store.inspect import RECHECK_S, RolloutNow, rollouts_now, with_status
from store.queue import enqueue_rollouts, rollout_queue
from workers.ops.commands import OperatorError, common_arguments, run_action

# Rollouts read per step of ``--all-waiting``: each step reads every rq queue's lists once
# (``store.inspect.jobs_by_rollout``), so a step of a thousand keeps 100,000 waiting rollouts
# to a hundred such reads, and never holds them all in memory at once.
_PER = 1000


def configure(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser, json_flag=False)
    parser.add_argument(
        "ids", nargs="*", metavar="ID",
        help="stuck or quarantined rollouts to requeue (or --all-waiting; default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--all-waiting", action="store_true",
        help="instead of IDs, every rollout waiting for a worker (pending, aborted or between "
        "turns) with no rq job, found from the store alone: after the queue's Redis or its "
        "jobs were lost (a switch)",
    )  # fmt: skip
    parser.add_argument(
        "--dry-run", action="store_true",
        help="print what would be requeued and write nothing (a switch)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if bool(args.ids) == args.all_waiting:
        raise OperatorError("name rollout IDs or --all-waiting, not both and not neither", 2)
    return run_action(_requeue_all_waiting if args.all_waiting else _requeue_ids, args)


async def _requeue_ids(client: RolloutClient, conn: Any, args: argparse.Namespace) -> int:
    ids = list(dict.fromkeys(args.ids))
    nows = await rollouts_now(client.store, conn, ids)
    refusals = [why for now in nows if (why := refusal(now)) is not None]
    if refusals:
        # All or nothing: a typo'd or ended id among them requeues none.
        raise OperatorError("; ".join(refusals) + ": nothing requeued")
    for now in nows:
        state = now.state
        assert state is not None  # refusal() refused the unreadable and the missing
        if not args.dry_run:
            await _enqueue(client, conn, state.queue, [state.rollout_id])
            if now.quarantine is not None:  # after its job is pushed: a refused push keeps it
                await client.redis.hdel(client.keys.quarantine(), state.rollout_id)  # type: ignore[misc]
        print(f"{_did(args)} {state.rollout_id} on {state.queue}: {what_next(now)}")
    return 0


async def _requeue_all_waiting(client: RolloutClient, conn: Any, args: argparse.Namespace) -> int:
    left = Counter[str]()  # why each waiting rollout it did not requeue was left alone
    first = await _first_look(client, conn, left)
    if first:
        await asyncio.sleep(RECHECK_S)
    done = 0
    for part in bulk.chunks(sorted(first), _PER):
        by_queue: dict[str, list[RolloutNow]] = {}
        for now in await rollouts_now(client.store, conn, part):
            why = _not_waiting(now)
            if why is None and now.state is not None and now.state.seq != first[now.rollout_id]:
                why = "moved on meanwhile"  # a worker, an operator or a reaper got to it first
            if why is not None:
                left[why] += 1
            elif now.state is not None:
                by_queue.setdefault(now.state.queue, []).append(now)
        for queue, nows in by_queue.items():
            if not args.dry_run:
                await _enqueue(client, conn, queue, [n.rollout_id for n in nows])
            for now in nows:
                print(f"{_did(args)} {now.rollout_id} on {queue}: {what_next(now)}")
            done += len(nows)
    summary = f"{_did(args)} {done} waiting rollout{'' if done == 1 else 's'}"
    if left:
        summary += "; left alone: " + ", ".join(f"{n} {why}" for why, n in sorted(left.items()))
    print(summary + ("; dry run: nothing written" if args.dry_run else ""))
    return 0


async def _first_look(client: RolloutClient, conn: Any, left: Counter[str]) -> dict[str, int]:
    """rollout id -> the seq it was seen at, waiting with no job, of every rollout whose
    snapshot says it waits; the others counted in ``left`` by why."""
    first: dict[str, int] = {}
    async for part in with_status(client.store, WAITING, _PER):
        for now in await rollouts_now(client.store, conn, part):
            why = _not_waiting(now)
            if why is not None:
                left[why] += 1
            elif now.state is not None:
                first[now.rollout_id] = now.state.seq
    return first


def _not_waiting(now: RolloutNow) -> str | None:
    """Why ``--all-waiting`` leaves this rollout alone, or None: it waits for a worker (its
    status, read from its log's head, not only its snapshot's status field) and nothing will
    give it one. A quarantined one is an operator's call (``rollouts stuck`` shows why), and
    a live one is never touched: its worker runs it, or a reaper takes it back by its lease."""
    s = now.state
    if s is None:
        return "unreadable" if now.problem else "gone"
    if s.status not in WAITING:
        return "no longer waiting"  # its snapshot said waiting; it ended or started since
    if now.quarantine is not None:
        return "quarantined (rollouts stuck says why)"
    left = now.lease_left_s()
    if left is not None and left > 0:
        return "with a valid lease"
    if now.live_jobs:
        return "with a job"
    return None


async def _enqueue(client: RolloutClient, conn: Any, queue: str, ids: list[str]) -> None:
    # As the reaper gives a lost worker's rollout back: at the front of its own queue.
    # With the queue apart (store.queue_redis), the jobs' ids are recorded on the store first.
    store = client.sync_store if client.queue_apart else None
    await asyncio.to_thread(
        enqueue_rollouts, rollout_queue(conn, queue), ids, at_front=True, keys=client.keys,
        store=store,
    )  # fmt: skip


def _did(args: argparse.Namespace) -> str:
    return "would requeue" if args.dry_run else "requeued"


def refusal(now: RolloutNow) -> str | None:
    """Why requeueing this rollout would be wrong (so that no operator can start a second run
    of a rollout that has one), or None."""
    rid, s = now.rollout_id, now.state
    if s is None:
        return (
            f"rollout {rid!r} cannot be read ({now.problem})"
            if now.problem
            else (f"no rollout {rid!r}")
        )
    if s.terminal:
        return f"rollout {rid!r} has ended ({s.status.value})"
    left = now.lease_left_s()
    if left is not None and left > 0:
        return f"rollout {rid!r} is generating on {s.worker_id} (lease valid {left:.1f}s more)"
    if now.live_jobs:
        j = now.live_jobs[0]
        return f"rollout {rid!r} already has job {j.job_id} ({j.where} on {j.queue})"
    return None


def what_next(now: RolloutNow) -> str:
    s = now.state
    assert s is not None
    if s.status in LIVE:
        what = (
            f"attempt {s.attempt} on {s.worker_id} is taken over by the next worker, which "
            f"resumes from {s.num_tokens} saved tokens"
        )
    elif s.num_tokens:
        what = f"{s.status.value}, resumes from {s.num_tokens} saved tokens"
    else:
        what = f"{s.status.value}, starts from the prompt"
    return what + ("; out of quarantine" if now.quarantine is not None else "")
