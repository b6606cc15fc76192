-- List a job just pushed for a rollout with the rollout's other jobs (the snapshot's field
-- "job", space-separated), so that its acknowledgement (lua/ack.lua) deletes it too. Sent in
-- the transaction that pushes the job (store.queue.enqueue_rollouts).
--
-- KEYS[1]  the rollout's snapshot
-- ARGV[1]  the job id
--
-- Returns 1 if listed, 0 if the rollout has no snapshot (nothing to acknowledge later).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local jobs = redis.call('HGET', KEYS[1], 'job')
redis.call('HSET', KEYS[1], 'job', jobs and (jobs .. ' ' .. ARGV[1]) or ARGV[1])
return 1
