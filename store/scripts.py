"""Lua scripts, read from ``store/lua/*.lua`` once per process and loaded once per client.

Calls go straight to EVALSHA. redis-py's ``Script`` objects add a coroutine and a
``SCRIPT EXISTS`` round trip per pipeline, which measurably costs at checkpoint rates; instead
a NOSCRIPT reply (first use, or a server restart that emptied the script cache) repeats the
call by the script's text (EVAL, which caches it too), which is safe because every script here
is idempotent.

``transaction`` runs script calls beside plain commands in one MULTI/EXEC, for writes whose
large values must not pass through Lua (Redis hashes every byte a script is given): the plain
commands carry the bytes and the script decides, undoing what it refuses (see
``lua/append.lua``). Such a script must run whenever its transaction does, so it is always
sent by its text (``by_text``): a NOSCRIPT would leave its plain commands done and unchecked.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import hiredis
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ExecAbortError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from store.errors import ReplicasNotAcked

Arg = int | str | bytes
# How long an acknowledged write waits for its replicas (``WAIT``) before it is refused.
REPLICA_WAIT_MS = 1000


@cache
def script_text(name: str) -> str:
    return resources.files("store").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


class Script:
    def __init__(self, name: str, text: str | None = None, *, by_text: bool = False) -> None:
        self.name = name
        self.text = script_text(name) if text is None else text
        self.by_text = by_text
        if by_text:
            # Sent with every call: without its comment lines (two thirds of its bytes), which
            # Redis hashes for each EVAL (~4 us of its CPU per call at 2 KB, ~15 at 6 KB).
            lines = self.text.splitlines()
            self.text = "\n".join(x for x in lines if x.strip() and not x.lstrip().startswith("--"))
        self.sha = hashlib.sha1(self.text.encode()).hexdigest()

    def invocation(self, *, by_text: bool = False) -> tuple[str, str]:
        """The command and its first argument: by sha, or by text when asked or always."""
        return ("EVAL", self.text) if by_text or self.by_text else ("EVALSHA", self.sha)

    async def __call__(self, client: Redis, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        try:
            return await client.execute_command(  # type: ignore[no-untyped-call]
                *self.invocation(), len(keys), *keys, *args
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
        command, body = self.invocation(by_text=by_text)
        async with client.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                pipe.execute_command(command, body, len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))


@dataclass(frozen=True, slots=True)
class Call:
    """One script call among the steps of a ``transaction``."""

    script: Script
    keys: Sequence[str]
    args: Sequence[Arg]


Step = Call | tuple[Arg, ...]  # a script call, or a plain command as execute_command takes it


async def transaction(client: Redis, steps: Sequence[Step], *, replicas: int = 0) -> list[Any]:
    """Run ``steps`` in one MULTI/EXEC; one reply per step, in order, an error as its exception
    object (EXEC runs every command, and one failing does not undo the others).

    A NOSCRIPT reply (first use, or a restart emptied the cache) repeats the whole transaction
    with the scripts by their text. That is safe only because a script that did not run let
    no plain step of its transaction do anything (a script that would is sent ``by_text``
    always), and every script here recognises a repeat.

    ``replicas``: the transaction counts as done once that many replicas confirm it (``WAIT``
    on its connection, ``REPLICA_WAIT_MS`` at most), else ``ReplicasNotAcked`` is raised.
    """
    replies = await _transaction(client, steps, by_text=False, replicas=replicas)
    if any(isinstance(r, NoScriptError) for r in replies):
        replies = await _transaction(client, steps, by_text=True, replicas=replicas)
    return replies


_MULTI = hiredis.pack_command(("MULTI",))
_EXEC = hiredis.pack_command(("EXEC",))


async def _transaction(
    client: Redis, steps: Sequence[Step], *, by_text: bool, replicas: int
) -> list[Any]:
    """redis-py's transaction pipeline, minus its per-command Python: commands packed by
    hiredis, replies read without response callbacks (a checkpoint of 64 rollouts is ~130
    commands; this took a quarter to a third off the client's CPU per append, measured).
    Retried on connection errors as the pipeline is, by the connection's own ``Retry``: a
    repeat is a retried append, which the script recognises."""
    packed = [_MULTI]
    for step in steps:
        if isinstance(step, Call):
            script = step.script
            step = (*script.invocation(by_text=by_text), len(step.keys), *step.keys, *step.args)
        packed.append(hiredis.pack_command(step))  # type: ignore[arg-type]
    packed.append(_EXEC)
    if replicas:
        packed.append(hiredis.pack_command(("WAIT", replicas, REPLICA_WAIT_MS)))  # type: ignore[arg-type]
    pool = client.connection_pool
    conn = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        return await conn.retry.call_with_retry(  # type: ignore[no-any-return]
            lambda: _exchange(conn, packed, len(steps), replicas), lambda error: conn.disconnect()
        )
    finally:
        await pool.release(conn)


async def _exchange(conn: Any, packed: list[bytes], n: int, replicas: int) -> list[Any]:
    await conn.send_packed_command(packed)
    await conn.read_response()  # MULTI's OK
    refused = await read_queued(conn, n)
    try:
        replies = await conn.read_response()
    except ExecAbortError as exc:
        if replicas:
            await conn.read_response()  # WAIT's, so that the connection is left clean
        raise (refused[0] if refused else exc) from None
    acked = int(await conn.read_response()) if replicas else 0
    if acked < replicas:
        raise ReplicasNotAcked(f"{conn.host}:{conn.port}", replicas, acked)
    return list(replies)


async def read_queued(conn: Any, n: int) -> list[ResponseError]:
    """The n QUEUED replies, read from the connection's parser under one deadline for all.
    redis-py's ``read_response`` opens an asyncio timeout per reply, and a worker's checkpoint
    of 256 rollouts is ~770 replies: 6.9 us of client CPU per reply that way, 1.2-1.9 this
    way (measured on 768-command transactions). What ``read_response`` does on a failure is
    done here too: the connection is dropped, and the error is redis-py's (which the
    connection's retry acts on)."""
    refused = []
    if type(conn).read_response is not AbstractConnection.read_response:
        # A connection that reads its own way (fakeredis's): reply by reply, through it.
        for _ in range(n):
            try:
                await conn.read_response()
            except ResponseError as exc:
                refused.append(exc)
        return refused
    try:
        async with asyncio.timeout(conn.socket_timeout):
            for _ in range(n):
                reply = await conn._parser.read_response()
                if isinstance(reply, ResponseError):
                    # Refused when queued (unknown command, wrong arity): EXEC aborts them all.
                    refused.append(reply)
    except TimeoutError:
        await conn.disconnect(nowait=True)
        raise RedisTimeoutError("Timeout reading the replies of a transaction") from None
    except OSError as exc:
        await conn.disconnect(nowait=True)
        raise RedisConnectionError(f"Error while reading a transaction's replies: {exc}") from exc
    except BaseException:
        await conn.disconnect(nowait=True)
        raise
    return refused


def run_sync(client: SyncRedis, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
    """``Script.__call__`` for a synchronous client (the trainer's submit path runs beside rq,
    which is synchronous)."""
    try:
        return client.execute_command(*script.invocation(), len(keys), *keys, *args)  # type: ignore[no-untyped-call]
    except NoScriptError:
        # EVAL, not SCRIPT LOAD then EVALSHA: a server restarting in between (its script cache
        # is not persisted) would refuse the EVALSHA again. EVAL caches it as well.
        return client.execute_command("EVAL", script.text, len(keys), *keys, *args)  # type: ignore[no-untyped-call]


def run_windowed_sync(
    client: SyncRedis,
    script: Script,
    calls: Iterable[tuple[Sequence[str], Sequence[Arg]]],
    *,
    window: int = 2,
) -> list[Any]:
    """Run ``script`` once per call, in order, keeping up to ``window`` calls in flight on one
    connection: the caller builds call k+1 (``calls`` may be a generator) while Redis runs
    call k, instead of waiting out each reply. One reply per call, in order.

    Only for scripts that are atomic and recognise a repeat: a call whose reply was lost with
    the connection ran whole or not at all, and is run again (``run_sync``, with the client's
    retries) along with every call not answered yet. A call answered NOSCRIPT (a restart
    emptied the script cache) did not run, and is run again by its text. An error raised by
    ``calls`` itself is raised once the calls already sent have been answered."""
    # Sent by sha, unprobed: a SCRIPT EXISTS first would be a round trip of every run, and
    # most runs are one call (a harness's submit). On a NOSCRIPT reply (first use, or a
    # restart emptied the cache), the calls in flight are answered (NOSCRIPT too, or run),
    # those refused run again in order by the script's text (which caches it), and the
    # window goes on by sha: the calls run in call order either way.
    w = _Window(client.connection_pool.get_connection(), script)
    source = iter(calls)
    build_error: Exception | None = None
    try:
        try:
            while True:
                try:
                    call = next(source)
                except StopIteration:
                    break
                except Exception as exc:  # the caller's, not Redis': raised after the drain
                    build_error = exc
                    break
                w.send(call)
                w.settle(window)
        finally:
            # Whatever ended the loop (the last call, an error building the next one), the
            # calls on the wire are answered first, so that what was sent is known to be done.
            while w.sent:
                w.read_next()
    except _LOST:
        w.lost(source)
    except BaseException:
        w.conn.disconnect()  # replies may be left unread on it
        raise
    finally:
        client.connection_pool.release(w.conn)
    for i in sorted(w.again):
        keys, args = w.calls[i]
        w.replies[i] = run_sync(client, script, keys, args)
    if build_error is not None:
        raise build_error
    return w.replies


_LOST = (RedisConnectionError, RedisTimeoutError)


class _Window:
    """The calls of one ``run_windowed_sync``: sent, answered, or to be run again."""

    def __init__(self, conn: Any, script: Script) -> None:
        self.conn = conn
        self.script = script
        self.calls: list[tuple[Sequence[str], Sequence[Arg]]] = []
        self.replies: list[Any] = []
        self.sent: deque[int] = deque()  # the calls sent and not answered yet, in order
        self.again: list[int] = []  # the calls to run again (NOSCRIPT, or their reply lost)

    def send(self, call: tuple[Sequence[str], Sequence[Arg]]) -> None:
        self.calls.append(call)
        self.replies.append(None)
        self.sent.append(len(self.calls) - 1)  # before sending: a send that fails goes again
        keys, args = call
        command = (*self.script.invocation(), len(keys), *keys, *args)
        self.conn.send_packed_command([hiredis.pack_command(command)])  # type: ignore[arg-type]

    def read_next(self) -> None:
        i = self.sent[0]
        try:
            self.replies[i] = self.conn.read_response()
        except NoScriptError:
            self.again.append(i)
        self.sent.popleft()

    def settle(self, window: int) -> None:
        """Read replies until fewer than ``window`` calls are in flight; after a NOSCRIPT,
        until none is, and run the refused calls again before any later one is sent."""
        while len(self.sent) >= window:
            self.read_next()
        if self.again:
            while self.sent:
                self.read_next()
            self.redo()

    def redo(self) -> None:
        """Run the calls refused NOSCRIPT again, in order, by the script's text (which caches
        it), on this connection once none is in flight. A call leaves ``again`` once answered:
        should the connection drop meanwhile, the rest go again with the unanswered ones."""
        while self.again:
            keys, args = self.calls[self.again[0]]
            command = ("EVAL", self.script.text, len(keys), *keys, *args)
            self.conn.send_packed_command([hiredis.pack_command(command)])  # type: ignore[arg-type]
            self.replies[self.again[0]] = self.conn.read_response()
            self.again.pop(0)

    def lost(self, unsent: Iterator[tuple[Sequence[str], Sequence[Arg]]]) -> None:
        """The connection dropped: every call not answered, and those not sent, go again."""
        self.conn.disconnect()
        self.again += self.sent
        self.sent.clear()
        for call in unsent:
            self.calls.append(call)
            self.replies.append(None)
            self.again.append(len(self.calls) - 1)


APPEND = Script("append", by_text=True)
PUBLISH_WEIGHTS = Script("publish_weights")
RELEASE_LEASE = Script("release_lease")
QUARANTINE_LEASE = Script("quarantine_lease")
CREATE_BATCH = Script("create_batch")
ACK = Script("ack")
STATS = Script("stats")
SUBMIT_CHUNK = Script("submit_chunk")
SET_LEASES = Script("set_leases", by_text=True)
# Each judges leases after the grace that follows Redis's refusals (lua/lease_grace.lua).
EXPIRED_LEASES = Script(
    "expired_leases", script_text("lease_grace") + script_text("expired_leases")
)
READ_LEASES = Script("read_leases", script_text("lease_grace") + script_text("read_leases"))
REGISTER_PRESENCE = Script("register_presence")
GIVE_BACK = Script("give_back")
# The queue on a Redis of its own (store/queue_redis.py): jobs already named on the store.
PUSH_JOBS = Script("push_jobs")
# An ack's queue-side step, the queue apart (store/ack_apart.py).
DROP_JOB = Script("drop_job")
# By its text: it goes inside the MULTI that pushes the job, where a NOSCRIPT would spoil it.
RECORD_JOB = Script("record_job", by_text=True)
REQUEUE_ABANDONED = Script("requeue_abandoned")
REQUEUE_DEQUEUED = Script("requeue_dequeued")
MARK_FIRST_SEEN = Script("mark_first_seen", by_text=True)
# Session affinity (store/affinity.py): a worker claims its hinted jobs; a job bounces to the
# worker it prefers.
CLAIM_HINTS = Script("claim_hints", by_text=True)
BOUNCE_JOB = Script("bounce_job", by_text=True)
# By its text: it goes inside the MULTI that starts jobs and the one that beats them.
TOUCH_JOBS = Script("touch_jobs", by_text=True)
# By its text: it goes inside the MULTI that records a job's success.
DROP_ACKNOWLEDGED_JOB = Script("drop_acknowledged_job", by_text=True)
# By its text: it goes inside the MULTI that starts jobs and the one that beats them.
STAMP_EXECUTIONS = Script("stamp_executions", by_text=True)
# Episodes' tool calls (store/tool_index.py, store/environment.py). By their text: each goes
# inside the MULTI that appends the events it follows.
TOOL_CALL_INDEX = Script("tool_call_index", by_text=True)
TURN_JOB = Script("turn_job", by_text=True)
TOOL_HEARTBEAT = Script("tool_heartbeat")
