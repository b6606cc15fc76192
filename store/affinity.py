"""Session affinity: a session's next call prefers the worker that served its previous one
(that worker's prefix cache likely holds the trajectory so far), and never waits for it.

What is recorded, and where:

- the session's worker (``Keys.session_worker``): set by the worker that *starts* a call of the
  session, in the transaction that records the start (``workers.affinity.record_served``), so
  a call resumed elsewhere names the worker that holds its prefix now. ``SET XX KEEPTTL``: it
  lives exactly as long as the session's index, whose ``note`` creates it (empty) and gives it
  the index's TTL (``store.sessions.note``, which also reads it: no round trip of its own);
- the job's hash carries the call's session and preferred worker (fields ``session`` and
  ``prefer``, beside rq's own, which rq ignores): a worker reads them with the job it fetches
  anyway;
- the preferred worker's hint list (``Keys.worker_hints``): the new jobs' ids pushed in the
  same atomic step that enqueues them (``lua/submit_chunk.lua``), trimmed to
  ``AFFINITY_HINTS_MAX`` and expiring ``AFFINITY_HINTS_TTL_S`` after the last push.

The job always goes on its queue as every job does: any worker may take it, so a call never
waits for its preferred worker. That worker takes it first in two cases:

- it has free slots while jobs are queued: it claims its hinted jobs before its share of the
  queue (``lua/claim_hints.lua``: ``LREM`` from the queue, 1 = ours, 0 = taken already), in the
  round trip that reads the queue's length anyway;
- it is blocked on an empty queue (the usual state of a worker with free slots): it flags
  itself waiting (``Keys.worker_waiting``) in the pipeline of its blocking pop. Redis hands a
  new job to whichever worker blocked first; one that is not preferred gives it back to the
  front of the queue (``lua/bounce_job.lua``) if the preferred worker is waiting there, and
  Redis then hands it to that worker (every other one still blocked bounces it too, at most
  ``AFFINITY_BOUNCES`` times in all).

A session-less call writes and reads none of this (no field, no hint, no extra command); the
cost of a session's call is counted in docs/harness-endpoints.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from store import defaults
from store.keys import Keys

# The job hash's fields (beside rq's) for a session's call.
SESSION_FIELD = "session"
PREFER_FIELD = "prefer"


@dataclass(frozen=True, slots=True)
class Affinity:
    """A session's call: its session, and the worker that started its previous call (None
    before any did, or once the session's record expired)."""

    session: str
    worker: str | None = None

    def job_fields(self) -> dict[str, Any]:
        """The fields every job of the call carries (``lua/submit_chunk.lua``'s shared ones)."""
        fields = {SESSION_FIELD: self.session}
        if self.worker:
            fields[PREFER_FIELD] = self.worker
        return fields

    def hint(self, keys: Keys) -> tuple[list[str], list[Any]]:
        """``lua/submit_chunk.lua``'s optional trailing key and arguments: the preferred
        worker's hint list, how many hints it keeps and its TTL (ms); none without one."""
        if not self.worker:
            return [], []
        ttl_ms = int(defaults.AFFINITY_HINTS_TTL_S * 1000)
        return [keys.worker_hints(self.worker)], [defaults.AFFINITY_HINTS_MAX, ttl_ms]
