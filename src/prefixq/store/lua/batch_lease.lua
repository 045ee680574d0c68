-- Take, renew or release a lease (a batch's: openai/lease.py; a shard's mover: worker/handover.py).
-- KEYS[1]  the lease key (a string holding the holder's token, with a TTL)
-- ARGV[1]  the caller's token
-- ARGV[2]  "acquire", "renew" or "release"
-- ARGV[3]  with acquire and renew: the TTL in milliseconds
-- acquire: takes the lease when no one holds it, or when what the key holds is no holder's lease
--          (no TTL, a TTL longer than ARGV[3], or not a string: a restore, a hand edit), which
--          would otherwise block every holder for good. Returns 1 if taken, 0 if held.
-- renew, release: only if the caller still holds it. Returns 1 if renewed or released, 0 if the
--          lease is not the caller's (expired or taken over).
if ARGV[2] == 'acquire' then
  local ttl = redis.call('PTTL', KEYS[1])
  local kind = redis.call('TYPE', KEYS[1])['ok']
  if ttl == -2 or ttl == -1 or ttl > tonumber(ARGV[3]) or kind ~= 'string' then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
    return 1
  end
  return 0
end
if redis.call('TYPE', KEYS[1])['ok'] ~= 'string' or redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
if ARGV[2] == 'release' then
  return redis.call('DEL', KEYS[1])
end
return redis.call('PEXPIRE', KEYS[1], ARGV[3])
