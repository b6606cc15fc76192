"""The only place that formats a Redis key.

Every key of one rollout carries one hash tag (its id, or on Redis Cluster its group's: see
``Keys.grouped``) so that its log and snapshot live in one slot and the append script may
touch both.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from dataclasses import dataclass

from store.errors import InvalidRolloutId, InvalidSessionId
from store.slots import slot_tag

DEFAULT_NAMESPACE = "dr"
MAX_ID_LEN = 200
MAX_BATCH_ID_LEN = 160


# Braces would break the hash tag; whitespace and colons make keys ambiguous to read; control
# characters (ESC among them) would reach terminals through every log line that names an id.
# Written as explicit ranges, never ``\s``: the API's document carries this class as a JSON
# Schema ``pattern`` (ECMA-262), whose ``\s`` differs from Python's (\x1c-\x1f, \x85, \ufeff),
# so a client would be told an id is valid that this check refuses. Excluded: braces, the
# colon, C0 controls and the space, DEL and the C1 controls with NBSP, and every other
# character either dialect calls whitespace.
ID_CHARS = (
    r"[^{}:\u0000-\u0020\u007f-\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
    r"\ufeff]"
)
_VALID_ID = re.compile(rf"{ID_CHARS}{{1,{MAX_ID_LEN}}}")
# The same rule as a JSON Schema pattern (its length goes in minLength/maxLength).
ID_PATTERN = f"^{ID_CHARS}+$"


def check_batch_id(batch_id: str) -> str:
    """A batch id names keys and prefixes its rollouts' ids (``<batch>.<group>.<sample>``), so
    it follows the rollout-id rules with room left for the suffix."""
    if (
        not isinstance(batch_id, str)
        or _VALID_ID.fullmatch(batch_id) is None
        or (len(batch_id) > MAX_BATCH_ID_LEN)
    ):
        raise InvalidRolloutId(
            f"batch id must be 1-{MAX_BATCH_ID_LEN} characters without braces, colons, "
            f"whitespace or control characters, got {batch_id!r}"
        )
    return batch_id


# A session id is the harness's (``X-Session-ID``), not ours: any text but control characters
# (a newline in it would reach log lines), hashed into its key, so braces or colons in it
# cannot break the hash tag. The same rule as a JSON Schema pattern for the API's document.
MAX_SESSION_ID_LEN = 256  # as the harness bodies take it (session_id)
SESSION_ID_PATTERN = r"^[^\u0000-\u001f\u007f-\u009f]+$"
_VALID_SESSION = re.compile(rf"[^\u0000-\u001f\u007f-\u009f]{{1,{MAX_SESSION_ID_LEN}}}")


def check_session_id(session_id: str) -> str:
    if not isinstance(session_id, str) or _VALID_SESSION.fullmatch(session_id) is None:
        raise InvalidSessionId(
            f"session id must be 1-{MAX_SESSION_ID_LEN} characters without control "
            f"characters, got {session_id!r}"
        )
    return session_id


def check_rollout_id(rollout_id: str) -> str:
    if not isinstance(rollout_id, str) or _VALID_ID.fullmatch(rollout_id) is None:
        raise InvalidRolloutId(
            f"rollout id must be 1-{MAX_ID_LEN} characters without braces, colons, "
            f"whitespace or control characters, got {rollout_id!r}"
        )
    return rollout_id


def group_tag(rollout_id: str) -> str | None:
    """``<batch>.<group>`` of an id as submit makes them (``<batch>.<group>.<sample>``), else
    None (an id of the caller's own)."""
    head, _, sample = rollout_id.rpartition(".")
    batch, _, group = head.rpartition(".")
    if batch and group.isdigit() and sample.isdigit():
        return f"{batch}.{group}"
    return None


@dataclass(frozen=True, slots=True)
class Keys:
    namespace: str = DEFAULT_NAMESPACE
    # On Redis Cluster: the samples of one group share their group's hash tag, so one slot
    # (``dr:{<batch>.<group>}:<rollout id>:log``), where otherwise every rollout is a slot of
    # its own (``dr:{<rollout id>}:log``, always on one Redis). A worker's checkpoint holds
    # whole groups more often than not (their jobs are queued one after another), and a slot's
    # rollouts share one transaction and one script call: bench_cluster measures what that
    # saves. A batch still spreads over every master, a group at a time.
    grouped: bool = False
    # On Redis Cluster the lease index is split in this many sorted sets (``leases(shard)``),
    # each in its own slot: one index renewed by 1,000 workers of 128 rollouts each costs its
    # master ~15% of a core (151 us per renewal, bench_cluster), all on one key. Every process
    # of a deployment must agree on it (``defaults.CLUSTER_LEASE_SHARDS``).
    lease_shards: int = 1

    def _base(self, rollout_id: str) -> str:
        check_rollout_id(rollout_id)
        tag = group_tag(rollout_id) if self.grouped else None
        if tag is None:
            return f"{self.namespace}:{{{rollout_id}}}"
        return f"{self.namespace}:{{{tag}}}:{rollout_id}"

    def log(self, rollout_id: str) -> str:
        return f"{self._base(rollout_id)}:log"

    def snapshot(self, rollout_id: str) -> str:
        return f"{self._base(rollout_id)}:snap"

    def snapshots_glob(self) -> str:
        """A SCAN pattern of every rollout's snapshot, whichever its form (``_base``)."""
        return f"{self.namespace}:{{*:snap"

    def rollout_of_snapshot(self, key: str) -> str:
        """The rollout id of a snapshot key ``snapshots_glob`` matched."""
        body = key[len(self.namespace) + 2 : -len(":snap")]  # "<id>}" or "<tag>}:<id>"
        head, _, rest = body.partition("}")
        return rest[1:] if rest else head

    def weights(self) -> str:
        """The weight-version log: one per deployment, so no rollout hash tag."""
        return f"{self.namespace}:weights"

    def leases(self, shard: int = 0) -> str:
        """The lease index of every generating rollout: one per deployment on one Redis; on
        Redis Cluster ``lease_shards`` of them, each rollout's in ``lease_shard`` (shard 0
        keeps the one index's name)."""
        name = f"{self.namespace}:leases"
        return name if shard == 0 else f"{name}.{shard}"

    def lease_refusals(self, shard: int = 0) -> str:
        """What the lease scripts last saw of Redis's refused writes (lua/lease_grace.lua):
        a hash beside its lease index, in its Cluster slot (the index's name as hash tag)."""
        return f"{{{self.leases(shard)}}}:refusals"

    def lease_shard(self, rollout_id: str) -> int:
        """The lease index shard of a rollout: a stable hash of its id (CRC32), so every
        process finds a rollout's lease in the same one."""
        if self.lease_shards == 1:
            return 0
        return zlib.crc32(rollout_id.encode()) % self.lease_shards

    def quarantine(self) -> str:
        """Rollouts set aside because they cannot be read (rollout id -> reason)."""
        return f"{self.namespace}:quarantine"

    def worker_leases(self, worker_id: str) -> str:
        """The rollouts one worker leased (a set): its leases, found at once when it dies."""
        return f"{self.namespace}:worker:{worker_id}:leases"

    def presence(self) -> str:
        """Workers whose process presence is watched (worker id -> when it registered: unix ms
        by Redis's clock). With rq's queue apart, on the queue's Redis (with the presence
        channels and ``presence_check``): one node, where ``PUBSUB NUMSUB`` sees every one."""
        return f"{self.namespace}:presence"

    def presence_channel(self, worker_id: str) -> str:
        """A channel, not a key: the worker's subscription to it lives as long as its process."""
        return f"{self.namespace}:alive:{worker_id}"

    def presence_check(self) -> str:
        """Which reaper checks the workers' presence this interval (a string with a short TTL)."""
        return f"{self.namespace}:presence:check"

    def stranded_check(self) -> str:
        """Which reaper checks for stranded rollouts this interval (a string with a short TTL)."""
        return f"{self.namespace}:stranded:check"

    def outbox_sweep(self) -> str:
        """On Redis Cluster, which reaper delivers what appenders left in the outboxes this
        interval (a string with a short TTL; ``workers.outbox_sweep``)."""
        return f"{self.namespace}:outbox:sweep"

    def stranded_scan(self) -> str:
        """When the fleet may next look for stranded rollouts, and the wait before that look
        (a hash: at, unix s by Redis's clock; wait, s): each look that requeues nothing
        doubles it."""
        return f"{self.namespace}:stranded:scan"

    def batch(self, batch_id: str) -> str:
        """A batch's record (a hash: request fingerprint, rollout ids, group size, retention)."""
        return f"{self.namespace}:batch:{{{batch_id}}}"

    def completions(self, batch_id: str) -> str:
        """A batch's completion stream: one entry per rollout that ended, written by the same
        atomic append that ended it. Rollouts of no batch (older records) share one stream."""
        if not batch_id:
            return f"{self.namespace}:completions"
        return f"{self.namespace}:batch:{{{batch_id}}}:done"

    def session(self, session_id: str) -> str:
        """A session's calls (a sorted set: batch id -> when the call was first made), in the
        order they were made; its hash tag is a digest of the session id (see above)."""
        digest = hashlib.sha256(check_session_id(session_id).encode()).hexdigest()[:32]
        return f"{self.namespace}:session:{{{digest}}}"

    def session_turns(self, session_id: str) -> str:
        """A session's calls that are later turns of a harness-driven episode (a hash: call
        batch id -> "<episode id> <turn> <fingerprint>": ``store.harness_turns``), beside the
        session's index in its slot, kept and deleted with it. A first turn's call is its
        episode's batch, recorded as any batch."""
        return self.session(session_id) + ":turns"

    def session_worker(self, session_id: str) -> str:
        """The worker that started the session's latest call (a string; "" until one did),
        in the session index's Cluster slot and with its TTL (``store.affinity``)."""
        return f"{self.session(session_id)}:worker"

    def worker_hints(self, worker_id: str) -> str:
        """Job ids hinted to a worker: calls of sessions it served before (a list, trimmed;
        ``store.affinity``). With rq's queue apart, on the queue's Redis, with the jobs."""
        return f"{self.namespace}:worker:{worker_id}:hints"

    def worker_waiting(self, worker_id: str) -> str:
        """Exists while the worker is blocked on its queue with free slots (set and deleted
        around its blocking pop; ``workers.affinity``)."""
        return f"{self.namespace}:worker:{worker_id}:waiting"

    def env_queue(self, queue: str) -> str:
        """An environment queue's claimable tool calls (a sorted set: member rollout id, score
        = when its call became claimable, unix ms by Redis's clock; ``store.environment``).
        Its own hash tag: on Redis Cluster it is a slot apart from the rollouts' keys (see
        lua/tool_call_index.lua for what that asks of the write that keeps it)."""
        return f"{self.namespace}:env:{{{check_batch_id(queue)}}}:calls"

    def env_bell(self, queue: str) -> str:
        """An environment queue's doorbell (a list, capped): one entry pushed per call that
        becomes claimable, popped by a runner blocked waiting for one (``BLPOP``), so a waiting
        runner wakes at once instead of polling. In the queue's hash tag: the script that
        indexes a call rings it in the same slot."""
        return f"{self.namespace}:env:{{{check_batch_id(queue)}}}:bell"

    def episode_deadlines(self) -> str:
        """The wall-time deadlines of episodes awaiting their tool (a sorted set: member rollout
        id, score = when ``max_wall_seconds`` run out, unix ms), kept by the appends beside
        the environment queues (lua/tool_call_index.lua), read by ``store.tool_sweep``."""
        return f"{self.namespace}:episode-deadlines"

    def tool_lease_refusals(self) -> str:
        """``lease_refusals`` for the tool-call lease index. On one Redis the same hash (one
        count of refusals per server); on Redis Cluster one beside ``tool_leases``, in its
        slot: a script may touch only its own slot's keys, and ``INFO errorstats`` is that
        master's own count anyway."""
        if not self.grouped:
            return self.lease_refusals()
        return f"{{{self.tool_leases()}}}:refusals"

    def tool_leases(self) -> str:
        """The lease index of every claimed tool call (a sorted set: member rollout id, score =
        expiry, unix ms by Redis's clock), as ``leases`` is for generation attempts: an
        episode has one call at most, so its rollout id names the call's live claim."""
        return f"{self.namespace}:tool-leases"

    def batches(self) -> str:
        """Every batch's id, scored by the time it was submitted (a sorted set)."""
        return f"{self.namespace}:batches"

    def stats(self) -> str:
        """Counters kept by the appends themselves: rollouts by state, tokens generated."""
        return f"{self.namespace}:stats"

    def slot_counters(self, slot: int) -> str:
        """On Redis Cluster, ``stats`` split by slot: the counters the appends of one slot's
        rollouts keep (in that slot, so the append script may), summed on read."""
        return f"{self.namespace}:stats:{{{slot_tag(slot)}}}"

    def slot_outbox(self, slot: int) -> str:
        """On Redis Cluster, the rollouts of one slot that ended and whose completion is not
        in their batch's stream yet (a sorted set: rollout id -> when it ended, unix ms),
        written by the append that ended them (``store.outbox``)."""
        return f"{self.namespace}:outbox:{{{slot_tag(slot)}}}"

    def completion_ids(self, batch_id: str) -> str:
        """On Redis Cluster, the completions delivered to a batch's stream (a hash: rollout
        id -> entry id), in the batch's slot: what makes a delivery repeated after a crash
        land once (``store.outbox``). Rollouts of no batch: tagged with their shared stream's
        name, so that both are in one slot."""
        if not batch_id:
            return f"{{{self.completions('')}}}:ids"
        return f"{self.completions(batch_id)}:ids"

    def workers(self) -> str:
        """Live workers' heartbeats (worker id -> their in-flight count, weights, time)."""
        return f"{self.namespace}:workers"

    def paused(self) -> str:
        """The deployment's pause (a hash: mode, at), set by a harness's ``/pause`` and
        deleted by ``/resume``: absent, workers admit rollouts."""
        return f"{self.namespace}:paused"

    def replica_mark(self) -> str:
        """A write made only to be waited for (``store.replicas``): a string that expires."""
        return f"{self.namespace}:replica-mark"

    def slot_replica_mark(self, slot: int) -> str:
        """``replica_mark`` on Redis Cluster: one in a slot of each master, since ``WAIT``
        confirms one master's writes only (``store.replicas``)."""
        return f"{self.replica_mark()}:{{{slot_tag(slot)}}}"

    def slot_write_probe(self, slot: int) -> str:
        """``write_probe`` on Redis Cluster: one in a slot of each master, each asked whether
        it accepts writes (``store.writable``)."""
        return f"{self.write_probe()}:{{{slot_tag(slot)}}}"

    def write_probe(self) -> str:
        """Never created: ``SET`` of it with ``XX`` writes nothing, yet Redis refuses it as any
        write when it refuses writes (``store.writable``)."""
        return f"{self.namespace}:write-probe"

    def rollout(self, rollout_id: str) -> tuple[str, str]:
        """``(log, snapshot)``: what the append script gets as KEYS, checked once."""
        base = self._base(rollout_id)
        return f"{base}:log", f"{base}:snap"
