-- The batch's side of an ack on Redis Cluster (store/ack_cluster.py): the completion entries
-- of acknowledged rollouts removed from the batch's stream, found by the ids their delivery
-- recorded (lua/deliver_completion.lua), and those records with them. In the batch's slot;
-- the rollouts themselves are deleted after this, in theirs (lua/ack.lua). Repeatable: a
-- rollout with no record here (removed already, never delivered) is skipped.
--
-- KEYS[1]  the batch's completion stream   KEYS[2]  its delivered completions (rollout -> id)
-- ARGV     the rollout ids
--
-- Returns how many entries it removed.
local removed = 0
for i = 1, #ARGV do
  local cid = redis.call('HGET', KEYS[2], ARGV[i])
  if cid then
    removed = removed + redis.call('XDEL', KEYS[1], cid)
    redis.call('HDEL', KEYS[2], ARGV[i])
  end
end
return removed
