-- Push the generation job of an episode's next turn, in the transaction that recorded the
-- tool result making it runnable (after lua/append.lua and lua/tool_call_index.lua, in the
-- same MULTI/EXEC): a result recorded always has its job, and a job is pushed only for a
-- result recorded. As lua/give_back.lua pushes a resume, at the front of the queue: the
-- episode is under way, and its next turn is a resume.
--
-- KEYS[1]  the rollout's snapshot (fields seq, head, st; "job" lists the rollout's jobs for
--          lua/ack.lua; "tj" the seq whose job was pushed, so a repeat pushes nothing)
-- KEYS[2]  the rq queue (a list)     KEYS[3]  rq's set of queues     KEYS[4]  the job's hash
--          (KEYS[1] alone: the queue is apart, only the job's id is recorded; ARGV[1..3])
-- ARGV[1]  the seq of the chain's last event      ARGV[2]  the snapshot head it wrote
-- ARGV[3]  the job id               ARGV[4]  its data               ARGV[5]  its description
-- ARGV[6 ..]  the job fields shared by every job (store.queue.JobWriter), as name, value pairs
--
-- Returns 1 if pushed, 0 if not (the append was refused, the episode is not at next_turn,
-- or this is a repeat). A queue key that holds something else than a list is refused before
-- any write.
local snap = redis.call('HMGET', KEYS[1], 'seq', 'head', 'st', 'tj')
if snap[1] ~= ARGV[1] or snap[2] ~= ARGV[2] or snap[3] ~= 'next_turn' or snap[4] == ARGV[1] then
  return 0
end
if #KEYS == 1 then
  -- The queue on a Redis of its own (store/queue_redis.py): the job's id is recorded here, and
  -- the writer pushes the job once this transaction has landed (store/turn_jobs.py).
  local listed = redis.call('HGET', KEYS[1], 'job')
  redis.call('HSET', KEYS[1], 'tj', ARGV[1], 'job', listed and (listed .. ' ' .. ARGV[3]) or ARGV[3])
  return 1
end
local kind = redis.call('TYPE', KEYS[2])['ok']
if kind ~= 'list' and kind ~= 'none' then
  return redis.error_reply('WRONGTYPE rq queue ' .. KEYS[2] .. ' holds a ' .. kind)
end
redis.call('HSET', KEYS[4], 'data', ARGV[4], 'description', ARGV[5], unpack(ARGV, 6))
redis.call('LPUSH', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[3], KEYS[2])
local jobs = redis.call('HGET', KEYS[1], 'job')
redis.call('HSET', KEYS[1], 'tj', ARGV[1], 'job', jobs and (jobs .. ' ' .. ARGV[3]) or ARGV[3])
return 1
