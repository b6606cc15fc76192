-- Set fields of rq job hashes, only of those that still exist. rq writes a started job's
-- fields (its start, its heartbeats) with a bare HSET, which on a job deleted meanwhile (its
-- rollout acknowledged between a worker's pop and its start) recreates it as a hash with no
-- payload and no TTL: no job to run, to sweep or to acknowledge, left in Redis for good.
--
-- KEYS      the job hashes
-- ARGV      field, value, field, value, ...: the same for every job
--
-- Returns how many of the jobs were written.
local written = 0
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    redis.call('HSET', key, unpack(ARGV))
    written = written + 1
  end
end
return written
