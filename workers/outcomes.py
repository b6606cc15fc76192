"""What the runner's attempts come to, and what a worker process counts of them.

``RolloutRunner.run`` returns a ``RunResult``; the worker ends the job by its ``Outcome``
(``workers.job_endings``), and ``workers.metrics`` serves the ``Stats`` as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from statemachine import AbortReason, FailureClass, RolloutState, Status


class Outcome(StrEnum):
    FINISHED = "finished"  # done now (or was already terminal when the job ran)
    TOOL_CALL = "tool_call"  # an episode's turn ended at a tool call, recorded; the job is done
    ENGINE_ERROR = "engine_error"  # progress kept, attempt aborted; the worker retries or fails it
    ABORTED = "aborted"  # stopped on request (shutdown, weight update, pause); progress kept
    LOST = "lost"  # another writer took the rollout over (fenced out); nothing more to do
    DUPLICATE = "duplicate"  # a live worker holds the rollout's lease: this job is a duplicate
    ENGINE_DEAD = "engine_dead"  # progress kept, attempt aborted; the engine is gone for good
    WRONG_QUEUE = "wrong_queue"  # the job came from a queue the rollout was not submitted to
    WRONG_MODEL = "wrong_model"  # earlier attempts ran another model: not for this worker
    FAILED = "failed"  # recorded failed here: a request error, or its worker-lost budget is spent


@dataclass(frozen=True, slots=True)
class RunResult:
    outcome: Outcome
    state: RolloutState
    error: str | None = None  # the engine's error (ENGINE_ERROR), or why it was refused
    # TOOL_CALL: the record of the turn's last event as stored, from which the episode's next
    # turn here reads only what came since (``store.since``).
    record: bytes | None = None


@dataclass(slots=True)
class Stats:
    """Counters of one worker process, across all its rollouts: each counts what this process
    recorded in Redis, where it recorded it (``workers.metrics`` serves them as they are)."""

    tokens: int = 0
    checkpoints: int = 0
    nonfinite_logprobs: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    engine_dead: str | None = None  # why the engine died, if it did (the worker then stops)
    aborts: dict[str, int] = field(default_factory=dict)  # Aborted events appended, by reason
    resumes: int = 0  # attempts begun from saved tokens
    tool_calls: int = 0  # episode turns that ended at a tool call (ToolCallRequested appended)
    takeovers: int = 0  # live attempts of a worker whose lease lapsed, fenced out by this one
    ended: dict[str, int] = field(default_factory=dict)  # rollouts ended here, by status
    failures: dict[str, int] = field(default_factory=dict)  # of those failed, by class

    def aborted(self, reason: AbortReason) -> None:
        self.aborts[reason.value] = self.aborts.get(reason.value, 0) + 1

    def end(self, status: Status, failure: FailureClass | None = None) -> None:
        self.ended[status.value] = self.ended.get(status.value, 0) + 1
        if failure is not None:
            self.failures[failure.value] = self.failures.get(failure.value, 0) + 1
