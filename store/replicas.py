"""Replica acknowledgement of a trainer's writes (``--min-replicas-acked`` of ``rollouts api``,
``RolloutClient(min_replicas_acked=N)``): a submit, an ack or a weight version counts as done
once N replicas of Redis have it, as a worker's checkpoint does (there ``WAIT`` follows the
transaction on its own connection: ``scripts.transaction``).

``WAIT`` confirms the writes of the connection it runs on, and these calls write through
several (a pool, rq's synchronous one). Replication is one ordered stream, though: a write
made now, after every write of the call was answered, lies behind all of them in it, so a
replica that has it has them. ``confirm`` makes that write (a marker key, expiring) and waits
for it on the same connection, in one round trip. On Redis Cluster every master replicates
its own stream: a marker on each master, each waited for on its own connection.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from store.cluster_commit import Block, commit
from store.errors import ReplicasNotAcked
from store.keys import Keys
from store.masters import one_slot_each
from store.scripts import REPLICA_WAIT_MS

P = ParamSpec("P")
T = TypeVar("T")


async def confirm(redis: Redis, keys: Keys, replicas: int, wait_ms: int = REPLICA_WAIT_MS) -> None:
    """Until ``replicas`` replicas hold every write answered before this call; else
    ``ReplicasNotAcked`` (the writes stand on the master: retry the call, which is
    idempotent, once the replicas are back). Nothing is asked for 0."""
    if replicas <= 0:
        return
    if isinstance(redis, RedisCluster):
        await _confirm_masters(redis, keys, replicas, wait_ms)
        return
    async with redis.pipeline(transaction=False) as pipe:
        pipe.set(keys.replica_mark(), b"", px=60_000)
        pipe.execute_command("WAIT", replicas, wait_ms)
        _, acked = await pipe.execute()
    if int(acked) < replicas:
        where = redis.get_connection_kwargs()  # type: ignore[no-untyped-call]
        raise ReplicasNotAcked(f"{where.get('host')}:{where.get('port')}", replicas, int(acked))


async def _confirm_masters(client: RedisCluster, keys: Keys, replicas: int, wait_ms: int) -> None:
    """``confirm`` on Redis Cluster, where each master replicates its own stream: a marker in
    a slot of every master (the call may have written to any of them, through any of its
    connections), each followed by ``WAIT`` on that master's connection that wrote it
    (``store.cluster_commit``), every master at once. The first master short is raised."""
    blocks = [Block(slot, (("SET", keys.slot_replica_mark(slot), b"", "PX", 60_000),))
              for _, slot in await one_slot_each(client)]  # fmt: skip
    for replies in await commit(client, blocks, replicas=replicas, wait_ms=wait_ms):
        if isinstance(replies, Exception):
            raise replies


class _Acking(Protocol):
    redis: Redis
    keys: Keys
    min_replicas_acked: int


S = TypeVar("S", bound=_Acking)


def acked(
    call: Callable[Concatenate[S, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]:
    """A client method whose writes count as done once ``self.min_replicas_acked`` replicas
    hold them (``confirm``, after the call returned)."""

    @functools.wraps(call)
    async def confirmed(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        result = await call(self, *args, **kwargs)
        await confirm(self.redis, self.keys, self.min_replicas_acked)
        return result

    return confirmed
