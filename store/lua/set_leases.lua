-- Take or renew leases, their expiry set by Redis's clock: now (TIME) + the TTL. The hosts'
-- clocks never enter it: every lease is stamped and judged (expired_leases.lua,
-- read_leases.lua) by this one clock, so workers whose clocks disagree cannot take each
-- other's rollouts over, and a worker whose clock is behind can still renew.
--
-- KEYS[1]   the lease index (a sorted set: member rollout id, score = expiry, unix ms by
--           Redis's clock)
-- ARGV[1]   'take': set each lease, held or not | 'renew': extend only the leases still held,
--           never shortening one (XX GT: a lease a reaper removed is never resurrected)
-- ARGV[2]   the TTL, ms
-- ARGV[3..] rollout ids (none: the clock is only read)
--
-- Returns Redis's clock at the call, unix ms.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = string.format('%.0f', now + tonumber(ARGV[2]))
local flags
if ARGV[1] == 'take' then
  flags = {}
elseif ARGV[1] == 'renew' then
  flags = {'XX', 'GT'}
else
  return redis.error_reply('set_leases: mode must be take or renew, not ' .. ARGV[1])
end
-- ZADD in chunks of 1000 members: unpack() is bounded by Lua's C stack (8000 values).
local args = {unpack(flags)}
for i = 3, #ARGV do
  args[#args + 1] = expiry
  args[#args + 1] = ARGV[i]
  if #args >= #flags + 2000 or i == #ARGV then
    redis.call('ZADD', KEYS[1], unpack(args))
    args = {unpack(flags)}
  end
end
return now
