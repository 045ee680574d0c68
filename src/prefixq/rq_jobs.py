"""Kept for the job paths RQ stores in queued jobs (``prefixq.rq_jobs.run_burst``):
the jobs live in prefixq.integrations.rq_jobs."""

from prefixq.integrations.rq_jobs import *  # noqa: F403
from prefixq.integrations.rq_jobs import __all__ as __all__
