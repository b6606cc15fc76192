"""Every tunable default of the system, in one place, each with the reason for its value."""

from __future__ import annotations

from statemachine.request import DEFAULT_QUEUE

# -- checkpoints --------------------------------------------------------------------------------
# A worker appends a rollout's new tokens after CHECKPOINT_TOKENS tokens or CHECKPOINT_INTERVAL_S
# seconds, whichever comes first. A crash regenerates at most that much. 16 tokens is ~0.1-0.3 s
# of decode per rollout on a GPU; the worker's rollouts checkpoint together at shared flush
# points (workers/runner.py), one Redis round trip per worker per checkpoint, far below Redis'
# capacity.
CHECKPOINT_TOKENS = 16
CHECKPOINT_INTERVAL_S = 0.25
# How long the checkpoints of one flush point wait for each other before they go out: about a
# decode step or two, the time every rollout's next chunk takes to arrive. Only mid-rollout
# checkpoints wait; a rollout's first and last events never do.
CHECKPOINT_GATHER_S = 0.02
# A worker takes its next job when a rollout has this many tokens left to generate (its
# max_tokens known), not when it ends: the job's dequeue, load, lease and Started (~15 ms of
# round trips, three of them fsynced) then overlap the rollout's last engine steps instead of
# leaving its engine place empty. The new rollout waits for that place: never more requests
# on the engine than max_concurrency. 8 steps cover those round trips at a small model's 2-4 ms
# steps; at a GPU's 20-50 ms a job is claimed at most a fraction of a second early. 0: at end.
PREFETCH_TOKENS = 8

# -- retries ------------------------------------------------------------------------------------
# Attempts a rollout gets when its engine fails on it; then it is recorded as failed with the
# engine's error. Aborts for weight updates, shutdowns, lost workers or a dead engine core do not
# count: they are not the rollout's fault.
MAX_ENGINE_ATTEMPTS = 3
MAX_WORKER_LOST = 5  # workers lost under one rollout (lapsed leases, takeovers) before it fails

# -- leases -------------------------------------------------------------------------------------
# A generating rollout is leased to its worker for LEASE_TTL_S; the worker renews all its leases
# every HEARTBEAT_S in one command. A worker that dies is noticed within about LEASE_TTL_S +
# REAP_INTERVAL_S, and its rollouts resume elsewhere from their last checkpoint. The TTL spans
# several heartbeats so that one slow round trip or GC pause does not cost a lease.
LEASE_TTL_S = 5.0
HEARTBEAT_S = 1.0
REAP_INTERVAL_S = 1.0

# A worker process that dies closes its Redis connections at once, and with them its presence
# subscription (store/presence.py): its leases are reaped then, not LEASE_TTL_S later. Some
# reaper checks every PRESENCE_CHECK_S (one per interval for the whole fleet); a worker counts
# as gone only if still absent PRESENCE_CONFIRM_S later (a live worker resubscribes within
# ~0.1 s of a dropped connection: redis-py's first retry). For PRESENCE_GRACE_S after Redis
# starts nobody is judged: every worker is reconnecting (its backoff is capped at 2 s). A stalled
# or partitioned worker keeps its connection open and falls back to the TTL.
PRESENCE_CHECK_S = 0.25
PRESENCE_CONFIRM_S = 0.25
PRESENCE_GRACE_S = 5.0

# rq's view of a job: its execution is heartbeated every RQ_HEARTBEAT_S; one not heartbeated for
# RQ_EXECUTION_TTL_S belonged to a dead worker, and every worker's reaper requeues such jobs
# (a worker killed after taking a job but before leasing its rollout, or after aborting it but
# before requeueing, left the rollout with no lease and no live job: lost for good). rq's own
# default of 60-90 s and more is too slow for preemptible nodes.
RQ_HEARTBEAT_S = 3.0
RQ_EXECUTION_TTL_S = 15.0

# -- shutdown -----------------------------------------------------------------------------------
# A stopping worker gives its rollouts this long to save their progress and requeue their
# jobs (normally a checkpoint round trip); any left are cancelled (their leases then lapse
# and the reaper recovers them).
SHUTDOWN_GRACE_S = 30.0
# How long a stopping worker waits for each background loop or closing step; past it the step
# is logged and left behind. A wait on shutdown is never unbounded (seen: a cancel lost inside
# redis-py kept a SIGTERMed worker alive forever).
LOOP_STOP_S = 5.0

# -- queue --------------------------------------------------------------------------------------
# The queue a rollout goes to when its submitter names none; recorded in ``Submitted``.
QUEUE_NAME = DEFAULT_QUEUE
# rq's job timeout: generations can legitimately run for many minutes; our own leases (not
# rq's timeout) detect dead workers, so this only bounds a runaway job.
JOB_TIMEOUT_S = 24 * 3600
# Seconds a worker blocks on the queue before looking around (shutdown, stats); a blocking
# pop, never a busy poll.
DEQUEUE_TIMEOUT_S = 1

# A job the worker cannot run now (Redis unreachable, a record written by newer code, another
# model's rollout, a bug) goes back to the queue after a backoff: REQUEUE_BACKOFF_S, doubling
# with each failure of that rollout on that worker, up to REQUEUE_BACKOFF_MAX_S. Nothing
# requeues in a hot loop (before: ~300 requeues/s of one unloadable job, on every worker).
REQUEUE_BACKOFF_S = 1.0
REQUEUE_BACKOFF_MAX_S = 60.0
# How long a worker keeps retrying rq's bookkeeping of a job (requeue, success, failure)
# through a Redis outage: well past the client's own ~15 s of retries and past rq's 60 s
# execution TTL, after which rq would call the job abandoned.
BOOKS_RETRY_S = 300.0

# -- clients ------------------------------------------------------------------------------------
# How often ``wait`` re-reads the status of rollouts still running; one pipelined round trip
# for all of them, backing off from the first value to the second.
WAIT_POLL_S = (0.02, 0.5)

# -- submissions ----------------------------------------------------------------------------------
# The largest max_tokens a submit accepts (a deployment with longer contexts raises it): a typo'd
# budget is refused at submit, not discovered as a worker-side error hours later.
MAX_TOKENS_CAP = 1 << 20
# Samples per prompt (GRPO uses 4-64) and rollouts per submit call.
MAX_GROUP_SIZE = 1024
MAX_SUBMIT_ROLLOUTS = 100_000
# Metadata rides in every rollout's Submitted record and comes back with its result: small.
MAX_METADATA_BYTES = 4096
# Rollouts recorded and enqueued per MULTI/EXEC: each chunk is one atomic round trip, so 10,000
# rollouts take ~10, and a failure leaves whole chunks (never a recorded but unqueued rollout).
SUBMIT_CHUNK = 1000

# -- retention ------------------------------------------------------------------------------------
# An ended rollout nobody acknowledged is deleted this long after it ended (0 keeps it forever):
# a trainer that crashed and never came back does not fill Redis until it refuses writes.
RETENTION_S = 24 * 3600
# How long one blocking read of a completion stream waits before looking around again.
COMPLETION_BLOCK_MS = 1000
