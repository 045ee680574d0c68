"""The files directory every server of a namespace shares (docs/operations.md, "Several serve
replicas"): a server whose ``files_dir`` is not the one the others write to refuses to start,
where it would otherwise answer 404 for every file uploaded or written through another replica.

File contents live on disk and their objects in Redis (openai/files.py), so replicas must share one
directory (a ReadWriteMany volume). The first server of a namespace writes a random token into
``<files_dir>/.volume-<namespace>`` (beside the namespaces' folders, never among the files) and
records it in Redis (`Keys.oai_files_volume`, SET NX);
every later server compares the two. The same token: it sees the shared directory. A directory
without the file, or with another token: not the shared one (a replica given a local directory,
or a volume replaced while Redis kept the files' objects). The file is made under a temporary
name and linked into place, so two servers starting at once on one fresh volume agree on it.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

import redis

from prefixq.core.errors import ConfigError
from prefixq.core.keys import Keys

__all__ = ["MARKER", "claim_volume"]

log = logging.getLogger(__name__)

#: the token's file in ``files_dir``: MARKER + the namespace
MARKER = ".volume-"


def _token(marker: Path) -> str:
    """The token ``marker`` holds, else a new one written there (created whole: a temporary
    file hard-linked into place, which fails if another server won)."""
    if not marker.exists():
        tmp = marker.with_name(f".new-{secrets.token_hex(8)}{marker.name}")
        tmp.write_text(secrets.token_hex(16) + "\n")
        try:
            os.link(tmp, marker)
        except FileExistsError:
            pass  # another server made it first: read theirs
        finally:
            tmp.unlink(missing_ok=True)
    return marker.read_text().strip()


def claim_volume(r: redis.Redis, keys: Keys, root: Path) -> str:
    """Check that ``root`` (``files_dir``) is the files directory the other servers of ``keys``'
    namespace use (recording it when this is the namespace's first server); returns its token.
    ConfigError (exit 2) when it is not."""
    root.mkdir(parents=True, exist_ok=True)
    marker = root / f"{MARKER}{keys.ns}"
    token = _token(marker)
    if r.set(keys.oai_files_volume, token, nx=True):
        log.info("files directory %s recorded as the one the servers of %s share", root, keys.ns)
        return token
    raw = r.get(keys.oai_files_volume)
    recorded = raw.decode() if isinstance(raw, bytes) else str(raw)
    if recorded != token:
        raise ConfigError(
            f"files_dir {str(root)!r} is not the files directory the other servers of "
            f"namespace {keys.ns!r} use ({marker} says {token[:8]}..., Redis "
            f"{recorded[:8]}...): give every server one shared directory (a ReadWriteMany volume); "
            f"if the old directory is lost for good, delete the Redis key {keys.oai_files_volume} "
            "(the files listed there are gone with it) and start again"
        )
    return token
