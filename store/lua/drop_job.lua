-- Delete an acknowledged rollout's rq job on the queue's own Redis (store/queue_redis.py):
-- the queue-side step of an ack (store/ack_apart.py), what lua/ack.lua does for each of the
-- rollout's jobs when the queue is on the store's Redis, by the same rule: a job still started
-- is its worker's to end (the rollout ended a moment ago and the worker's rq bookkeeping has
-- not run yet; that worker, finding the rollout gone, deletes the job then). Checked here, in
-- the step that deletes, so a job started since the ack read it is left alone too.
--
-- KEYS[1]  the job hash   KEYS[2]  its results stream   KEYS[3]  its executions index
-- KEYS[4..]  its queue's registries of ended jobs (finished, failed, canceled), when it has a
--            queue (none for a job whose hash is gone already)
-- ARGV[1]  the job id
--
-- Returns 1 if deleted (or gone already), 0 if left to its worker. Repeatable.
if redis.call('HGET', KEYS[1], 'status') == 'started' then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
for i = 4, #KEYS do
  redis.call('ZREM', KEYS[i], ARGV[1])
end
return 1
