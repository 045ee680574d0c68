-- Claim the webhook deliveries that are due (store/webhook_outbox.py): each is pushed to ARGV[2],
-- past the attempt this deliverer makes now, so no other deliverer takes it meanwhile; if this one
-- dies, the delivery is due again at ARGV[2] and another takes it (at-least-once).
-- KEYS[1]  the outbox's due set     (delivery id -> next attempt, epoch ms)
-- KEYS[2]  the outbox hash          (delivery id -> JSON record)
-- ARGV[1]  now (epoch ms)
-- ARGV[2]  until when a claim holds (epoch ms)
-- ARGV[3]  most deliveries to claim
-- Returns {id, record, id, record, ...}; an id without a record is dropped from the due set.
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, id in ipairs(ids) do
  local rec = redis.call('HGET', KEYS[2], id)
  if rec then
    redis.call('ZADD', KEYS[1], ARGV[2], id)
    out[#out + 1] = id
    out[#out + 1] = rec
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
return out
