"""Fails a benchmark at once, with the error, when a task or process it started dies.

A benchmark waits on what its workers do: a rollout's next tokens, a round's end, a
completion. When the worker is gone, that wait never ends: bench_weight_update's worker task
once died at start (``AttributeError``) and the benchmark printed nothing until it was killed
240 s later. A ``Watch`` follows what a benchmark started; the moment a watched task ends (it
raised, or returned while the benchmark still needed it) or a watched process exits, the
benchmark's own task is cancelled where it waits and ``Died`` is raised in its place, with the
task's exception as its cause or the process's exit status and the tail of its log::

    async with Watch() as watch:
        watch.redis(server)
        run = watch.task(asyncio.create_task(worker.run()), "worker")
        ...  # wait for what the worker does
        watch.release(run)  # from here on it ends on purpose
        worker.request_stop()
        await run

Code without an event loop to interrupt (a synchronous waiting loop) calls ``check()`` in its
loop instead. A loop waiting for a rollout to get somewhere calls ``still_going``: a rollout
that ended (failed, say) never will.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Any

from store.client import RolloutClient
from store.redis_server import RedisServer

POLL_S = 0.1  # a process's exit is polled for; a task's end is seen at once (done callback)
# If the benchmark is still inside the block this long after its cancel (a cancel can be lost
# inside redis-py, see workers/worker.py), it is cancelled again.
RECANCEL_S = 10.0
TAIL_CHARS = 3000

Watched = asyncio.Task[Any] | subprocess.Popen[bytes]


class Died(RuntimeError):
    """Something a benchmark started (a worker task, a worker, API or Redis process, a rollout)
    ended while the benchmark still needed it."""


class Watch:
    def __init__(self) -> None:
        self._tasks: dict[asyncio.Task[Any], str] = {}
        self._procs: dict[subprocess.Popen[bytes], tuple[str, Path | None]] = {}
        self.died: Died | None = None
        self._host: asyncio.Task[Any] | None = None  # the benchmark's task, inside the block
        self._poller: asyncio.Task[None] | None = None
        self._cancels = 0

    # -- what is watched ---------------------------------------------------------------------

    def task(self, task: asyncio.Task[Any], name: str) -> asyncio.Task[Any]:
        """Watch ``task`` (a worker's ``run()``) until ``release``; returns it."""
        self._tasks[task] = name
        task.add_done_callback(self._task_ended)
        return task

    def process(
        self, proc: subprocess.Popen[bytes], name: str, log: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Watch ``proc`` until ``release``; ``log``: where its output goes (its tail is
        reported). Returns it."""
        self._procs[proc] = (name, log)
        return proc

    def redis(self, server: RedisServer) -> None:
        """Watch a benchmark's own redis-server: a worker outlives a Redis that went away
        (it reconnects until Redis is back), so the benchmark would wait forever."""
        assert server.proc is not None, "the server is not running"
        self.process(server.proc, "redis-server", server.data_dir / "redis.log")

    def release(self, *things: Watched) -> None:
        """Stop watching: from here on they end on purpose (stopped, killed by the benchmark)."""
        for thing in things:
            if isinstance(thing, asyncio.Task):
                self._tasks.pop(thing, None)
            else:
                self._procs.pop(thing, None)

    def check(self) -> None:
        """Raise ``Died`` if something watched has ended (for synchronous waiting loops)."""
        self._poll()
        if self.died is not None:
            raise self.died

    # -- the benchmark's block ---------------------------------------------------------------

    async def __aenter__(self) -> Watch:
        self._host = asyncio.current_task()
        self.check()  # something may have died before the block
        self._poller = asyncio.create_task(self._poll_loop(), name="watch")
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool:
        host, self._host = self._host, None  # nothing interrupts the benchmark from here on
        if self._poller is not None:
            self._poller.cancel()  # not awaited: no await here, so no cancel lands here
        if self.died is None:
            return False
        assert host is not None
        for _ in range(self._cancels):
            host.uncancel()  # ours: the benchmark's caller sees Died, not a cancellation
        if isinstance(e, asyncio.CancelledError):
            self.died.__suppress_context__ = True  # the cancel was only the messenger
        elif self.died.__cause__ is None:
            self.died.__cause__ = e  # what the death made the benchmark raise
        raise self.died

    # -- noticing ----------------------------------------------------------------------------

    def _task_ended(self, task: asyncio.Task[Any]) -> None:
        name = self._tasks.pop(task, None)
        if name is None:
            return  # released: it ended on purpose
        if task.cancelled():
            self._fail(Died(f"{name} was cancelled while the benchmark still needed it"))
        elif (error := task.exception()) is not None:
            died = Died(f"{name} died: {type(error).__name__}: {error}")
            died.__cause__ = error  # its traceback is printed with the benchmark's
            self._fail(died)
        else:
            self._fail(Died(f"{name} ended while the benchmark still needed it: "
                            f"{task.result()!r:.500}"))  # fmt: skip

    def _poll(self) -> None:
        for proc, (name, log) in list(self._procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del self._procs[proc]
            self._fail(Died(f"{name} (pid {proc.pid}) {_exit_status(code)}{_tail(log)}"))

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(RECANCEL_S if self.died else POLL_S)
            if self.died:
                self._interrupt()  # the last cancel did not end the block
            else:
                self._poll()

    def _fail(self, died: Died) -> None:
        if self.died is None:
            self.died = died
            self._interrupt()

    def _interrupt(self) -> None:
        # Callbacks and the poller run only while the benchmark's task waits: the cancel lands
        # where it waits, inside the block (``_host`` is None from ``__aexit__`` on).
        if self._host is not None and not self._host.done():
            self._host.cancel(msg="watch: something the benchmark started died")
            self._cancels += 1


async def still_going(client: RolloutClient, rollout_id: str, waiting_for: str) -> None:
    """Raise ``Died`` if the rollout a benchmark waits on has ended (it will never get there)."""
    state = await client.store.load(rollout_id)
    if state.terminal:
        raise Died(f"rollout {rollout_id} ended {state.status.value} while the benchmark waited "
                   f"for {waiting_for}: {state.error}")  # fmt: skip


def _exit_status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _tail(log: Path | None) -> str:
    if log is None:
        return ""
    try:
        text = log.read_text(errors="replace")
    except OSError as exc:
        return f"; its log {log} cannot be read: {exc}"
    return f"; the end of its log ({log}):\n{text[-TAIL_CHARS:]}"
