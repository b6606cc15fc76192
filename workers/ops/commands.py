"""The operator commands: ``rollouts status``, ``show``, ``stuck`` and ``cancel`` (``requeue``
is in ``workers.ops.requeue``).

They read Redis directly (the same URL options as ``rollouts worker``) and work with no API and
no worker running. Reads go through ``store.inspect`` and ``store.timeline``; the two that
write go through the operations that already exist: ``cancel`` is the trainer's
``RolloutClient.cancel``, ``requeue`` enqueues as the reaper does (``store.queue``).

Failures are raised as ``OperatorError`` (one line, an exit code); ``workers.cli`` prints them
as ``rollouts COMMAND: error: ...``, with the traceback under ``--debug``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from statemachine import RolloutState
from store import lifecycle, queue_redis, redis_options
from store.client import RolloutClient
from store.connection import DEFAULT_URL, connect_sync
from store.errors import InvalidRedisUrl, RolloutNotFound
from store.inspect import cluster_status, find_stuck, rollouts_now
from store.lifecycle import RolloutEnded
from store.timeline import build as build_timeline
from workers.errors import WorkerError
from workers.ops import episode_text, timeline_plot
from workers.ops import text as ops_text

CANCEL_REASON = "cancelled by an operator"


class OperatorError(WorkerError):
    """What an operator command refuses or cannot do: one line, and the exit code to use
    (1: refused or failed; 2: a usage or configuration error, as argparse's own)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# -- argparse ---------------------------------------------------------------------------------
def common_arguments(parser: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    redis_options.add_arguments(parser, otherwise=DEFAULT_URL)
    queue_redis.add_argument(parser)
    if json_flag:
        parser.add_argument("--json", action="store_true", help="print JSON for scripts (a switch)")


def configure_status(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser)


def configure_show(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser)
    parser.add_argument("rollout_id", nargs="?", metavar="ID",
                        help="the rollout to show (required, unless --session)")  # fmt: skip
    parser.add_argument("--session", metavar="S", help="instead of a rollout, list session S's "
                        "calls in order, with their rollouts' states (default: none)")  # fmt: skip
    parser.add_argument(
        "--plot", metavar="FILE", help="also draw the timeline into FILE (.png, .svg or .pdf; "
        "needs matplotlib): the attempts colored by weight version, with their workers, aborts "
        "and resumes (default: none)",
    )  # fmt: skip


def configure_stuck(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser)


def configure_cancel(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser, json_flag=False)
    parser.add_argument(
        "ids", nargs="*", metavar="ID", help="rollouts to cancel (or --batch; default: none)"
    )
    parser.add_argument("--batch", metavar="B", help="cancel every rollout of batch B that has "
                        "not ended (default: none; the IDs are cancelled)")  # fmt: skip
    parser.add_argument(
        "--group", type=int, metavar="G", help="with --batch: only group G (default: all groups)"
    )
    parser.add_argument(
        "--reason",
        default=CANCEL_REASON,
        help=f"recorded with each cancel (default: {CANCEL_REASON!r})",
    )


# -- running ----------------------------------------------------------------------------------
Action = Callable[[RolloutClient, Any, argparse.Namespace], Awaitable[int]]


def run_action(action: Action, args: argparse.Namespace) -> int:
    try:
        url = redis_options.resolve(args) or DEFAULT_URL
        queue_url = queue_redis.resolve(url, args.queue_redis)
    except InvalidRedisUrl as exc:
        raise OperatorError(str(exc), 2) from exc  # names the file, never the URL

    async def go() -> int:
        client = RolloutClient(url, queue_url=queue_url)
        conn = connect_sync(queue_url)  # rq's (synchronous) view: queues, registries, jobs
        try:
            return await action(client, conn, args)
        finally:
            await client.aclose()
            conn.close()

    return asyncio.run(go())


def _print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def run_status(args: argparse.Namespace) -> int:
    return run_action(_status, args)


def run_show(args: argparse.Namespace) -> int:
    if (args.rollout_id is None) == (args.session is None):
        raise OperatorError("name a rollout ID or --session S, not both and not neither", 2)
    if args.session is not None:
        if args.plot is not None:
            raise OperatorError("--plot draws one rollout: not with --session", 2)
        return run_action(_show_session, args)
    if args.plot is not None:
        # Before anything is read: a bad FILE or a missing matplotlib costs nothing.
        problem = timeline_plot.check(args.plot)
        if problem is not None:
            raise OperatorError(problem, 2)
    return run_action(_show, args)


def run_stuck(args: argparse.Namespace) -> int:
    return run_action(_stuck, args)


def run_cancel(args: argparse.Namespace) -> int:
    if bool(args.ids) == (args.batch is not None):
        raise OperatorError("name rollout IDs or --batch B, not both and not neither", 2)
    if args.group is not None and args.batch is None:
        raise OperatorError("--group needs --batch", 2)
    return run_action(_cancel, args)


# -- the commands -----------------------------------------------------------------------------
async def _status(client: RolloutClient, conn: Any, args: argparse.Namespace) -> int:
    status = await cluster_status(client)
    if args.json:
        _print_json(ops_text.status_json(status))
    else:
        print(ops_text.status_text(status))
    return 0


async def _show(client: RolloutClient, conn: Any, args: argparse.Namespace) -> int:
    rid = args.rollout_id
    events = await client.store.events(rid)
    if not events:
        raise OperatorError(str(RolloutNotFound(rid)))
    timeline = build_timeline(events)
    [now] = await rollouts_now(client.store, conn, [rid])
    if args.json:
        shown = {**timeline.to_dict(), "now": ops_text.now_json(now)}
        if timeline.state.request.episode is not None:  # a plain rollout's JSON is unchanged
            shown["episode"] = episode_text.episode_json(timeline.state)
        _print_json(shown)
    else:
        print(ops_text.timeline_text(timeline, now))
    if args.plot is not None:
        # A live rollout's last bar runs to now; an ended one's picture ends where it ended.
        timeline_plot.plot_timelines(
            [timeline], args.plot, now=None if timeline.state.terminal else time.time()
        )
        if not args.json:  # stdout stays one JSON document
            print(f"timeline drawn to {args.plot}")
    return 0


async def _show_session(client: RolloutClient, conn: Any, args: argparse.Namespace) -> int:
    try:
        calls = await client.session(args.session)
    except ValueError as exc:  # InvalidSessionId: one line, as argparse's own
        raise OperatorError(str(exc), 2) from None
    if args.json:
        _print_json(ops_text.session_json(args.session, calls))
    else:
        print(ops_text.session_text(args.session, calls))
    return 0


async def _stuck(client: RolloutClient, conn: Any, args: argparse.Namespace) -> int:
    stuck = await find_stuck(client.store, conn)
    if args.json:
        _print_json(ops_text.stuck_json(stuck))
    else:
        print(ops_text.stuck_text(stuck))
    return 0


async def _cancel(client: RolloutClient, conn: Any, args: argparse.Namespace) -> int:
    if args.batch is not None:
        try:
            info = await client.batch(args.batch)
        except RolloutNotFound:
            raise OperatorError(f"no batch {args.batch!r}") from None
        try:
            targets = info.ids if args.group is None else info.group_ids(args.group)
            cancelled = await client.cancel(batch_id=args.batch, group=args.group,
                                            reason=args.reason)  # fmt: skip
        except ValueError as exc:  # a group the batch does not have
            raise OperatorError(str(exc), 2) from exc
    else:
        targets = list(dict.fromkeys(args.ids))
        cancelled = await _cancel_ids(client, targets, args.reason)
    done = set(cancelled)
    rest = [rid for rid in targets if rid not in done]
    ended = []
    for rid, head in zip(rest, await lifecycle.heads(client.store, rest), strict=True):
        ended.append(f"{rid} ({head.status.value if isinstance(head, RolloutState) else 'gone'})")
    print(f"cancelled {len(cancelled)}: {', '.join(cancelled) or '-'}")
    if ended:
        print(f"already ended {len(ended)}: {', '.join(ended)}")
    return 0


async def _cancel_ids(client: RolloutClient, ids: list[str], reason: str) -> list[str]:
    """Cancel the ids that have not ended; the ended ones are reported, not refused. Every id
    must exist: an unknown one cancels nothing."""
    heads = await lifecycle.heads(client.store, ids)
    missing = [str(h) for h in heads if isinstance(h, RolloutNotFound)]
    if missing:
        raise OperatorError("; ".join(missing) + ": nothing cancelled")
    for h in heads:
        if isinstance(h, Exception):
            raise h
    todo = [rid for rid, h in zip(ids, heads, strict=True)
            if isinstance(h, RolloutState) and not h.terminal]  # fmt: skip
    while todo:
        try:
            return await client.cancel(todo, reason=reason)
        except RolloutEnded as exc:
            # One ended between the look and the cancel (which then cancelled nothing).
            todo = [rid for rid in todo if rid not in exc.ended]
    return []
