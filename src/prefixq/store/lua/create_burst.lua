-- Create a burst's record, once: a burst id is taken by the first producer only.
-- KEYS[1]  the burst record hash
-- ARGV[1]  the number of field/value pairs that follow
-- ARGV[2..] field, value, field, value, ... (total, status "queued", created, ...)
-- Returns 1 if the record was created, 0 if a burst with this id exists (nothing is written).
-- The record has no TTL while the burst runs; lua/record_result.lua gives the burst's keys one
-- when its last result is recorded.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 2, 1 + 2 * tonumber(ARGV[1])))
return 1
