-- Acknowledge one ended rollout: delete its keys, its completion entry and its rq jobs.
-- (rq's key layout is relied on here: job:<id>, results:<id>, executions:<id>,
-- <registry>:<queue>.)
--
-- KEYS[1]  the rollout's log     KEYS[2]  its snapshot     KEYS[3]  its batch's completions
-- ARGV[1]  rq's key prefix for the job and its registries ("rq:"); "" when the queue is on
--          a Redis of its own (store/queue_redis.py): its jobs are not here, and the ack
--          deleted them there first (lua/drop_job.lua), so this deletes the rollout only
-- ARGV[2]  "outbox" on Redis Cluster (store/ack_cluster.py), where the batch's stream is in
--          another slot: KEYS[3] is then the rollout's slot's outbox, from which the rollout
--          is removed (ARGV[3]: its id); its completion entry was removed from the batch's
--          stream by the ack's batch step already (lua/drop_completions.lua), so no XDEL here
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
if ARGV[2] == 'outbox' then
  redis.call('ZREM', KEYS[3], ARGV[3])
elseif snap[2] then
  redis.call('XDEL', KEYS[3], snap[2])
end
-- Every job made for the rollout, space-separated: the submit's, then each one the reaper, the
-- stranded-rollout net or an operator pushed (lua/give_back.lua, lua/record_job.lua). A
-- requeue or a sweep moves a job without making a new one.
local jobs = snap[3] or ''
if ARGV[1] == '' then jobs = '' end
for job in string.gmatch(jobs, '%S+') do
  local jkey = ARGV[1] .. 'job:' .. job
  local job_fields = redis.call('HMGET', jkey, 'origin', 'status')
  local origin = job_fields[1]
  -- A job still started is its worker's to end: the rollout ended a moment ago and the
  -- worker's rq bookkeeping has not run yet. That worker, finding the rollout gone, deletes
  -- the job then (workers/job_endings.py); deleting it here would have its heartbeat and its
  -- success write it back.
  if job_fields[2] == 'started' then origin = nil else
    redis.call('DEL', jkey, ARGV[1] .. 'results:' .. job, ARGV[1] .. 'executions:' .. job)
  end
  if origin then
    for _, registry in ipairs({'finished', 'failed', 'canceled'}) do
      redis.call('ZREM', ARGV[1] .. registry .. ':' .. origin, job)
    end
  end
end
redis.call('DEL', KEYS[1], KEYS[2])
return {'ok'}
