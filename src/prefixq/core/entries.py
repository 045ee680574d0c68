"""Stream entries: a `Request` as the short-keyed map one shard's stream carries, and back.

An entry holds the request's own part (``p`` prompt text, ``m`` trailing chat messages, ``t``
token ids, or ``n`` the inputs of an embeddings request, whose options are ``po``) and its shared
prefix either inline (``x``) or by reference (``xr``: the digest of a prefix stored once,
content-addressed, under `Keys.prefix`). A prefix object is ``{"x": text}``,
``{"m": leading messages}`` or ``{"t": token ids}``. Other keys: ``v`` version, ``b`` burst,
``i`` input index, ``id`` request id, ``s`` sampling, ``e`` enqueued (epoch s), ``k`` shard,
``w`` estimated uncached prompt tokens (the placement's load unit), ``pc`` predicted cached tokens,
``dl`` the burst's deadline (epoch s; absent = none), ``u`` the OpenAI url of the line (absent for
a plain line) and ``md`` its body's model (absent when none): both only for the output objects,
as ``eo`` is (what a /v1/responses object echoes of its body); ``rf`` a per-line refusal (the
request runs nothing: its result is that message);
``pr`` the burst's priority and ``tn`` its tenant (absent: ``normal`` and ``default``, so that the
default path's entries carry no extra byte; prefixq.core.sharing); ``a`` the checkpoint hash
that ends the request's shared prefix (8 bytes; absent without one): its prefix group, which moves
between shards whole, and the prefix map's entry that follows it (affinity/handover.py); ``g``
the group's pass key (client/shared_pass.py); ``lk`` instead, for a long prefix no other
request of the burst shares (a lone request: no group), its pass key, which only the worker's
pass window follows (worker/shared_pass.py); ``sa`` the group's shared ancestor, ``[key,
tokens]`` (affinity/ancestors.py: counted once by the worker's KV budget). ``a``, ``g``, ``lk``
and ``sa`` are hints: one malformed is left out, never a refused entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import xxhash

from prefixq.core.errors import WireError
from prefixq.core.records import Request, Result
from prefixq.core.sharing import DEFAULT_PRIORITY, DEFAULT_TENANT, PRIORITIES, valid_tenant

VERSION = 1


def split_prefix(req: Request) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(prefix object or None, the request's own part) for one request."""
    if req.inputs is not None:
        return None, {"n": req.inputs}
    if req.prompt_token_ids is not None:
        own: dict[str, Any] = {"t": req.prompt_token_ids}
        return ({"t": req.prefix} if isinstance(req.prefix, list) else None), own
    if req.messages is not None:
        if len(req.messages) > 1:
            return {"m": req.messages[:-1]}, {"m": req.messages[-1:]}
        return None, {"m": req.messages}
    own = {"p": req.prompt}
    return ({"x": req.prefix} if isinstance(req.prefix, str) and req.prefix else None), own


def prefix_size(prefix: dict[str, Any]) -> int:
    """Characters (or token ids) in a prefix object, to decide whether to store it once."""
    if "x" in prefix:
        return len(prefix["x"])
    if "t" in prefix:
        return len(prefix["t"]) * 4
    return sum(len(m.get("content") or "") for m in prefix["m"])


def digest(packed_prefix: bytes) -> str:
    """Content address of a packed prefix object (128-bit xxh3, hex)."""
    return xxhash.xxh3_128_hexdigest(packed_prefix)


@dataclass(slots=True)
class Entry:
    """A decoded stream entry, checked for shape (never trusted beyond that)."""

    burst: str
    index: int
    id: str
    own: dict[str, Any]
    prefix: dict[str, Any] | None
    prefix_ref: str | None
    sampling: dict[str, Any]
    enqueued: float
    shard: int
    work: int
    predicted_cached: int
    #: epoch seconds after which the request is not admitted any more (None: no deadline)
    deadline: float | None = None
    #: the OpenAI url the request's line named (None for a plain line), for the output objects
    endpoint: str | None = None
    #: the body's ``model`` of an OpenAI line (None if it named none)
    model: str | None = None
    #: what the output object echoes of the body (`Request.echo`)
    echo: dict[str, Any] | None = None
    #: the line's refusal (`Request.refusal`): its result, without running anything
    refusal: str | None = None
    #: the burst's priority (prefixq.core.sharing.PRIORITIES) and tenant
    priority: str = DEFAULT_PRIORITY
    tenant: str = DEFAULT_TENANT
    #: the checkpoint hash that ends the shared prefix (its prefix group), if it has one
    anchor: bytes | None = None
    #: the shared prefix's pass key, the same in every burst (client/shared_pass.py)
    group: int | None = None
    #: a lone request's long prefix's pass key (no group: only the pass window follows it)
    lone_key: int | None = None
    #: the part of the group's prefix other groups share (affinity/ancestors.py): key, tokens
    ancestor: int | None = None
    ancestor_tokens: int = 0
    #: an embeddings request's options (`Request.pooling`)
    pooling: dict[str, Any] | None = None

    @classmethod
    def from_wire(cls, d: Any) -> Entry:
        """Validate the shape of a decoded entry; WireError says what is wrong."""
        if not isinstance(d, dict):
            raise WireError(f"entry is a {type(d).__name__}, not a map")
        if d.get("v") != VERSION:
            raise WireError(f"unsupported entry version {d.get('v')!r}")
        try:
            e = cls(
                burst=_typed(d, "b", str),
                index=_typed(d, "i", int),
                id=_typed(d, "id", str),
                own={k: d[k] for k in ("p", "m", "t", "n") if k in d},
                prefix=d.get("x"),
                prefix_ref=d.get("xr"),
                sampling=d.get("s") or {},
                enqueued=float(d.get("e", 0.0)),
                shard=_count(d, "k"),
                work=_count(d, "w"),
                predicted_cached=_count(d, "pc"),
                deadline=None if d.get("dl") is None else float(d["dl"]),
                endpoint=_optional_str(d, "u"),
                model=_optional_str(d, "md"),
                refusal=_optional_str(d, "rf"),
                pooling=d.get("po"),
            )
        except (TypeError, ValueError, OverflowError) as err:
            raise WireError(f"malformed entry: {err}") from None
        anchor = d.get("a")
        if anchor is not None:  # only a hint for moves: one that is not 8 bytes is no group
            e.anchor = anchor if isinstance(anchor, bytes) and len(anchor) == 8 else None
        group = d.get("g")
        if group is not None:  # a hint too: one that is no 64-bit key is left out
            e.group = group if _u64(group) else None
        lone = d.get("lk")
        if lone is not None and e.group is None:
            e.lone_key = lone if _u64(lone) else None
        sa = d.get("sa")
        if isinstance(sa, list) and len(sa) == 2 and all(_u64(x) for x in sa) and sa[1]:
            e.ancestor, e.ancestor_tokens = sa[0], min(sa[1], _MAX_COUNT)
        pr, tn = d.get("pr"), d.get("tn")  # absent on the default path: nothing to check
        if pr is not None:
            if not isinstance(pr, str) or pr not in PRIORITIES:
                raise WireError(f"entry priority {pr!r} is not one of {', '.join(PRIORITIES)}")
            e.priority = pr
        if tn is not None:
            if not isinstance(tn, str) or not valid_tenant(tn):
                raise WireError(f"entry tenant {str(tn)[:80]!r} is not a tenant name")
            e.tenant = tn
        if not 0 <= e.index < _MAX_COUNT:
            raise WireError(f"entry index {e.index} out of range")
        # the enqueue time names the burst's incarnation (record_result.lua): one that no
        # record can hold would drop the result as another burst's, not dead-letter it
        if not (math.isfinite(e.enqueued) and e.enqueued >= 0):
            raise WireError(f"entry enqueue time {e.enqueued!r} is not a time")
        if e.deadline is not None and math.isnan(e.deadline):
            raise WireError("entry deadline is not a number")
        if len(e.own) != 1:
            raise WireError("entry needs exactly one of p, m, t, n")
        if e.pooling is not None and not isinstance(e.pooling, dict):
            raise WireError("entry pooling options are not a map")
        if not isinstance(e.sampling, dict):
            raise WireError("entry sampling is not a map")
        if e.prefix is not None and not _is_prefix(e.prefix):
            raise WireError("entry prefix is malformed")
        if e.prefix_ref is not None and not isinstance(e.prefix_ref, str):
            raise WireError("entry prefix reference is not a string")
        echo = d.get("eo")
        if echo is not None and not isinstance(echo, dict):
            raise WireError("entry echo is not a map")
        e.echo = echo
        return e

    def result(self, shard: int, worker: str) -> Result:
        """An empty result for this entry's request, as served by ``worker`` of ``shard``."""
        res = Result(
            id=self.id,
            index=self.index,
            shard=shard,
            worker=worker,
            predicted_cached_tokens=self.predicted_cached,
            endpoint=self.endpoint,
            model=self.model,
            echo=self.echo,
        )
        res.timings.enqueued = self.enqueued
        if "n" in self.own:
            res.encoding_format = (self.pooling or {}).get("encoding_format") or "float"
        return res

    def failed(self, shard: int, worker: str, code: str, error: str, now: float) -> Result:
        """This entry's request failed without being served (`Result.failed`, with what the
        entry knows: shard, enqueue time, predicted cache hits, endpoint and model)."""
        res = Result.failed(self.id, self.index, code, error, worker=worker, now=now)
        res.shard, res.timings.enqueued = shard, self.enqueued
        res.predicted_cached_tokens = self.predicted_cached
        res.endpoint, res.model, res.echo = self.endpoint, self.model, self.echo
        return res

    def to_request(self, prefix: dict[str, Any] | None) -> Request:
        """The full request, given the resolved prefix object (inline or fetched)."""
        prefix = prefix if prefix is not None else self.prefix
        if prefix is not None and not _is_prefix(prefix):
            raise WireError("stored prefix is malformed")
        req = Request(
            id=self.id,
            sampling=dict(self.sampling),
            endpoint=self.endpoint,
            model=self.model,
            echo=self.echo,
            refusal=self.refusal,
        )
        ((key, value),) = self.own.items()
        if not isinstance(value, str if key == "p" else list):
            raise WireError(
                f"entry field {key!r} must be {'a string' if key == 'p' else 'a list'}, "
                f"not {type(value).__name__}"
            )
        if prefix is not None and {"t": "t", "m": "m", "p": "x"}.get(key) not in prefix:  # its kind
            raise WireError(f"entry field {key!r} cannot follow a prefix of {next(iter(prefix))!r}")
        if self.pooling is not None and key != "n":
            raise WireError("entry has pooling options but no embeddings input")
        if "n" in self.own:
            req.inputs, req.pooling = list(self.own["n"]), dict(self.pooling or {})
        elif "t" in self.own:
            req.prompt_token_ids = list((prefix or {}).get("t", ())) + list(self.own["t"])
        elif "m" in self.own:
            req.messages = list((prefix or {}).get("m", ())) + list(self.own["m"])
        else:
            req.prompt = str((prefix or {}).get("x", "")) + str(self.own["p"])
        return req


def to_wire(
    req: Request,
    *,
    burst: str,
    index: int,
    shard: int,
    enqueued: float,
    work: int,
    predicted_cached: int,
    prefix: dict[str, Any] | None,
    prefix_ref: str | None,
    own: dict[str, Any],
    deadline: float | None = None,
    priority: str = DEFAULT_PRIORITY,
    tenant: str = DEFAULT_TENANT,
    anchor: bytes | None = None,
    group: int | None = None,
    lone_key: int | None = None,
    ancestor: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The entry map for one request (prefix inline or by reference, never both)."""
    d: dict[str, Any] = {
        "v": VERSION,
        "b": burst,
        "i": index,
        "id": req.id,
        "e": enqueued,
        "k": shard,
        "w": work,
        "pc": predicted_cached,
        **own,  # after the small fields: an entry over a limit is still identified by them
    }
    if req.sampling:
        d["s"] = req.sampling
    if deadline is not None:
        d["dl"] = deadline
    if req.endpoint is not None:
        d["u"] = req.endpoint
    if req.model is not None:
        d["md"] = req.model
    if req.echo:
        d["eo"] = req.echo
    if req.refusal is not None:
        d["rf"] = req.refusal
    if req.pooling:
        d["po"] = req.pooling
    if priority != DEFAULT_PRIORITY:
        d["pr"] = priority
    if tenant != DEFAULT_TENANT:
        d["tn"] = tenant
    if anchor is not None:
        d["a"] = anchor
    if group is not None:
        d["g"] = group
    elif lone_key is not None:
        d["lk"] = lone_key
    if ancestor is not None:
        d["sa"] = list(ancestor)
    if prefix_ref is not None:
        d["xr"] = prefix_ref
    elif prefix is not None:
        d["x"] = prefix
    return d


#: bound on the entry's counters (index, shard, work, predicted cached tokens): they end up in
#: Redis HINCRBY arguments, which must stay within 64 bits even when summed over a batch
_MAX_COUNT = 1 << 40


def _count(d: dict[str, Any], key: str) -> int:
    value = int(d.get(key, 0))
    if not 0 <= value < _MAX_COUNT:
        raise ValueError(f"entry field {key!r}={value} out of range")
    return value


def _u64(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 64


def _typed(d: dict[str, Any], key: str, kind: type) -> Any:
    value = d.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise WireError(f"entry field {key!r} must be {kind.__name__}")
    return value


def _optional_str(d: dict[str, Any], key: str) -> str | None:
    value = d.get(key)
    if value is not None and not isinstance(value, str):
        raise WireError(f"entry field {key!r} must be str")
    return value


def _is_prefix(p: Any) -> bool:
    if not isinstance(p, dict) or len(p) != 1:
        return False
    ((key, value),) = p.items()
    return (key == "x" and isinstance(value, str)) or (
        key in ("m", "t") and isinstance(value, list)
    )
