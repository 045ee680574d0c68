-- Acknowledge and delete the entries of several streams of one shard in one call: a worker's
-- group of results spans many lanes when many bursts share the shard (one or two streams are
-- acked with plain XACK and XDEL instead).
-- KEYS[1..n]   the streams (all of one shard: one Cluster slot)
-- ARGV[1]      the consumer group
-- ARGV[2..n+1] how many entry ids of each stream follow, in the order of KEYS
-- ARGV[n+2..]  the entry ids
-- Returns the number of entries acknowledged.
local at = #KEYS + 2
local acked = 0
for i, key in ipairs(KEYS) do
  local ids = {}
  for j = 1, tonumber(ARGV[i + 1]) do
    ids[j] = ARGV[at]
    at = at + 1
  end
  acked = acked + redis.call('XACK', key, ARGV[1], unpack(ids))
  redis.call('XDEL', key, unpack(ids))
end
return acked
