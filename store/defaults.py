"""Every tunable default of the system, in one place, each with the reason for its value."""

from __future__ import annotations

from statemachine.request import DEFAULT_QUEUE

# -- checkpoints --------------------------------------------------------------------------------
# A worker appends a rollout's new tokens after CHECKPOINT_TOKENS tokens or CHECKPOINT_INTERVAL_S
# seconds, whichever comes first. A crash regenerates at most that much. 16 tokens is ~0.1-0.3 s
# of decode per rollout on a GPU; the worker's rollouts checkpoint together at shared flush
# points (workers/generation.py), one Redis round trip per worker per checkpoint, far below Redis'
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
# A claimed tool call is leased to its environment runner for TOOL_LEASE_TTL_S (renewed by the
# runner's heartbeat, ``EnvironmentClient.heartbeat``, every TOOL_HEARTBEAT_S or so); one left
# to lapse is lost, and its tool's declared effect decides (``store.tool_sweep``). Longer than
# a generation lease: a runner is a separate process, often in a sandbox farther from Redis.
TOOL_LEASE_TTL_S = 15.0
TOOL_HEARTBEAT_S = 3.0
# How often each worker's reaper (and each environment runner) looks for lapsed tool leases.
TOOL_SWEEP_S = TOOL_LEASE_TTL_S / 3
# A call whose runner reports env_error is claimable again this many times; the failure after
# that ends the episode (``episode_commands.fail_call``).
TOOL_RETRIES = 2
# How often a blocking claim looks at its environment queue again while it is empty. A claim
# must not take the entry off the queue (a runner dying between the pop and its append would
# strand the call), so it waits on the queue's doorbell instead (``Keys.env_bell``: rung once
# per call that becomes claimable, by the append itself) and wakes at once; this is only the
# fallback look, for a ring another runner took (an idle runner's look is one ZRANGE).
TOOL_CLAIM_POLL_S = 1.0
# The longest a claim over HTTP waits for a call (``POST /v1/env/{queue}/claim``): a waiting
# claim holds a connection and polls, and a runner's HTTP client times out on its own clock;
# a runner that wants to wait longer asks again. A lease asked over HTTP is at most
# TOOL_LEASE_MAX_S: a runner that never heartbeats must not hold a call for a day.
API_CLAIM_WAIT_MAX_S = 30.0
TOOL_LEASE_MAX_S = 3600.0
# A rollout (or rq job) a reaper could not give back (its enqueue refused: Redis out of memory,
# a damaged queue key) keeps its expired lease (or lapsed execution) and is tried again after
# REAP_RETRY_S, doubling with each failure up to REAP_RETRY_MAX_S: never every pass, and the
# others are reaped meanwhile. Short: a rollout waits on it once the cause is gone.
REAP_RETRY_S = 1.0
REAP_RETRY_MAX_S = 15.0
# The net under every give back (workers/stranded.py): one reaper of the fleet compares, every
# STRANDED_CHECK_S, the rollouts that need a job with the jobs that would run them (two round
# trips); only a shortfall makes it look for stranded ones (a SCAN), and a look that finds none
# to requeue doubles the wait before the next, up to STRANDED_SCAN_MAX_S.
STRANDED_CHECK_S = 30.0
# The lease index's shards on Redis Cluster (store.keys.Keys.lease_shards): a deployment's
# constant, since a rollout's lease is looked for in the shard its id hashes to.
CLUSTER_LEASE_SHARDS = 16
# On Redis Cluster, how often some reaper of the fleet delivers the completions an appender
# that died left in its slot's outbox (workers/outbox_sweep.py, store/outbox.py).
OUTBOX_SWEEP_S = 5.0
STRANDED_SCAN_MAX_S = 600.0

# A worker process that dies closes its Redis connections at once, and with them its presence
# subscription (store/presence.py): its leases are reaped then, not LEASE_TTL_S later. Some
# reaper checks every PRESENCE_CHECK_S (one per interval for the whole fleet); a worker counts
# as gone only if it stays absent for its confirmation window and renews none of its leases
# meanwhile (a live process renews every HEARTBEAT_S). The window is PRESENCE_RTT_FACTOR of the
# round trips to Redis the worker registered, within [PRESENCE_CONFIRM_MIN_S,
# PRESENCE_CONFIRM_S]: a resubscribe is several round trips (connect, CLIENT SETNAME/SETINFO,
# SUBSCRIBE): ~0.1 s on a LAN (the minimum, as before issue 28, keeps a dead worker noticed
# ~0.5 s after its death), but 0.5-0.9 s measured over a link of 50-200 ms each way and 1.4-1.6 s
# when a second drop hits the reconnect, where a fixed 0.25 s took live workers over (a
# worker_lost charged each time); there the window reaches two heartbeats (a renewal held up by
# a reconnect lands ~2 s after the one before). A worker that registered no round trip gets the
# longest. For PRESENCE_GRACE_S after Redis starts nobody is judged: every worker is
# reconnecting (its backoff is capped at 2 s). A stalled or partitioned worker keeps its
# connection open and falls back to the TTL.
PRESENCE_CHECK_S = 0.25
PRESENCE_CONFIRM_MIN_S = 0.25
PRESENCE_CONFIRM_S = 2 * HEARTBEAT_S
PRESENCE_RTT_FACTOR = 10
PRESENCE_GRACE_S = 5.0

# rq's view of a job: its execution is heartbeated every RQ_HEARTBEAT_S; one not heartbeated for
# RQ_EXECUTION_TTL_S belonged to a dead worker, and every worker's reaper requeues such jobs
# (a worker killed after taking a job but before leasing its rollout, or after aborting it but
# before requeueing, left the rollout with no lease and no live job: lost for good). rq's own
# default of 60-90 s and more is too slow for preemptible nodes.
RQ_HEARTBEAT_S = 3.0
RQ_EXECUTION_TTL_S = 15.0

# -- Redis refusing writes ----------------------------------------------------------------------
# Redis refuses writes for a condition of its own (store.errors.StoreUnwritable: out of memory
# under noeviction, a failed RDB/AOF write, a read-only replica). A worker keeps its rollouts,
# their unsaved tokens and their attempts, takes no new job, and retries each refused write
# after STORE_RETRY_S[0] s, doubling up to STORE_RETRY_S[1]: a refused write costs Redis
# almost nothing, and the capped retry resumes checkpoints within about a second of the
# condition clearing.
STORE_RETRY_S = (0.05, 1.0)
# Nobody can renew a lease while Redis refuses writes, so every lease may have lapsed when the
# condition clears. A reaper leaves lapsed leases alone until its worker has seen Redis accept
# writes for this long: each live worker renews its leases within a heartbeat of that, and a
# worker that really died is still recovered (by its lapsed lease, or its closed connection).
STORE_REAP_GRACE_S = LEASE_TTL_S
# The Retry-After (seconds) of the HTTP API's 503 for a refused write: the condition clears only
# when memory or disk is freed (an operator, the trainer's acknowledgements), so faster retries
# would only add refused writes.
STORE_RETRY_AFTER_S = 5

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
# Rollouts recorded and enqueued per script (lua/submit_chunk.lua): each chunk is one atomic
# round trip, and a failure leaves whole chunks (never a recorded but unqueued rollout). Redis
# serves nobody else while one runs: ~18 us per rollout of a short prompt on an idle 2-core
# machine, 2-5x that under load, plus ~5-10 ns per byte of records (Redis hashes every byte a
# script is given; 1,000 rollouts of an 8,192-token prompt held it 240 ms). So a chunk is at
# most 250 rollouts and 1 MiB of records: ~5-10 ms idle. A chunk of 500 cost Redis 55 ms of
# CPU once in a loaded CI run (110 us per rollout), over the 50 ms every bulk operation keeps
# under (issue 28); 10,000 short rollouts are 40 chunks, two in flight at once (with chunks of
# 1,000, 0.27-0.54 s with appendfsync always on this loaded machine; with 200, 25-45% longer).
SUBMIT_CHUNK = 250
SUBMIT_CHUNK_BYTES = 1 << 20

# Rollouts per script or transaction of an operation over many of them (cancel, ack, the reads
# of wait, stuck and requeue; see store/bulk.py): Redis serves nobody else while one runs. A
# cancel's append held it ~12 us per rollout on an idle 2-core machine (a 20,000-rollout cancel
# in one transaction: 0.25 s, a worker's renewal waited 0.43 s), 73 us in issue 28's run, and a
# chunk of 500 took 51 ms of wall time once on the same machine under a load of 4.6: 200 keep a
# chunk to ~2.5 ms idle and ~15 ms at the rate; 100,000 rollouts take 500 round trips.
BULK_CHUNK = 200
# Rollouts loaded (log and all) per transaction when results are read: a load reads the whole
# log. 64 rollouts of 1,024 tokens (64 records each) cost Redis 1.9 ms of CPU (measured), so
# 32 of 32,768 tokens (2,048 records each) cost ~30 ms.
LOAD_CHUNK = 32

# -- retention ------------------------------------------------------------------------------------
# An ended rollout nobody acknowledged is deleted this long after it ended (0 keeps it forever):
# a trainer that crashed and never came back does not fill Redis until it refuses writes.
RETENTION_S = 24 * 3600
# A session's index of calls outlives the newest call's submit by the retention plus this: its
# rollouts are retained from when they end, which is after the submit, by up to a call's
# generation time.
SESSION_GRACE_S = 3600
# A harness-driven episode (a session's calls as the turns of one episode: store/harness_turns)
# that waits this long for its harness's next call ends (``session_end``): its harness is gone
# or done without saying so. An agent's tool may run minutes (a test suite, a build); an
# hour of no call is past any tool such a harness runs between two calls.
SESSION_IDLE_S = 3600
# How long a harness turn's completion stream (what its call waits on) is kept after its last
# entry: it serves the waiting call and its retries; a later retry reads the episode itself.
TURN_STREAM_TTL_S = SESSION_GRACE_S
# Session affinity (store/affinity.py): a session's next call is hinted to the worker that
# started its previous one. A worker's hint list keeps at most AFFINITY_HINTS_MAX entries (the
# newest; a hint is only a preference, its job stays on the queue) and expires
# AFFINITY_HINTS_TTL_S after its last push (a dead worker's list goes by itself). A job taken
# by a worker it does not prefer goes back to the front of its queue, for its preferred worker
# blocked there, at most AFFINITY_BOUNCES times.
AFFINITY_HINTS_MAX = 256
AFFINITY_HINTS_TTL_S = 300
AFFINITY_BOUNCES = 2
# How long one blocking read of a completion stream waits before looking around again.
COMPLETION_BLOCK_MS = 1000

# `rollouts api`: the largest request body (413 beyond). A 100,000-rollout submit (the most one
# takes) of 64-token prompts is ~25 MB of JSON.
API_MAX_BODY_BYTES = 64 * 1024 * 1024
# Harness calls (store.api.harness) waiting at once on one API (``--max-waiting``), how long
# one waits before a 504 (its rollouts go on; a retry attaches), and what a caller's
# disconnect does to its rollouts (``--on-disconnect``).
API_MAX_WAITING = 4096
API_CALL_TIMEOUT_S = 3600.0
ON_DISCONNECT = ("keep", "cancel")
