-- Pick the shard a joining worker serves (`prefixq worker --join`): the lowest of 0..n-1 with no
-- live worker and no other joiner holding it, held for the joiner until ARGV[4].
-- KEYS[1]  the live hash (shard -> last heartbeat)   KEYS[2] the joins hash (shard -> held until)
-- ARGV[1]  now (epoch s)   ARGV[2] heartbeat TTL (s)   ARGV[3] n, the shard count
-- ARGV[4]  held until (epoch s)   ARGV[5] seconds ahead of now past which a time is not one
-- Returns the shard, or -1 when every shard is served or held (the caller grows the count).
local now, ttl, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local ahead = tonumber(ARGV[5])
-- a field that is not a time (a hand edit: not a number, inf, nan, far ahead) is none, as the
-- producers read the live hash (store/liveness.py), and never holds a shard for good
local function time_of(key, k, latest)
  local t = tonumber(redis.call('HGET', key, tostring(k)) or '')
  if t == nil or t ~= t or t > latest then
    return -1e18
  end
  return t
end
for k = 0, n - 1 do
  local beat = time_of(KEYS[1], k, now + ahead)
  local held = time_of(KEYS[2], k, tonumber(ARGV[4]) + ahead)
  if now - beat > ttl and held < now then
    redis.call('HSET', KEYS[2], tostring(k), ARGV[4])
    return k
  end
end
return -1
