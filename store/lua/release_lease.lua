-- Remove a rollout's lease only if it has not been renewed since the caller looked at it.
--
-- KEYS[1]  the lease index (a sorted set: member rollout id, score = expiry, unix ms by
--          Redis's clock: see set_leases.lua)
-- ARGV[1]  rollout id
-- ARGV[2]  the expiry the caller saw (its score: no clock is read here); the lease is removed
--          only if still <= it
--
-- Returns 1 if removed, 0 if it was renewed meanwhile or is gone.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) <= tonumber(ARGV[2]) then
  return redis.call('ZREM', KEYS[1], ARGV[1])
end
return 0
