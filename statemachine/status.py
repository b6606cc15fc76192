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
    # An episode between turns (``statemachine.episode``):
    AWAITING_TOOL = "awaiting_tool"  # a tool call is requested; waiting for an environment
    RUNNING_TOOL = "running_tool"  # an environment runner holds the call's live claim
    NEXT_TURN = "next_turn"  # the call's result is recorded; waiting for a worker's next turn


# Explicit sets, never ordering tricks: adding a state forces a decision here.
TERMINAL: frozenset[Status] = frozenset({Status.DONE, Status.FAILED, Status.CANCELLED})
# An attempt of a generation worker is running: its writes are fenced on it. The tool states
# are not here: no generation attempt runs while a tool does (a runner's claim is fenced by
# its own number, in ``transitions``).
LIVE: frozenset[Status] = frozenset({Status.GENERATING, Status.RESUMED})
# A generation job is due: what requeues generation jobs (a stranded rollout, a lost job)
# acts on these. NEXT_TURN is one (its next turn is a generation job like a resume).
WAITING: frozenset[Status] = frozenset({Status.PENDING, Status.ABORTED, Status.NEXT_TURN})
# Waiting for an environment, or in one: in neither LIVE nor WAITING, so nothing that
# requeues generation jobs or fences generation attempts touches them.
AT_TOOL: frozenset[Status] = frozenset({Status.AWAITING_TOOL, Status.RUNNING_TOOL})


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
    # An episode's budgets (``EpisodeSpec``), each its own reason so a trainer can tell them
    # apart (a turn cap is not a context overflow):
    MAX_TURNS = "max_turns"  # it would need a turn beyond max_turns
    MAX_TOTAL_TOKENS = "max_total_tokens"  # sampled + observation tokens fill max_total_tokens
    TOOL_TIME = "tool_time"  # its calls used up max_tool_seconds
    WALL_TIME = "wall_time"  # max_wall_seconds passed since it was submitted
    # A harness-driven episode (``EpisodeSpec.harness``) ended with its session: its harness
    # finished the session, a call of the session did not extend it (a new episode holds
    # that call), or no call came for ``SESSION_IDLE_S``.
    SESSION_END = "session_end"


# The budget reasons an episode may end with between turns, when no attempt is running
# (``LENGTH`` too: its sampled-token budget can run out exactly at a tool call).
EPISODE_FINISH: frozenset[FinishReason] = frozenset(
    {
        FinishReason.MAX_TURNS,
        FinishReason.MAX_TOTAL_TOKENS,
        FinishReason.TOOL_TIME,
        FinishReason.WALL_TIME,
        FinishReason.SESSION_END,
    }
)


class FailureClass(StrEnum):
    """Why a rollout failed, each with its own handling: a request error is the request's
    fault and is never retried; the others are retried within a budget before they fail it."""

    REQUEST_ERROR = "request_error"  # the engine can never serve it (too long, bad ids, ...)
    ENGINE_ERROR = "engine_error"  # the engine failed on it, MAX_ENGINE_ATTEMPTS times
    WORKER_LOST = "worker_lost"  # its workers kept dying under it
    UNREADABLE = "unreadable"  # its stored records cannot be decoded
    # What ends an episode at a tool call:
    ENV_FATAL = "env_fatal"  # the environment said the call can never succeed
    ENV_ERROR = "env_error"  # the call kept failing with env_error beyond its retry budget
    # A call's runner was lost with the call's effect unknown, and the tool's declared effect
    # is ``restart``: running it again could apply its side effect twice.
    EFFECT_UNVERIFIED = "effect_unverified"


class ToolFailure(StrEnum):
    """How a tool call failed, as its environment runner reports it."""

    ENV_ERROR = "env_error"  # transient (a timeout, a flaky sandbox): retried within a budget
    ENV_FATAL = "env_fatal"  # will never succeed (bad arguments, a broken task): ends it


class GroupPolicy(StrEnum):
    """What a failed sample does to the other samples of its group (GRPO needs whole groups)."""

    SAMPLE = "sample"  # it fails alone; its siblings carry on
    GROUP = "group"  # its siblings are cancelled: a group with a hole is useless to the trainer
