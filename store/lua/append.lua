-- Append one event to a rollout's log and update its snapshot, in one atomic step.
--
-- KEYS[1]  the rollout's log (a stream; entry id 0-<seq>, one field "e" = the event record)
-- KEYS[2]  the rollout's snapshot (a hash: seq, live, st, head, sub, cid)
-- KEYS[3]  the completion stream of the rollout's batch
-- KEYS[4]  the deployment's counters (a hash: rollouts by state, tokens)
-- KEYS[5]  the rollout's batch record (a hash; its field "ttl" is the retention in seconds)
-- ARGV[1]  seq of the event (integer >= 1); must be the snapshot's seq + 1
-- ARGV[2]  fence: the attempt that must be live for this write, or "" for no fence
-- ARGV[3]  the encoded event record (opaque bytes)
-- ARGV[4]  the encoded snapshot head after the event (opaque bytes)
-- ARGV[5]  the live attempt after the event ("0" when none)
-- ARGV[6]  the status after the event
-- ARGV[7]  tokens the event adds (0 for all but token records)
-- ARGV[8]  the rollout id (what the completion entry names)
-- ARGV[9]  optional, with seq 1 only: the id of the rq job enqueued with it (for ack)
--
-- Returns {"ok"} | {"dup"} | {"stale", live} | {"conflict", current_seq}
--   dup:      this exact record is already at this seq (a retried write): nothing written
--   stale:    the fence names an attempt that is not live any more: nothing written
--   conflict: another event already took this seq (or a gap): nothing written
--
-- A terminal status also records the completion (XADD to KEYS[3], its id kept in the
-- snapshot's "cid" so an acknowledgement can remove it) and starts the retention clock on the
-- rollout's keys. Being in the same script as the event, a completion is never missed and
-- never recorded twice, whatever fails around it.
local seq = tonumber(ARGV[1])
local snap = redis.call('HMGET', KEYS[2], 'seq', 'live', 'st')
local cur = tonumber(snap[1] or '0')
local live = snap[2] or '0'
local before = snap[3]
local id = '0-' .. ARGV[1]

if cur >= seq then
  local found = redis.call('XRANGE', KEYS[1], id, id)
  if #found == 1 and found[1][2][2] == ARGV[3] then
    return {'dup'}
  end
end
if ARGV[2] ~= '' and ARGV[2] ~= live then
  return {'stale', live}
end
if cur ~= seq - 1 then
  return {'conflict', tostring(cur)}
end

local status = ARGV[6]
redis.call('XADD', KEYS[1], id, 'e', ARGV[3])
if seq == 1 then
  -- The submitted record is immutable: keep it beside the head so a snapshot read needs no log.
  redis.call('HSET', KEYS[2], 'seq', ARGV[1], 'live', ARGV[5], 'st', status, 'head', ARGV[4],
    'sub', ARGV[3])
  if ARGV[9] and ARGV[9] ~= '' then
    redis.call('HSET', KEYS[2], 'job', ARGV[9])
  end
else
  redis.call('HSET', KEYS[2], 'seq', ARGV[1], 'live', ARGV[5], 'st', status, 'head', ARGV[4])
end

-- Counters: live states count the rollouts in them now; terminal states count every rollout
-- that ever ended so (no transition leaves them, and expiry or an ack does not un-end one).
if before ~= status then
  if before then
    redis.call('HINCRBY', KEYS[4], before, -1)
  end
  redis.call('HINCRBY', KEYS[4], status, 1)
end
local tokens = tonumber(ARGV[7])
if tokens > 0 then
  redis.call('HINCRBY', KEYS[4], 'tokens', tokens)
end

if status == 'done' or status == 'failed' or status == 'cancelled' then
  local cid = redis.call('XADD', KEYS[3], '*', 'r', ARGV[8], 's', status)
  redis.call('HSET', KEYS[2], 'cid', cid)
  local ttl = tonumber(redis.call('HGET', KEYS[5], 'ttl') or '0')
  if ttl > 0 then
    -- Unacknowledged results expire ttl seconds after they ended; the batch's stream and
    -- record live as long as its last result.
    redis.call('EXPIRE', KEYS[1], ttl)
    redis.call('EXPIRE', KEYS[2], ttl)
    redis.call('EXPIRE', KEYS[3], ttl)
    redis.call('EXPIRE', KEYS[5], ttl)
  end
end
return {'ok'}
