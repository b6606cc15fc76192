"""redis-py asyncio connections that let a task's cancellation through.

A task cancelled while it runs synchronous code (a Ctrl-C landing between two awaits, a
worker's shutdown cancelling a loop that just woke) carries the cancel to its next await. When
that await is a Redis command, redis-py 7 on Python 3.11 (the version this was found and tested
on) swallows it in two places, and the task runs on as if never cancelled:

- the pool checks every connection it hands out with ``can_read_destructive``: a socket read
  under ``asyncio.timeout(0)``. A ``timeout`` counts a cancel already pending when it was
  entered as its own expiry and raises ``TimeoutError``, which redis-py reads as "no data";
- every command is written under ``asyncio.wait_for``, which on 3.11 returns the inner result
  when the inner write finished as the cancel came.

Here the check never awaits (whatever the server sent is already in the stream's buffer, read
there by the event loop), and the write runs under a plain ``timeout`` entered before it, which
leaves a cancel it did not cause alone. Everything else is redis-py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aredis
from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


def keep_cancels(client: aredis.Redis) -> aredis.Redis:
    """``client``, whose connections from now on let cancellation through (before its first)."""
    pool = client.connection_pool
    pool.connection_class = keeping(pool.connection_class)
    return client


def keeping(base: type[AbstractConnection]) -> type[AbstractConnection]:
    """``base`` with the cancel-safe methods (for a client with no pool of its own to patch:
    a Redis Cluster client's nodes, ``store.connection.connect_cluster``)."""
    # One per connection class a URL chooses (TCP, TLS, unix socket), made once.
    if base not in _MADE:
        _MADE[base] = type(f"CancelSafe{base.__name__}", (_CancelSafe, base), {})
    return _MADE[base]


_MADE: dict[type[AbstractConnection], type[AbstractConnection]] = {}


class _CancelSafe(AbstractConnection):
    """A mixin over whichever connection class; only the two methods that swallowed."""

    async def can_read_destructive(self) -> bool:
        parser = self._parser
        if not isinstance(parser, _AsyncHiredisParser):
            # redis-py's pure-Python parser polls with at_eof() under its timeout(0): it never
            # awaits there, so the timeout never fires and a pending cancel is left alone.
            return bool(await super().can_read_destructive())  # type: ignore[no-untyped-call]
        if not parser._connected:
            await self.disconnect(nowait=True)
            raise RedisConnectionError(f"Error while reading from {self._host_error()}: closed")
        reader: Any = parser._reader
        if reader.gets() is not NOT_ENOUGH_DATA:
            return True  # a reply already parsed and never read (consumed, as redis-py does)
        stream = self._reader
        # Bytes or an end of stream the loop has received and no one read: either way the
        # pool reconnects. StreamReader has no public peek; _buffer is what at_eof() reads.
        return stream is None or bool(stream._buffer) or stream.at_eof()  # type: ignore[attr-defined]

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        if not self.is_connected:
            await self.connect_check_health(check_health=False)
        if check_health:
            await self.check_health()  # type: ignore[no-untyped-call]
        if isinstance(command, str):
            command = command.encode()
        if isinstance(command, bytes):
            command = [command]
        writer: Any = self._writer
        try:
            if self.socket_timeout:
                async with asyncio.timeout(self.socket_timeout):
                    writer.writelines(command)
                    await writer.drain()
            else:
                writer.writelines(command)
                await writer.drain()
        except TimeoutError:
            await self.disconnect(nowait=True)
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as e:
            await self.disconnect(nowait=True)
            if len(e.args) == 1:
                err_no, errmsg = "UNKNOWN", e.args[0]
            else:
                err_no, errmsg = e.args[0], e.args[1]
            raise RedisConnectionError(f"Error {err_no} while writing to socket. {errmsg}.") from e
        except BaseException:
            # A cancel mid-write leaves part of a command on the socket: as redis-py does, the
            # connection is dropped rather than reused.
            await self.disconnect(nowait=True)
            raise
