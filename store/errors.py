"""Errors of the Redis store. One base class; domain errors from ``statemachine`` pass through."""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error raised by ``store``."""


class InvalidRolloutId(StoreError, ValueError):
    """A rollout id that cannot be used in a key."""


class RolloutNotFound(StoreError, KeyError):
    def __init__(self, rollout_id: str) -> None:
        super().__init__(f"no rollout {rollout_id!r}")
        self.rollout_id = rollout_id

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


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
    """The writer's attempt is no longer live (lease lost, aborted, finished): drop the rollout."""

    def __init__(self, rollout_id: str, seq: int, attempt: int, live: int) -> None:
        live_text = f"attempt {live} is live" if live else "no attempt is live"
        super().__init__(rollout_id, seq, f"attempt {attempt} is stale ({live_text})")
        self.attempt = attempt
        self.live = live


class InvalidRedisUrl(StoreError, ValueError):
    """A Redis URL that cannot be read or used. Its message never contains the URL itself
    (it may hold a password)."""
