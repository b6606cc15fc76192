-- Inside the transaction that records a job's end: if its rollout is gone (acknowledged),
-- delete what that transaction just wrote of the job, as ack.lua would have. ack leaves a
-- started job to its worker; an ack landing between the worker's read (still started, ours)
-- and this transaction would otherwise see the job written back (finished, kept an hour),
-- and a worker killed before its next round trip never deleted it. In the same MULTI, no
-- ack can come in between: before it, this deletes; after it, ack sees the job ended.
--
-- KEYS[1]  the rollout's snapshot   KEYS[2]  the job hash   KEYS[3]  its results stream
-- KEYS[4]  its executions index     KEYS[5..]  its queue's registries of ended jobs
-- ARGV[1]  the job id
--
-- Returns 1 if the job was deleted, 0 if its rollout is still there.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
for i = 5, #KEYS do
  redis.call('ZREM', KEYS[i], ARGV[1])
end
return 1
