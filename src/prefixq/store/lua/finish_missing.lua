-- Fail the given requests of a burst that have no result yet (cancel, deadline): exactly once per
-- index, like record_result.lua, so a worker recording one of them later gets "already recorded".
-- Called in chunks (store/burst_end.py: at most 1,000 indexes a call) so that Redis is never blocked long.
-- KEYS[1]  results hash of the burst   (field = input index, value = wire-encoded result)
-- KEYS[2]  burst record hash           (total, done, failed, status, per-reason counters)
-- KEYS[3]  burst events stream         (one entry per recorded result, for waiters)
-- KEYS[4]  the burst's request-id list (only given a TTL here)
-- ARGV[1]  the reason: "cancelled" or "expired"; also the counter each recorded index raises, and
--          the status set when the burst completes (meanwhile "cancelling" / "expiring")
-- ARGV[2]  TTL in seconds the burst's keys get once it has finished
-- ARGV[3]  now (epoch seconds, as a string)
-- ARGV[4], ARGV[5], ...  pairs: input index, wire-encoded failed result
-- Returns {recorded, state}: recorded = results written by this call; state
--   1  the burst still has requests without a result
--   2  this call completed the burst (status ARGV[1], or "cancelled" if a cancel is under way;
--      the four keys then expire ARGV[2] seconds later): the caller runs the completion hooks
--      (on_complete), exactly once per burst
--   3  the burst had completed before this call: nothing written, nothing changed
--  -2  the burst record does not exist, or lacks its total: nothing written
local rec = redis.call('HMGET', KEYS[2], 'total', 'done', 'failed', 'status')
local total = tonumber(rec[1] or '')
if not total then
  return {0, -2}
end
local reason = ARGV[1]
local finished = tonumber(rec[2] or 0) + tonumber(rec[3] or 0)
if finished >= total then
  return {0, 3}
end
local recorded = 0
for i = 4, #ARGV - 1, 2 do
  local index = ARGV[i]
  if tonumber(index) < total and redis.call('HSETNX', KEYS[1], index, ARGV[i + 1]) == 1 then
    recorded = recorded + 1
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', 100000, '*', 'i', index)
  end
end
if recorded > 0 then
  redis.call('HINCRBY', KEYS[2], 'failed', recorded)
  redis.call('HINCRBY', KEYS[2], reason, recorded)
end
if finished + recorded >= total then
  local final = rec[4] == 'cancelling' and 'cancelled' or reason
  redis.call('HSET', KEYS[2], 'status', final, 'finished_at', ARGV[3])
  local ttl = tonumber(ARGV[2])
  for k = 1, 4 do
    redis.call('EXPIRE', KEYS[k], ttl)
  end
  return {recorded, 2}
end
-- under way: "cancelling" (a cancel outranks a deadline) or "expiring"
if rec[4] ~= 'cancelling' then
  redis.call('HSET', KEYS[2], 'status', reason == 'cancelled' and 'cancelling' or 'expiring')
end
return {recorded, 1}
