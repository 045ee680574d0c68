"""Every Redis key prefixq uses, in one place.

Per-shard keys carry the Cluster hash tag ``{s<k>}`` and per-burst keys ``{b<id>}``, so that the
keys one Lua script touches always share a slot. A shard's request queues are its intake streams
(one per priority) and its lanes (one per burst with more than its head there):
prefixq.core.sharing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prefixq.core.sharing import PRIORITIES

#: the consumer group every worker of a shard joins
GROUP = "workers"
#: the one field of a stream entry; its value is a wire-encoded record
FIELD = b"d"
#: field of an entry that `prefixq reclaim` moved off a dead consumer: the deliveries it had
#: before the move, which count towards ``max_attempts`` (store/dead_letters.py)
CARRIED = b"n"
#: field of an intake entry saying that its burst's lane on that shard has new entries (a lane's
#: doorbell: the producer adds it after them; docs/architecture.md)
LANE = b"l"
#: field of every entry of a burst on a shard: its place in the burst's enqueue order there, as
#: b"L:I", the lane entries and the intake entries the producer sent to that shard before it. A
#: worker reads the intake and the lane apart; it admits an entry only after those (worker/
#: scheduler.py, "gated"), whatever order the two streams are read in (client/layout.py).
POS = b"o"


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one namespace."""

    ns: str

    # deployment
    @property
    def config(self) -> str:
        """Hash: shards and block_size, written by the first worker (or producer given shards),
        and the workers' orphan_after_s (the last worker started)."""
        return f"{self.ns}:config"

    @property
    def control(self) -> str:
        """Stream of operator commands to every live worker (worker/control.py)."""
        return f"{self.ns}:control"

    @property
    def control_acks(self) -> str:
        """Hash: ``<command id>:<worker>`` -> the worker's JSON answer."""
        return f"{self.ns}:control:acks"

    # per shard
    def stream(self, shard: int) -> str:
        """The shard's intake stream of priority ``normal`` (consumer group `GROUP`): the heads of
        bursts, lane doorbells, and requeued entries (`intake`)."""
        return f"{self.ns}:{{s{shard}}}:requests"

    def intake(self, shard: int, priority: str) -> str:
        """The shard's intake stream of one priority (consumer group `GROUP`)."""
        if priority == "normal":
            return self.stream(shard)
        return f"{self.ns}:{{s{shard}}}:requests:{priority}"

    def intakes(self, shard: int) -> list[str]:
        """The shard's intake streams, one per priority, highest first."""
        return [self.intake(shard, p) for p in PRIORITIES]

    def streams(self, shard: int, lane_bursts: Iterable[str] = ()) -> list[str]:
        """Every request stream of the shard: its intakes (highest priority first), then the lanes
        of ``lane_bursts`` (the bursts of its lane index, or those a worker knows), sorted."""
        return [*self.intakes(shard), *sorted(self.lane(shard, b) for b in lane_bursts)]

    def lane(self, shard: int, burst: str) -> str:
        """Stream of one burst's entries on one shard after its head (consumer group `GROUP`,
        created by the producer with the stream)."""
        return f"{self.ns}:{{s{shard}}}:lane:{burst}"

    def lanes(self, shard: int) -> str:
        """Hash: burst -> its lane's priority, tenant and sealed flag
        (prefixq.core.sharing.LaneInfo)."""
        return f"{self.ns}:{{s{shard}}}:lanes"

    def enqueued(self, shard: int, burst: str, token: str) -> str:
        """String with TTL: how many entries one submission of ``burst`` (its ``token``) added to
        this shard's streams, so that a pipeline sent again adds none twice (lua/enqueue.lua)."""
        return f"{self.ns}:{{s{shard}}}:enq:{burst}:{token}"

    def dead(self, shard: int) -> str:
        """Stream of dead letters: the original entry plus reason and delivery count."""
        return f"{self.ns}:{{s{shard}}}:dead"

    def workers(self, shard: int) -> str:
        """Sorted set: worker name -> last heartbeat (epoch s)."""
        return f"{self.ns}:{{s{shard}}}:workers"

    def heartbeat(self, shard: int, worker: str) -> str:
        """Hash with TTL: one live worker's state (pid, host, in flight, counters)."""
        return f"{self.ns}:{{s{shard}}}:hb:{worker}"

    def pass_marks(self, shard: int, worker: str) -> str:
        """String: the pass keys of the prefix groups one worker's engine holds, newest last
        (msgpack array, a TTL; worker/shared_pass.py): where a joining burst starts. One per
        worker: several workers of a shard each hold their own (a producer reads those of the
        shard's registered workers, `workers`)."""
        return f"{self.ns}:{{s{shard}}}:pass:{worker}"

    def moving(self, shard: int) -> str:
        """Hash: entries taken off this shard and not yet put on their new shard (``<stream>\n<id>``
        -> msgpack [target shard, fields]); a mover that dies leaves its plan here for the next
        (store/entry_moves.py)."""
        return f"{self.ns}:{{s{shard}}}:moving"

    def moved_in(self, shard: int) -> str:
        """Set with TTL: the entries moved onto this shard (``<source>\n<stream>\n<id>``), so that
        a retried move adds none twice (store/entry_moves.py)."""
        return f"{self.ns}:{{s{shard}}}:movedin"

    def mover(self, shard: int) -> str:
        """String with TTL: the lease of the one process moving this shard's queue away
        (worker/fleet.py, `prefixq handover`)."""
        return f"{self.ns}:{{s{shard}}}:mover"

    def history(self, shard: int) -> str:
        """Stream, capped: the shard's rolling history, one sample per worker every
        ``history_every_s`` (worker/history.py; the dashboard draws it)."""
        return f"{self.ns}:{{s{shard}}}:history"

    # placement
    @property
    def load(self) -> str:
        """Hash: shard -> estimated outstanding prefill tokens (producers add, workers subtract)."""
        return f"{self.ns}:load"

    @property
    def prefix_map(self) -> str:
        """Hash: prefix checkpoint hash (8 bytes) -> shard; the map's current generation, every
        checkpoint claimed or used is written here (lua/claim_prefixes.lua)."""
        return f"{self.ns}:{{pmap}}"

    @property
    def prefix_map_old(self) -> str:
        """Hash: the prefix map's previous generation (same slot), read where `prefix_map` has
        no entry and dropped whole when `prefix_map` fills half of ``map_max_entries``."""
        return f"{self.ns}:{{pmap}}:old"

    @property
    def pass_order(self) -> str:
        """Hash: a prefix group's pass key -> its place in the corpus order (first submitted
        first; field ``n``: the next place), with a TTL (client/shared_pass.py)."""
        return f"{self.ns}:pass-order"

    @property
    def pass_shards(self) -> str:
        """Hash: a prefix group's pass key -> the shard the last burst that asked about it
        placed it on, with a TTL: which shard's pass a later burst's group follows
        (client/shared_pass.py)."""
        return f"{self.ns}:pass-shards"

    @property
    def moves(self) -> str:
        """Stream: one entry per prefix group moved: by the load guard at placement (``why``
        absent), or queued entries moved off a shard (``why``: orphaned, steal, drain, operator)."""
        return f"{self.ns}:moves"

    @property
    def move_totals(self) -> str:
        """Hash: the moves stream's totals since the namespace began, ``<why>:groups``,
        ``<why>:requests``, ``<why>:tokens`` (store/move_log.py), read without the stream."""
        return f"{self.ns}:moves:totals"

    # the fleet: which shards have a live worker (one slot, hash tag {fleet}: store/liveness.py)
    @property
    def live(self) -> str:
        """Hash: shard -> the last heartbeat of any of its workers (epoch s): which shards have a
        live worker, for placement and the movers in one read."""
        return f"{self.ns}:{{fleet}}:live"

    @property
    def tasks(self) -> str:
        """Hash: shard -> what its workers serve (``generate``, ``embed``: `Settings.task`),
        written by each worker as it starts and beats; a shard without a field serves generate.
        Placement puts a burst only on shards that serve its task."""
        return f"{self.ns}:{{fleet}}:tasks"

    @property
    def orphans(self) -> str:
        """Hash: shard -> when a live worker first saw it without one (epoch s); cleared by the
        shard's next heartbeat."""
        return f"{self.ns}:{{fleet}}:orphans"

    @property
    def joins(self) -> str:
        """Hash: shard -> until when a joining worker holds it while its engine starts (epoch s;
        `prefixq worker --join`, store/deployment.py); cleared by the shard's next heartbeat, or by
        the joiner as it exits before one."""
        return f"{self.ns}:{{fleet}}:joins"

    @property
    def shard_stats(self) -> str:
        """Hash: per-shard token counters (``<k>:prompt``, ``<k>:cached``, ``<k>:predicted``)."""
        return f"{self.ns}:shardstats"

    def prefix(self, digest: str) -> str:
        """String with TTL: a shared prefix stored once, content-addressed."""
        return f"{self.ns}:prefix:{digest}"

    # bursts
    @property
    def bursts(self) -> str:
        """Sorted set: burst id -> created (epoch s)."""
        return f"{self.ns}:bursts"

    def burst(self, burst: str) -> str:
        """Hash: a burst's record and progress counters."""
        return f"{self.ns}:{{b{burst}}}:meta"

    def results(self, burst: str) -> str:
        """Hash: input index -> wire-encoded result (written once per index)."""
        return f"{self.ns}:{{b{burst}}}:results"

    def ids(self, burst: str) -> str:
        """List: the burst's request ids in input order (cancel and expiry fill their results);
        written whole with the burst's record (lua/create_burst.lua renames `staged_ids` to it)."""
        return f"{self.ns}:{{b{burst}}}:ids"

    def staged_ids(self, burst: str, token: str) -> str:
        """List with TTL: one submission's request ids before its burst's record exists (its
        ``token`` tells two producers of one burst id apart); lua/create_burst.lua renames it to
        `ids` when it creates the record, or deletes it."""
        return f"{self.ns}:{{b{burst}}}:ids:{token}"

    @property
    def deadlines(self) -> str:
        """Sorted set: burst id -> deadline (epoch s), for bursts submitted with one; written just
        before the burst's record, in its create's round trip. The record's ``deadline`` is the
        truth: an entry is when to look (store/burst_end.expire_due)."""
        return f"{self.ns}:deadlines"

    @property
    def cancels(self) -> str:
        """Stream: one entry ``{b: burst}`` per cancelled burst, read by every worker."""
        return f"{self.ns}:cancels"

    def events(self, burst: str) -> str:
        """Stream: one entry per finished request, for waiters (capped)."""
        return f"{self.ns}:{{b{burst}}}:events"

    # replication fences (store/fence.py)
    def fence(self, tag: int) -> str:
        """String with a short TTL: what `min_replicas_acked`'s WAIT follows on one master; the
        hash tag ``{f<tag>}`` picks the master (store/fence.py finds a tag for each)."""
        return f"{self.ns}:{{f{tag}}}:fence"

    # OpenAI Batch API server (prefixq/openai/): one Cluster slot, hash tag {oai}, per namespace
    @property
    def oai_files(self) -> str:
        """Sorted set: file id -> created (epoch ms), for listing files."""
        return f"{self.ns}:{{oai}}:files"

    def oai_file_gone(self, file_id: str) -> str:
        """String with TTL: a removed file's created (epoch ms), so that a list's ``after`` cursor
        naming it still pages (openai/pages.py; a client deleting what it lists)."""
        return f"{self.ns}:{{oai}}:file-gone:{file_id}"

    @property
    def oai_files_volume(self) -> str:
        """String: the token of the files directory the namespace's servers share (its
        ``.volume-<namespace>`` file holds the same: openai/files_volume.py)."""
        return f"{self.ns}:{{oai}}:files-volume"

    def oai_file(self, file_id: str) -> str:
        """Hash: one file's object (id, bytes, lines, created_at, filename, purpose, and
        expires_at when it has one)."""
        return f"{self.ns}:{{oai}}:file:{file_id}"

    @property
    def oai_expiring(self) -> str:
        """Sorted set: file id -> expires_at (epoch s), for files that expire (openai/expiry.py)."""
        return f"{self.ns}:{{oai}}:expiring"

    @property
    def oai_batches(self) -> str:
        """Sorted set: batch id -> created (epoch ms), for listing batches."""
        return f"{self.ns}:{{oai}}:batches"

    def oai_batch(self, batch_id: str) -> str:
        """Hash: one batch's record (status, timestamps, burst, file ids, errors, counts)."""
        return f"{self.ns}:{{oai}}:batch:{batch_id}"

    @property
    def oai_open(self) -> str:
        """Set: batches not yet in a final status, watched by every server's finalizer."""
        return f"{self.ns}:{{oai}}:open"

    def oai_lease(self, batch_id: str) -> str:
        """String with TTL: the token of the server validating or finalizing the batch."""
        return f"{self.ns}:{{oai}}:lease:{batch_id}"

    # webhook outbox (store/webhook_outbox.py): the same {oai} slot, so that a batch's final status
    # and its deliveries are written by one script
    @property
    def hooks(self) -> str:
        """Hash: delivery id (``webhook-id``) -> JSON (url, body, first, attempts, last error)."""
        return f"{self.ns}:{{oai}}:hooks"

    @property
    def hooks_due(self) -> str:
        """Sorted set: delivery id -> when its next attempt is due (epoch ms); a claimed delivery
        is pushed past its attempt, so another deliverer takes it only if this one died."""
        return f"{self.ns}:{{oai}}:hooks:due"

    def hook_seen(self, delivery_id: str) -> str:
        """String with TTL: a burst's delivery was queued once (its id is derived from the burst,
        so every process that sees the burst end may try)."""
        return f"{self.ns}:{{oai}}:hooks:seen:{delivery_id}"

    @property
    def hook_bursts(self) -> str:
        """Sorted set: burst with an ``on_complete_url`` -> when submitted (epoch s): written by
        the producer before the burst, so a deliverer queues its event when it ends even if the
        process that ended it died first; removed once queued."""
        return f"{self.ns}:{{oai}}:hooks:bursts"

    @property
    def hooks_stats(self) -> str:
        """Hash: ``delivered``, ``retried``, ``gave_up``: counters since the namespace began."""
        return f"{self.ns}:{{oai}}:hooks:stats"
