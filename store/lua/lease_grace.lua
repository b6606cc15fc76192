-- Shared by the scripts that judge leases (expired_leases.lua, read_leases.lua), prepended to
-- each: whether Redis refused writes recently, by Redis's own count of its refusals.
--
-- While Redis refuses writes (out of memory, a failed disk write, a read-only replica) no
-- worker can renew a lease, so a lease that lapsed then says nothing about its worker: no
-- lease counts as lapsed until a grace after the last refusal seen, by which each live worker
-- has renewed its leases (it does every heartbeat, and its first heartbeat after the refusals
-- end renews them). Those of a worker that died meanwhile lapse when the grace ends, and are
-- taken over then. Judged on Redis, fleet-wide: each worker's reaper also holds off while its
-- own worker sees refusals, but a reaper whose worker saw none (one started just after, one
-- that wrote nothing then) took live workers' lapsed leases as soon as Redis accepted writes.
--
-- The refusals are counted by Redis itself (INFO errorstats: OOM, MISCONF, READONLY replies,
-- since its start), so nothing has to be written while writes are refused. What the scripts
-- last saw of that count, and when it last changed (Redis's clock), is kept in a hash
-- beside the lease index (store.keys.lease_refusals): a change since is a refusal since,
-- dated at the look that sees it, at most a reaper pass after it happened. A count that fell
-- (Redis restarted, or CONFIG RESETSTAT) and is not zero has refusals since: dated now too.
-- Without errorstats (Redis before 6.2, fakeredis) the count stays 0: no grace.
--
-- Nobody could renew a lease while Redis was down either: restarted, or failed over (a replica
-- promoted, on one Redis or a cluster's master). Both show as a new replication id (INFO
-- replication, master_replid: a master draws a new one at each start and a promoted replica
-- on promotion, while the record beside the index came back in the AOF or the replica's copy),
-- and a change of it starts the same grace. Without it, every lease of a master that was down
-- longer than the lease TTL was taken from its live worker as soon as the master answered
-- (measured on a cluster: a lease of 4 s around a 2.4 s failover). The first look records the
-- id without a grace; a Redis that names no id (fakeredis) gives ''.
local REFUSALS = {OOM = true, MISCONF = true, READONLY = true}

local function refusal_count()
  local ok, info = pcall(redis.call, 'INFO', 'errorstats')
  local count = 0
  if ok and type(info) == 'string' then
    for name, n in string.gmatch(info, 'errorstat_(%u+):count=(%d+)') do
      if REFUSALS[name] then count = count + tonumber(n) end
    end
  end
  return count
end

local function replication_id()
  local ok, info = pcall(redis.call, 'INFO', 'replication')
  if ok and type(info) == 'string' then
    return string.match(info, 'master_replid:(%w+)') or ''
  end
  return ''
end

-- The end of the grace (unix ms by Redis's clock; 0: none was ever needed). ``record``: keep
-- what was seen (the reaper's pass does; a reader only looks, and takes an unrecorded change
-- as one now). Should recording be refused, Redis refuses writes now: graced too.
local function grace_until(record_key, now, grace_ms, record)
  local count = refusal_count()
  local replid = replication_id()
  local seen = redis.call('HMGET', record_key, 'count', 'at', 'replid')
  local at = tonumber(seen[2]) or 0
  local refused = count ~= tonumber(seen[1])
  local moved = replid ~= seen[3]
  if refused or moved then
    if (refused and count > 0) or (moved and seen[3]) then at = now end
    if record and not pcall(redis.call, 'HSET', record_key, 'count', count, 'at', at,
                            'replid', replid) then
      at = now
    end
  end
  if at == 0 then return 0 end
  return at + grace_ms
end
