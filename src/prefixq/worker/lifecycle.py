"""A worker's exit codes and the bounds of its stop: how long each step of `Worker.stop` may take
whatever Redis does, and the stable consumer name a restarted worker resumes its entries under.
"""

from __future__ import annotations

import socket

from prefixq.core.settings import Settings

EXIT_OK = 0
EXIT_ENGINE_DEAD = 3
#: seconds a stopping worker lets its reader finish the round it is in (a read blocks for at most
#: reader.BLOCK_MS) before it cancels it: a read retrying an unreachable Redis is given up
READ_STOP_S = 1.0
#: seconds after the drain (in-flight requests done, or the grace period over) for writing and
#: acking results and unregistering, whatever Redis does; what is not done by then stays pending
#: (nothing is lost: a restarted worker of the same name replays it, another reclaims it after
#: claim_idle_s)
FLUSH_S = 5.0
#: of `FLUSH_S`, what unregistering is sure to get
_UNREGISTER_S = 0.5


def stop_bound_s(settings: Settings) -> float:
    """The longest a worker's stop takes from `Worker.stop` (SIGTERM) to its exit, whatever Redis
    does: ``grace_s`` for in-flight requests, then `FLUSH_S` (plus the engine's own shutdown
    and the process's exit)."""
    return settings.grace_s + FLUSH_S


def default_name(shard: int, gpu: str | None) -> str:
    """Stable per host, shard and GPU, so a restarted worker resumes its own pending entries."""
    return f"{socket.gethostname()}-s{shard}-{'gpu' + gpu if gpu else 'cpu'}"
