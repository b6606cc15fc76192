-- Give an abandoned rq job back: out of the registry that holds it and onto the front of its
-- queue, in one atomic step (rq's own way, its cleanup to the failed registry and then a
-- requeue from there, is three steps, and a failure between them strands the job).
--
-- KEYS[1]  the registry (a sorted set): the queue's started registry (member "job id:execution
--          id", score = the execution's heartbeat expiry, unix s), or its failed registry
--          (member job id), for a job rq's own maintenance failed as abandoned
-- KEYS[2]  the rq queue (a list)     KEYS[3]  the job's hash
-- ARGV[1]  the registry member       ARGV[2]  the cutoff (unix s): only an entry whose score
--          is at or before it is taken
-- ARGV[3]  the job id                ARGV[4]  the time it is queued again (rq's format)
-- ARGV[5]  the status the job must have ("started", or "failed")
-- ARGV[6]  "1": an entry whose job has another status (it ended) or is gone is removed, as
--          rq's cleanup of the started registry does
--
-- Returns 1 if requeued now; 0 if not (heartbeated meanwhile, taken by another sweep, or its
-- job has ended, is gone, or is a hash without a payload, deleted here). A queue key that holds something else than a list is refused
-- before any write (a failing command does not undo those before it): the entry stays for a
-- later sweep.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) > tonumber(ARGV[2]) then
  return 0
end
-- A hash without a payload is no job: fields written back after its job was deleted (by
-- earlier workers' bare HSETs). Nothing can run it, and every dequeue would skip it: it goes.
if redis.call('EXISTS', KEYS[3]) == 1 and redis.call('HEXISTS', KEYS[3], 'data') == 0 then
  redis.call('DEL', KEYS[3])
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
if redis.call('HGET', KEYS[3], 'status') ~= ARGV[5] then
  if ARGV[6] == '1' then
    redis.call('ZREM', KEYS[1], ARGV[1])
  end
  return 0
end
local kind = redis.call('TYPE', KEYS[2])['ok']
if kind ~= 'list' and kind ~= 'none' then
  return redis.error_reply('WRONGTYPE rq queue ' .. KEYS[2] .. ' holds a ' .. kind)
end
-- What rq's requeue writes: queued, not started by anyone (a field left out reads as unset).
redis.call('HSET', KEYS[3], 'status', 'queued', 'enqueued_at', ARGV[4])
redis.call('HDEL', KEYS[3], 'started_at', 'ended_at', 'worker_name')
redis.call('PERSIST', KEYS[3])
redis.call('LPUSH', KEYS[2], ARGV[3])
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
