"""Steps of a worker's shutdown, each bounded: the process is going away, and nothing that
hangs or fails on the way (a task that swallows its cancel, Redis gone) may keep it from
exiting or skip the steps after it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from store.errors import unwritable

log = logging.getLogger("rollouts.worker")


async def stop_all(tasks: list[asyncio.Task[Any]], timeout_s: float) -> None:
    """Cancel ``tasks`` and wait for them, at most ``timeout_s``: a task that swallowed its
    cancel is logged and left behind rather than waited for forever."""
    for task in tasks:
        task.cancel()
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        log.error("task %s did not stop within %.1f s; leaving it", task.get_name(), timeout_s)


async def bounded(step: Awaitable[Any], timeout_s: float, what: str) -> None:
    """One shutdown step, at most ``timeout_s``; its failure is logged, never raised (the
    process is going away; nothing else must be skipped for it)."""
    try:
        await asyncio.wait_for(step, timeout_s)
    except TimeoutError:
        log.error("closing the %s took over %.1f s; going on", what, timeout_s)
    except Exception as exc:
        # Redis gone (or refusing writes) during shutdown: whatever is left is recovered by
        # leases and the reaper.
        log.warning("closing the %s failed: %s", what, exc, exc_info=not is_outage(exc))


def is_outage(exc: BaseException) -> bool:
    """Redis unreachable, or refusing writes for a condition of its own: logged without a
    traceback (it says nothing about the code)."""
    return isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError) or (
        unwritable(exc) is not None
    )
