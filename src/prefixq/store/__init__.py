"""Redis: connections, deployment record, eviction-policy check, Lua scripts and their callers,
burst ends, dead letters."""
