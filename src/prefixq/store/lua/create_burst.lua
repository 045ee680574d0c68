-- Create a burst's record and its request-id list together, once: a burst id is taken by the first
-- producer only, and a burst never exists without the ids of all its requests (a cancel or an
-- expiry gives each of its results the id submitted for its index).
-- KEYS[1]  the burst record hash
-- KEYS[2]  this submission's staged id list (Keys.staged_ids: pushed, in input order, in the same
--          pipeline just before this call)
-- KEYS[3]  the burst's id list (Keys.ids)
-- ARGV[1]  this submission's token (kept as the record's field "token")
-- ARGV[2]  the burst's total: the length the staged list must have
-- ARGV[3]  the number of field/value pairs that follow
-- ARGV[4..] field, value, field, value, ... (total, status "queued", created, ...)
-- Returns 1 if the record was created, or had been by this same submission (the client sent the
-- pipeline again after losing its reply: nothing is written twice); 0 if another burst has this
-- id; -1 if the staged list is not whole (a push of it was refused: out of memory): nothing is
-- created. The staged list is gone after every call.
-- The record has no TTL while the burst runs; lua/record_result.lua gives the burst's keys one
-- when its last result is recorded.
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('DEL', KEYS[2])
  if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
    return 1
  end
  return 0
end
if redis.call('LLEN', KEYS[2]) ~= tonumber(ARGV[2]) then
  redis.call('DEL', KEYS[2])
  return -1
end
redis.call('HSET', KEYS[1], 'token', ARGV[1], unpack(ARGV, 4, 3 + 2 * tonumber(ARGV[3])))
redis.call('RENAME', KEYS[2], KEYS[3])
redis.call('PERSIST', KEYS[3])
return 1
