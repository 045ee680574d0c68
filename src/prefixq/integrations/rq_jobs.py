"""Bursts as RQ jobs (docs/architecture.md, decision 2; docs/rq.md).

`run_burst` is an ordinary RQ job function, used through RQ's public API with
`rq.serializers.JSONSerializer` (never pickle), on RQ 2.x and 3.x alike. A stock ``rq worker``
running it submits the burst, waits for its results and returns a JSON summary as the job's
return value. A burst that runs past its timeout (`BurstTimeout`) or has more failed requests than
``max_failed`` allows (`BurstFailed`) fails the RQ job with a message naming the burst. The other
way out to RQ, a burst's ``on_complete`` job, is prefixq.integrations.rq_callbacks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import redis
from rq import get_current_job
from rq.job import Job

from prefixq.client import results
from prefixq.client.out_file import out_path_problem
from prefixq.client.producer import Producer
from prefixq.client.submit_args import check_burst_id, new_burst_id
from prefixq.core.errors import (
    BurstFailed,
    BurstIdTaken,
    BurstTimeout,
    ConfigError,
    ValidationError,
)
from prefixq.core.inputs import read_requests
from prefixq.core.records import Request
from prefixq.core.settings import Settings
from prefixq.integrations.rq_callbacks import RQ_ON_COMPLETE, enqueue_on_complete
from prefixq.store import burst_end
from prefixq.store.connection import sync_client
from prefixq.store.redis_url import redact

__all__ = ["DEFAULT_TIMEOUT", "run_burst"]

log = logging.getLogger(__name__)

#: seconds `run_burst` waits for the burst's results unless told otherwise
DEFAULT_TIMEOUT = 3600.0
#: the wait ends this long before the RQ job's own timeout, so the job fails with our message
_JOB_TIMEOUT_MARGIN_S = 5.0
#: new burst ids tried when the one drawn is taken (as `Producer.submit` does)
_NEW_ID_ATTEMPTS = 5


# ---- bursts as RQ jobs ----------------------------------------------------------------------
def run_burst(
    requests_or_path: str | os.PathLike[str] | Sequence[Mapping[str, Any]],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    max_failed: float | None = None,
    out: str | None = None,
    burst_id: str | None = None,
    token_ids: bool = False,
    on_complete_url: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Submit a burst, wait for every result, return its summary: an ordinary RQ job function.

    ``requests_or_path`` is a list of request objects (plain or OpenAI batch lines) or the path
    of a JSONL file readable on the RQ worker's host. ``timeout``: seconds to wait for the
    results (also cut to a few seconds under the RQ job's own ``job_timeout``); past it the job
    fails with `BurstTimeout` and the burst keeps running. ``max_failed``: an ``int`` is the
    number of failed requests allowed, a ``float`` in [0, 1] the allowed share of the burst;
    more fails the job with `BurstFailed` (None: no limit). ``out``: also write the results as
    JSON lines there (input order; ``token_ids`` adds output token ids). ``on_complete_url``: the
    burst's webhook (`Producer.submit`; docs/operations.md, "Receiving webhooks"). Every other
    keyword is a `Settings` field (``redis_url``, ``namespace``, ``placement``, ``shards``,
    ``codec``, ...) that overrides the environment (``REDIS_URL``, ``PREFIXQ_*``) of the RQ
    worker.

    Returns a JSON-serialisable dict; docs/rq.md lists its fields.
    """
    started = time.monotonic()
    settings = Settings.from_env(**overrides)
    _check_max_failed(max_failed)
    _check_out(out, token_ids)
    reqs = _load(requests_or_path, settings)
    budget = _wait_budget(timeout)

    client = sync_client(settings)
    try:
        burst = _earlier_attempt(get_current_job(), settings, client, burst_id)
        if burst is None:
            burst = _submit(settings, reqs, burst_id, on_complete_url)
        submit_s = time.monotonic() - started
        try:
            st = results.wait(burst, settings, timeout=max(budget - submit_s, 0.001), client=client)
        except BurstTimeout:
            now = results.status(burst, settings, client=client)
            raise BurstTimeout(
                f"burst {burst}: {now.done + now.failed}/{now.total} results after "
                f"{time.monotonic() - started:.0f}s (timeout={timeout:g}s); the burst keeps "
                f"running in namespace {settings.namespace!r} (`prefixq results {burst} "
                f"--namespace {settings.namespace}` collects it later)"
            ) from None
        written = None
        if out:
            written = results.write_jsonl(
                burst, out, settings, timeout=60.0, token_ids=token_ids, client=client
            )
            log.info("run_burst: wrote %d results of burst %s to %s", written, burst, out)
        summary = _summary(settings, st, submit_s=submit_s, out=out, written=written)
        if st.status in ("cancelled", "expired"):
            raise BurstFailed(_ended_message(settings, st))
        if _too_many_failed(st.failed, st.total, max_failed):
            raise BurstFailed(_failed_message(settings, st, max_failed, client))
    finally:
        client.close()
    log.info(
        "run_burst: burst %s finished: %d done, %d failed, %s req/s",
        burst,
        st.done,
        st.failed,
        summary["requests_per_s"],
    )
    return summary


#: the RQ job's meta fields that name the burst an attempt of it submits (kept across retries)
META_BURST, META_NAMESPACE = "prefixq_run_burst", "prefixq_run_namespace"
#: the job's ``created_at`` when it noted the burst: a new job enqueued under the same id (RQ
#: keeps the old one's meta) is another job, whose own requests are submitted
META_CREATED = "prefixq_run_job_created"
#: the burst record's ``metadata`` field that names the RQ job that submitted it
META_RQ_JOB = "rq_job"


def _earlier_attempt(
    job: Job | None, settings: Settings, client: redis.Redis, burst_id: str | None
) -> str | None:
    """The burst an earlier attempt of this RQ job (a retry after a failure or a killed worker)
    submitted in full, to wait on again instead of submitting the requests a second time.

    An earlier attempt that died while submitting left a burst partly enqueued: it is cancelled
    as a whole (nothing of it is left for a worker to run), and this attempt submits anew."""
    if job is None or job.meta.get(META_NAMESPACE) != settings.namespace:
        return None
    noted = job.meta.get(META_CREATED)  # None: noted before it was kept (an upgrade)
    if noted is not None and noted != _created(job):
        return None  # noted by an earlier job under the same id, not by an attempt of this one
    prior = job.meta.get(META_BURST)
    if not isinstance(prior, str):
        return None
    total, per_shard, metadata = client.hmget(
        settings.keys.burst(prior), "total", "per_shard", "metadata"
    )
    if total is None or _rq_job_of(metadata) != job.id:
        return None  # never created (or long expired, or another's): submit it (again)
    if per_shard is not None:
        log.info("run_burst: RQ job %s attempted before: waiting again on burst %s", job.id, prior)
        return prior
    log.warning(
        "run_burst: an earlier attempt of RQ job %s died while submitting burst %s: cancelling "
        "it and submitting anew",
        job.id,
        prior,
    )
    burst_end.cancel(prior, settings, client=client, on_burst_done=enqueue_on_complete)
    if burst_id == prior:
        raise ValidationError(
            f"burst {prior}: an earlier attempt of RQ job {job.id} died while submitting it, so it "
            "was cancelled; the id cannot be used again (enqueue with another burst_id)"
        )
    return None


def _created(job: Job) -> str:
    """When the job was created (kept by its retries and requeues, new for a new job)."""
    return job.created_at.isoformat() if job.created_at is not None else ""


def _rq_job_of(metadata: bytes | None) -> str | None:
    """The RQ job id a burst record's ``metadata`` names as the one that submitted it."""
    try:
        got = json.loads(metadata or b"{}").get(META_RQ_JOB)
    except (ValueError, AttributeError):
        return None
    return got if isinstance(got, str) else None


def _submit(
    settings: Settings, reqs: list[Any], burst_id: str | None, on_complete_url: str | None = None
) -> str:
    """Submit the burst, its id noted in the running RQ job's meta first (`_earlier_attempt`)."""
    job = get_current_job()
    metadata = {META_RQ_JOB: job.id} if job is not None else None
    for attempt in range(_NEW_ID_ATTEMPTS):
        burst = new_burst_id() if burst_id is None else check_burst_id(burst_id)
        if job is not None:
            job.meta.update(
                {META_BURST: burst, META_NAMESPACE: settings.namespace, META_CREATED: _created(job)}
            )
            job.save_meta()  # type: ignore[no-untyped-call]
        try:
            Producer(settings, on_burst_done=RQ_ON_COMPLETE).submit(
                reqs, burst_id=burst, metadata=metadata, on_complete_url=on_complete_url
            )
        except BurstIdTaken:  # another producer drew the same new id: draw again
            if burst_id is not None or attempt + 1 == _NEW_ID_ATTEMPTS:
                raise
            continue
        log.info("run_burst: submitted %d requests as burst %s", len(reqs), burst)
        return burst
    raise AssertionError("unreachable")


def _load(
    src: str | os.PathLike[str] | Sequence[Mapping[str, Any]], settings: Settings
) -> list[Any]:
    """The requests: a list as given (validated by the producer), or the lines of a JSONL file."""
    if isinstance(src, str | os.PathLike):
        path = os.fspath(src)
        if path == "-":
            raise ValidationError("run_burst reads a JSONL file path, not stdin ('-')")
        try:
            reqs: list[Request] = read_requests(path, settings)
        except FileNotFoundError:
            raise ValidationError(
                f"{path}: no such file on the RQ worker's host ({socket.gethostname()})"
            ) from None
        return reqs
    if isinstance(src, Mapping):
        raise ValidationError("run_burst takes a list of request objects or a JSONL path, not one")
    if isinstance(src, bytes | bytearray) or not isinstance(src, Iterable):
        raise ValidationError(
            f"run_burst takes a list of request objects or a JSONL path, not {type(src).__name__}"
        )
    return list(src)


def _check_out(out: object, token_ids: object) -> None:
    """``out`` and ``token_ids`` usable, checked before the burst is submitted (not after it ran):
    ``out`` a path whose folder exists, ``token_ids`` a bool."""
    if not isinstance(token_ids, bool):
        raise ConfigError(f"token_ids must be true or false, not {token_ids!r}")
    if out is None:
        if token_ids:
            raise ConfigError("token_ids goes with out (the file the token ids are written to)")
        return
    if not isinstance(out, str | os.PathLike) or not os.fspath(out):
        raise ConfigError(f"out must be a file path on the RQ worker's host, not {out!r}")
    why = out_path_problem(out)
    if why:
        raise ConfigError(
            f"out {os.fspath(out)!r} {why} on the RQ worker's host ({socket.gethostname()})"
        )


def _check_max_failed(max_failed: float | None) -> None:
    if max_failed is None:
        return
    if isinstance(max_failed, bool) or not isinstance(max_failed, int | float):
        raise ConfigError(f"max_failed must be an int, a float or None, not {max_failed!r}")
    if isinstance(max_failed, int) and max_failed < 0:
        raise ConfigError(f"max_failed as a count must be >= 0, not {max_failed}")
    if isinstance(max_failed, float) and not 0.0 <= max_failed <= 1.0:
        raise ConfigError(f"max_failed as a share must be in [0, 1], not {max_failed}")


def _too_many_failed(failed: int, total: int, max_failed: float | None) -> bool:
    """Whether ``failed`` of ``total`` is over ``max_failed`` (int: a count; float: a share)."""
    if max_failed is None:
        return False
    if isinstance(max_failed, int):
        return failed > max_failed
    return failed / total > max_failed  # not failed > share * total: 0.29 * 100 < 29


def _wait_budget(timeout: float) -> float:
    """``timeout``, cut to end a little before the running RQ job's own timeout (if any)."""
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or timeout <= 0
        or not math.isfinite(timeout)
    ):
        raise ConfigError(f"timeout must be a positive number of seconds, not {timeout!r}")
    job = get_current_job()
    job_timeout = getattr(job, "timeout", None) if job is not None else None
    if not isinstance(job_timeout, int | float) or job_timeout <= 0:
        return timeout  # not under RQ, or an RQ job without a time limit (-1)
    # RQ's clock runs from the job's start (started_at, just before it imports and calls this
    # function), not from now: what went before (the import, a loaded machine) counts against it
    cap = max(job_timeout - _spent(job) - min(_JOB_TIMEOUT_MARGIN_S, job_timeout / 10), 0.001)
    if cap < timeout:
        log.warning(
            "RQ job timeout %ss is under run_burst timeout %ss: waiting at most %.1fs "
            "(enqueue with job_timeout above the burst timeout)",
            job_timeout,
            timeout,
            cap,
        )
        return cap
    return timeout


def _spent(job: Job | None) -> float:
    """Seconds since RQ started ``job`` (0 when it does not say)."""
    started = getattr(job, "started_at", None)
    if not isinstance(started, datetime):
        return 0.0
    if started.tzinfo is None:  # RQ 2.x keeps naive UTC
        started = started.replace(tzinfo=UTC)
    return max((datetime.now(UTC) - started).total_seconds(), 0.0)


def _summary(
    settings: Settings,
    st: results.BurstStatus,
    *,
    submit_s: float,
    out: str | None,
    written: int | None,
) -> dict[str, Any]:
    """The job's return value (plain JSON types only)."""
    m = st.meta
    last = st.finished_at if st.finished_at > st.created else time.time()
    span = max(last - st.created, 1e-9)
    return {
        "burst": st.burst,
        "namespace": settings.namespace,
        "redis_url": redact(settings.redis_url),
        "status": st.status,
        "total": st.total,
        "done": st.done,
        "failed": st.failed,
        "created": st.created,
        "finished_at": last,
        "elapsed_s": round(span, 6),
        "requests_per_s": round((st.done + st.failed) / span, 3),
        "submit_s": round(submit_s, 6),
        "placement": m.get("placement", ""),
        "per_shard": [int(x) for x in m.get("per_shard", "").split(",") if x],
        "prompt_tokens": int(m.get("prompt_tokens", 0)),
        "cached_tokens": int(m.get("cached_tokens", 0)),
        "results_key": settings.keys.results(st.burst),
        "out": out,
        "written": written,
    }


def _ended_message(settings: Settings, st: results.BurstStatus) -> str:
    """A burst that a cancel or its deadline ended before all its requests ran."""
    cut = int(st.meta.get(st.status, 0) or 0)
    return (
        f"burst {st.burst} was {st.status} before it finished: {st.done} done, {st.failed} "
        f"failed ({cut} {st.status}) of {st.total} (results in namespace "
        f"{settings.namespace!r}: `prefixq results {st.burst} --namespace {settings.namespace}`)"
    )


def _failed_message(
    settings: Settings, st: results.BurstStatus, max_failed: float | None, client: redis.Redis
) -> str:
    """What failed and where the results are, with the first failure's reason."""
    first = next(
        (
            res
            for res in results.iterate(st.burst, settings, timeout=60.0, client=client)
            if res.error
        ),
        None,
    )
    why = f"; first failure: request {first.id!r}: {first.error}" if first else ""
    return (
        f"burst {st.burst}: {st.failed} of {st.total} requests failed, over "
        f"max_failed={max_failed!r}{why} (results in namespace {settings.namespace!r}: "
        f"`prefixq results {st.burst} --namespace {settings.namespace}`)"
    )
