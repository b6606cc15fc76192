"""A loopback TCP proxy between one worker and Redis: a link the soak can make slow and flaky.

Clean, it forwards bytes as they come. Slow (``slow``), every chunk it forwards is held back
50-200 ms (in order: a later chunk never overtakes an earlier one, as on a real link), and each
connection is dropped now and then (both sides reset at once, as a broken middlebox does). It
runs on a thread of its own, with its own event loop, so that nothing the soak does on its
loop (a blocking call, a long audit) stalls the link, and a link fault is all the worker sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from dataclasses import dataclass

DROP_TICK_S = 0.5  # how often each connection rolls the dice for a drop
STOP_S = 5.0


@dataclass(frozen=True, slots=True)
class LinkMode:
    latency_s: tuple[float, float] = (0.0, 0.0)
    drops_per_s: float = 0.0  # per connection

    @property
    def clean(self) -> bool:
        return self.latency_s == (0.0, 0.0) and self.drops_per_s == 0.0


CLEAN = LinkMode()


class LinkProxy:
    def __init__(self, upstream_port: int, *, seed: int = 0) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.mode = CLEAN
        self.connections = 0
        self.drops = 0
        self._rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> int:
        """Listen on a free loopback port; returns it."""
        self._thread = threading.Thread(target=self._run, name="soak-link", daemon=True)
        self._thread.start()
        if not self._ready.wait(STOP_S):
            raise RuntimeError("the link proxy did not start")
        return self.port

    def set_mode(self, mode: LinkMode) -> None:
        self.mode = mode  # read by the proxy's thread: one attribute, replaced whole

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):
                # Its loop has already ended.
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(STOP_S)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        dropper = asyncio.create_task(self._drop_now_and_then())
        async with server:
            await self._stop.wait()
            server.close()
            dropper.cancel()
            for pair in list(self._pairs):
                _reset(*pair)
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._relay(reader, writer)
        except asyncio.CancelledError:
            # The proxy is stopping. Ending normally: a cancelled connection task makes
            # asyncio's streams log a traceback (Python 3.11) for nothing wrong.
            pass
        finally:
            self._tasks.discard(task)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            # Redis is down (a restart): the client sees its connection refused, in effect.
            _reset(writer)
            return
        pair = (writer, up_writer)
        self._pairs.add(pair)
        try:
            await asyncio.gather(
                self._pump(reader, up_writer), self._pump(up_reader, writer),
                return_exceptions=True,
            )  # fmt: skip
        finally:
            self._pairs.discard(pair)
            _reset(*pair)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward one direction; in slow mode each chunk is delivered ``latency`` after it
        arrived, never before the chunk ahead of it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            due_last = 0.0
            while data := await reader.read(65536):
                lo, hi = self.mode.latency_s
                delay = self._rng.uniform(lo, hi) if hi > 0 else 0.0
                due_last = max(due_last, loop.time() + delay)
                queue.put_nowait((due_last, data))
            queue.put_nowait(None)  # the other side closed: deliver what is held, then close
            await sender
        finally:
            sender.cancel()
            _reset(writer)

    async def _drop_now_and_then(self) -> None:
        while True:
            await asyncio.sleep(DROP_TICK_S)
            p = self.mode.drops_per_s * DROP_TICK_S
            for pair in list(self._pairs):
                if p > 0 and self._rng.random() < p:
                    self.drops += 1
                    _reset(*pair)


def _reset(*writers: asyncio.StreamWriter) -> None:
    for w in writers:
        # abort(): an RST, not a FIN; the other side learns at once that the link broke.
        with contextlib.suppress(Exception):
            # Already closed.
            w.transport.abort()
