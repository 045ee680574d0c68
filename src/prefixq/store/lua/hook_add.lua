-- Queue one webhook delivery of a burst's end, once (store/webhook_outbox.py): its id is derived
-- from the burst, so every process that sees the burst end may call this; the first one queues it.
-- KEYS[1]  the outbox hash          (delivery id -> JSON record)
-- KEYS[2]  the outbox's due set     (delivery id -> next attempt, epoch ms)
-- KEYS[3]  the delivery's seen key  (set with a TTL: queued once, even after it was delivered)
-- ARGV[1]  delivery id
-- ARGV[2]  its JSON record (url, body, first, attempts)
-- ARGV[3]  when its first attempt is due (epoch ms)
-- ARGV[4]  seconds the seen key lives (as long as the burst's record)
-- Returns 1 if queued, 0 if it was queued before.
if not redis.call('SET', KEYS[3], '1', 'NX', 'EX', ARGV[4]) then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
