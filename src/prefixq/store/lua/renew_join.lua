-- Renew a joining worker's hold on its shard while its engine starts (`prefixq worker --join`),
-- only while the hold is still the one it wrote: a hold its first heartbeat ended, or a later
-- joiner's, is left alone.
-- KEYS[1]  the joins hash (shard -> held until)   ARGV[1] the shard   ARGV[2] the hold it wrote
-- ARGV[3]  the new hold (held until, epoch s)
-- Returns 1 if renewed, else 0.
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
  return 1
end
return 0
