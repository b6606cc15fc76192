"""Whether Redis accepts writes now, asked without writing anything.

Redis refuses writes for conditions of its own (``store.errors.StoreUnwritable``): used memory
above ``maxmemory`` with nothing to evict, a failed RDB save or AOF write, a read-only replica.
Each is judged by Redis before a command runs, so the exact question is a write that changes
nothing: ``SET <probe> "" XX`` of a key that never exists. It is refused exactly when a
checkpoint would be (``SET`` may grow memory, so it is checked against ``maxmemory`` as an
append is), and accepted it writes nothing, so it is not replicated nor logged to the AOF.
Reading ``INFO`` instead would mean re-deriving Redis's own rules (memory not counted against
``maxmemory``, save points, the AOF fsync status), and ``PING`` is refused under MISCONF only.
On Redis Cluster each master is asked (a probe key in a slot of each), since each refuses for
conditions of its own.
"""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from store.errors import StoreUnwritable, unwritable
from store.keys import Keys
from store.masters import one_slot_each


async def refusal(redis: Redis, keys: Keys) -> StoreUnwritable | None:
    """Why Redis refuses writes now, or None if it accepts them. Raises any other error
    (Redis unreachable, an ACL that forbids the probe)."""
    if isinstance(redis, RedisCluster):
        return await _masters_refusal(redis, keys)
    try:
        await redis.set(keys.write_probe(), b"", xx=True)
    except ResponseError as exc:
        return _named(exc)
    return None


async def _masters_refusal(client: RedisCluster, keys: Keys) -> StoreUnwritable | None:
    """``refusal`` on Redis Cluster: every master asked at once (each refuses for its own
    reasons: its memory, its disk), through a probe key in a slot of each; the first that
    refuses is named with its address."""
    masters = await one_slot_each(client)
    probes = [client.set(keys.slot_write_probe(slot), b"", xx=True) for _, slot in masters]
    answers = await asyncio.gather(*probes, return_exceptions=True)
    for (node, _), answer in zip(masters, answers, strict=True):
        if isinstance(answer, ResponseError):
            named = _named(answer)
            return StoreUnwritable(named.refusal, f"{named.detail} (master {node.name})")
        if isinstance(answer, BaseException):
            raise answer
    return None


def _named(exc: ResponseError) -> StoreUnwritable:
    named = unwritable(exc)
    if named is None:
        raise exc
    return named
