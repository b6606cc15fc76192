-- Record a new weight version, refusing any version that is not above the latest.
--
-- KEYS[1]  the weights log (a stream; entry id 0-<version>, fields path and at)
-- ARGV[1]  version (integer >= 1)
-- ARGV[2]  checkpoint path
-- ARGV[3]  unix time
--
-- Returns {"ok"} | {"old", latest_version}
local latest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local current = 0
if #latest == 1 then
  current = tonumber(string.match(latest[1][1], '^0%-(%d+)$'))
end
if tonumber(ARGV[1]) <= current then
  return {'old', tostring(current)}
end
redis.call('XADD', KEYS[1], '0-' .. ARGV[1], 'path', ARGV[2], 'at', ARGV[3])
return {'ok'}
