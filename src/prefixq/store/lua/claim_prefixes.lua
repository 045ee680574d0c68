-- Claim prefix checkpoints for shards in the shared affinity map, mark the ones used as recent,
-- and keep the map within its bound.
-- The map is two generations of one hash each: KEYS[1] the current one, which every checkpoint
-- claimed or used is written to, and KEYS[2] the previous one, read where the current one has no
-- entry (a checkpoint's shard: the current generation's, else the previous one's). When a call
-- would take the current generation past half the bound it becomes the previous one (RENAME) and
-- the previous one is dropped whole (UNLINK): an approximate LRU in which a checkpoint claimed or
-- used stays mapped while fewer than max / 2 other checkpoints have been written after it, and
-- both generations together never hold more than max entries (an exact LRU keeps the last max;
-- this one keeps at least the last max / 2, and a sorted set of scores, one ZADD member per
-- checkpoint, was over a third of the map's Redis time: docs/BENCHMARKS.md).
-- KEYS[1]  current generation    (checkpoint hash, 8 raw bytes -> shard)
-- KEYS[2]  previous generation   (the same, older)
-- ARGV[1]  max entries   ARGV[2] g = number of groups of claims
-- ARGV[3 .. 2+3g]  g triples: shard, mode, the checkpoints claimed (8 raw bytes each,
--          concatenated: one argument per group rather than three per claim, which cost a
--          producer more to pack than Redis to run)
--          mode "n": claim only if absent (as HSETNX) -- two racing producers agree on the winner
--          mode "m": move (HSET) -- the load guard relocating a prefix group
-- ARGV[3+3g]  (optional) checkpoints used but not claimed, concatenated (marked recent: copied
--          into the current generation unless there already; one in neither is left out)
-- Returns, for each claim in the order given (group by group), the shard the map holds for it
-- afterwards.
-- The checkpoints of one call are distinct. Each command takes up to BATCH of them; the script
-- runs atomically, so an HMGET then an HSET of the absent fields is HSETNX field by field.
local BATCH = 1000 -- well under Lua's unpack limit (8,000 values)
local maxn = tonumber(ARGV[1])
local groups = tonumber(ARGV[2])
local half = math.floor(maxn / 2)
local cps, shards, modes, young = {}, {}, {}, {}
local function split(blob, shard, mode)
  for i = 1, #blob / 8 do
    local k = #cps + 1
    cps[k] = string.sub(blob, 8 * i - 7, 8 * i)
    shards[k], modes[k] = shard, mode
  end
end
for g = 1, groups do
  split(ARGV[3 * g + 2], ARGV[3 * g], ARGV[3 * g + 1])
end
local n = #cps
split(ARGV[3 * groups + 3] or '', false, false)
local total = #cps
-- each checkpoint's entry: young[i] in the current generation, else old[i] in the previous one
local old, adds = {}, 0
for first = 1, total, BATCH do
  local last = math.min(total, first + BATCH - 1)
  local got = redis.call('HMGET', KEYS[1], unpack(cps, first, last))
  local miss, at = {}, {}
  for i = first, last do
    local v = got[i - first + 1]
    young[i] = v
    if not v then
      miss[#miss + 1] = cps[i]
      at[#at + 1] = i
    end
  end
  if #miss > 0 then
    local prev = redis.call('HMGET', KEYS[2], unpack(miss))
    for k = 1, #miss do
      old[at[k]] = prev[k]
    end
    adds = adds + #miss
  end
end
-- a new generation when this call's writes would take the current one past half the bound
local rotated = false
if adds > 0 and redis.call('HLEN', KEYS[1]) + adds > half then
  redis.call('UNLINK', KEYS[2])
  if redis.call('EXISTS', KEYS[1]) == 1 then
    redis.call('RENAME', KEYS[1], KEYS[2])
  end
  rotated = true
end
local out, set = {}, {}
local function put(cp, v)
  set[#set + 1] = cp
  set[#set + 1] = v
  if #set == 2 * BATCH then
    redis.call('HSET', KEYS[1], unpack(set))
    set = {}
  end
end
for i = 1, total do
  local cp, had = cps[i], young[i] or old[i]
  local v = had
  if i <= n then
    local shard, mode = shards[i], modes[i]
    if mode == 'm' or not had then
      v = shard
    end
    out[i] = v
  end
  -- written where the current generation lacks it (or it changes): claimed, moved, or used
  if v and (rotated or young[i] ~= v) then
    put(cp, v)
  end
end
if #set > 0 then
  redis.call('HSET', KEYS[1], unpack(set))
end
-- one call of more than half the bound: the previous generation goes, then what is past the bound
local size = redis.call('HLEN', KEYS[1])
if size > half then
  redis.call('UNLINK', KEYS[2])
  for i = total, 1, -1 do
    if size <= maxn then
      break
    end
    if redis.call('HDEL', KEYS[1], cps[i]) == 1 then
      size = size - 1
    end
  end
end
return out
