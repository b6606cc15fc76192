-- Give back a job stuck in rq's intermediate list (taken off its queue by a worker that died
-- before starting it): out of that list and onto the front of the queue, in one atomic step.
--
-- KEYS[1]  the queue's intermediate list     KEYS[2]  the rq queue (a list)
-- KEYS[3]  the job's first-seen mark (mark_first_seen.lua): deleted once the job has left the
--          list, here or before (it would otherwise stay for rq's 24 hours)
-- ARGV[1]  the job id
--
-- Returns 1 if requeued now, 0 if it is no longer in the intermediate list (another sweep took
-- it, or a worker started it). A queue key that holds something else than a list is refused
-- before any write: the job stays in the intermediate list for a later sweep.
local kind = redis.call('TYPE', KEYS[2])['ok']
if kind ~= 'list' and kind ~= 'none' then
  return redis.error_reply('WRONGTYPE rq queue ' .. KEYS[2] .. ' holds a ' .. kind)
end
redis.call('DEL', KEYS[3])
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then
  return 0
end
redis.call('LPUSH', KEYS[2], ARGV[1])
return 1
