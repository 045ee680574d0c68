-- Move an OpenAI batch record from one of some statuses to a new one, atomically.
-- KEYS[1]  batch record hash            (field status, timestamps, file ids, ...)
-- KEYS[2]  the namespace's open-batches set
-- KEYS[3]  the batch's lease key        (checked only when ARGV[2] is not empty)
-- ARGV[1]  batch id (member of KEYS[2])
-- ARGV[2]  lease token the caller holds, or "" to move without a lease
-- ARGV[3]  comma-separated statuses the record may be in now
-- ARGV[4]  the new status
-- ARGV[5]  "1" if the new status is final (the batch leaves the open set), else "0"
-- ARGV[6..] field, value pairs written with the new status
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
redis.call('HSET', KEYS[1], 'status', ARGV[4], unpack(ARGV, 6))
if ARGV[5] == '1' then
  redis.call('SREM', KEYS[2], ARGV[1])
end
return 1
