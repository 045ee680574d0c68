-- Take entries off a shard to move them to another, all or nothing, in the source shard's slot
-- (store/entry_moves.py): each entry is written to the source shard's plan hash with its target
-- and its fields (the deliveries it had added to the carried count), then acked and deleted.
-- Putting them on the target (put_entries.lua) and dropping the plan follow; a mover that dies
-- in between leaves the plan for the next one.
-- KEYS[1]  the source shard's stream holding the entries (an intake or a lane)
-- KEYS[2]  the source shard's plan hash (Keys.moving)
-- ARGV[1]  consumer group   ARGV[2] mode: "new" (never delivered to any consumer) or "pending"
-- ARGV[3]  pending: the consumer each entry must still be pending on
-- ARGV[4]  pending: the minimum idle time (ms)
-- ARGV[5]  the carried-count field   ARGV[6] the lane doorbell field   ARGV[7] the position field
--          (the last two are dropped: a moved entry announces no lane and waits for nothing)
-- ARGV[8]  the target shard
-- ARGV[9..] the entry ids
-- Returns the number taken: 0 if any entry is not eligible (new: delivered meanwhile or gone;
-- pending: no longer pending on ARGV[3] with that idle time), which takes none of them; a pending
-- entry whose payload is gone is only acked (and not counted).
local function older_or_same(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as <= bs)
end
local mode = ARGV[2]
local last = nil
if mode == 'new' then
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local name, delivered = nil, nil
    for i = 1, #g, 2 do
      if g[i] == 'name' then name = g[i + 1] end
      if g[i] == 'last-delivered-id' then delivered = g[i + 1] end
    end
    if name == ARGV[1] then last = delivered end
  end
  if last == nil then
    last = '0-0'
  end
end
local found = {}
local deliveries = {}
for i = 9, #ARGV do
  local id = ARGV[i]
  if mode == 'new' then
    if older_or_same(id, last) then
      return 0
    end
    local e = redis.call('XRANGE', KEYS[1], id, id)
    if #e == 0 then
      return 0
    end
    found[id] = e[1][2]
    deliveries[id] = 0
  else
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[4], id, id, 1)
    if #p == 0 or p[1][2] ~= ARGV[3] then
      return 0
    end
    local e = redis.call('XRANGE', KEYS[1], id, id)
    found[id] = e[1] and e[1][2] or false
    deliveries[id] = p[1][4]
  end
end
local taken = 0
for i = 9, #ARGV do
  local id = ARGV[i]
  local old = found[id]
  if mode == 'pending' then
    redis.call('XACK', KEYS[1], ARGV[1], id)
  end
  redis.call('XDEL', KEYS[1], id)
  if old then
    local fields = {}
    local carried = 0
    for j = 1, #old, 2 do
      local f = old[j]
      if f == ARGV[5] then
        carried = tonumber(old[j + 1]) or 0
      elseif f ~= ARGV[6] and f ~= ARGV[7] then
        fields[#fields + 1] = f
        fields[#fields + 1] = old[j + 1]
      end
    end
    fields[#fields + 1] = ARGV[5]
    fields[#fields + 1] = tostring(carried + deliveries[id])
    redis.call('HSET', KEYS[2], KEYS[1] .. '\n' .. id, cmsgpack.pack({tonumber(ARGV[8]), fields}))
    taken = taken + 1
  end
end
return taken
