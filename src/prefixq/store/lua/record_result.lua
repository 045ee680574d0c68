-- Record one request's result exactly once, and count it in its burst.
-- KEYS[1]  results hash of the burst   (field = input index, value = wire-encoded result)
-- KEYS[2]  burst record hash           (total, done, failed, token counters, status)
-- KEYS[3]  burst events stream         (one entry per recorded result, for waiters)
-- KEYS[4]  the burst's request-id list (only given a TTL here)
-- ARGV[1]  input index
-- ARGV[2]  wire-encoded result
-- ARGV[3]  the result's error code ("" for a success; "cancelled" and "expired" are also
--          counted per reason, as prefixq.store.burst_end counts the results it records)
-- ARGV[4]  TTL in seconds the burst's keys get once it has finished
-- ARGV[5]  now (epoch seconds, as a string)
-- ARGV[6]  prompt tokens   ARGV[7] cached prompt tokens   ARGV[8] predicted cached tokens
-- ARGV[9]  the entry's enqueue time, which is its burst record's `created` (absent, "" or "0":
--          unknown): a record created at another time is another burst of the same id (the id
--          was submitted again once this entry's burst had expired): -2, nothing written
-- ARGV[10] the recording worker's name (absent or "": not counted): the record's `w:<name>`
--          counts each worker's results, its share of the burst
-- ARGV[11] (absent: 0) results of the same burst recorded by the calls before this one in the
--          same pipeline, counted here for them (one HINCRBY per burst and written group, not
--          one per result: prefixq.store.scripts.record_calls; a call whose reply is not -2 has
--          counted them, whatever its own result became)
-- Returns
--   1  recorded
--   2  recorded, and it was the burst's last outstanding request (status "finished", or
--      "cancelled"/"expired" when a cancel or an expiry ended some of it; the four
--      keys then expire ARGV[4] seconds later: a running burst's keys never expire)
--   0  a result for this index existed already (a redelivery: only ack it)
--   3  a result existed already and the burst has finished (ack; completion hooks may run again)
--  -1  the index is outside the burst (index >= total): nothing is written
--  -2  the burst record does not exist, or lacks its total (expired, evicted, never created),
--      or is another burst's of the same id (ARGV[9]): nothing is written, so a lost record is
--      never re-created as an empty, "finished" one
local rec = redis.call('HMGET', KEYS[2], 'total', 'done', 'failed', 'created')
local total = tonumber(rec[1] or '')
if not total then
  return -2
end
local enqueued, created = tonumber(ARGV[9] or ''), tonumber(rec[4] or '')
if enqueued and enqueued ~= 0 and created and math.abs(created - enqueued) > 0.001 then
  return -2
end
local worker, others = ARGV[10] or '', tonumber(ARGV[11] or '0') or 0
local function count(n)
  if worker ~= '' and n ~= 0 then
    redis.call('HINCRBY', KEYS[2], 'w:' .. worker, n)
  end
end
if tonumber(ARGV[1]) >= total then
  count(others)
  return -1
end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  count(others)
  if tonumber(rec[2] or 0) + tonumber(rec[3] or 0) >= total then
    return 3
  end
  return 0
end
local failed = ARGV[3] ~= ''
local done = redis.call('HINCRBY', KEYS[2], failed and 'failed' or 'done', 1)
if ARGV[3] == 'cancelled' or ARGV[3] == 'expired' then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
end
redis.call('HINCRBY', KEYS[2], 'prompt_tokens', ARGV[6])
redis.call('HINCRBY', KEYS[2], 'cached_tokens', ARGV[7])
redis.call('HINCRBY', KEYS[2], 'predicted_cached_tokens', ARGV[8])
count(others + 1)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', 100000, '*', 'i', ARGV[1])
local other = failed and rec[2] or rec[3]
if done + tonumber(other or 0) >= total then
  -- a burst whose cancel or expiry was under way (prefixq.store.burst_end), or some of whose requests
  -- a worker found past their deadline, ends as such
  local s = redis.call('HMGET', KEYS[2], 'status', 'expired')
  local ended = 'finished'
  if s[1] == 'cancelling' then
    ended = 'cancelled'
  elseif s[1] == 'expiring' or tonumber(s[2] or 0) > 0 then
    ended = 'expired'
  end
  redis.call('HSET', KEYS[2], 'status', ended, 'finished_at', ARGV[5])
  local ttl = tonumber(ARGV[4])
  for i = 1, 4 do
    redis.call('EXPIRE', KEYS[i], ttl)
  end
  return 2
end
return 1
