-- Take one idle entry off a dead consumer, atomically (`prefixq reclaim`): either re-add it at the
-- tail of its priority's intake stream as a new, undelivered entry that carries its delivery
-- count, or move it to the dead-letter stream. Either way the old entry is acked and deleted, so
-- it is never served twice.
-- KEYS[1]  the shard's stream holding the entry (an intake or a lane)
-- KEYS[2]  requeue: the shard's intake stream of the entry's priority; dead: the shard's
--          dead-letter stream (all of the shard's keys share one slot)
-- ARGV[1]  consumer group   ARGV[2] entry id   ARGV[3] consumer it must still be pending on
-- ARGV[4]  minimum idle time (ms)   ARGV[5] "requeue" or "dead"
-- ARGV[6..] requeue: the carried-count field name, the count (deliveries so far), and the name
--           of the lane doorbell field (dropped: the entry no longer announces its lane)
--           dead: the dead letter's field/value pairs
-- Returns false if the entry is no longer pending on ARGV[3] with that idle time (a live worker
-- claimed it meanwhile, or it finished), 0 if it was pending but its payload is gone (only acked),
-- else the id of the entry it became (in KEYS[2]).
local p = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[4], ARGV[2], ARGV[2], 1)
if #p == 0 or p[1][2] ~= ARGV[3] then
  return false
end
local e = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if #e == 0 then
  return 0
end
if ARGV[5] == 'dead' then
  return redis.call('XADD', KEYS[2], 'MAXLEN', '~', 100000, '*', unpack(ARGV, 6))
end
local fields = {}
local old = e[1][2]
for i = 1, #old, 2 do
  if old[i] ~= ARGV[6] and old[i] ~= ARGV[8] then
    fields[#fields + 1] = old[i]
    fields[#fields + 1] = old[i + 1]
  end
end
fields[#fields + 1] = ARGV[6]
fields[#fields + 1] = ARGV[7]
return redis.call('XADD', KEYS[2], '*', unpack(fields))
