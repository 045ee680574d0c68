-- Move an OpenAI batch record from one of some statuses to a new one, atomically; a move to a final
-- status also queues the batch's webhook deliveries (store/webhook_outbox.py) in the same script.
-- KEYS[1]  batch record hash            (field status, timestamps, file ids, ...)
-- KEYS[2]  the namespace's open-batches set
-- KEYS[3]  the batch's lease key        (checked only when ARGV[2] is not empty)
-- KEYS[4]  the webhook outbox hash      (delivery id -> JSON record)
-- KEYS[5]  the webhook outbox's due set (delivery id -> next attempt, epoch ms)
-- ARGV[1]  batch id (member of KEYS[2])
-- ARGV[2]  lease token the caller holds, or "" to move without a lease
-- ARGV[3]  comma-separated statuses the record may be in now
-- ARGV[4]  the new status
-- ARGV[5]  "1" if the new status is final (the batch leaves the open set), else "0"
-- ARGV[6]  when the deliveries are due (epoch ms)
-- ARGV[7]  n: the number of webhook deliveries to queue with the move
-- ARGV[8 .. 7+2n]  pairs: delivery id, JSON record
-- ARGV[8+2n ..]    field, value pairs written with the new status
-- Returns 1 if moved, 0 if the record is in another status, -1 if there is no record,
-- -2 if the caller's lease is gone (another server took the batch over): nothing is written.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return -1
end
if ARGV[2] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[2] then
  return -2
end
local allowed = false
for s in string.gmatch(ARGV[3], '[^,]+') do
  if s == status then
    allowed = true
  end
end
if not allowed then
  return 0
end
local hooks = tonumber(ARGV[7])
redis.call('HSET', KEYS[1], 'status', ARGV[4], unpack(ARGV, 8 + 2 * hooks))
if ARGV[5] == '1' then
  redis.call('SREM', KEYS[2], ARGV[1])
end
for i = 8, 7 + 2 * hooks, 2 do
  redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[5], ARGV[6], ARGV[i])
end
return 1
