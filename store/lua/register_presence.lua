-- Register a worker whose presence subscription Redis confirmed, stamped by Redis's clock
-- (no host clock enters anything that judges a worker; see set_leases.lua).
--
-- KEYS[1]  the registry of watched workers (a hash: worker id -> "<when it registered, unix ms
--          by Redis's clock> <its round trip to Redis, ms>"; store/presence.py reads the
--          round trip to size the worker's confirmation window)
-- ARGV[1]  the worker id
-- ARGV[2]  its round trip, ms
--
-- Returns Redis's clock, unix ms.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.0f', now) .. ' ' .. ARGV[2])
return now
