-- Correct a worker's result count in its burst's record (`w:<worker>`, counted by
-- lua/record_result.lua once per burst and written group): by how many results of a group the
-- count it carried was off (a result of the group refused, or already recorded by a redelivery).
-- Never creates the record: a record that is gone (expired, deleted) or is another burst's of the
-- same id is left alone, so no record hash without a TTL is ever made here.
-- KEYS[1]  burst record hash
-- ARGV[1]  the worker's name   ARGV[2] the correction (may be negative)
-- ARGV[3]  the entries' enqueue time, their record's `created` ("0": not checked)
-- Returns 1 when counted, 0 when the record is gone or another burst's.
local rec = redis.call('HMGET', KEYS[1], 'total', 'created')
if not tonumber(rec[1] or '') then
  return 0
end
local enqueued, created = tonumber(ARGV[3] or ''), tonumber(rec[2] or '')
if enqueued and enqueued ~= 0 and created and math.abs(created - enqueued) > 0.001 then
  return 0
end
redis.call('HINCRBY', KEYS[1], 'w:' .. ARGV[1], ARGV[2])
return 1
