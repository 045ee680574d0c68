-- Record how a webhook delivery's attempt ended (store/webhook_outbox.py), and count it.
-- KEYS[1]  the outbox's due set     (delivery id -> next attempt, epoch ms)
-- KEYS[2]  the outbox hash          (delivery id -> JSON record)
-- KEYS[3]  the outbox's counters    (delivered, retried, gave_up)
-- ARGV[1]  delivery id
-- ARGV[2]  the outcome: delivered, retried (ARGV[3], ARGV[4] given) or gave_up
-- ARGV[3]  the updated JSON record  (retried)
-- ARGV[4]  when the next attempt is due (epoch ms; retried)
-- Returns 1, or 0 if the delivery was settled already (a deliverer whose claim ran out while it
-- tried; another took it over): nothing is written.
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return 0
end
if ARGV[2] == 'retried' then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
  redis.call('ZADD', KEYS[1], ARGV[4], ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
end
redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
return 1
