"""The only place that formats a Redis key.

Every key of one rollout carries the hash tag ``{rollout_id}`` so that, on Redis Cluster, a
rollout's log and snapshot live in one slot and the append script may touch both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from store.errors import InvalidRolloutId

DEFAULT_NAMESPACE = "dr"
_MAX_ID_LEN = 200
_MAX_BATCH_ID_LEN = 160


# Braces would break the hash tag; whitespace and colons make keys ambiguous to read.
_VALID_ID = re.compile(rf"[^{{}}:\s]{{1,{_MAX_ID_LEN}}}")


def check_batch_id(batch_id: str) -> str:
    """A batch id names keys and prefixes its rollouts' ids (``<batch>.<group>.<sample>``), so
    it follows the rollout-id rules with room left for the suffix."""
    if (
        not isinstance(batch_id, str)
        or _VALID_ID.fullmatch(batch_id) is None
        or (len(batch_id) > _MAX_BATCH_ID_LEN)
    ):
        raise InvalidRolloutId(
            f"batch id must be 1-{_MAX_BATCH_ID_LEN} characters without braces, colons or "
            f"whitespace, got {batch_id!r}"
        )
    return batch_id


def check_rollout_id(rollout_id: str) -> str:
    if not isinstance(rollout_id, str) or _VALID_ID.fullmatch(rollout_id) is None:
        raise InvalidRolloutId(
            f"rollout id must be 1-{_MAX_ID_LEN} characters without braces, colons or "
            f"whitespace, got {rollout_id!r}"
        )
    return rollout_id


@dataclass(frozen=True, slots=True)
class Keys:
    namespace: str = DEFAULT_NAMESPACE

    def log(self, rollout_id: str) -> str:
        return f"{self.namespace}:{{{check_rollout_id(rollout_id)}}}:log"

    def snapshot(self, rollout_id: str) -> str:
        return f"{self.namespace}:{{{check_rollout_id(rollout_id)}}}:snap"

    def weights(self) -> str:
        """The weight-version log: one per deployment, so no rollout hash tag."""
        return f"{self.namespace}:weights"

    def leases(self) -> str:
        """The lease index of every generating rollout (one per deployment)."""
        return f"{self.namespace}:leases"

    def quarantine(self) -> str:
        """Rollouts set aside because they cannot be read (rollout id -> reason)."""
        return f"{self.namespace}:quarantine"

    def worker_leases(self, worker_id: str) -> str:
        """The rollouts one worker leased (a set): its leases, found at once when it dies."""
        return f"{self.namespace}:worker:{worker_id}:leases"

    def presence(self) -> str:
        """Workers whose process presence is watched (worker id -> when it subscribed, ms)."""
        return f"{self.namespace}:presence"

    def presence_channel(self, worker_id: str) -> str:
        """A channel, not a key: the worker's subscription to it lives as long as its process."""
        return f"{self.namespace}:alive:{worker_id}"

    def presence_check(self) -> str:
        """Which reaper checks the workers' presence this interval (a string with a short TTL)."""
        return f"{self.namespace}:presence:check"

    def batch(self, batch_id: str) -> str:
        """A batch's record (a hash: request fingerprint, rollout ids, group size, retention)."""
        return f"{self.namespace}:batch:{{{batch_id}}}"

    def completions(self, batch_id: str) -> str:
        """A batch's completion stream: one entry per rollout that ended, written by the same
        atomic append that ended it. Rollouts of no batch (older records) share one stream."""
        if not batch_id:
            return f"{self.namespace}:completions"
        return f"{self.namespace}:batch:{{{batch_id}}}:done"

    def batches(self) -> str:
        """Every batch's id, scored by the time it was submitted (a sorted set)."""
        return f"{self.namespace}:batches"

    def stats(self) -> str:
        """Counters kept by the appends themselves: rollouts by state, tokens generated."""
        return f"{self.namespace}:stats"

    def workers(self) -> str:
        """Live workers' heartbeats (worker id -> their in-flight count, weights, time)."""
        return f"{self.namespace}:workers"

    def rollout(self, rollout_id: str) -> tuple[str, str]:
        """``(log, snapshot)``: what the append script gets as KEYS, checked once."""
        base = f"{self.namespace}:{{{check_rollout_id(rollout_id)}}}"
        return f"{base}:log", f"{base}:snap"
