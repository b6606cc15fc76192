-- Give a job taken by a worker it does not prefer back to the front of its queue, for the worker
-- it prefers, if that worker is blocked on the queue right now (store/affinity.py): Redis then
-- hands it to that worker (or to another one blocked there, which bounces it again, at most
-- ARGV[2] times in all).
--
-- KEYS[1]  the preferred worker's waiting flag (holds the queue it waits on)
-- KEYS[2]  the job's hash     KEYS[3]  the queue's intermediate list     KEYS[4]  the rq queue
-- ARGV[1]  the job id         ARGV[2]  the most bounces of one job
--
-- Returns 1 if given back (the caller must not start it), 0 if the caller keeps it: the
-- preferred worker is not waiting on this queue, the job's bounces are spent, the job is gone
-- (acknowledged: its run ends it), or it is no longer in the intermediate list.
if redis.call('GET', KEYS[1]) ~= KEYS[4] or redis.call('EXISTS', KEYS[2]) == 0 then
  return 0
end
local kind = redis.call('TYPE', KEYS[4])['ok']
if kind ~= 'list' and kind ~= 'none' then
  return 0
end
if redis.call('HINCRBY', KEYS[2], 'bounces', 1) > tonumber(ARGV[2]) then
  return 0
end
if redis.call('LREM', KEYS[3], 1, ARGV[1]) == 0 then
  return 0
end
redis.call('LPUSH', KEYS[4], ARGV[1])
return 1
