-- Give a leased rollout back to its queue: push a new rq job for it and remove its lease, in
-- one atomic step, only if the lease was not renewed since the caller read it (the lease test
-- of lua/release_lease.lua). A failure writes nothing, so the expired lease stays for the next
-- pass to try again; a repeat after a lost reply finds the lease gone and pushes nothing.
--
-- KEYS[1]  the lease index (a sorted set: member rollout id, score = expiry, unix ms)
-- KEYS[2]  the rq queue (a list)     KEYS[3]  rq's set of queues     KEYS[4]  the job's hash
-- KEYS[5]  the rollout's snapshot (its field "job" lists the rollout's jobs, for lua/ack.lua)
-- ARGV[1]  rollout id                ARGV[2]  the expiry the caller saw (unix ms)
-- ARGV[3]  the job id                ARGV[4]  its data               ARGV[5]  its description
-- ARGV[6]  "1": at the front of the queue, else at its back
-- ARGV[7 ..]  the job fields shared by every job (store.queue.JobWriter), as name, value pairs
--
-- Returns 1 if given back now, 0 if the lease was renewed meanwhile or is gone (nothing
-- written). A queue key that holds something else than a list is refused before any write:
-- a command failing inside a script does not undo the ones before it.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) > tonumber(ARGV[2]) then
  return 0
end
local kind = redis.call('TYPE', KEYS[2])['ok']
if kind ~= 'list' and kind ~= 'none' then
  return redis.error_reply('WRONGTYPE rq queue ' .. KEYS[2] .. ' holds a ' .. kind)
end
redis.call('HSET', KEYS[4], 'data', ARGV[4], 'description', ARGV[5], unpack(ARGV, 7))
if ARGV[6] == '1' then
  redis.call('LPUSH', KEYS[2], ARGV[3])
else
  redis.call('RPUSH', KEYS[2], ARGV[3])
end
redis.call('SADD', KEYS[3], KEYS[2])
redis.call('ZREM', KEYS[1], ARGV[1])
-- Listed with the rollout's other jobs, so that its acknowledgement deletes this one too.
local jobs = redis.call('HGET', KEYS[5], 'job')
if jobs or redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('HSET', KEYS[5], 'job', jobs and (jobs .. ' ' .. ARGV[3]) or ARGV[3])
end
return 1
