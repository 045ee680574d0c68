-- Renew or release a batch lease, only if the caller still holds it.
-- KEYS[1]  the lease key (a string holding the holder's token, with a TTL)
-- ARGV[1]  the caller's token
-- ARGV[2]  "renew" or "release"
-- ARGV[3]  with renew: the new TTL in milliseconds
-- Returns 1 if renewed or released, 0 if the lease is not the caller's (expired or taken over).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
if ARGV[2] == 'release' then
  return redis.call('DEL', KEYS[1])
end
return redis.call('PEXPIRE', KEYS[1], ARGV[3])
