-- The corpus order of the shared pass (client/shared_pass.py): each prefix group's place, given
-- the first time a burst submits it, so that later bursts over the same documents walk them in
-- the order the first one did.
-- KEYS[1]  the pass-order hash (pass key -> place; field 'n': the next place)
-- ARGV[1]  TTL (s)   ARGV[2] most places kept (beyond: the order starts over; 0: never now, a
--          burst's later calls, so that its places stay in one order)   ARGV[3..] keys
-- Returns the place of each key, then the next place (the order's length).
-- The order is a hint: a value that is not a place (a hash field that is not a whole number,
-- a key of another type) is given a new place, or the order starts over; never an error.
local function place(v)
  local x = tonumber(v)
  if x and x >= 0 and x < 2 ^ 53 and x == math.floor(x) then
    return x
  end
  return nil
end
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'hash' and kind ~= 'none' then
  redis.call('DEL', KEYS[1])
end
local most = tonumber(ARGV[2])
local n = place(redis.call('HGET', KEYS[1], 'n') or '0')
if n == nil or (most > 0 and n > most) then
  redis.call('DEL', KEYS[1])
  n = 0
end
local out = {}
for i = 3, #ARGV do
  local v = place(redis.call('HGET', KEYS[1], ARGV[i]))
  if v == nil then
    v = n
    n = n + 1
    redis.call('HSET', KEYS[1], ARGV[i], v)
  end
  out[#out + 1] = v
end
redis.call('HSET', KEYS[1], 'n', n)
redis.call('EXPIRE', KEYS[1], ARGV[1])
out[#out + 1] = n
return out
