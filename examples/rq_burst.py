"""Pattern 1: a burst as an RQ job (`prefixq.rq_jobs.run_burst`), and reading its summary.

An upstream RQ job builds the prompts and enqueues ``run_burst``; a stock ``rq worker`` runs it
(submit, wait, return the summary), and a downstream job that depends on it reads the summary and
the results. Run it (from the repository root; examples/README.md has the details)::

    export REDIS_URL=redis://127.0.0.1:6379/0
    prefixq workers --cpu 1 &        # or: prefixq workers --gpus 0,1
    rq worker --url "$REDIS_URL" --serializer rq.serializers.JSONSerializer \
        --path examples pipeline &
    python examples/rq_burst.py
"""

from __future__ import annotations

import json
import logging
from typing import Any

import redis
from rq import Queue, get_current_job
from rq.job import Job
from rq.serializers import JSONSerializer

from prefixq import Burst
from prefixq.core.settings import Settings

log = logging.getLogger(__name__)

QUEUE = "pipeline"
#: seconds run_burst waits for the burst; the RQ job_timeout must be longer
BURST_TIMEOUT = 1800
DOCUMENT = (
    "Redis Streams are append-only logs with consumer groups. Each entry has an id; a consumer "
    "group hands every entry to one consumer and keeps it pending until it is acknowledged. "
    "XAUTOCLAIM moves entries that stayed pending too long to another consumer."
)
QUESTIONS = [
    "What is a consumer group?",
    "When is an entry no longer pending?",
    "What does XAUTOCLAIM do?",
    "Name one property of a stream.",
]


def upstream(n: int = len(QUESTIONS)) -> dict[str, str]:
    """An upstream RQ job: build the burst, enqueue `run_burst` and a report job after it."""
    job = get_current_job()
    assert job is not None, "upstream runs as an RQ job"
    q = Queue(job.origin, connection=job.connection, serializer=JSONSerializer)
    requests = [
        # the shared document is the prefix: prefixq sends all of them to one shard's KV cache
        {"id": f"q{i}", "prefix": DOCUMENT, "prompt": f"\nQ: {question}\nA:", "max_tokens": 32}
        for i, question in enumerate((QUESTIONS * n)[:n])
    ]
    burst_job = q.enqueue(
        "prefixq.rq_jobs.run_burst",
        requests,
        timeout=BURST_TIMEOUT,  # run_burst's own wait
        max_failed=0.05,  # fail the RQ job if over 5% of the requests fail
        job_timeout=BURST_TIMEOUT + 60,  # RQ's limit for the job: keep it above the wait
        result_ttl=86_400,  # keep the summary for a day
    )
    report_job = q.enqueue("rq_burst.report", burst_job.id, depends_on=burst_job)
    log.info("burst job %s, report job %s", burst_job.id, report_job.id)
    return {"burst_job": burst_job.id, "report_job": report_job.id}


def report(burst_job_id: str) -> dict[str, Any]:
    """A downstream RQ job: read run_burst's summary (its return value), then the results."""
    job = get_current_job()
    assert job is not None, "report runs as an RQ job"
    burst_job = Job.fetch(burst_job_id, connection=job.connection, serializer=JSONSerializer)
    summary = burst_job.return_value()
    assert summary is not None, f"run_burst job {burst_job_id} has no result"
    # the summary names the namespace; REDIS_URL comes from this worker's environment
    settings = Settings.from_env(namespace=summary["namespace"])
    answers = {res.id: res.text.strip() for res in Burst(summary["burst"], settings).iterate()}
    return {
        "burst": summary["burst"],
        "requests_per_s": summary["requests_per_s"],
        "answers": answers,
    }


def main() -> None:
    """Enqueue the upstream job, then wait for the summary and the report and print them."""
    settings = Settings.from_env()
    conn = redis.Redis.from_url(settings.redis_url)
    q = Queue(QUEUE, connection=conn, serializer=JSONSerializer)
    # by dotted path: the RQ worker imports `rq_burst` from examples/ (its --path)
    up = q.enqueue("rq_burst.upstream")
    ids = _wait(up, 120)
    burst_job = Job.fetch(ids["burst_job"], connection=conn, serializer=JSONSerializer)
    summary = _wait(burst_job, BURST_TIMEOUT + 120)
    print(json.dumps(summary, indent=2))
    rep = Job.fetch(ids["report_job"], connection=conn, serializer=JSONSerializer)
    print(json.dumps(_wait(rep, 120), indent=2, ensure_ascii=False))


def _wait(job: Job, timeout: int) -> Any:
    """The job's return value once it has one; raise with RQ's traceback if it failed."""
    res = job.latest_result(timeout=timeout)
    if res is None:
        raise SystemExit(f"RQ job {job.id}: no result after {timeout}s (is `rq worker` running?)")
    if res.type != res.Type.SUCCESSFUL:
        raise SystemExit(f"RQ job {job.id} failed:\n{res.exc_string}")
    return res.return_value


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
