-- Delete a burst's drained lane on one shard, with its lane index entry, atomically: only when the
-- lane holds no entry at all (none waiting, none pending: acked entries are deleted) and no more
-- can come (the producer sealed it; or the burst ended and nothing was added for a while).
-- KEYS[1]  the lane stream        KEYS[2]  the shard's lane index hash (same slot)
-- ARGV[1]  the burst id (the index field)
-- ARGV[2]  "sealed": close only if the index says sealed;
--          "ended": the burst was cancelled or expired; close if the lane's last entry was added
--          at least ARGV[3] ms ago (its producer may be gone before sealing it)
-- ARGV[3]  minimum idle time in ms for "ended"
-- ARGV[4]  the consumer group
-- ARGV[5]  now, in ms since the epoch (the caller's clock: TIME is outside the namespace's ACL
--          rule, docs/delivery.md; a skew of seconds does not matter against ARGV[3])
-- Returns 1 if the lane was closed (or already gone: its index entry is removed); 0 if it holds
-- entries that are all delivered (pending on workers) or it may still grow; -1 if it holds
-- entries not yet delivered (the worker that asked thought it drained: it reads it again).
local function newer(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am > bm or (am == bm and as > bs)
end
if redis.call('XLEN', KEYS[1]) > 0 then
  local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local f = {}
    for i = 1, #g, 2 do
      f[g[i]] = g[i + 1]
    end
    if f['name'] == ARGV[4] and #last > 0 and newer(last[1][1], f['last-delivered-id']) then
      return -1
    end
  end
  return 0
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  if ARGV[2] == 'sealed' then
    local info = redis.call('HGET', KEYS[2], ARGV[1])
    if not info or string.sub(info, -1) ~= '1' then
      return 0
    end
  else
    local s = redis.call('XINFO', 'STREAM', KEYS[1])
    local last = '0-0'
    for i = 1, #s, 2 do
      if s[i] == 'last-generated-id' then
        last = s[i + 1]
      end
    end
    local ms = tonumber(string.match(last, '^(%d+)-')) or 0
    if tonumber(ARGV[5]) - ms < tonumber(ARGV[3]) then
      return 0
    end
  end
  redis.call('DEL', KEYS[1])
end
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
