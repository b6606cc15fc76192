-- The leases whose expiry has passed by Redis's clock, oldest first (what a reaper takes
-- back). Judged here, not by the reaper's host clock: see set_leases.lua. None has passed
-- while Redis refuses writes, nor for a grace after: see lease_grace.lua (prepended).
--
-- KEYS[1]  the lease index (a sorted set: member rollout id, score = expiry, unix ms by
--          Redis's clock)
-- KEYS[2]  what the lease scripts last saw of Redis's refusals (lease_grace.lua)
-- ARGV[1]  at most this many      ARGV[2]  the grace after the last refusal, ms
--
-- Returns {now (Redis's clock, unix ms), {rollout id, expiry, rollout id, expiry, ...},
--          the end of the grace (unix ms; 0: none)}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local grace = grace_until(KEYS[2], now, tonumber(ARGV[2]), true)
if now < grace then
  return {now, {}, grace}
end
local rows = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now),
  'WITHSCORES', 'LIMIT', 0, ARGV[1])
return {now, rows, grace}
