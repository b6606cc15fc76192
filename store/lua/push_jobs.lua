-- Push rq jobs whose ids a store step already recorded on their rollouts' snapshots (the
-- queue on a Redis of its own, store/queue_redis.py): the queue-side half of what
-- lua/submit_chunk.lua and lua/give_back.lua do in one step on one Redis. Repeatable: a job
-- whose hash exists is left alone (pushed before, by this call's lost first try), so a retry
-- never queues a job twice.
--
-- KEYS[1]  the rq queue (a list)     KEYS[2]  rq's set of queues
-- KEYS[3 .. 2+n]  each job's hash
-- ARGV[1]  n                         ARGV[2]  "1": at the front of the queue, else at its back
-- ARGV[3]  m: the job fields shared by every job, then ARGV[4 .. 3+2m] as name, value pairs
-- then, per job i (from 0): ARGV[b+3i+1] its id, ARGV[b+3i+2] its data, ARGV[b+3i+3] its
--   description (b = 3 + 2m)
-- Optionally (a session's call, store/affinity.py): KEYS[3+n] the preferred worker's hint
-- list, ARGV[b+3n+1] the most hints it keeps, ARGV[b+3n+2] its TTL (ms).
--
-- Returns the number of jobs pushed now. A queue key holding something else than a list is
-- refused before any write.
local n = tonumber(ARGV[1])
local m = tonumber(ARGV[3])
local shared = {}
for j = 1, 2 * m do
  shared[j] = ARGV[3 + j]
end
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'list' and kind ~= 'none' then
  return redis.error_reply('WRONGTYPE rq queue ' .. KEYS[1] .. ' holds a ' .. kind)
end
local base = 3 + 2 * m
local pushed = {}
for i = 0, n - 1 do
  local job = KEYS[3 + i]
  local a = base + 3 * i
  if redis.call('EXISTS', job) == 0 then
    redis.call('HSET', job, 'data', ARGV[a + 2], 'description', ARGV[a + 3], unpack(shared))
    pushed[#pushed + 1] = ARGV[a + 1]
  end
end
if #pushed > 0 then
  if ARGV[2] == '1' then
    redis.call('LPUSH', KEYS[1], unpack(pushed))
  else
    redis.call('RPUSH', KEYS[1], unpack(pushed))
  end
  redis.call('SADD', KEYS[2], KEYS[1])
  local hints = KEYS[3 + n]
  if hints then
    local h = base + 3 * n
    redis.call('RPUSH', hints, unpack(pushed))
    redis.call('LTRIM', hints, -tonumber(ARGV[h + 1]), -1)
    redis.call('PEXPIRE', hints, ARGV[h + 2])
  end
end
return #pushed
