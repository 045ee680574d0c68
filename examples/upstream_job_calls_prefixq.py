"""Pattern 2: an upstream RQ job calls prefixq directly and chains a downstream job on completion.

``summarize`` submits the burst with ``Producer(...).submit(..., on_complete=..., rq_queue=...)``
and waits on the ``Burst`` it returns (``burst.wait()``). When the burst's last request is
recorded, the prefixq worker that recorded it enqueues ``on_burst_done(burst_id)`` on ``rq_queue``
exactly once, and any RQ worker on that queue runs it. The upstream job need not wait at all
(``wait=False``): the callback does not depend on it. Run it (from the repository root)::

    export REDIS_URL=redis://127.0.0.1:6379/0
    prefixq workers --cpu 1 &
    rq worker --url "$REDIS_URL" --serializer rq.serializers.JSONSerializer \
        --path examples pipeline &
    python examples/upstream_job_calls_prefixq.py
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis
from rq import Queue, get_current_job
from rq.job import Job
from rq.serializers import JSONSerializer

from prefixq import Burst, Producer, Settings
from prefixq.integrations.rq_callbacks import callback_job_id

log = logging.getLogger(__name__)

QUEUE = "pipeline"
TICKETS = [
    "The export button does nothing when the report has more than 10,000 rows.",
    "Please add dark mode to the dashboard.",
    "Login fails with 'invalid token' after changing my password.",
    "Invoices show the wrong currency symbol for Swiss francs.",
]
INSTRUCTION = "Classify the support ticket as bug or feature request, then give a one-line reason."


def summarize(wait: bool = True) -> dict[str, Any]:
    """An upstream RQ job: submit a burst with a completion callback, optionally wait for it."""
    settings = Settings.from_env()  # REDIS_URL, PREFIXQ_NAMESPACE of this RQ worker
    requests = [
        {
            "id": f"ticket-{i}",
            "prefix": INSTRUCTION,  # shared: every request lands on the same shard's KV cache
            "prompt": f"\nTicket: {text}\nAnswer:",
            "max_tokens": 24,
            "temperature": 0.0,
        }
        for i, text in enumerate(TICKETS)
    ]
    burst = Producer(settings).submit(
        requests,
        on_complete="upstream_job_calls_prefixq:on_burst_done",  # "module:function"
        rq_queue=QUEUE,
    )
    log.info("submitted burst %s (%d requests)", burst, len(requests))
    if not wait:
        return {"burst": burst.id, "namespace": settings.namespace}
    st = burst.wait(timeout=600)  # the Burst handle; str(burst) is the id
    return {
        "burst": burst.id,
        "namespace": settings.namespace,
        "done": st.done,
        "failed": st.failed,
    }


def on_burst_done(burst_id: str) -> dict[str, Any]:
    """The downstream RQ job, enqueued by prefixq once the burst is finished (exactly once)."""
    job = get_current_job()
    assert job is not None, "on_burst_done runs as an RQ job"
    # prefixq puts the burst's namespace in the job's meta; REDIS_URL comes from the environment
    settings = Settings.from_env(namespace=job.meta["prefixq_namespace"])
    burst = Burst(burst_id, settings)  # the handle of an id passed on as a string
    labels = {res.id: res.text.strip() for res in burst.collect()}
    st = burst.status()
    return {"burst": burst_id, "done": st.done, "failed": st.failed, "labels": labels}


def main() -> None:
    """Enqueue the upstream job; print its result, then the callback job's result."""
    settings = Settings.from_env()
    conn = redis.Redis.from_url(settings.redis_url)
    q = Queue(QUEUE, connection=conn, serializer=JSONSerializer)
    up = _wait(q.enqueue("upstream_job_calls_prefixq.summarize"), 700)
    print(json.dumps(up, indent=2))
    # the callback's RQ job id is fixed per (namespace, burst), so it can be looked up; the
    # worker enqueues it just after recording the last result, so it may not exist quite yet
    cb_id = callback_job_id(up["namespace"], up["burst"])
    deadline = time.monotonic() + 30
    while not Job.exists(cb_id, connection=conn):
        if time.monotonic() > deadline:
            raise SystemExit(f"callback job {cb_id} was never enqueued (see the worker's log)")
        time.sleep(0.1)
    cb = Job.fetch(cb_id, connection=conn, serializer=JSONSerializer)
    print(json.dumps(_wait(cb, 120), indent=2, ensure_ascii=False))


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
