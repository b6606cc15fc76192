-- Record a chunk of new rollouts and enqueue their rq jobs, all in one atomic step; or, with
-- the queue on a Redis of its own (store/queue_redis.py), record them only (see below).
--
-- KEYS[1]  the deployment's counters     KEYS[2]  the rq queue (a list)
-- KEYS[3]  rq's set of queues            then, per rollout i (from 0):
-- KEYS[4+3i] its log   KEYS[5+3i] its snapshot   KEYS[6+3i] its rq job's hash
-- ARGV[1]  rollouts in the chunk (n)     ARGV[2]  m: the job fields shared by every job
-- ARGV[3 .. 2+2m]  those fields, as name, value pairs
-- then, per rollout i: ARGV[b+5i+1] its Submitted record, ARGV[b+5i+2] its snapshot head,
--   ARGV[b+5i+3] its job id, ARGV[b+5i+4] its job's data, ARGV[b+5i+5] its job's description
--   (b = 2 + 2m)
-- Optionally (a session's call hinted to the worker that served its previous one, see
-- store/affinity.py): KEYS[4+3n] that worker's hint list, ARGV[b+5n+1] the most hints it keeps,
-- ARGV[b+5n+2] its TTL (ms): the new jobs' ids are pushed onto it, in this same atomic step, so
-- no worker sees a hint before its job is on the queue.
--
-- Returns one status per rollout: "ok" (recorded and enqueued), "dup" (this exact record is
-- there already: a retry; its job was enqueued with it, none is added) or "conflict" (another
-- record holds the id: nothing written for it). The same fields as lua/append.lua writes for
-- a first event, so every later append and read sees no difference; one script for the chunk
-- instead of a transaction of per-rollout commands, because a client's cost is per reply.
--
-- The store's part only (no rq key: the queue is on a Redis of its own, and store/
-- submit_apart.py pushes the jobs there next, with lua/push_jobs.lua): KEYS[1] the counters,
-- then per rollout KEYS[2+2i] its log, KEYS[3+2i] its snapshot; ARGV[1] n, ARGV[2] 0, then per
-- rollout ARGV[3+3i] its record, ARGV[4+3i] its head, ARGV[5+3i] its job id (recorded on the
-- snapshot, pushed by the queue step). Told apart by the count of KEYS (1 + 2n: never that of
-- the whole step, 3 + 3n or 4 + 3n). Returns per rollout {"ok", "pending", its job id},
-- {"conflict"} or {"dup", its status, its jobs (the snapshot's "job")}: a retry after a crash
-- between the two steps pushes the recorded job of a rollout still pending, which the first
-- try never did.
local n = tonumber(ARGV[1])
local m = tonumber(ARGV[2])
local queued = #KEYS ~= 1 + 2 * n
local shared = {}
for j = 1, 2 * m do
  shared[j] = ARGV[2 + j]
end
local base = 2 + 2 * m
-- Per rollout: the first of its keys, keys and arguments each.
local k0, kn, an = 4, 3, 5
if not queued then k0, kn, an = 2, 2, 3 end
local statuses = {}
local pushed = {}
for i = 0, n - 1 do
  local log, snap = KEYS[k0 + kn * i], KEYS[k0 + kn * i + 1]
  local a = base + an * i
  local record = ARGV[a + 1]
  if redis.call('EXISTS', snap) == 1 then
    local found = redis.call('XRANGE', log, '0-1', '0-1')
    if #found == 1 and found[1][2][2] == record then
      if queued then
        statuses[i + 1] = 'dup'
      else
        local seen = redis.call('HMGET', snap, 'st', 'job')
        statuses[i + 1] = {'dup', seen[1] or '', seen[2] or ''}
      end
    else
      statuses[i + 1] = queued and 'conflict' or {'conflict'}
    end
  else
    redis.call('XADD', log, '0-1', 'e', record)
    redis.call('HSET', snap, 'seq', '1', 'live', '0', 'st', 'pending', 'head', ARGV[a + 2],
      'job', ARGV[a + 3])
    if queued then
      redis.call('HSET', KEYS[k0 + kn * i + 2], 'data', ARGV[a + 4], 'description', ARGV[a + 5],
        unpack(shared))
    end
    pushed[#pushed + 1] = ARGV[a + 3]
    statuses[i + 1] = queued and 'ok' or {'ok', 'pending', ARGV[a + 3]}
  end
end
if #pushed > 0 then
  redis.call('HINCRBY', KEYS[1], 'pending', #pushed)
  if queued then
    redis.call('RPUSH', KEYS[2], unpack(pushed))
    redis.call('SADD', KEYS[3], KEYS[2])
    local hints = KEYS[4 + 3 * n]
    if hints then
      local h = base + 5 * n
      redis.call('RPUSH', hints, unpack(pushed))
      redis.call('LTRIM', hints, -tonumber(ARGV[h + 1]), -1)
      redis.call('PEXPIRE', hints, ARGV[h + 2])
    end
  end
end
return statuses
