-- Renew the leases of tool-call claims, each only while it is its call's live claim: a
-- zombie runner (its claim lost, the call claimed again since) renews nothing and learns so.
-- Expiries by Redis's clock, never shortened, never resurrected (XX GT, as set_leases.lua).
--
-- KEYS[1]   the tool lease index (lua/tool_call_index.lua)
-- KEYS[2..] the snapshots of the claims' rollouts, one per claim, in ARGV's order
-- ARGV[1]   the TTL, ms
-- ARGV[2..] per claim: rollout id, its fence (claim number and call, as "tc" holds them:
--           store/tool_index.py's claim_fence; the number alone would match the next call's
--           claim of the same number)
--
-- Returns {now (Redis's clock, unix ms), {1 if claim i is live and renewed, else 0, ...}}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = string.format('%.0f', now + tonumber(ARGV[1]))
local out = {}
for i = 1, #KEYS - 1 do
  local rid, claim = ARGV[2 * i], ARGV[2 * i + 1]
  local snap = redis.call('HMGET', KEYS[i + 1], 'st', 'tc')
  if snap[1] == 'running_tool' and snap[2] == claim and redis.call('ZSCORE', KEYS[1], rid) then
    redis.call('ZADD', KEYS[1], 'XX', 'GT', expiry, rid)
    out[i] = 1
  else
    out[i] = 0
  end
end
return {now, out}
