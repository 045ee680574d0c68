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
#: seconds a stopping worker with ``--hand-over`` gives the move of its queue, after it
#: unregistered (what is not moved by then, a live worker moves once the shard is orphaned: a
#: plan begun is finished first)
HAND_OVER_S = 30.0


def stop_bound_s(settings: Settings, *, hand_over: bool = False) -> float:
    """The longest a worker's stop takes from `Worker.stop` (SIGTERM) to its exit, whatever Redis
    does: ``grace_s`` for in-flight requests, then `FLUSH_S` (plus the engine's own shutdown
    and the process's exit); with ``--hand-over``, up to `HAND_OVER_S` more to move the rest of
    its queue (skipped at once when Redis did not answer its unregister). A stop of a worker
    process still under way `STOP_SPARE_S` after it is ended by a watchdog
    (cli/worker_signals.py)."""
    return settings.grace_s + FLUSH_S + (HAND_OVER_S if hand_over else 0.0)


def default_name(shard: int, gpu: str | None) -> str:
    """Stable per host, shard and GPU, so a restarted worker resumes its own pending entries."""
    return f"{socket.gethostname()}-s{shard}-{'gpu' + gpu if gpu else 'cpu'}"
