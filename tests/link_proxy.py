"""A bad network link, on loopback: a TCP proxy in front of a server (Redis) that delays every
chunk by a random latency and drops connections when told to.

Each direction of each connection keeps its order: a chunk is delivered at its arrival plus a
latency drawn from ``latency_s``, or just after the chunk before it if that is later (a
link's delay, not reordering). A drop closes both sides of a connection at once, as a
switch or NAT losing the flow would: the server sees its client go away (and drops its
subscriptions), the client sees its socket closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field


@dataclass(eq=False)  # hashed by identity: held in a set
class _Link:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for writer in (self.client, self.server):
            writer.transport.abort()


class LinkProxy:
    def __init__(
        self, target_port: int, *, latency_s: tuple[float, float] = (0.05, 0.2), seed: int = 0
    ) -> None:
        self.target_port = target_port
        self.latency_s = latency_s
        self.rng = random.Random(seed)
        self.links: set[_Link] = set()
        self.dropped = 0  # connections dropped so far
        self.accepted = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def drop(self, fraction: float = 1.0) -> int:
        """Drop each open connection with probability ``fraction``; returns how many."""
        doomed = [link for link in self.links if self.rng.random() < fraction]
        for link in doomed:
            self.links.discard(link)
            link.close()
        self.dropped += len(doomed)
        return len(doomed)

    async def close(self) -> None:
        self.drop(1.0)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            c_writer.transport.abort()
            return
        self.accepted += 1
        link = _Link(c_writer, s_writer)
        self.links.add(link)
        link.tasks = [
            asyncio.create_task(self._pump(c_reader, s_writer, link)),
            asyncio.create_task(self._pump(s_reader, c_writer, link)),
        ]

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        deliver = asyncio.create_task(self._deliver(queue, writer))
        last = 0.0
        try:
            while chunk := await reader.read(65536):
                last = max(last, loop.time() + self.rng.uniform(*self.latency_s))
                queue.put_nowait((last, chunk))
            queue.put_nowait((last, b""))  # end of stream: after what is in flight
            await deliver
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            deliver.cancel()
            if link in self.links:
                self.links.discard(link)
                link.close()

    async def _deliver(
        self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            at, chunk = await queue.get()
            await asyncio.sleep(max(0.0, at - loop.time()))
            if not chunk:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(chunk)
            await writer.drain()
