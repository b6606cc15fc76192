"""The states a user sees, and the small enums events carry."""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    PENDING = "pending"  # submitted, waiting for its first worker
    GENERATING = "generating"  # the first attempt is running
    ABORTED = "aborted"  # progress is saved; waiting for a worker to resume it
    RESUMED = "resumed"  # a later attempt is running from the saved prefix
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


# Explicit sets, never ordering tricks: adding a state forces a decision here.
TERMINAL: frozenset[Status] = frozenset({Status.DONE, Status.FAILED, Status.CANCELLED})
LIVE: frozenset[Status] = frozenset({Status.GENERATING, Status.RESUMED})
WAITING: frozenset[Status] = frozenset({Status.PENDING, Status.ABORTED})


class AbortReason(StrEnum):
    WEIGHT_UPDATE = "weight_update"
    WORKER_LOST = "worker_lost"
    SHUTDOWN = "shutdown"
    ENGINE_ERROR = "engine_error"  # the engine failed on this rollout: counts against its budget
    ENGINE_DEAD = "engine_dead"  # the engine died under it: not the rollout's fault, no charge
    CANCELLED = "cancelled"


class FinishReason(StrEnum):
    """Why generation ended; separate from the status, as in vLLM."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
