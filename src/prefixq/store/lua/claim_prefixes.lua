-- Claim prefix checkpoints for shards in the shared affinity map, touch their LRU scores, and
-- keep the map within its bound.
-- KEYS[1]  prefix map hash        (checkpoint hash, 8 raw bytes -> shard)
-- KEYS[2]  LRU sorted set         (checkpoint hash -> last use, epoch s)
-- ARGV[1]  now   ARGV[2] max entries   ARGV[3] n = number of claims
-- ARGV[4 .. 3+3n]  n triples: checkpoint, shard, mode
--          mode "n": claim only if absent (as HSETNX) -- two racing producers agree on the winner
--          mode "m": move (HSET) -- the load guard relocating a prefix group
-- ARGV[4+3n ..]    checkpoints used but not claimed (their LRU score is refreshed)
-- Returns, for each claim, the shard the map holds for it afterwards.
-- The checkpoints of one call are distinct. Each command takes up to BATCH of them (one HMGET,
-- one HSET, one ZADD, one HDEL per batch rather than one call each: a 16 KB prompt has ~24
-- checkpoints, and a Lua call per checkpoint cost Redis more than the work itself); the script
-- runs atomically, so an HMGET then an HSET of the absent fields is HSETNX field by field.
local BATCH = 1000 -- well under Lua's unpack limit (8,000 values)
local now = ARGV[1]
local maxn = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local out = {}
for first = 1, n, BATCH do
  local last = math.min(n, first + BATCH - 1)
  local cps = {}
  for i = first, last do
    cps[#cps + 1] = ARGV[4 + 3 * (i - 1)]
  end
  local held = redis.call('HMGET', KEYS[1], unpack(cps))
  local set, touch = {}, {}
  for i = first, last do
    local pos = 4 + 3 * (i - 1)
    local cp, shard, mode = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2]
    local had = held[i - first + 1]
    if mode == 'm' or not had then
      set[#set + 1] = cp
      set[#set + 1] = shard
      out[i] = shard
    else
      out[i] = had
    end
    touch[#touch + 1] = now
    touch[#touch + 1] = cp
  end
  if #set > 0 then
    redis.call('HSET', KEYS[1], unpack(set))
  end
  redis.call('ZADD', KEYS[2], unpack(touch))
end
local rest = 4 + 3 * n
for first = rest, #ARGV, BATCH do
  local touch = {}
  for j = first, math.min(#ARGV, first + BATCH - 1) do
    touch[#touch + 1] = now
    touch[#touch + 1] = ARGV[j]
  end
  redis.call('ZADD', KEYS[2], unpack(touch))
end
local size = redis.call('ZCARD', KEYS[2])
if size > maxn then
  local old = redis.call('ZPOPMIN', KEYS[2], size - maxn)
  local gone = {}
  for k = 1, #old, 2 do
    gone[#gone + 1] = old[k]
    if #gone == BATCH then
      redis.call('HDEL', KEYS[1], unpack(gone))
      gone = {}
    end
  end
  if #gone > 0 then
    redis.call('HDEL', KEYS[1], unpack(gone))
  end
end
return out
