-- A shard's outstanding prefill tokens (Keys.load) raised or lowered: HINCRBY that nothing in
-- the hash can make fail. The counter is an estimate every producer, mover and worker writes, so
-- a value that is not an integer (or a key of another type) is replaced by the increment
-- (readers clamp it at 0) rather than refusing a submit, a move or a worker's acks.
-- KEYS[1]  the load hash   ARGV[1] the shard   ARGV[2] the increment (an integer)
local ok, v = pcall(redis.call, 'HINCRBY', KEYS[1], ARGV[1], ARGV[2])
if ok then
  return v
end
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' then
  redis.call('DEL', KEYS[1])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return tonumber(ARGV[2])
