"""A CPU engine on transformers + torch, for tests, demos and the tiny models.

`CpuEngine` is the front end that lives in the worker's process; the model and its decode
loop (`cpu.core.EngineCore`) run in a child process (`cpu.process`), as vLLM's AsyncLLM runs
its engine core. The worker's event loop, which records progress in Redis, therefore never
competes with the decode loop for the GIL (measured in-process: durable/direct 0.92 on
bench/bench_overhead.py; the reason is in `cpu.process`). The two talk over a pair of pipes in
framed msgpack (`cpu.wire`): requests go in by serial number, each decode round comes back
as one frame. Two threads here move the bytes, so the event loop never blocks on a pipe: a
writer, and a reader that hands every chunk to the event loop that asked for it (an engine
may be used from several loops).

Chunking: one chunk per sampled token (per decode step), carrying the weight version that
sampled it. It is also a ``StepEngine``: requests added with ``add`` come back a decode round
at a time (``steps``), one ``Step`` per frame for all of them, built by the reader thread and
handed to the event loop with one wake-up, instead of one queue item per token per request.

Abort: `abort` marks the stream aborted on the event loop at once (anything already queued
for it is dropped and its iterator raises RequestAborted) and tells the core, which forgets
the request before its next round.

Failures: an error of one request (a failed forward) ends that stream with EngineError and
nothing else. If the core process dies, every stream and load in flight and every later call
raise `EngineDead`: the worker then stops, saving what it has, so its rollouts resume on
another worker instead of using up their attempts here.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import subprocess
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.engines.base import Chunk, End, EngineLimits, EngineRequest, Step
from workers.engines.cpu.channel import (
    ERRORS,
    Post,
    StepBuilder,
    chunk_of,
    fresh,
    handshake,
    post_all,
    settler,
    spawn_core,
    still_open,
)
from workers.engines.cpu.wire import FrameReader, write_frame
from workers.engines.errors import (
    EngineClosed,
    EngineDead,
    EngineError,
    RequestAborted,
    WeightLoadError,
)
from workers.engines.identity import model_identity
from workers.engines.inflight import InFlightEngine, Stream, check_request

log = logging.getLogger(__name__)

# How long close() waits for the core to exit on its own before killing it.
CLOSE_TIMEOUT_S = 10.0


@dataclass(eq=False)
class _Stream(Stream):
    """Event-loop side of one request: its serial number for the core, and its queue."""

    serial: int
    queue: asyncio.Queue[Any] | None  # None: a request added with ``add`` (its tokens in steps)
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """What the core reported when asked: its pid, requests it holds, and its weights."""

    pid: int
    requests_in_flight: int
    weight_version: int


_END = object()  # queued to wake a consumer whose request was aborted


class CpuEngine(InFlightEngine[_Stream]):
    """`Engine` on a local Hugging Face model directory (see the module docstring)."""

    def __init__(
        self, model_dir: str | Path, *, weight_version: int = 0, threads: int | None = None
    ) -> None:
        # torch's intra-op pool spins on every core it owns; leave one to the worker's event
        # loop and Redis (measured: with all cores, durable/direct fell to ~0.7).
        threads = threads or max(1, (os.cpu_count() or 2) - 1)
        super().__init__(weight_version=weight_version, source=str(model_dir))
        self._serials = itertools.count()
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        # Guarded by _lock: where the reader thread sends each serial's chunks and each
        # token's reply, and the error every later call gets once the core is gone.
        self._sinks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._replies: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Any]] = {}
        # Guarded by _lock: serial -> request id of the requests added with ``add``, and where
        # their steps go (one loop and queue per engine: ``steps`` has one consumer).
        self._step_sinks: dict[int, str] = {}
        self._step_out: tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]] | None = None
        self._step_open: set[str] = set()  # on the event loop: added, end not yet consumed
        self._gone: EngineError | None = None
        # Messages for the core, written by a thread of their own: a write blocks while the
        # pipe is full (a long prompt, the core busy with a weight load), and the event loop
        # must not block with it.
        self._outbox: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self._proc, self._to_core, self._from_core = spawn_core(model_dir, weight_version, threads)
        reader = FrameReader(self._from_core)
        try:
            info = handshake(reader, self._proc, model_dir)
        except BaseException:
            self._kill()
            self._close_fds()
            raise
        self.pid: int = info["pid"]
        # After the handshake: the core has checked the directory and reports what is wrong.
        self._model_id = model_identity(model_dir)
        self._vocab_size: int = info["vocab_size"]
        self._max_positions: int = info["max_positions"]
        self._tokenizer: Any = None
        self._thread = threading.Thread(
            target=self._read_loop, args=(reader,), name="cpu-engine-reader", daemon=True
        )
        self._thread.start()
        self._writer = threading.Thread(target=self._write_loop, name="cpu-engine-writer")
        self._writer.daemon = True
        self._writer.start()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # noqa: PLC0415  (slow import; tests only)

            self._tokenizer = AutoTokenizer.from_pretrained(self._source, local_files_only=True)
        return self._tokenizer

    # ---- the Engine protocol ---------------------------------------------------------

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(context_length=self._max_positions, vocab_size=self._vocab_size)

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        self._check_request(request)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stream = _Stream(serial=next(self._serials), queue=queue)
        self._track(request.request_id, stream)
        finished = False
        try:
            with self._lock:
                self._raise_if_gone()  # under the lock: the reader's last sweep sees this sink
                self._sinks[stream.serial] = (loop, queue)
            self._send(_add_message(stream.serial, request))
            while True:
                item = await queue.get()
                if stream.aborted:
                    # Late outputs after abort() are dropped, whatever was already queued.
                    raise RequestAborted(f"request {request.request_id!r} was aborted")
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            self._untrack(request.request_id, stream)
            if not finished:
                # Aborted, or the consumer stopped iterating: free the core's slot.
                self._abort_serial(stream.serial)

    async def add(self, request: EngineRequest) -> None:
        self._check_request(request)
        loop = asyncio.get_running_loop()
        rid = request.request_id
        stream = _Stream(serial=next(self._serials), queue=None, request_id=rid)
        with self._lock:
            self._raise_if_gone()  # under the lock: the reader's last sweep sees this sink
            if self._step_out is None or self._step_out[0] is not loop:
                self._step_out = (loop, asyncio.Queue())
            self._step_sinks[stream.serial] = rid
        self._track(rid, stream)
        self._step_open.add(rid)
        self._send(_add_message(stream.serial, request))

    async def steps(self) -> AsyncIterator[Step]:
        out = self._step_out
        while out is not None and (self._step_open or not out[1].empty()):
            item = await out[1].get()
            if isinstance(item, BaseException):
                raise item
            item = self._still_open(item)
            for rid in item.ends:
                self._step_open.discard(rid)
                stream = self._streams.get(rid)
                if stream is not None and stream.queue is None:
                    self._untrack(rid, stream)
            yield item

    def _still_open(self, step: Step) -> Step:
        """``step`` without what it holds of requests aborted since the reader queued it (the
        reader builds steps ahead of the consumer): after ``abort`` returns, no token of the
        request comes, and its only end is the abort's."""
        return still_open(step, self._step_open.__contains__)

    async def _stop(self, stream: _Stream) -> None:
        if stream.queue is None:
            # Added with ``add``: its end is reported in the steps, as an abort.
            self._step_open.discard(stream.request_id)
            aborted = RequestAborted(f"request {stream.request_id!r} was aborted")
            if self._step_out is not None:
                ended = Step.only_ends({stream.request_id: End(error=aborted)})
                self._step_out[1].put_nowait(ended)
        else:
            stream.queue.put_nowait(_END)
        self._abort_serial(stream.serial)

    async def load_weights(self, source: str, version: int) -> None:
        await self._ask(["load", None, str(source), version], (str(source), version))

    async def health(self) -> EngineHealth:
        """Ask the core how it is; raises EngineDead/EngineClosed if it is not there."""
        requests, version = await self._ask(["health", None])
        return EngineHealth(pid=self.pid, requests_in_flight=requests, weight_version=version)

    async def close(self) -> None:
        if self._closed:
            await asyncio.to_thread(self._thread.join)
            return
        self._closed = True
        self._send(["close"])  # the core answers what it holds with EngineClosed, and exits
        self._outbox.put(None)
        await asyncio.to_thread(self._reap)

    # ---- front-end helpers -----------------------------------------------------------

    def _check_request(self, request: EngineRequest) -> None:
        self._raise_if_gone()  # first: a dead core is EngineDead, even for a duplicate id
        self._check_new(request.request_id)
        check_request(request, self.limits, context_name="max_position_embeddings")

    def _raise_if_gone(self) -> None:
        self._raise_if_closed()
        if self._gone is not None:
            raise fresh(self._gone)

    def _send(self, message: list[Any]) -> None:
        self._outbox.put(message)

    def _abort_serial(self, serial: int) -> None:
        with self._lock:
            known = self._sinks.pop(serial, None) is not None
            known = self._step_sinks.pop(serial, None) is not None or known
        if known:
            self._send(["abort", serial])

    async def _ask(self, message: list[Any], context: Any = None) -> Any:
        """Send a message that the core answers once (by token); return the answer."""
        self._raise_if_gone()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        token = next(self._tokens)
        message[1] = token
        with self._lock:
            self._raise_if_gone()
            self._replies[token] = (loop, future, context)
        try:
            self._send(message)
            return await future
        finally:
            with self._lock:
                self._replies.pop(token, None)

    # ---- writer and reader threads ---------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            batch = [self._outbox.get()]
            while not self._outbox.empty():  # whatever else is waiting goes in the same frame
                batch.append(self._outbox.get())
            messages = [m for m in batch if m is not None]
            try:
                if messages:
                    write_frame(self._to_core, messages)
            except OSError:
                return  # the core is gone (EPIPE): the reader thread reports it
            if None in batch:
                return

    def _read_loop(self, reader: FrameReader) -> None:
        try:
            while True:
                self._dispatch(reader.read(None))
        except EOFError:
            pass
        except Exception:
            # The channel is broken; nothing more from it can be trusted.
            log.exception("CPU engine: unreadable output from the core; killing it")
            self._proc.kill()
        code = self._proc.wait()
        if self._closed:
            gone: EngineError = EngineClosed("engine closed while the request was in flight")
        else:
            gone = EngineDead(f"the CPU engine process (pid {self.pid}) died, exit code {code}")
            log.error("%s", gone)
        with self._lock:
            self._gone = gone
            sinks, self._sinks = self._sinks, {}
            replies, self._replies = self._replies, {}
            stepping, self._step_sinks = self._step_sinks, {}
        posts: dict[asyncio.AbstractEventLoop, list[tuple[Post, Any]]] = {}
        if stepping and self._step_out is not None:
            loop, steps = self._step_out
            posts.setdefault(loop, []).append((steps.put_nowait, fresh(gone)))
        for loop, chunks in sinks.values():
            posts.setdefault(loop, []).append((chunks.put_nowait, fresh(gone)))
        for loop, future, _ in replies.values():
            posts.setdefault(loop, []).append((settler(future), fresh(gone)))
        post_all(posts)

    def _dispatch(self, messages: list[Any]) -> None:
        posts: dict[asyncio.AbstractEventLoop, list[tuple[Post, Any]]] = {}
        steps = StepBuilder()
        with self._lock:
            for message in messages:
                kind = message[0]
                rid = self._step_sinks.get(message[1]) if kind in ("chunk", "error") else None
                if rid is not None:
                    if steps.take(rid, message):
                        del self._step_sinks[message[1]]
                    continue
                if kind == "chunk":
                    sink = self._sinks.get(message[1])
                    if sink is None:
                        continue  # aborted: late output is dropped
                    if message[5] is not None:  # its finish reason: the stream ends
                        del self._sinks[message[1]]
                    chunk = chunk_of(message)
                    posts.setdefault(sink[0], []).append((sink[1].put_nowait, chunk))
                elif kind == "error":
                    _, serial, error, text = message
                    sink = self._sinks.pop(serial, None)
                    if sink is not None:
                        exc = ERRORS.get(error, EngineError)(text)
                        posts.setdefault(sink[0], []).append((sink[1].put_nowait, exc))
                elif kind in ("loaded", "health"):
                    reply = self._replies.pop(message[1], None)
                    if reply is not None:
                        loop, future, context = reply
                        posts.setdefault(loop, []).append(
                            (settler(future), self._answer(message, context))
                        )
                else:
                    log.warning("CPU engine: unknown message %r from the core", kind)
            if steps and self._step_out is not None:
                loop, queue_ = self._step_out
                posts.setdefault(loop, []).extend((queue_.put_nowait, s) for s in steps.build())
        post_all(posts)

    def _answer(self, message: list[Any], context: Any) -> Any:
        if message[0] == "health":
            return message[2], message[3]
        _, _, error, text = message
        if error is not None:
            return ERRORS.get(error, WeightLoadError)(text)
        # The load is complete: from now on this engine reports the new weights.
        self._source, self._weight_version = context
        return None

    # ---- process ---------------------------------------------------------------------

    def _reap(self) -> None:
        try:
            self._proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("CPU engine process %d did not exit; killing it", self._proc.pid)
            self._kill()
        self._thread.join()
        self._writer.join()
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self._to_core, self._from_core):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _kill(self) -> None:
        with contextlib.suppress(OSError):
            self._proc.kill()
        self._proc.wait()


def _add_message(serial: int, request: EngineRequest) -> list[Any]:
    """The core's "add" message for ``request`` (``cpu.wire``)."""
    return ["add", serial, list(request.prompt_token_ids), request.sampling.to_dict(),
            request.resumed_tokens, request.prompt_routes_from]  # fmt: skip
