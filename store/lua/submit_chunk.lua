-- Record a chunk of new rollouts and enqueue their rq jobs, all in one atomic step.
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
local n = tonumber(ARGV[1])
local m = tonumber(ARGV[2])
local shared = {}
for j = 1, 2 * m do
  shared[j] = ARGV[2 + j]
end
local base = 2 + 2 * m
local statuses = {}
local pushed = {}
for i = 0, n - 1 do
  local log, snap, job = KEYS[4 + 3 * i], KEYS[5 + 3 * i], KEYS[6 + 3 * i]
  local a = base + 5 * i
  local record = ARGV[a + 1]
  if redis.call('EXISTS', snap) == 1 then
    local found = redis.call('XRANGE', log, '0-1', '0-1')
    if #found == 1 and found[1][2][2] == record then
      statuses[i + 1] = 'dup'
    else
      statuses[i + 1] = 'conflict'
    end
  else
    redis.call('XADD', log, '0-1', 'e', record)
    redis.call('HSET', snap, 'seq', '1', 'live', '0', 'st', 'pending', 'head', ARGV[a + 2],
      'job', ARGV[a + 3])
    redis.call('HSET', job, 'data', ARGV[a + 4], 'description', ARGV[a + 5], unpack(shared))
    pushed[#pushed + 1] = ARGV[a + 3]
    statuses[i + 1] = 'ok'
  end
end
if #pushed > 0 then
  redis.call('HINCRBY', KEYS[1], 'pending', #pushed)
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
return statuses
