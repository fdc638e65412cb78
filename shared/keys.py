"""Every Redis key, channel, stream, consumer group and TTL, under one prefix.

No other module spells a key. Build one (`settings.redis_keys()`) and pass it around.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

# TTLs (seconds)
STATE_TTL_S = 3600  # request state and id log, after the request finished
LIVE_STATE_TTL_S = 86400  # upper bound while a request is still running
ABORT_TTL_S = 600
# A claimed request id is held while its request may run, then released on finish (aborted
# ones keep it as long as their abort marker, so the rid cannot be reused under a live abort).
RID_CLAIM_TTL_S = LIVE_STATE_TTL_S
HEARTBEAT_TTL_S = 10
HEARTBEAT_EVERY_S = 2.0
# A response's SSE event log lives as long as its request state (replay after re-attach).
EVENTS_TTL_S = STATE_TTL_S

# Streams are trimmed approximately to this many entries (MAXLEN ~).
REQUEST_STREAM_MAXLEN = 100_000

SCHEDULER_GROUP = "schedulers"
# Priority bands, in the order schedulers read them: one request stream each ("" = the
# default stream `req`); a job goes to its priority's band (`band_of`).
PRIORITY_BANDS = ("high", "", "low")
# Results of a weight update are kept this long (seconds) for the api that asked.
WEIGHTS_RESULTS_TTL_S = 3600
# A request's slot in its API key's in-flight set expires this long after its api replica
# last renewed it (a dead replica's slots free themselves).
IN_FLIGHT_LEASE_S = 30

# Dead letters (jobs delivered more than max_deliveries times) are trimmed to this many.
DEAD_LETTER_MAXLEN = 10_000
# ... and the maintenance job drops those older than this (seconds).
DEAD_LETTER_KEEP_S = 7 * 86400

# The jobs tier (arq). A running batch holds its lease, renewed every BATCH_LEASE_S / 4; a
# batch whose lease is gone while it is not finished is run again (workers.maintenance).
BATCH_LEASE_S = 10.0
# A finished batch's record (and its lines' bookkeeping) is kept this long (seconds).
BATCH_KEEP_S = 30 * 86400


@dataclass(frozen=True)
class Keys:
    """Key names. A request's keys and the request stream shard its job goes to share one
    Redis Cluster hash tag (`{...}`, the shard's), so the scripts and transactions that
    touch them run on one slot; `stream_shards` spreads requests over that many slots."""

    prefix: str = "rs"
    stream_shards: int = 1

    # -- streams ---------------------------------------------------------------------------
    @property
    def request_stream(self) -> str:
        """Stream of GenerateJob entries (shard 0, default band); group SCHEDULER_GROUP."""
        return self.request_stream_of("")

    def request_stream_of(self, band: str, shard: int = 0) -> str:
        """The request stream of a priority band (PRIORITY_BANDS) in one stream shard."""
        name = f"{self.prefix}:req:{{{shard_tag(shard, self.stream_shards)}}}"
        return f"{name}:{band}" if band else name

    def shard_streams(self, shard: int) -> list[str]:
        """One shard's request streams, highest priority first."""
        return [self.request_stream_of(band, shard) for band in PRIORITY_BANDS]

    @property
    def request_streams(self) -> list[str]:
        """Every shard's request streams (each shard's highest priority first)."""
        return [s for shard in range(self.stream_shards) for s in self.shard_streams(shard)]

    def shard(self, rid: str) -> int:
        """The stream shard of a request: its job's stream and its keys' hash tag."""
        return shard_of(rid, self.stream_shards)

    def _tagged(self, family: str, rid: str) -> str:
        return f"{self.prefix}:{family}:{{{shard_tag(self.shard(rid), self.stream_shards)}}}:{rid}"

    @property
    def dead_letters(self) -> str:
        """Stream of jobs given up on: the job's fields plus `rid`, `reason`, `deliveries`."""
        return f"{self.prefix}:req:dlq"

    # -- channels --------------------------------------------------------------------------
    def token_channel(self, shard: int) -> str:
        """Scheduler -> detokenizer TokenBatch messages for one shard."""
        return f"{self.prefix}:tok:{shard}"

    def output_channel(self, api_id: str) -> str:
        """Detokenizer -> api TextBatch messages for the api replica that holds the client."""
        return f"{self.prefix}:out:{api_id}"

    @property
    def control_channel(self) -> str:
        """Broadcast ControlMessage (aborts, pause, ...)."""
        return f"{self.prefix}:ctl"

    # -- per-request keys ------------------------------------------------------------------
    def state(self, rid: str) -> str:
        """Hash: status, api_id, worker, epoch, counts, finish_reason, timestamps."""
        return self._tagged("state", rid)

    def ids(self, rid: str) -> str:
        """List of generated token ids (RPUSH per step): the durable output log."""
        return self._tagged("ids", rid)

    def rid_claim(self, rid: str) -> str:
        """String (SET NX): the api replica that claimed `rid`; makes rids unique fleet-wide."""
        return self._tagged("rid", rid)

    def abort(self, rid: str) -> str:
        """Exists while `rid` is aborted (written before any local state is dropped)."""
        return self._tagged("abort", rid)

    def events(self, rid: str) -> str:
        """List of the SSE events a streaming response sent (event id = index), for replay."""
        return self._tagged("events", rid)

    @property
    def stream_layout(self) -> str:
        """String: the fleet's stream shard count, set by the first api or scheduler to start;
        a process started with another count refuses to run (its jobs would be stranded)."""
        return f"{self.prefix}:stream_shards"

    # -- fleet control ---------------------------------------------------------------------
    @property
    def pause(self) -> str:
        """String: the fleet's pause mode (abort | retract | in_place) while paused."""
        return f"{self.prefix}:pause"

    @property
    def weights(self) -> str:
        """Hash: the fleet's target weights (model_path, weight_version, mode); absent = the
        weights each scheduler started with."""
        return f"{self.prefix}:weights"

    def weights_results(self, weight_version: str) -> str:
        """Hash: scheduler id -> "ok" or why loading `weight_version` failed."""
        return f"{self.prefix}:weights:{weight_version}:results"

    @property
    def weights_turn(self) -> str:
        """String (SET NX PX): the one scheduler loading new weights in a rolling update."""
        return f"{self.prefix}:weights:turn"

    def rate_limit(self, client: str) -> str:
        """Hash: one API key's token bucket (tokens, at); tagged like its in-flight set."""
        return f"{self.prefix}:limit:{{{client}}}:bucket"

    def in_flight(self, client: str) -> str:
        """Sorted set: one API key's requests in flight (rid -> expiry, unix time)."""
        return f"{self.prefix}:limit:{{{client}}}:inflight"

    # -- files and batches (OpenAI Files / Batch API; the jobs tier) ---------------------
    def file(self, file_id: str) -> str:
        """Hash: a stored file's record (shared.file_store.FileRecord); content on disk."""
        return f"{self.prefix}:file:{file_id}"

    @property
    def files(self) -> str:
        """Sorted set: every file id by creation time (listing, expiry sweep)."""
        return f"{self.prefix}:files"

    def batch(self, batch_id: str) -> str:
        """Hash: a batch's record (shared.batches.BatchRecord), its counts updated in place."""
        return f"{self.prefix}:batch:{batch_id}"

    @property
    def batches(self) -> str:
        """Sorted set: every batch id by creation time (listing)."""
        return f"{self.prefix}:batches"

    @property
    def active_batches(self) -> str:
        """Set: the batches not yet finished (the maintenance job's recovery looks here)."""
        return f"{self.prefix}:batches:active"

    def batch_lease(self, batch_id: str) -> str:
        """String (SET PX): the jobs worker running a batch, while it runs it."""
        return f"{self.prefix}:batch:{batch_id}:lease"

    def batch_lines(self, batch_id: str) -> str:
        """Hash: custom_id -> rid of a batch's lines sent and not yet written out."""
        return f"{self.prefix}:batch:{batch_id}:lines"

    @property
    def jobs_queue(self) -> str:
        """arq's queue (a sorted set); arq's job ids carry this prefix too."""
        return f"{self.prefix}:arq:queue"

    # -- workers ---------------------------------------------------------------------------
    def heartbeat(self, kind: str, worker_id: str) -> str:
        return f"{self.prefix}:worker:{kind}:{worker_id}"

    def worker_registry(self, kind: str) -> str:
        """Sorted set of the workers of `kind` by last beat (finding them without a SCAN)."""
        return f"{self.prefix}:workers:{kind}"

    def api_requests(self, api_id: str) -> str:
        """Set of the live rids whose client an api replica holds (its orphans if it dies)."""
        return f"{self.prefix}:api:{api_id}:rids"

    def shard_lease(self, shard: int) -> str:
        """String (SET NX PX): the detokenizer that owns token shard `shard` until it expires."""
        return f"{self.prefix}:lease:tok:{shard}"


def band_of(priority: int) -> str:
    """The priority band of a request: above 0 high, below 0 low, else the default."""
    return "high" if priority > 0 else "low" if priority < 0 else ""


def shard_of(rid: str, num_shards: int) -> int:
    """Stable shard of a request id (same answer in every process)."""
    return zlib.crc32(rid.encode()) % max(1, num_shards)


@cache
def shard_tag(shard: int, num_shards: int) -> str:
    """The hash tag of stream shard `shard` of `num_shards`: the first of "0", "0.1", "0.2"...
    whose slot lies in the shard's equal part of the slot range, so a cluster whose nodes
    own equal contiguous ranges (what `redis-cli --cluster create` makes) gets its shards
    spread evenly."""
    size = REDIS_CLUSTER_HASH_SLOTS / max(1, num_shards)
    low, high = int(shard * size), int((shard + 1) * size)
    for n in range(100_000):
        tag = f"{shard}.{n}" if n else str(shard)
        if low <= key_slot(tag.encode()) < high:
            return tag
    raise AssertionError(f"no tag for shard {shard} of {num_shards}")  # never: ~size/16384 hit
