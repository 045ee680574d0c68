-- The corpus order of the shared pass (client/shared_pass.py): each prefix group's place, given
-- the first time a burst submits it, so that later bursts over the same documents walk them in
-- the order the first one did.
-- KEYS[1]  the pass-order hash (pass key -> place; field 'n': the next place)
-- ARGV[1]  TTL (s)   ARGV[2] most places kept (beyond: the order starts over)   ARGV[3..] keys
-- Returns the place of each key, then the next place (the order's length).
local n = tonumber(redis.call('HGET', KEYS[1], 'n') or '0')
if n > tonumber(ARGV[2]) then
  redis.call('DEL', KEYS[1])
  n = 0
end
local out = {}
for i = 3, #ARGV do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if not v then
    v = n
    n = n + 1
    redis.call('HSET', KEYS[1], ARGV[i], n - 1)
  end
  out[#out + 1] = tonumber(v)
end
redis.call('HSET', KEYS[1], 'n', n)
redis.call('EXPIRE', KEYS[1], ARGV[1])
out[#out + 1] = n
return out
