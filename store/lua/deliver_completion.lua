-- Deliver a rollout's completion to its batch's stream, once (store/outbox.py): on Redis
-- Cluster the append that ended the rollout cannot reach the batch's slot, so it records the
-- completion in its own slot's outbox, and this runs next, in the batch's slot. A repeat (a
-- deliverer that crashed before it could clear the outbox, the sweep) finds the entry made.
--
-- KEYS[1]  the batch's completion stream
-- KEYS[2]  the completions delivered to it (a hash: rollout id -> entry id)
-- KEYS[3]  the batch's record (its field "ttl": the retention in seconds)
-- ARGV[1]  the rollout id     ARGV[2]  its terminal status
--
-- Returns {entry id, ttl}: the outbox's side records the id in the snapshot (what an ack
-- removes) and starts the rollout's own retention clock.
local cid = redis.call('HGET', KEYS[2], ARGV[1])
local ttl = tonumber(redis.call('HGET', KEYS[3], 'ttl') or '0')
if not cid then
  cid = redis.call('XADD', KEYS[1], '*', 'r', ARGV[1], 's', ARGV[2])
  redis.call('HSET', KEYS[2], ARGV[1], cid)
  if ttl > 0 then
    -- As lua/append.lua does on one Redis: the batch's keys live as long as its last result.
    for i = 1, 3 do
      redis.call('EXPIRE', KEYS[i], ttl)
    end
  end
end
return {cid, ttl}
