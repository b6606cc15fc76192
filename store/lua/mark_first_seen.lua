-- A sweep's first-seen mark of a job in rq's intermediate list (rq's set_first_seen and
-- get_first_seen, workers/rq_sweep.py), only while the job is still there: the sweep read the
-- list a round trip or two earlier, and a worker may have started the job since (its start
-- deleted any mark then): a mark set after that would have stayed for rq's 24 hours, junk in
-- a Redis that should hold in-flight work only (a 30-minute soak left 61).
--
-- KEYS[1]  the queue's intermediate list     KEYS[2]  the job's first-seen mark
-- ARGV[1]  the job id     ARGV[2]  now (Redis's clock, unix seconds)     ARGV[3]  the mark's TTL (s)
--
-- Returns the mark (when the job was first seen there), or nil if the job has left the list.
if not redis.call('LPOS', KEYS[1], ARGV[1]) then
  return false
end
redis.call('SET', KEYS[2], ARGV[2], 'NX', 'EX', ARGV[3])
return redis.call('GET', KEYS[2])
