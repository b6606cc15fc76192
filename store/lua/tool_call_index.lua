-- Keep the indexes of episodes' tool calls in step with their snapshots, in the transaction
-- that appended their events (right after lua/append.lua, in the same MULTI/EXEC): a call is
-- on its environment queue exactly while its episode is awaiting_tool, and leased exactly
-- while it is running_tool. Run for the events of episodes only: a plain rollout never pays
-- for it. An event lua/append.lua refused is skipped (the snapshot is not the one it wrote):
-- whoever's event took that seq ran this script in its own transaction.
--
-- KEYS[1]   the tool lease index (a sorted set: member rollout id, score = expiry, unix ms by
--           Redis's clock, as set_leases.lua stamps generation leases)
-- KEYS[2]   the generation lease index: an episode awaiting its tool has no generation lease,
--           and the one its last turn held goes here, in the step that ended the turn. Its
--           worker dropping it later could remove the lease of a worker that has taken the
--           next turn since (a quick tool's result pushes that turn's job at once).
-- KEYS[3]   the wall-time deadlines of episodes awaiting their tool (a sorted set: member
--           rollout id, score = submitted_at + max_wall_seconds, unix ms by the submitter's
--           clock): what a sweep ends with wall_time when no runner claims the call in time
--           (store/tool_sweep.py); an episode is on it exactly while it is on its queue
-- then per event i (from 0), with k = 4 + 3i:
-- KEYS[k]   its rollout's snapshot (fields seq, st, head from lua/append.lua; this script
--           keeps "tc", the live claim of the episode's pending call, for tool_heartbeat.lua:
--           its number and its call, as store/tool_index.py's claim_fence spells them)
-- KEYS[k+1] the environment queue its episode names (a sorted set: member rollout id, score
--           = when the call became claimable, unix ms by Redis's clock: oldest first)
-- KEYS[k+2] that queue's doorbell (a list): the rollout id pushed at its tail per call that
--           becomes claimable, so a runner blocked on it (BLPOP) wakes at once, oldest ring
--           first, and tries that episode before looking at the queue; capped at the newest
--           BELL_MAX entries, so a queue nobody serves keeps no more than that (a runner that
--           comes finds some rung for calls already claimed, looks, finds nothing, and waits
--           again). A ring is a hint: the queue is the authority, looked at whenever a ring
--           names no claimable call.
-- ARGV[1]   the lease TTL of a claim that lands here, ms
-- ARGV[2]   how long a harness turn's completion stream is kept, s (0: no expiry)
-- then per event i, with a = 2 + 6i:
-- ARGV[a+1] its rollout id        ARGV[a+2] its seq
-- ARGV[a+3] the snapshot head it wrote (lua/append.lua's ARGV)
-- ARGV[a+4] the live claim after it, as claim_fence spells it ("0": none)
-- ARGV[a+5] its wall-time deadline, unix ms ("": the episode has none)
-- ARGV[a+6] "" for an environment's episode; for a harness-driven one (its harness's calls
--           feed its turns: store/harness_turns.py) "h" when the turn under way is the
--           first, "ht" for a later one. KEYS[k+1] (and KEYS[k+2]) are then that turn's
--           call's completion stream, not a queue: a turn's end adds the entry its call
--           waits on, and so does an end of the episode within a later turn (the first
--           turn's call's stream is the episode batch's, which lua/append.lua writes then).
--
-- Returns one integer per event: 1 if its indexes were set, 0 if the event did not land.
--
-- Redis Cluster: an environment queue and the lease index are slots apart from a rollout's
-- keys, so this script cannot run there beside append.lua (nor can append.lua, whose
-- counters hash are a slot of their own too). The way there (issue 32): the events stay the
-- authority, and this step runs after the append as a second, idempotent step driven by the
-- snapshot (it reads the status; re-running it changes nothing), repeated by a sweep over
-- awaiting_tool episodes for a writer that died between the two steps.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local leases, generation, deadlines = KEYS[1], KEYS[2], KEYS[3]
local BELL_MAX = 64
local out = {}
local stream_ttl = tonumber(ARGV[2])
for i = 0, (#ARGV - 2) / 6 - 1 do
  local snapkey, queue, bell = KEYS[4 + 3 * i], KEYS[5 + 3 * i], KEYS[6 + 3 * i]
  local a = 2 + 6 * i
  local mode = ARGV[a + 6]
  local rid, claim = ARGV[a + 1], ARGV[a + 4]
  local snap = redis.call('HMGET', snapkey, 'seq', 'head', 'st', 'tc')
  if snap[1] ~= ARGV[a + 2] or snap[2] ~= ARGV[a + 3] then
    out[i + 1] = 0
  else
    local st = snap[3]
    if st == 'awaiting_tool' and mode ~= '' then
      -- A harness turn ended: its call's answer is ready (a repeated append adds a second
      -- entry, which a waiter never needs: it stops at the first).
      redis.call('XADD', queue, '*', 'r', rid, 's', st)
      if mode == 'ht' and stream_ttl > 0 then
        redis.call('EXPIRE', queue, stream_ttl)
      end
    elseif st == 'awaiting_tool' then
      if redis.call('ZADD', queue, 'NX', now, rid) == 1 then
        redis.call('RPUSH', bell, rid)
        redis.call('LTRIM', bell, -BELL_MAX, -1)
      end
    end
    if st == 'awaiting_tool' then
      if ARGV[a + 5] ~= '' then
        redis.call('ZADD', deadlines, ARGV[a + 5], rid)
      end
      redis.call('ZREM', leases, rid)
      redis.call('ZREM', generation, rid)
      redis.call('HDEL', snapkey, 'tc')
    elseif st == 'running_tool' then
      redis.call('ZREM', queue, rid)
      redis.call('ZREM', deadlines, rid)
      if snap[4] ~= claim then
        -- A claim that just landed (a repeat of its append finds it recorded, and leaves
        -- a lease its runner may have renewed since alone).
        redis.call('HSET', snapkey, 'tc', claim)
        redis.call('ZADD', leases, string.format('%.0f', now + tonumber(ARGV[1])), rid)
      end
    else
      if mode == '' then
        redis.call('ZREM', queue, rid)
      elseif mode == 'ht' and (st == 'done' or st == 'failed' or st == 'cancelled') then
        redis.call('XADD', queue, '*', 'r', rid, 's', st)
        if stream_ttl > 0 then
          redis.call('EXPIRE', queue, stream_ttl)
        end
      end
      redis.call('ZREM', deadlines, rid)
      redis.call('ZREM', leases, rid)
      redis.call('HDEL', snapkey, 'tc')
    end
    out[i + 1] = 1
  end
end
return out
