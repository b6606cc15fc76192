"""Lua scripts, read from ``store/lua/*.lua`` once per process and loaded once per client.

Calls go straight to EVALSHA. redis-py's ``Script`` objects add a coroutine and a
``SCRIPT EXISTS`` round trip per pipeline, which measurably costs at checkpoint rates; instead
a NOSCRIPT reply (first use, or a server restart that emptied the script cache) repeats the
call by the script's text (EVAL, which caches it too), which is safe because every script here
is idempotent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import NoScriptError

Arg = int | str | bytes


@cache
def script_text(name: str) -> str:
    return resources.files("store").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


class Script:
    def __init__(self, name: str) -> None:
        self.name = name
        self.text = script_text(name)
        self.sha = hashlib.sha1(self.text.encode()).hexdigest()

    async def __call__(self, client: Redis, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        try:
            return await client.execute_command(  # type: ignore[no-untyped-call]
                "EVALSHA", self.sha, len(keys), *keys, *args
            )
        except NoScriptError:
            # The server has not seen it yet (or restarted): run it by its text, which also
            # caches it (a SCRIPT LOAD then EVALSHA could meet a restart in between).
            return await client.execute_command(  # type: ignore[no-untyped-call]
                "EVAL", self.text, len(keys), *keys, *args
            )

    async def many(
        self, client: Redis, calls: Sequence[tuple[Sequence[str], Sequence[Arg]]]
    ) -> list[Any]:
        """Run the script once per call in one pipelined round trip; replies in order."""
        replies = await self._pipelined(client, calls)
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            # As above, by the script's text; only the calls that hit NOSCRIPT are repeated.
            again = await self._pipelined(client, [calls[i] for i in missing], by_text=True)
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def _pipelined(
        self,
        client: Redis,
        calls: Sequence[tuple[Sequence[str], Sequence[Arg]]],
        *,
        by_text: bool = False,
    ) -> list[Any]:
        command, body = ("EVAL", self.text) if by_text else ("EVALSHA", self.sha)
        async with client.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                pipe.execute_command(command, body, len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))


def run_sync(client: SyncRedis, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
    """``Script.__call__`` for a synchronous client (the trainer's submit path runs beside rq,
    which is synchronous)."""
    try:
        return client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)  # type: ignore[no-untyped-call]
    except NoScriptError:
        # EVAL, not SCRIPT LOAD then EVALSHA: a server restarting in between (its script cache
        # is not persisted) would refuse the EVALSHA again. EVAL caches it as well.
        return client.execute_command("EVAL", script.text, len(keys), *keys, *args)  # type: ignore[no-untyped-call]


APPEND = Script("append")
PUBLISH_WEIGHTS = Script("publish_weights")
RELEASE_LEASE = Script("release_lease")
QUARANTINE_LEASE = Script("quarantine_lease")
CREATE_BATCH = Script("create_batch")
ACK = Script("ack")
STATS = Script("stats")
SUBMIT_CHUNK = Script("submit_chunk")
