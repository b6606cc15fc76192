-- The lease index as it stands now by Redis's clock (see set_leases.lua): for an operator's
-- figures, and for a worker asking whether a live worker holds a rollout's lease. A lease
-- that lapsed while Redis refused writes, or within the grace after, is not lapsed yet:
-- see lease_grace.lua (prepended); the caller reads its expiry against the grace's end.
--
-- KEYS[1]   the lease index (a sorted set: member rollout id, score = expiry, unix ms by
--           Redis's clock)
-- KEYS[2]   what the lease scripts last saw of Redis's refusals (lease_grace.lua)
-- ARGV[1]   the grace after the last refusal, ms
-- ARGV[2..] rollout ids (may be none)
--
-- Returns {now (Redis's clock, unix ms), leases held, of which expired,
--          {expiry of each rollout id, or nil when it holds no lease},
--          the end of the grace (unix ms; 0: none)}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local grace = grace_until(KEYS[2], now, tonumber(ARGV[1]), false)
local expiries = {}
for i = 2, #ARGV do
  expiries[i - 1] = redis.call('ZSCORE', KEYS[1], ARGV[i])
end
local held = redis.call('ZCARD', KEYS[1])
local expired = 0
if now >= grace then
  expired = redis.call('ZCOUNT', KEYS[1], '-inf', string.format('%.0f', now))
end
return {now, held, expired, expiries, grace}
