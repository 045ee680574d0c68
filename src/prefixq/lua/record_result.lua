-- Record one request's result exactly once, and count it in its burst.
-- KEYS[1]  results hash of the burst   (field = input index, value = wire-encoded result)
-- KEYS[2]  burst record hash           (total, done, failed, token counters, status)
-- KEYS[3]  burst events stream         (one entry per recorded result, for waiters)
-- ARGV[1]  input index
-- ARGV[2]  wire-encoded result
-- ARGV[3]  "1" if the request failed, else "0"
-- ARGV[4]  TTL in seconds for the three keys
-- ARGV[5]  now (epoch seconds, as a string)
-- ARGV[6]  prompt tokens   ARGV[7] cached prompt tokens   ARGV[8] predicted cached tokens
-- Returns 0 if a result for this index already existed (a redelivery: only ack it),
-- 1 if recorded, 2 if recorded and it was the burst's last outstanding request,
-- -1 if the index is outside the burst (total known and index >= total): nothing is written.
local total = tonumber(redis.call('HGET', KEYS[2], 'total') or '')
if total and tonumber(ARGV[1]) >= total then
  return -1
end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return 0
end
local ttl = tonumber(ARGV[4])
redis.call('HINCRBY', KEYS[2], ARGV[3] == '1' and 'failed' or 'done', 1)
redis.call('HINCRBY', KEYS[2], 'prompt_tokens', ARGV[6])
redis.call('HINCRBY', KEYS[2], 'cached_tokens', ARGV[7])
redis.call('HINCRBY', KEYS[2], 'predicted_cached_tokens', ARGV[8])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', 100000, '*', 'i', ARGV[1])
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[3], ttl)
local c = redis.call('HMGET', KEYS[2], 'total', 'done', 'failed')
if c[1] and (tonumber(c[2] or 0) + tonumber(c[3] or 0)) >= tonumber(c[1]) then
  redis.call('HSET', KEYS[2], 'status', 'finished', 'finished_at', ARGV[5])
  return 2
end
return 1
