-- Add one chunk of a burst's entries to one shard's streams, each at most once: a pipeline sent
-- again (redis-py's cluster pipeline after a failover, the producer's ride-through:
-- client/enqueue.py) adds nothing this submission already added. The shard's entries of a burst
-- are numbered in the order the producer sends them (its place in the shard's sequence); the
-- guard holds how many of them are in, and this script adds a chunk's entries and moves the guard
-- at once, so a replica holds both or neither. All keys are in the shard's slot ({s<k>}).
-- KEYS[1]  the guard (Keys.enqueued: this submission's count of entries on this shard; TTL)
-- KEYS[2]  the shard's intake of the burst's priority
-- KEYS[3]  the burst's lane on the shard
-- KEYS[4]  the shard's lane index (Keys.lanes)
-- ARGV[1]  the guard's TTL (s)
-- ARGV[2]  the entries this submission sent to this shard before this chunk
-- ARGV[3]  how many of the entries go to the lane; the rest go to the intake, and after lane
--          entries the one that follows is their doorbell
-- ARGV[4]  the lane's info (prefixq.core.sharing.LaneInfo) if this chunk makes the lane (its
--          stream, its group and its lane index field), else ""
-- ARGV[5]  the burst id   ARGV[6] the consumer group
-- ARGV[7], ARGV[8], ARGV[9]  the field names: payload, place, doorbell (prefixq.core.keys)
-- ARGV[10..] per entry, in order: payload, place
-- Returns the number of entries skipped as already added (0 on a first send), or, when fewer than
-- ARGV[2] are in (a failover lost entries this submission sent before and the master answered
-- for), minus the number missing, adding nothing: the producer's submit fails (WritesLost).
local sent = tonumber(redis.call('GET', KEYS[1]) or '0')
local start = tonumber(ARGV[2])
local laned = tonumber(ARGV[3])
local n = (#ARGV - 9) / 2
if sent >= start + n then
  return n
end
if sent < start then
  return sent - start
end
if ARGV[4] ~= '' and sent <= start then
  -- a lane left by an expired burst of the same id keeps its group (BUSYGROUP)
  local made = redis.pcall('XGROUP', 'CREATE', KEYS[3], ARGV[6], '0', 'MKSTREAM')
  if type(made) == 'table' and made.err and not string.find(made.err, 'BUSYGROUP') then
    return made
  end
  redis.call('HSET', KEYS[4], ARGV[5], ARGV[4])
end
local skipped = 0
for i = 0, n - 1 do
  local data, place = ARGV[10 + 2 * i], ARGV[11 + 2 * i]
  if start + i < sent then
    skipped = skipped + 1
  elseif i < laned then
    redis.call('XADD', KEYS[3], '*', ARGV[7], data, ARGV[8], place)
  elseif laned > 0 then
    redis.call('XADD', KEYS[2], '*', ARGV[7], data, ARGV[9], '1', ARGV[8], place)
  else
    redis.call('XADD', KEYS[2], '*', ARGV[7], data, ARGV[8], place)
  end
end
redis.call('SET', KEYS[1], start + n, 'EX', ARGV[1])
return skipped
