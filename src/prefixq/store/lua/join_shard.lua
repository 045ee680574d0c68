-- Pick the shard a joining worker serves (`prefixq worker --join`): the lowest of 0..n-1 with no
-- live worker and no other joiner holding it, held for the joiner until ARGV[4].
-- KEYS[1]  the live hash (shard -> last heartbeat)   KEYS[2] the joins hash (shard -> held until)
-- ARGV[1]  now (epoch s)   ARGV[2] heartbeat TTL (s)   ARGV[3] n, the shard count
-- ARGV[4]  held until (epoch s)
-- Returns the shard, or -1 when every shard is served or held (the caller grows the count).
local now, ttl, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
for k = 0, n - 1 do
  -- a field that is not a time (a hand edit) is no beat and no hold, as the producers read it
  local beat = tonumber(redis.call('HGET', KEYS[1], tostring(k)) or '') or -1e18
  local held = tonumber(redis.call('HGET', KEYS[2], tostring(k)) or '') or -1e18
  if now - beat > ttl and held < now then
    redis.call('HSET', KEYS[2], tostring(k), ARGV[4])
    return k
  end
end
return -1
