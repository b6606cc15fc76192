-- Acknowledge one ended rollout: delete its keys, its completion entry and its rq job.
--
-- KEYS[1]  the rollout's log     KEYS[2]  its snapshot     KEYS[3]  its batch's completions
-- ARGV[1]  rq's key prefix for the job and its registries ("rq:")
--
-- Returns {"ok"} | {"missing"} (no such rollout: acknowledged or expired already) |
-- {"live", status} (not ended: nothing deleted; a live rollout is never deleted)
local snap = redis.call('HMGET', KEYS[2], 'st', 'cid', 'job', 'sub')
local st = snap[1]
if not st then
  if snap[4] then return {'live', 'unknown'} end  -- written before statuses were kept here
  return {'missing'}
end
if st ~= 'done' and st ~= 'failed' and st ~= 'cancelled' then
  return {'live', st}
end
if snap[2] then
  redis.call('XDEL', KEYS[3], snap[2])
end
local job = snap[3]
if job then
  local jkey = ARGV[1] .. 'job:' .. job
  local origin = redis.call('HGET', jkey, 'origin')
  redis.call('DEL', jkey, ARGV[1] .. 'results:' .. job)
  if origin then
    for _, registry in ipairs({'finished', 'failed', 'canceled'}) do
      redis.call('ZREM', ARGV[1] .. registry .. ':' .. origin, job)
    end
  end
end
redis.call('DEL', KEYS[1], KEYS[2])
return {'ok'}
