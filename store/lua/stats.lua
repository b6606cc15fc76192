-- Everything `stats` reports, read in one round trip.
--
-- KEYS[1]  the deployment's counters (hash)    KEYS[2]  the workers' heartbeats (hash)
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
return {redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2]), queues, now}
