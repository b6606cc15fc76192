"""redis-py's asyncio cluster client, riding out a master's failover as the single-Redis
client (``store.connection.connect``) rides out an outage: for up to ``RETRY_WINDOW_S``, with
backoff.

redis-py's own cluster client does not. After a connection error it reads the slot map again
(``initialize``), and that read asks the first master of the map for its command table: while
a dead master is still in the map (its failover takes ``cluster-node-timeout`` and ~1.5 s
more) that is often the dead one, the read fails, and the command fails with it, unretried.
Its own retries (``retry``'s count) go back to back with no pause, all spent in milliseconds.
So every command a worker sends outside its checkpoints (a rollout's load, a lease's read,
the fleet's beat) failed for the ~2.5 s of a failover; a run that met one failed, gave its job
back with its attempt still open and its lease held, and the job, met again, was dropped as a
duplicate of that attempt, which the reaper took over only when its lease lapsed (a
worker_lost charged, the rollout stalled for the lease TTL; seen in CI,
``tests/cluster/test_cluster_faults.py::test_plain_commands_ride_out_a_failover``).

Here the command table is read from the first master that answers, and a command or a
pipeline that failed for a reason the cluster heals (a connection lost or refused, a timeout,
CLUSTERDOWN, a slot not covered yet) is sent again after a backoff, until the window ends.
That repeats a command as redis-py's own retries (and the single-Redis client's) already do:
the store's writes are built to be repeated (a repeated append is recognised). The group
commits go their own way (``store.cluster_commit``), with the same window."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.backoff import EqualJitterBackoff
from redis.cluster import PRIMARY
from redis.exceptions import ClusterDownError, RedisClusterException, SlotNotCoveredError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

T = TypeVar("T")

# What a failover or a migration heals (never a refused credential: see ``retryable``).
HEALED = (RedisConnectionError, RedisTimeoutError, ClusterDownError, SlotNotCoveredError, OSError)


async def ride_out(
    do: Callable[[], Awaitable[T]],
    window_s: float,
    backoff: tuple[float, float],
    retryable: Callable[[Exception], bool],
) -> T:
    """``do()``, again after a backoff each time it fails healably, until ``window_s`` ends."""
    deadline = time.monotonic() + window_s
    pause = EqualJitterBackoff(*backoff)
    failures = 0
    while True:
        try:
            return await do()
        except HEALED as exc:
            failures += 1
            delay = pause.compute(failures)
            if not retryable(exc) or time.monotonic() + delay > deadline:
                raise
            await asyncio.sleep(delay)


class RidingCluster(RedisCluster):
    """``RedisCluster`` whose commands and pipelines ride out a failover (module docstring)."""

    def __init__(
        self,
        *args: Any,
        window_s: float,
        backoff: tuple[float, float],
        retryable: Callable[[Exception], bool],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.window_s, self.backoff, self.retryable = window_s, backoff, retryable
        read_table = self.commands_parser.initialize

        async def from_a_live_master(node: Any = None) -> None:
            # The command table (the same on every node) from the first master that answers;
            # that master becomes the default node (redis-py's pick, the map's first, may be
            # the one that is down).
            masters = self.nodes_manager.get_nodes_by_server_type(PRIMARY)
            tried: BaseException | None = None
            for candidate in [node, *(m for m in masters if m is not node)]:
                if candidate is None:
                    continue
                try:
                    await read_table(candidate)
                except HEALED as exc:
                    tried = exc
                    continue
                self.nodes_manager.default_node = candidate
                return
            if tried is not None:
                raise tried
            await read_table(node)

        self.commands_parser.initialize = from_a_live_master  # type: ignore[method-assign]

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return await ride_out(
            lambda: super(RidingCluster, self).execute_command(*args, **kwargs),
            self.window_s, self.backoff, self.retryable,
        )  # fmt: skip

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")  # type: ignore[no-untyped-call]
        return RidingPipeline(self, transaction)  # type: ignore[abstract]


class RidingPipeline(ClusterPipeline):
    """A cluster pipeline sent again, whole, after a healable failure (as a single Redis's
    pipeline is on a dropped connection): the commands the store pipelines are repeatable."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        client: RidingCluster = self.cluster_client  # type: ignore[assignment]
        strategy: Any = self._execution_strategy  # its queue is redis-py's own
        queued = list(strategy._command_queue)

        async def once() -> Any:
            # redis-py empties the queue after each try, failed or not: put it back.
            strategy._command_queue = list(queued)
            return await super(RidingPipeline, self).execute(raise_on_error, allow_redirections)

        return await ride_out(once, client.window_s, client.backoff, client.retryable)
