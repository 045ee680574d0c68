"""RQ job functions for tests/test_rq.py, imported by its `rq worker` process (PYTHONPATH=tests)."""

from __future__ import annotations

from rq import get_current_job


def calls_key(burst: str) -> str:
    """The Redis counter `mark_done` raises for ``burst``."""
    return f"rqtest:calls:{burst}"


def mark_done(burst: str) -> str:
    """A completion callback: count this call in Redis (on the RQ job's own connection)."""
    job = get_current_job()
    assert job is not None, "mark_done runs as an RQ job"
    job.connection.incr(calls_key(burst))
    return burst
