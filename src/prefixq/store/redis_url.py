"""A REDIS_URL read before any client is made: its seed nodes, its options checked, its secrets
hidden.

TLS (``rediss://``) and ACL credentials come from the URL
(``rediss://user:password@host:port/db?ssl_ca_certs=/path/ca.crt``); redis-py reads the ``ssl_*``
options from the query string, and `check_url` makes an unknown option or a missing certificate
file a `ConfigError` at once. A URL may list several seed nodes of a Redis Cluster, for when one
is down: ``redis://user:pw@h1:7000,h2:7001,h3:7002/0`` (`seeds`, `seed_url`). `redact` is the
URL as logs and errors print it.
"""

from __future__ import annotations

import os
import re
from urllib.parse import parse_qs, urlsplit

from redis.connection import URL_QUERY_ARGUMENT_PARSERS

from prefixq.core.errors import ConfigError

#: query options a REDIS_URL may carry besides redis-py's typed ones (all ``ssl_*`` need rediss://)
_SSL_OPTIONS = frozenset(
    {
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_ca_data",
        "ssl_cert_reqs",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password",
        "ssl_ciphers",
        "ssl_check_hostname",
        "ssl_min_version",
        "ssl_include_verify_flags",
        "ssl_exclude_verify_flags",
    }
)
_FILE_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def seeds(url: str) -> list[tuple[str, int]]:
    """The (host, port) seed nodes a REDIS_URL names: one, or several separated by commas
    (``redis://user:pw@h1:7000,h2:7001/0``); [] for a unix socket."""
    scheme, sep, rest = url.partition("://")
    if scheme.lower() == "unix":
        return []
    if not sep or scheme.lower() not in ("redis", "rediss"):
        raise ConfigError(
            f"REDIS_URL {redact(url)!r} is not a Redis URL: redis://host:port/db, "
            "rediss://host:port/db (TLS) or unix:///path/to/redis.sock"
        )
    netloc = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    hosts = netloc.rpartition("@")[2]
    out = []
    for one in hosts.split(","):
        parts = urlsplit(f"{scheme}://{one}")
        try:
            port = parts.port or 6379
        except ValueError:
            raise ConfigError(f"REDIS_URL seed {one!r} has a bad port") from None
        if not parts.hostname:
            where = f"seed {one!r}" if one else "URL"
            raise ConfigError(f"REDIS_URL {where} names no host: {redact(url)!r}")
        out.append((parts.hostname, port))
    return out


def seed_url(url: str, index: int = 0) -> str:
    """``url`` naming only its ``index``-th seed node (credentials, database and options kept)."""
    if "," not in url:
        return url
    scheme, _, rest = url.partition("://")
    netloc, sep, tail = rest.partition("/")
    if not sep:
        netloc, sep, tail = rest.partition("?")
    cred, at, hosts = netloc.rpartition("@")
    host = hosts.split(",")[index]
    return f"{scheme}://{cred}{at}{host}{sep}{tail}"


def check_url(url: str) -> None:
    """ConfigError for a REDIS_URL option redis-py would reject late (at the first command) or
    a certificate file that does not exist."""
    multi = "," in url.partition("://")[2].split("/", 1)[0]
    if multi:
        seeds(url)  # each seed parses
        url = seed_url(url)
    parts = urlsplit(url)
    db = parts.path.strip("/")
    if parts.scheme in ("redis", "rediss") and db and not db.isdigit():
        # redis-py ignores a database it cannot read as a number: db 0, someone else's data
        raise ConfigError(f"REDIS_URL database {db!r} is not a number (redis://host:port/0)")
    if multi and db not in ("", "0"):
        raise ConfigError(
            f"REDIS_URL lists several seed nodes (a Redis Cluster) but names database {db}: a "
            "cluster has database 0 only (end the URL with /0)"
        )
    known = set(URL_QUERY_ARGUMENT_PARSERS) | _SSL_OPTIONS | {"client_name"}
    for name, values in parse_qs(parts.query).items():
        if name not in known:
            raise ConfigError(
                f"REDIS_URL option {name!r} is unknown (known: {', '.join(sorted(known))})"
            )
        if name.startswith("ssl_") and parts.scheme != "rediss":
            raise ConfigError(f"REDIS_URL option {name!r} needs a rediss:// (TLS) URL")
        if name in _FILE_OPTIONS and not os.path.isfile(values[-1]):
            raise ConfigError(f"REDIS_URL option {name}={values[-1]!r}: no such file")


#: query options of a REDIS_URL whose value is a secret (the TLS key file's password)
_SECRET_OPTION = re.compile(r"([?&](?:ssl_)?password=)[^&#]*", re.IGNORECASE)


def redact(url: str) -> str:
    """The URL with any password (its own, or ``ssl_password=``) replaced by ***."""
    url = _SECRET_OPTION.sub(r"\1***", url)
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    cred, _, host = rest.rpartition("@")
    user = cred.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in cred else f"{scheme}://{user}@{host}"
