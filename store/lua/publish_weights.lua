-- Record a new weight version, refusing any version that is not above the latest.
--
-- KEYS[1]  the weights log (a stream; entry id 0-<version>, fields path and at)
-- ARGV[1]  version (decimal, no leading zeros, 1 <= version <= 2^63 - 1)
-- ARGV[2]  checkpoint path
-- ARGV[3]  unix time
--
-- Returns {"ok"} | {"old", latest_version (decimal string)} | {"dup", at}
--   dup: the latest version is this one, with this path: a publish retried as it was (its
--        reply lost, or its replicas short of --min-replicas-acked), answered as the first was
--
-- Versions are compared as decimal strings, never as Lua numbers: those are doubles, exact
-- only below 2^53 (2^53 + 1 read as 2^53 was refused as "not above" it), and tostring() of
-- 2^63 - 1 gave "9.2233720368548e+18", which the client could not parse. Without leading
-- zeros (the caller's are checked, and Redis writes stream ids so), the longer string is the
-- larger number, and strings of one length compare as their digits do.
local latest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local current = '0'
if #latest == 1 then
  current = string.match(latest[1][1], '^0%-(%d+)$')
end
local version = ARGV[1]
if version == current then
  local fields = latest[1][2]
  if fields[1] == 'path' and fields[2] == ARGV[2] then
    return {'dup', fields[4]}
  end
end
if #version < #current or (#version == #current and version <= current) then
  return {'old', current}
end
redis.call('XADD', KEYS[1], '0-' .. version, 'path', ARGV[2], 'at', ARGV[3])
return {'ok'}
