-- Append one event to a rollout's log and update its snapshot, in one atomic step.
--
-- KEYS[1]  the rollout's log (a stream; entry id 0-<seq>, one field "e" = the event record)
-- KEYS[2]  the rollout's snapshot (a hash: seq, live, head, sub)
-- ARGV[1]  seq of the event (integer >= 1); must be the snapshot's seq + 1
-- ARGV[2]  fence: the attempt that must be live for this write, or "" for no fence
-- ARGV[3]  the encoded event record (opaque bytes)
-- ARGV[4]  the encoded snapshot head after the event (opaque bytes)
-- ARGV[5]  the live attempt after the event ("0" when none)
--
-- Returns {"ok"} | {"dup"} | {"stale", live} | {"conflict", current_seq}
--   dup:      this exact record is already at this seq (a retried write): nothing written
--   stale:    the fence names an attempt that is not live any more: nothing written
--   conflict: another event already took this seq (or a gap): nothing written
local seq = tonumber(ARGV[1])
local snap = redis.call('HMGET', KEYS[2], 'seq', 'live')
local cur = tonumber(snap[1] or '0')
local live = snap[2] or '0'
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

redis.call('XADD', KEYS[1], id, 'e', ARGV[3])
if seq == 1 then
  -- The submitted record is immutable: keep it beside the head so a snapshot read needs no log.
  redis.call('HSET', KEYS[2], 'seq', ARGV[1], 'live', ARGV[5], 'head', ARGV[4], 'sub', ARGV[3])
else
  redis.call('HSET', KEYS[2], 'seq', ARGV[1], 'live', ARGV[5], 'head', ARGV[4])
end
return {'ok'}
