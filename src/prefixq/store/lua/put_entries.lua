-- Put entries taken off another shard (take_entries.lua) at the tail of this shard's intake
-- streams, each at most once, in the target shard's slot (store/entry_moves.py).
-- KEYS[1]  the target shard's set of entries moved in (Keys.moved_in)
-- KEYS[2..] the target shard's intake streams the entries go to
-- ARGV[1]  the set's TTL (s)   ARGV[2] the number of entries
-- then per entry: its token (source shard, stream and id), the index of its stream in KEYS, the
-- number of field/value items, and those items
-- Returns the number added (an entry whose token is in the set was put before: skipped).
local at = 3
local added = 0
for _ = 1, tonumber(ARGV[2]) do
  local token, key, n = ARGV[at], KEYS[tonumber(ARGV[at + 1])], tonumber(ARGV[at + 2])
  local fields = {}
  for j = 1, n do
    fields[j] = ARGV[at + 2 + j]
  end
  at = at + 3 + n
  if redis.call('SADD', KEYS[1], token) == 1 then
    redis.call('XADD', key, '*', unpack(fields))
    added = added + 1
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return added
