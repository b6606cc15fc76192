"""What an environment runner does beside running calls: renew its claims' leases, and sweep
every runner's lapsed ones.

The heartbeat renews the leases of all the calls running here in one round trip; a claim it
finds no longer live was given up (the sweep saw its lease lapse: this runner stalled) or its
episode ended, so the tool's task is cancelled: it is fenced out, and its report would be
refused anyway. The sweep (``store.tool_sweep``) turns lapsed leases into ``ToolCallLost``,
so that a deployment whose only environment is these runners still recovers a dead runner's
calls. Several runners sweeping at once are safe: each loss is an append fenced by the
episode's seq, so exactly one sweeper records it, and the others are refused and move on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from store.environment import EnvironmentClient, ToolCallClaim
from store.errors import StoreError
from store.tool_sweep import sweep_lost_calls, sweep_wall_time
from workers.shutdown import is_outage

log = logging.getLogger("rollouts.env")


@dataclass(slots=True)
class Running:
    """A call running here. ``reporting``: its tool returned and its report is on the way (a
    heartbeat answering "not live" then is about the report itself, never a reason to cancel);
    ``fenced``: the heartbeat found its claim not live and cancelled it."""

    claim: ToolCallClaim
    reporting: bool = False
    fenced: bool = False


async def heartbeat_loop(
    env: EnvironmentClient,
    running: dict[asyncio.Task[None], Running],
    every_s: float,
    lease_s: float,
) -> None:
    """Every ``every_s``: renew the leases of ``running``'s claims for ``lease_s``; cancel the
    tools of those no longer live."""
    while True:
        await asyncio.sleep(every_s)
        calls = [(task, r) for task, r in running.items() if not r.reporting]
        if not calls:
            continue
        try:
            live = await env.heartbeat([r.claim for _, r in calls], lease_s)
        except (RedisError, OSError, StoreError) as exc:
            # A missed beat is survivable: the lease spans several.
            log.warning("heartbeat failed: %s", exc, exc_info=not is_outage(exc))
            continue
        for (task, r), ok in zip(calls, live, strict=True):
            if not ok and not r.reporting and not task.done():
                r.fenced = True
                task.cancel()


async def sweep_loop(
    env: EnvironmentClient, every_s: float, counted: Callable[[int], None]
) -> None:
    """Every ``every_s``: one pass of the lost-call sweep; ``counted`` gets how many calls it
    recorded lost."""
    while True:
        await asyncio.sleep(every_s)
        try:
            counted(len(await sweep_lost_calls(env.store)))
            await sweep_wall_time(env.store)
        except (RedisError, OSError, StoreError) as exc:
            # Redis gone or refusing: the next pass sees the same lapsed leases.
            log.warning("lost-call sweep failed: %s", exc, exc_info=not is_outage(exc))
        except Exception:
            # An unreadable rollout or a bug: logged with its traceback; one pass failing must
            # not stop this runner serving its calls, and the next pass tries again.
            log.exception("lost-call sweep failed")
