-- Take back one failed result so that its request can run again (`prefixq dead --requeue`):
-- compare-and-delete, so a result recorded since it was read is never removed.
-- KEYS[1]  results hash of the burst   (field = input index, value = wire-encoded result)
-- KEYS[2]  burst record hash           (total, done, failed, status, finished_at)
-- KEYS[3]  burst events stream         KEYS[4]  the burst's request-id list
-- ARGV[1]  input index
-- ARGV[2]  the encoded failed result the field must still hold
-- Returns 1 if the result was removed and the burst's failed count lowered (a finished burst is
-- queued again, and its keys stop expiring while it runs), 0 if the field holds something else
-- or nothing, -1 if the burst was cancelled or expired (or is being): its request must not run
-- again, and its status and counters are the cancel's or the expiry's (nothing changes either way).
local status = redis.call('HGET', KEYS[2], 'status')
if status == 'cancelling' or status == 'cancelled' or status == 'expiring' or status == 'expired' then
  return -1
end
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then
  return 0
end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HINCRBY', KEYS[2], 'failed', -1)
if status == 'finished' then
  redis.call('HSET', KEYS[2], 'status', 'queued')
  redis.call('HDEL', KEYS[2], 'finished_at')
  for i = 1, 4 do
    redis.call('PERSIST', KEYS[i])
  end
end
return 1
