-- Record a batch once: the idempotency check of a submit. Also reads the newest published
-- weight version, which the submit stamps into its rollouts' records as their admitted
-- version: read here, atomically with the batch's creation, it costs the submit no round
-- trip of its own.
--
-- KEYS[1]  the batch record (a hash)
-- KEYS[2]  the index of batches (a sorted set: batch id -> submit time)
-- KEYS[3]  the weight-version log (a stream whose entry ids are 0-<version>)
-- ARGV[1]  the batch id          ARGV[2]  the submission's fingerprint
-- ARGV[3]  groups                ARGV[4]  samples per group
-- ARGV[5]  named rollout ids (msgpack list; "" when they are <batch>.<group>.<sample>)
-- ARGV[6]  the queue             ARGV[7]  retention in seconds (0 = keep)
-- ARGV[8]  submit time (unix seconds)
--
-- Returns {outcome, latest}: outcome "new" (recorded), "same" (already recorded with this
-- fingerprint: a retry) or "different" (another submission holds this batch id: nothing
-- written); latest the newest weight-log entry's id ("" when none was published).
--
-- The batch record's part only (Redis Cluster, where the three keys are three slots; store/
-- submit_cluster.py): KEYS[1] alone, the same ARGV. Its caller read the weight log and added
-- the batch to the index (ZADD NX) first; this reads no version ("" as latest) and indexes
-- nothing. Told apart by the count of KEYS.
local whole = #KEYS == 3
local version = ''
if whole then
  local latest = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
  if latest[1] then version = latest[1][1] end
end
local fp = redis.call('HGET', KEYS[1], 'fp')
if fp then
  if fp == ARGV[2] then return {'same', version} end
  return {'different', version}
end
redis.call('HSET', KEYS[1], 'fp', ARGV[2], 'groups', ARGV[3], 'n', ARGV[4], 'ids', ARGV[5],
  'queue', ARGV[6], 'ttl', ARGV[7], 'at', ARGV[8])
if whole then redis.call('ZADD', KEYS[2], ARGV[8], ARGV[1]) end
return {'new', version}
