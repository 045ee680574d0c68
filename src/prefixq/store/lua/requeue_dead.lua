-- Put a dead letter's request back on its shard's stream, once (`prefixq dead --requeue`).
-- KEYS[1]  the shard's intake stream of the entry's priority
-- KEYS[2]  the shard's dead-letter stream (same slot)
-- ARGV[1]  dead letter id   ARGV[2] the entry's field name   ARGV[3] the wire-encoded entry
-- Returns the new entry's id, or false if the dead letter was already gone (another call took it).
if redis.call('XDEL', KEYS[2], ARGV[1]) == 0 then
  return false
end
return redis.call('XADD', KEYS[1], '*', ARGV[2], ARGV[3])
