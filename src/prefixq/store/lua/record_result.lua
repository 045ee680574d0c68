-- Record results of one burst exactly once each, and count them in its burst: one call for all of
-- a written group's results of the burst (the burst's counters move once per call, not once per
-- result), each result decided as if recorded alone, in order.
-- KEYS[1]  results hash of the burst   (field = input index, value = wire-encoded result)
-- KEYS[2]  burst record hash           (total, done, failed, token counters, status)
-- KEYS[3]  burst events stream         (one entry per recorded result, for waiters)
-- KEYS[4]  the burst's request-id list (only given a TTL here)
-- ARGV[1]  TTL in seconds the burst's keys get once it has finished
-- ARGV[2]  now (epoch seconds, as a string)
-- ARGV[3]  the recording worker's name ("": not counted): the record's `w:<name>` counts each
--          worker's recorded results, its share of the burst
-- then 7 per result:
--   input index; wire-encoded result; error code ("" for a success; "cancelled" and "expired"
--   are also counted per reason, as prefixq.store.burst_end counts the results it records);
--   prompt tokens; cached prompt tokens; predicted cached tokens; the entry's enqueue time,
--   which is its burst record's `created` ("" or "0": unknown): a record created at another
--   time is another burst of the same id (the id was submitted again once this entry's burst
--   had expired): -2, nothing written for it
-- Returns one reply per result:
--   1  recorded
--   2  recorded, and it was the burst's last outstanding request (status "finished", or
--      "cancelled"/"expired" when a cancel or an expiry ended some of it; the four
--      keys then expire ARGV[1] seconds later: a running burst's keys never expire)
--   0  a result for this index existed already (a redelivery: only ack it)
--   3  a result existed already and the burst has finished (ack; completion hooks may run again)
--  -1  the index is outside the burst (index >= total): nothing is written
--  -2  the burst record does not exist, or lacks its total (expired, evicted, never created),
--      or is another burst's of the same id: nothing is written, so a lost record is never
--      re-created as an empty, "finished" one
local n = (#ARGV - 3) / 7
local out = {}
local rec = redis.call('HMGET', KEYS[2], 'total', 'done', 'failed', 'created')
local total = tonumber(rec[1] or '')
if not total then
  for j = 1, n do
    out[j] = -2
  end
  return out
end
local created = tonumber(rec[4] or '')
local done, failed = tonumber(rec[2] or '0') or 0, tonumber(rec[3] or '0') or 0
-- counter -> what this call adds to it, written once (`flush`)
local add = {}
local order = {}
local function bump(field, by)
  if add[field] == nil then
    add[field] = 0
    order[#order + 1] = field
  end
  add[field] = add[field] + by
end
local written = {}
local function flush()
  for _, field in ipairs(order) do
    if add[field] ~= 0 or not written[field] then  -- a counter is there once it was counted
      redis.call('HINCRBY', KEYS[2], field, add[field])
      written[field] = true
    end
    add[field] = 0
  end
end
local mine = ARGV[3] ~= '' and ('w:' .. ARGV[3]) or nil
for j = 1, n do
  local a = 3 + (j - 1) * 7
  local index, code = ARGV[a + 1], ARGV[a + 3]
  local enqueued = tonumber(ARGV[a + 7] or '')
  if enqueued and enqueued ~= 0 and created and math.abs(created - enqueued) > 0.001 then
    out[j] = -2
  elseif tonumber(index) >= total then
    out[j] = -1
  elseif redis.call('HSETNX', KEYS[1], index, ARGV[a + 2]) == 0 then
    out[j] = (done + failed >= total) and 3 or 0
  else
    if code ~= '' then
      failed = failed + 1
      bump('failed', 1)
      if code == 'cancelled' or code == 'expired' then
        bump(code, 1)
      end
    else
      done = done + 1
      bump('done', 1)
    end
    bump('prompt_tokens', tonumber(ARGV[a + 4]))
    bump('cached_tokens', tonumber(ARGV[a + 5]))
    bump('predicted_cached_tokens', tonumber(ARGV[a + 6]))
    if mine then
      bump(mine, 1)
    end
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', 100000, '*', 'i', index)
    out[j] = 1
    if done + failed >= total then
      -- a burst whose cancel or expiry was under way (prefixq.store.burst_end), or some of whose
      -- requests a worker found past their deadline, ends as such
      flush()
      local s = redis.call('HMGET', KEYS[2], 'status', 'expired')
      local ended = 'finished'
      if s[1] == 'cancelling' then
        ended = 'cancelled'
      elseif s[1] == 'expiring' or tonumber(s[2] or 0) > 0 then
        ended = 'expired'
      end
      redis.call('HSET', KEYS[2], 'status', ended, 'finished_at', ARGV[2])
      local ttl = tonumber(ARGV[1])
      for i = 1, 4 do
        redis.call('EXPIRE', KEYS[i], ttl)
      end
      out[j] = 2
    end
  end
end
flush()
return out
