-- Take the jobs hinted to a worker (store/affinity.py) off its queue: each hinted job still on
-- the queue moves to the queue's intermediate list, as rq's own dequeue (LMOVE) moves it, and
-- is this worker's to start; one that is not there (another worker took it, or it was for
-- another queue) is dropped from the hints.
--
-- KEYS[1]  the worker's hint list     KEYS[2]  the rq queue     KEYS[3]  its intermediate list
-- ARGV[1]  the most jobs to claim (the worker's free slots)
--
-- Returns the claimed job ids, oldest hint first. At most ARGV[1] + 4 hints are looked at per
-- call: a stale hint costs an LREM over the queue (from its tail, where recent jobs are), so a
-- list of stale hints is drained a few at a time, never in one long call.
local want = tonumber(ARGV[1])
local tries = want + 4
local claimed = {}
while #claimed < want and tries > 0 do
  tries = tries - 1
  local id = redis.call('LPOP', KEYS[1])
  if not id then
    break
  end
  if redis.call('LREM', KEYS[2], -1, id) == 1 then
    redis.call('RPUSH', KEYS[3], id)
    claimed[#claimed + 1] = id
  end
end
return claimed
