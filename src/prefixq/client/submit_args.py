"""A submit's arguments, checked before anything is sent (`Producer.asubmit`'s first step): the
requests' container (`check_requests`: each request itself is validated as its chunk is sent),
the options and the burst record's fields they give (`check_options`), and the burst id
(`check_burst_id`, or `new_burst_id` when none is given). A refusal here leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prefixq.affinity.placement import Placer
from prefixq.client.order import ORDERS
from prefixq.client.request_file import RequestFile
from prefixq.core.checks import callback_path
from prefixq.core.errors import ValidationError
from prefixq.core.records import Request
from prefixq.core.settings import Settings
from prefixq.core.sharing import check_priority, check_tenant
from prefixq.core.webhooks import check_url

_BURST_ID = re.compile(r"[A-Za-z0-9_.:@+-]{1,200}")
#: called with (requests enqueued so far, total)
Progress = Callable[[int, int], None]


def check_burst_id(burst: str) -> str:
    """``burst`` if it is a usable burst id: 1-200 of letters, digits and ``_.:@+-`` (no braces:
    a burst's keys share one Cluster hash tag built from it; no spaces or control characters:
    it is printed and typed). ValidationError otherwise."""
    if not isinstance(burst, str) or not _BURST_ID.fullmatch(burst):
        raise ValidationError(
            f"burst id {burst!r} must be 1-200 characters of letters, digits and _.:@+-"
        )
    return burst


def new_burst_id() -> str:
    """Sortable and unique: UTC time plus 6 random hex digits."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def check_requests(
    requests: Iterable[Request | Mapping[str, Any]],
) -> Sequence[Request | Mapping[str, Any]]:
    """``requests`` as a sequence (a `RequestFile` as it is: checked already, read again chunk
    by chunk), if it is a non-empty iterable of request objects; ValidationError otherwise."""
    if isinstance(requests, str | bytes | Mapping | Request):
        raise ValidationError(
            "submit takes a list (an iterable) of requests, not one "
            f"{type(requests).__name__}: wrap a single request in a list"
        )
    if not isinstance(requests, Iterable):  # an int, an async generator, None
        raise ValidationError(
            f"submit takes a list (an iterable) of requests, not {type(requests).__name__}"
        )
    raw: Sequence[Request | Mapping[str, Any]]
    if isinstance(requests, RequestFile):  # checked already, read again chunk by chunk
        raw = requests
    else:
        raw = list(requests)
        for i, x in enumerate(raw):  # the rest is validated after the head went out
            if not isinstance(x, Mapping | Request):
                raise ValidationError(
                    f"line {i + 1}: expected a JSON object, got {type(x).__name__}"
                )
    if not raw:
        raise ValidationError("the burst is empty")
    return raw


def check_options(
    s: Settings,
    *,
    order: str,
    placement: str | Placer | None,
    on_complete: str | None,
    rq_queue: str | None,
    on_complete_url: str | None,
    progress: Progress | None,
    deadline: float | None,
    metadata: Mapping[str, str] | None,
    priority: str | None,
    tenant: str | None,
) -> dict[str, Any]:
    """The burst record's fields `Producer.asubmit`'s options give (``priority`` and ``tenant``
    falling back to the settings'), once every option is checked; ValidationError otherwise."""
    if order not in ORDERS:
        raise ValidationError(f"order must be one of {', '.join(ORDERS)}, not {order!r}")
    if on_complete is not None:
        if not isinstance(on_complete, str):
            raise ValidationError(
                f"on_complete must look like 'package.module:function', not {on_complete!r}"
            )
        callback_path(on_complete)  # ValidationError unless dotted names around one colon
    if on_complete_url is not None:
        check_url(on_complete_url, "on_complete_url")
    if rq_queue is not None and (not isinstance(rq_queue, str) or not rq_queue.strip()):
        raise ValidationError(f"rq_queue must be an RQ queue name, not {rq_queue!r}")
    meta: dict[str, Any] = {
        "priority": check_priority(s.priority if priority is None else priority),
        "tenant": check_tenant(s.tenant if tenant is None else tenant),
    }
    if deadline is not None:
        if isinstance(deadline, bool) or not isinstance(deadline, int | float):
            raise ValidationError(f"deadline must be epoch seconds, not {deadline!r}")
        if not math.isfinite(deadline):
            raise ValidationError(f"deadline must be finite epoch seconds, not {deadline!r}")
        meta["deadline"] = deadline
    if metadata is not None and not isinstance(metadata, Mapping):
        raise ValidationError(f"metadata must map strings to strings, not {metadata!r}")
    if progress is not None and not callable(progress):
        raise ValidationError(f"progress must be a function (done, total), not {progress!r}")
    if (
        placement is not None
        and not isinstance(placement, str)
        and not callable(getattr(placement, "place", None))
    ):
        raise ValidationError(f"placement must be a name or a Placer, not {placement!r}")
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValidationError("metadata must map strings to strings")
        meta["metadata"] = json.dumps(dict(metadata), ensure_ascii=False)
    if on_complete:
        meta["on_complete"] = on_complete
        meta["rq_queue"] = rq_queue or "default"
    if on_complete_url:
        meta["on_complete_url"] = on_complete_url
    for name, v in meta.items():  # a lone surrogate (os.fsdecode's) cannot be written to Redis
        if isinstance(v, str) and not v.isascii():
            try:
                v.encode()
            except UnicodeEncodeError:
                raise ValidationError(
                    f"{name} holds a lone surrogate, which is not valid Unicode text"
                ) from None
    return meta
