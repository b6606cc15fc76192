-- Append events to rollouts' logs and update their snapshots, in one atomic step.
--
-- KEYS[1]    the deployment's counters (a hash: rollouts by state, tokens); on Redis Cluster,
--            the counters of the events' slot (every event of a call is in that slot)
-- ARGV[1]    where a terminal event's completion goes: "" to its batch's stream (KEYS[k+2],
--            KEYS[k+3] below), or "outbox" on Redis Cluster, where the batch's keys are in
--            another slot: KEYS[k+2] is then the slot's outbox (a sorted set: rollout id ->
--            when it ended, unix ms), KEYS[k+3] is not read, and store/outbox.py delivers the
--            completion and starts the retention clock (the batch's record holds its TTL)
-- then per event i (from 0), with k = 2 + 4i:
-- KEYS[k]    its rollout's log (a stream; entry id 0-<seq>, one field "e" = the event record)
-- KEYS[k+1]  its rollout's snapshot (a hash: seq, live, st, head, cid, job)
-- KEYS[k+2]  the completion stream of the rollout's batch
-- KEYS[k+3]  the rollout's batch record (a hash; its field "ttl" is the retention in seconds)
-- ARGV per event i, with a = 1 + 9i:
-- ARGV[a+1]  seq of the event (integer >= 1); must be the snapshot's seq + 1
-- ARGV[a+2]  fence: the attempt that must be live for this write, or "" for no fence
-- ARGV[a+3]  the encoded event record (opaque bytes), or "" for a header (below)
-- ARGV[a+4]  the encoded snapshot head after the event (opaque bytes)
-- ARGV[a+5]  the live attempt after the event ("0" when none)
-- ARGV[a+6]  the status after the event
-- ARGV[a+7]  tokens the event adds (0 for all but token records)
-- ARGV[a+8]  the rollout id (what the completion entry names)
-- ARGV[a+9]  "" for the first event of a caller's chain; for a later one, the snapshot head
--            the chain's previous event wrote (its ARGV[a+4]): see "Chains" below
-- At most one event per rollout in a call: a rollout's next event goes in a later call.
--
-- Chains. A caller may send several events of one rollout in one transaction (a takeover's
-- Aborted then Resumed; a checkpoint then Finished; Aborted then Failed), each computed from
-- the state after the one before. Its first event is checked on its seq (the caller's view is
-- exact when its seq is the log's). A later one is accepted only if the rollout's head is the
-- one the chain's previous event wrote: had that event been refused (its seq taken by another
-- writer's), the next seq may well be free, and an event computed from a state the log never
-- had would land (issue 28: a takeover's Resumed after its refused Aborted, over a live
-- attempt). Comparing heads, not the log's records, keeps the large records out of Lua.
-- Attempt openers (Started, Resumed) are fenced on "0" besides: an attempt opens only while
-- no attempt is live, whoever computed it.
--
-- An event's record reaches its log one of two ways:
--   whole:  the record is in its ARGV and the script writes the log entry itself. Redis
--           hashes every byte of every string that enters Lua (issue 15 measured ~40 us of
--           Redis CPU for a 13 KB chunk, ~11 for its XADD alone), so this is for the Submitted
--           record (seq 1, whose log does not exist yet) only.
--   header: its ARGV holds "" and the record was written by the plain command just before
--           this call, in the same MULTI/EXEC:
--             XADD KEYS[k] NOMKSTREAM 0-<seq> e <record>
--           The stream's ids do half the fencing: the log's last id is always the snapshot's
--           seq, so the XADD of a seq already taken fails and writes nothing. The XADD of a seq
--           after it lands, and the script undoes it when it refuses the event (a stale
--           attempt, or a gap): XDEL, then XSETID back to the log's last entry, so the next
--           writer of that seq is not refused by the stream. Nobody reads between the two:
--           a transaction runs whole. The log must exist (seq >= 2).
--           That is one command per record where a gate that let the XADD through took
--           three (RENAME the log aside in the script, XADD, RENAME it back), and gave ~5 us
--           of Redis CPU per event back (bench_store). It needs the script to run whenever
--           its XADDs do, so it is always sent by its text (EVAL), never by sha: a NOSCRIPT
--           after a restart would otherwise let the records in unchecked.
-- One call for many events because a script call's own cost (setup, garbage collection) was
-- about that of the redis.call work it does for one event (perf on redis-server 7.0).
--
-- Returns one reply per event, its words separated by spaces (a string, not a table: cheaper
-- for Lua to build): "ok" | "dup" | "stale <live>" | "conflict <current_seq>" |
--   "taken stale <live>" | "taken conflict <current_seq>"
--   dup:      this exact record is already at this seq (a retried write): nothing written
--   stale:    the fence names an attempt that is not live any more: nothing written
--   conflict: another event already took this seq (or a gap): nothing written
--   taken:    (headers) the seq is taken and nothing was written: a dup if the stored record
--             is the caller's (it compares; the record never enters Lua), else the refusal
--
-- A terminal status also records the completion (XADD to the batch's stream, its id kept in
-- the snapshot's "cid" so an acknowledgement can remove it) and starts the retention clock on
-- the rollout's keys. Being in the same transaction as the event, a completion is never missed
-- and never recorded twice, whatever fails around it.
local replies = {}
local counts = {}
local function count(field, n)
  counts[field] = (counts[field] or 0) + n
end

local outbox = ARGV[1] == 'outbox'
for i = 0, ((#ARGV - 1) / 9) - 1 do
  local k, a = 2 + 4 * i, 1 + 9 * i
  local log, snapkey = KEYS[k], KEYS[k + 1]
  local seq = tonumber(ARGV[a + 1])
  local fence, record, status, prev = ARGV[a + 2], ARGV[a + 3], ARGV[a + 6], ARGV[a + 9]
  local snap = redis.call('HMGET', snapkey, 'seq', 'live', 'st')
  local cur = tonumber(snap[1] or '0')
  local live = snap[2] or '0'
  local before = snap[3]

  local reply = nil
  if fence ~= '' and fence ~= live then
    reply = 'stale ' .. live
  elseif cur ~= seq - 1 or (prev ~= '' and prev ~= redis.call('HGET', snapkey, 'head')) then
    reply = 'conflict ' .. cur
  end
  if reply and cur >= seq then
    if record == '' then
      reply = 'taken ' .. reply
    else
      local id = '0-' .. ARGV[a + 1]
      local found = redis.call('XRANGE', log, id, id)
      if #found == 1 and found[1][2][2] == record then
        reply = 'dup'
      end
    end
  elseif reply and record == '' and snap[1] then
    -- A seq after the snapshot's: the record's XADD landed (if the log exists). Nothing at
    -- this id can be anyone else's, since the log holds no entry after the snapshot's seq.
    -- (With no snapshot there is no rollout to protect, and no such promise to rely on.)
    if redis.call('XDEL', log, '0-' .. ARGV[a + 1]) == 1 then
      local top = redis.call('XREVRANGE', log, '+', '-', 'COUNT', 1)
      redis.call('XSETID', log, top[1] and top[1][1] or '0-0')
    end
  end

  if not reply then
    reply = 'ok'
    if record ~= '' then
      redis.call('XADD', log, '0-' .. ARGV[a + 1], 'e', record)
    end
    -- (The Submitted record is read from the log's entry 0-1; it is not copied here.)
    redis.call('HSET', snapkey, 'seq', ARGV[a + 1], 'live', ARGV[a + 5], 'st', status,
      'head', ARGV[a + 4])
    -- Counters: live states count the rollouts in them now; terminal states count every
    -- rollout that ever ended so (no transition leaves them; expiry or an ack does not
    -- un-end one).
    if before ~= status then
      if before then
        count(before, -1)
      end
      count(status, 1)
    end
    count('tokens', tonumber(ARGV[a + 7]))
    if outbox and (status == 'done' or status == 'failed' or status == 'cancelled') then
      local now = redis.call('TIME')
      redis.call('ZADD', KEYS[k + 2], 'NX', now[1] * 1000 + math.floor(now[2] / 1000), ARGV[a + 8])
    elseif status == 'done' or status == 'failed' or status == 'cancelled' then
      local done = KEYS[k + 2]
      redis.call('HSET', snapkey, 'cid', redis.call('XADD', done, '*', 'r', ARGV[a + 8],
        's', status))
      local ttl = tonumber(redis.call('HGET', KEYS[k + 3], 'ttl') or '0')
      if ttl > 0 then
        -- Unacknowledged results expire ttl seconds after they ended; the batch's stream
        -- and record live as long as its last result.
        redis.call('EXPIRE', log, ttl)
        redis.call('EXPIRE', snapkey, ttl)
        redis.call('EXPIRE', done, ttl)
        redis.call('EXPIRE', KEYS[k + 3], ttl)
      end
    end
  end
  replies[i + 1] = reply
end

for field, n in pairs(counts) do
  if n ~= 0 then
    redis.call('HINCRBY', KEYS[1], field, n)
  end
end
return replies
