-- Grow the deployment's shard count by one, only from the count the caller saw (two joiners that
-- both found every shard served grow it once each, never twice from one count).
-- KEYS[1]  the config hash   ARGV[1] the count the caller saw
-- Returns the count afterwards (ARGV[1] + 1 when this call grew it, else what another set).
local n = redis.call('HGET', KEYS[1], 'shards')
if n == ARGV[1] then
  redis.call('HSET', KEYS[1], 'shards', tonumber(n) + 1)
  return tonumber(n) + 1
end
return tonumber(n or '0')
