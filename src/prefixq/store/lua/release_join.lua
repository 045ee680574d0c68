-- Release a joining worker's hold on its shard (`prefixq worker --join` that exits before its
-- first heartbeat), only while the hold is still the one it wrote: a later joiner's is kept.
-- KEYS[1]  the joins hash (shard -> held until)   ARGV[1] the shard   ARGV[2] the hold it wrote
-- Returns 1 if released, else 0.
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
