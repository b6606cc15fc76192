"""Transactions on Redis Cluster, grouped per master: the cluster's form of
``scripts.transaction``.

Redis Cluster runs a MULTI/EXEC (and a script) only over keys of one slot, even when two slots
share a master. So a write that spans rollouts (a worker's checkpoint of every rollout it
runs) becomes one block per slot, each its own MULTI/EXEC, and the blocks of one master go
together: packed into one write on one connection of that master, read back in order. A
commit costs one round trip per master it touches, whatever the number of rollouts, and the
masters are written concurrently.

redis-py offers neither: its cluster pipeline sends no MULTI across slots and blocks EVALSHA,
and its transactional pipeline holds one slot. So this talks to each master's connections
itself (``ClusterNode.acquire_connection``), and does what the client would do on a reply
that names another owner: ``MOVED`` (a failover, a slot migrated), ``ASK`` and ``TRYAGAIN``
(a slot migrating), ``CLUSTERDOWN``, or the master gone: it reloads the slot map and sends the
blocks not done again, with backoff, for up to ``window_s``. That is safe because every write
sent here recognises a repeat (an append already stored is a ``dup``; see lua/append.lua).

Replica acknowledgement: with ``replicas`` > 0, each master's blocks are followed by
``WAIT replicas timeout`` on the same connection (WAIT counts only its own connection's
writes, and cannot run inside MULTI or a script). Fewer acks in time make every block of that
master a ``ReplicasNotAcked``: applied on the master, not counted as saved.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import hiredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ExecAbortError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from store import scripts
from store.connection import RETRY_WINDOW_S
from store.errors import ReplicasNotAcked

# Replies that mean "not here, not now": the block is sent again once the slot map is reloaded.
# (MovedError is an AskError.)
_ELSEWHERE = (AskError, TryAgainError, ClusterDownError, SlotNotCoveredError)
# The master itself unreachable (killed, restarting, loading its data): the same, after a wait.
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
# How long blocks are sent again before their error is theirs: a failover takes
# ``cluster-node-timeout`` and a second or two more (2.7 s at 1000 ms, ~7 s at 5000 ms).
WINDOW_S = RETRY_WINDOW_S
# Blocks sent again, by the name of what sent them (MovedError, AskError, ConnectionError...):
# for a process's metrics, and for the tests to see a migration or a failover met.
resent: Counter[str] = Counter()
_MULTI = hiredis.pack_command(("MULTI",))
_EXEC = hiredis.pack_command(("EXEC",))


@dataclass(frozen=True, slots=True)
class Block:
    """Steps that run as one MULTI/EXEC: every key they name is in ``slot``."""

    slot: int
    steps: Sequence[scripts.Step]


class _Again(Exception):
    """A block's reply that sends it again (its cause: the reply)."""


async def commit(
    client: RedisCluster,
    blocks: Sequence[Block],
    *,
    replicas: int = 0,
    wait_ms: int = scripts.REPLICA_WAIT_MS,
    window_s: float | None = None,
) -> list[list[Any] | Exception]:
    """Each block in one MULTI/EXEC on its slot's master, one round trip per master; per
    block, its replies (one per step, an error as its exception object, as
    ``scripts.transaction`` gives them), or the exception that refused the whole block: a
    master unreachable for all of ``window_s`` (default ``WINDOW_S``) fails its blocks alone.
    Scripts are sent by their text (EVAL): a replica promoted by a failover has no script
    cache, and a NOSCRIPT inside a MULTI would leave its plain steps unchecked."""
    await client.initialize()
    out: list[list[Any] | Exception | None] = [None] * len(blocks)
    pending = list(range(len(blocks)))
    deadline = time.monotonic() + (WINDOW_S if window_s is None else window_s)
    pause = 0.05
    while True:
        why = await _send(client, blocks, pending, out, replicas, wait_ms)
        if why and time.monotonic() + pause > deadline:
            for i, exc in why.items():
                out[i] = exc
            why = {}
        if not why:
            return [r for r in out if r is not None]  # every block answered
        for exc in why.values():
            resent[type(exc).__name__] += 1
        await asyncio.sleep(pause)
        pause = min(2 * pause, 1.0)
        await _reload(client)
        pending = list(why)


async def _send(
    client: RedisCluster,
    blocks: Sequence[Block],
    pending: Sequence[int],
    out: list[list[Any] | Exception | None],
    replicas: int,
    wait_ms: int,
) -> dict[int, Exception]:
    """One try of the ``pending`` blocks, every master at once; their replies go into
    ``out``, and what is returned are the blocks to send again, with why."""
    why: dict[int, Exception] = {}
    by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
    for i in pending:
        try:
            node = client.nodes_manager.get_node_from_slot(blocks[i].slot)
        except SlotNotCoveredError as exc:
            why[i] = exc
            continue
        by_node.setdefault(node.name, (node, []))[1].append(i)
    rounds = [
        _round(node, [blocks[i] for i in idx], replicas, wait_ms) for node, idx in by_node.values()
    ]
    results = await asyncio.gather(*rounds, return_exceptions=True)
    for (_, idx), result in zip(by_node.values(), results, strict=True):
        if isinstance(result, _UNREACHABLE):
            why.update(dict.fromkeys(idx, result))
        elif isinstance(result, BaseException):
            raise result
        else:
            for i, reply in zip(idx, result, strict=True):
                if isinstance(reply, _Again):
                    assert isinstance(reply.__cause__, Exception)
                    why[i] = reply.__cause__
                else:
                    out[i] = reply
    return why


async def _reload(client: RedisCluster) -> None:
    """The slot map read again from the nodes that answer; a failure now (a failover under
    way) is met again by the next round's blocks."""
    with contextlib.suppress(Exception):  # whatever it is, the blocks' retries report it
        await client.nodes_manager.initialize()


async def _round(
    node: ClusterNode, blocks: Sequence[Block], replicas: int, wait_ms: int
) -> list[list[Any] | Exception]:
    """One master's blocks in one write and one read; an ``_Again`` for a block to send
    again. Raises what makes the master unreachable (every block goes again)."""
    packed: list[bytes] = []
    for block in blocks:
        packed.append(_MULTI)
        for step in block.steps:
            if isinstance(step, scripts.Call):
                step = ("EVAL", step.script.text, len(step.keys), *step.keys, *step.args)
            packed.append(hiredis.pack_command(step))  # type: ignore[arg-type]
        packed.append(_EXEC)
    if replicas:
        packed.append(hiredis.pack_command(("WAIT", replicas, wait_ms)))  # type: ignore[arg-type]
    conn = node.acquire_connection()
    try:
        await conn.send_packed_command(packed)
        out: list[list[Any] | Exception] = []
        for block in blocks:
            await conn.read_response()  # MULTI's OK
            refused = await scripts.read_queued(conn, len(block.steps))
            try:
                out.append(list(await conn.read_response()))
            except ExecAbortError as exc:
                cause: ResponseError = refused[0] if refused else exc
                if isinstance(cause, _ELSEWHERE):
                    again = _Again(str(cause))
                    again.__cause__ = cause
                    out.append(again)
                else:
                    out.append(cause)
        if replicas:
            acked = int(await conn.read_response())
            if acked < replicas:
                short = ReplicasNotAcked(node.name, replicas, acked)
                out = [short if isinstance(r, list) else r for r in out]
        return out
    except BaseException:
        await conn.disconnect()  # replies may be left unread on it
        raise
    finally:
        node.release(conn)
