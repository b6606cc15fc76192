"""Whether Redis accepts writes now, asked without writing anything.

Redis refuses writes for conditions of its own (``store.errors.StoreUnwritable``): used memory
above ``maxmemory`` with nothing to evict, a failed RDB save or AOF write, a read-only replica.
Each is judged by Redis before a command runs, so the exact question is a write that changes
nothing: ``SET <probe> "" XX`` of a key that never exists. It is refused exactly when a
checkpoint would be (``SET`` may grow memory, so it is checked against ``maxmemory`` as an
append is), and accepted it writes nothing, so it is not replicated nor logged to the AOF.
Reading ``INFO`` instead would mean re-deriving Redis's own rules (memory not counted against
``maxmemory``, save points, the AOF fsync status), and ``PING`` is refused under MISCONF only.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from store.errors import StoreUnwritable, unwritable
from store.keys import Keys


async def refusal(redis: Redis, keys: Keys) -> StoreUnwritable | None:
    """Why Redis refuses writes now, or None if it accepts them. Raises any other error
    (Redis unreachable, an ACL that forbids the probe)."""
    try:
        await redis.set(keys.write_probe(), b"", xx=True)
    except ResponseError as exc:
        named = unwritable(exc)
        if named is None:
            raise
        return named
    return None
