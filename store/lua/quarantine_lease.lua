-- Set a rollout that cannot be read aside: remove its lease (only if nobody renewed it since
-- the caller looked at it) and record why in the quarantine hash, in one atomic step.
--
-- KEYS[1]  the lease index (a sorted set: member rollout id, score = expiry, unix ms by
--          Redis's clock: see set_leases.lua)
-- KEYS[2]  the quarantine (a hash: rollout id -> reason)
-- ARGV[1]  rollout id
-- ARGV[2]  the expiry the caller saw (its score; no clock is read here)
-- ARGV[3]  the reason
--
-- Returns 1 if quarantined now, 0 if the lease was renewed meanwhile or is gone.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) <= tonumber(ARGV[2]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
  return 1
end
return 0
