-- The rollout's side of a delivered completion (store/outbox.py), in the rollout's slot: the
-- entry id goes into the snapshot (an ack removes that entry), the retention clock starts on
-- the rollout's keys as lua/append.lua starts it on one Redis, and the outbox lets it go.
--
-- KEYS[1]  the rollout's log   KEYS[2]  its snapshot   KEYS[3]  its slot's outbox
-- ARGV[1]  the rollout id      ARGV[2]  the completion's entry id   ARGV[3]  the TTL (s; 0: none)
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HSET', KEYS[2], 'cid', ARGV[2])
  local ttl = tonumber(ARGV[3])
  if ttl > 0 then
    redis.call('EXPIRE', KEYS[1], ttl)
    redis.call('EXPIRE', KEYS[2], ttl)
  end
end
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
