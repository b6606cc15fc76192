"""Errors of the Redis store. One base class; domain errors from ``statemachine`` pass through."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import Any, ParamSpec, TypeVar

from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError

T = TypeVar("T")
P = ParamSpec("P")


class StoreError(Exception):
    """Base of every error raised by ``store``."""


class InvalidRolloutId(StoreError, ValueError):
    """A rollout id that cannot be used in a key."""


class InvalidSessionId(InvalidRolloutId):
    """A session id that cannot name a session (empty, too long, control characters)."""


class RolloutNotFound(StoreError, KeyError):
    def __init__(self, rollout_id: str) -> None:
        super().__init__(f"no rollout {rollout_id!r}")
        self.rollout_id = rollout_id

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class GroupNotFound(StoreError, ValueError):
    """A group index a batch does not have (a ValueError: an argument out of range)."""

    def __init__(self, batch_id: str, groups: int, group: int) -> None:
        super().__init__(f"batch {batch_id!r} has groups 0..{groups - 1}, not {group}")
        self.batch_id = batch_id
        self.group = group


class AppendRefused(StoreError):
    """An append the store refused; nothing was written."""

    def __init__(self, rollout_id: str, seq: int, message: str) -> None:
        super().__init__(f"rollout {rollout_id!r} event #{seq}: {message}")
        self.rollout_id = rollout_id
        self.seq = seq


class SequenceConflict(AppendRefused):
    """Another writer already took this sequence number: reload and decide again."""

    def __init__(self, rollout_id: str, seq: int, current_seq: int) -> None:
        super().__init__(rollout_id, seq, f"conflict: the log is at #{current_seq}")
        self.current_seq = current_seq


class RolloutExists(SequenceConflict):
    """A different rollout was already submitted under this id."""


class StaleAttempt(AppendRefused):
    """The writer's attempt is no longer live (lease lost, aborted, finished): drop the rollout.
    ``attempt`` 0: the event would open an attempt, and one (``live``) is live already."""

    def __init__(self, rollout_id: str, seq: int, attempt: int, live: int) -> None:
        live_text = f"attempt {live} is live" if live else "no attempt is live"
        if attempt == 0:
            message = f"no attempt may open while one is live ({live_text})"
        else:
            message = f"attempt {attempt} is stale ({live_text})"
        super().__init__(rollout_id, seq, message)
        self.attempt = attempt
        self.live = live


class ClaimLost(StoreError):
    """A tool call's claim is not live any more (its lease lapsed and the call was given up
    or claimed again, or its episode ended): a zombie runner's report, refused with nothing
    written. The runner drops the call; whatever it did is the live claim's to redo."""

    def __init__(self, rollout_id: str, call_id: str, claim: int, why: str) -> None:
        super().__init__(f"rollout {rollout_id!r} call {call_id!r} claim {claim}: {why}")
        self.rollout_id = rollout_id
        self.call_id = call_id
        self.claim = claim


class InvalidRedisUrl(StoreError, ValueError):
    """A Redis URL that cannot be read or used. Its message never contains the URL itself
    (it may hold a password)."""


class Refusal(StrEnum):
    """Why Redis refuses writes for a condition of its own (``StoreUnwritable``)."""

    OOM = "oom"  # used memory above ``maxmemory`` and nothing to evict (``noeviction``)
    # A failed RDB save with ``stop-writes-on-bgsave-error yes``, or a failed AOF write or
    # fsync (a full disk under ``appendfsync everysec``; under ``always`` Redis exits instead).
    MISCONF = "misconf"
    READONLY = "readonly"  # a read-only replica (a failover the clients have not followed yet)
    # A master with ``min-replicas-to-write`` set and fewer replicas than that connected.
    NOREPLICAS = "noreplicas"


class StoreUnwritable(StoreError):
    """Redis refused a write for a condition of its own, not for anything the write said:
    nothing was written, and the same write succeeds once the condition clears (an operator
    raises ``maxmemory`` or frees the disk, a trainer acknowledges what it consumed, a
    failover completes). Not a bug of the caller and not a lost worker: retry it later."""

    def __init__(self, refusal: Refusal, detail: str) -> None:
        super().__init__(f"Redis refuses writes ({refusal.value}): {detail}")
        self.refusal = refusal
        self.detail = detail  # Redis's own words


class ReplicasNotAcked(StoreUnwritable):
    """A write its master applied that fewer replicas than asked (``--min-replicas-acked``)
    confirmed within the timeout (``WAIT``): it does not count as saved, since a failover
    now could lose it. Unlike the other refusals it may have been applied; it is handled the
    same way, since the same write sent again is recognised (an append already stored is a
    ``dup``) and succeeds once the replicas answer: a worker keeps its tokens and retries."""

    def __init__(self, node: str, wanted: int, acked: int) -> None:
        super().__init__(
            Refusal.NOREPLICAS,
            f"{acked} of {wanted} replicas of {node} confirmed the write in time",
        )
        self.node, self.wanted, self.acked = node, wanted, acked


# What each condition's error reply says, wherever redis-py puts it: its own prefix is stripped
# from a bare reply ("OOM command not allowed ..." -> OutOfMemoryError("command not allowed
# ...")), kept inside a transaction's (EXECABORT "Transaction discarded because of: OOM ...")
# and inside a pipeline's annotation ("Command # 2 (XADD ...) of pipeline caused error: ...").
_REFUSALS: tuple[tuple[Refusal, type[Exception] | None, re.Pattern[str]], ...] = (
    (Refusal.OOM, OutOfMemoryError,
     re.compile(r"\bOOM command not allowed|command not allowed when used memory")),
    (Refusal.MISCONF, None, re.compile(r"\bMISCONF\b")),
    (Refusal.READONLY, ReadOnlyError,
     re.compile(r"\bREADONLY\b|can't write against a read only replica")),
    (Refusal.NOREPLICAS, None, re.compile(r"\bNOREPLICAS\b")),
)  # fmt: skip
# What redis-py and Redis put before the reply itself (dropped from ``detail``).
_WRAPPED = re.compile(r"caused error: |discarded because of: ")


def unwritable(exc: BaseException) -> StoreUnwritable | None:
    """The ``StoreUnwritable`` that ``exc`` is (a redis-py error reply refusing a write for a
    condition of Redis's own), or None for any other error. The one place these replies are
    recognised: the workers, the trainer client and the HTTP API all ask here."""
    if isinstance(exc, StoreUnwritable):
        return exc
    if not isinstance(exc, ResponseError):
        return None
    text = str(exc)
    for refusal, cls, words in _REFUSALS:
        if (cls is not None and isinstance(exc, cls)) or words.search(text):
            detail = _WRAPPED.split(text)[-1]
            if not detail.startswith(refusal.name):
                detail = f"{refusal.name} {detail}"  # the prefix redis-py stripped
            return StoreUnwritable(refusal, detail)
    return None


@contextmanager
def writes_named() -> Iterator[None]:
    """Raise a write refused for a condition of Redis's own as ``StoreUnwritable`` (its
    cause the redis-py error); anything else passes through unchanged."""
    try:
        yield
    except ResponseError as exc:
        named = unwritable(exc)
        if named is None:
            raise
        raise named from exc


def named(call: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """A call Redis may refuse for a condition of its own (out of memory, a failed disk write,
    a read-only replica): raised as ``StoreUnwritable`` (nothing was written; the same call
    succeeds once the condition clears), never as redis-py's error. Writes, and the reads of
    rollouts too: they read in a MULTI, and out of memory Redis refuses anything queued in one."""

    @functools.wraps(call)
    async def named(*args: P.args, **kwargs: P.kwargs) -> T:
        with writes_named():
            return await call(*args, **kwargs)

    return named


def named_stream(stream: Callable[P, AsyncIterator[T]]) -> Callable[P, AsyncIterator[T]]:
    """``named`` for a stream of results."""

    @functools.wraps(stream)
    async def named(*args: P.args, **kwargs: P.kwargs) -> AsyncIterator[T]:
        with writes_named():
            # The streams are async generators (closable), typed as the iterators they are.
            async with contextlib.aclosing(stream(*args, **kwargs)) as items:  # type: ignore[type-var]
                async for item in items:
                    yield item

    return named
