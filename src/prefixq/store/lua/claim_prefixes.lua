-- Claim prefix checkpoints for shards in the shared affinity map, touch their LRU scores, and
-- keep the map within its bound.
-- KEYS[1]  prefix map hash        (checkpoint hash, 8 raw bytes -> shard)
-- KEYS[2]  LRU sorted set         (checkpoint hash -> last use, epoch s)
-- ARGV[1]  now   ARGV[2] max entries   ARGV[3] n = number of claims
-- ARGV[4 .. 3+3n]  n triples: checkpoint, shard, mode
--          mode "n": claim only if absent (HSETNX) -- two racing producers agree on the winner
--          mode "m": move (HSET) -- the load guard relocating a prefix group
-- ARGV[4+3n ..]    checkpoints used but not claimed (their LRU score is refreshed)
-- Returns, for each claim, the shard the map holds for it afterwards.
local now = ARGV[1]
local maxn = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local out = {}
local pos = 4
for i = 1, n do
  local cp, shard, mode = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2]
  pos = pos + 3
  if mode == 'm' or redis.call('HSETNX', KEYS[1], cp, shard) == 1 then
    if mode == 'm' then redis.call('HSET', KEYS[1], cp, shard) end
    out[i] = shard
  else
    out[i] = redis.call('HGET', KEYS[1], cp)
  end
  redis.call('ZADD', KEYS[2], now, cp)
end
for j = pos, #ARGV do
  redis.call('ZADD', KEYS[2], now, ARGV[j])
end
local size = redis.call('ZCARD', KEYS[2])
if size > maxn then
  local old = redis.call('ZPOPMIN', KEYS[2], size - maxn)
  for k = 1, #old, 2 do
    redis.call('HDEL', KEYS[1], old[k])
  end
end
return out
