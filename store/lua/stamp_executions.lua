-- Stamp rq executions' heartbeats by Redis's clock. rq scores an execution in its queue's
-- started registry with the beating host's clock (now + TTL) and its maintenance judges the
-- score by its own: a worker whose clock is behind (or a sweeper whose clock is ahead) by
-- more than the TTL had its running jobs given back as abandoned, and delivered again. Sent
-- in the transaction that starts or beats the executions, after rq's own stamps (XX: never
-- re-adding an execution ended meanwhile), so the sweeps (workers/rq_sweep.py) judge every
-- execution by one clock, as leases are (set_leases.lua).
--
-- KEYS      each execution's started registry
-- ARGV[1]   the TTL, s      ARGV[2..]  each execution's member ("job id:execution id")
--
-- Returns Redis's clock, unix s.
local now = tonumber(redis.call('TIME')[1])
local score = now + tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', score, ARGV[i + 1])
end
return now
