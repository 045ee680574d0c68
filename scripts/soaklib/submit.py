"""A burst submitted through the Python API, as a process the soak can kill mid-submit.

``python scripts/soaklib/submit.py FILE BURST PRIORITY TENANT DEADLINE REDIS_URL NAMESPACE``
reads the JSONL request file and calls ``Producer(settings).submit(...)`` with that burst id,
priority and tenant (and ``deadline`` epoch seconds unless DEADLINE is ``-``). Like
``prefixq submit``: the burst id on stdout and exit 0, or the error on stderr and exit 1.
"""

from __future__ import annotations

import json
import sys

from prefixq.client import Producer
from prefixq.core.errors import PrefixqError
from prefixq.core.settings import Settings


def main(argv: list[str]) -> int:
    path, burst, priority, tenant, deadline, url, namespace = argv
    with open(path, encoding="utf-8") as f:
        reqs = [json.loads(line) for line in f if line.strip()]
    settings = Settings.from_env(redis_url=url, namespace=namespace)
    try:
        got = Producer(settings).submit(
            reqs,
            burst_id=burst,
            priority=priority,
            tenant=tenant,
            deadline=None if deadline == "-" else float(deadline),
        )
    except PrefixqError as e:
        print(f"prefixq: error: {e}", file=sys.stderr)
        return 1
    print(got)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
