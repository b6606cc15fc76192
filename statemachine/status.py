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
    # The deployment was paused with mode=abort (a harness's ``POST /pause``): not the
    # rollout's fault, no charge; it resumes from its saved tokens after ``/resume``.
    PAUSED = "paused"


class FinishReason(StrEnum):
    """Why generation ended; separate from the status, as in vLLM."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached


class FailureClass(StrEnum):
    """Why a rollout failed, each with its own handling: a request error is the request's
    fault and is never retried; the others are retried within a budget before they fail it."""

    REQUEST_ERROR = "request_error"  # the engine can never serve it (too long, bad ids, ...)
    ENGINE_ERROR = "engine_error"  # the engine failed on it, MAX_ENGINE_ATTEMPTS times
    WORKER_LOST = "worker_lost"  # its workers kept dying under it
    UNREADABLE = "unreadable"  # its stored records cannot be decoded


class GroupPolicy(StrEnum):
    """What a failed sample does to the other samples of its group (GRPO needs whole groups)."""

    SAMPLE = "sample"  # it fails alone; its siblings carry on
    GROUP = "group"  # its siblings are cancelled: a group with a hole is useless to the trainer
