-- Everything `stats` reports, read in one round trip.
--
-- KEYS[1]  the deployment's counters (hash)    KEYS[2]  the workers' heartbeats (hash)
-- or KEYS[1] the workers' heartbeats alone: no counters are read (on Redis Cluster they are
-- kept per slot, summed apart: store/slot_counters.py; a reaper's prune needs none), and the
-- clock is the heartbeats' master's
-- ARGV[1]  rq's key prefix ("rq:"); "" reads no rq key (the queue on a Redis of its own,
--          whose depths its caller reads there, or a caller that wants none: a reaper's prune)
--
-- Returns {counters (flat list), workers (flat list), queues (flat list: name, depth),
--          Redis's clock (unix ms): what the workers' heartbeats are stamped and judged by}
local queues = {}
local names = {}
if ARGV[1] ~= '' then names = redis.call('SMEMBERS', ARGV[1] .. 'queues') end
for _, key in ipairs(names) do
  local name = string.sub(key, string.len(ARGV[1] .. 'queue:') + 1)
  table.insert(queues, name)
  table.insert(queues, redis.call('LLEN', key))
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local counters = {}
if #KEYS == 2 then counters = redis.call('HGETALL', KEYS[1]) end
return {counters, redis.call('HGETALL', KEYS[#KEYS]), queues, now}
