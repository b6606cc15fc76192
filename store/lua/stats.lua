-- Everything `stats` reports, read in one round trip.
--
-- KEYS[1]  the deployment's counters (hash)    KEYS[2]  the workers' heartbeats (hash)
-- ARGV[1]  rq's key prefix ("rq:")
--
-- Returns {counters (flat list), workers (flat list), queues (flat list: name, depth)}
local queues = {}
for _, key in ipairs(redis.call('SMEMBERS', ARGV[1] .. 'queues')) do
  local name = string.sub(key, string.len(ARGV[1] .. 'queue:') + 1)
  table.insert(queues, name)
  table.insert(queues, redis.call('LLEN', key))
end
return {redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2]), queues}
