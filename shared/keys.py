"""Every Redis key, channel, stream, consumer group and TTL, under one prefix.

No other module spells a key. Build one `Keys(settings.key_prefix)` and pass it around.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

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
# Dead letters (jobs delivered more than max_deliveries times) are trimmed to this many.
DEAD_LETTER_MAXLEN = 10_000


@dataclass(frozen=True)
class Keys:
    prefix: str = "rs"

    # -- streams ---------------------------------------------------------------------------
    @property
    def request_stream(self) -> str:
        """Stream of GenerateJob entries; consumer group SCHEDULER_GROUP."""
        return f"{self.prefix}:req"

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
        return f"{self.prefix}:state:{rid}"

    def ids(self, rid: str) -> str:
        """List of generated token ids (RPUSH per step): the durable output log."""
        return f"{self.prefix}:ids:{rid}"

    def rid_claim(self, rid: str) -> str:
        """String (SET NX): the api replica that claimed `rid`; makes rids unique fleet-wide."""
        return f"{self.prefix}:rid:{rid}"

    def abort(self, rid: str) -> str:
        """Exists while `rid` is aborted (written before any local state is dropped)."""
        return f"{self.prefix}:abort:{rid}"

    def events(self, rid: str) -> str:
        """List of the SSE events a streaming response sent (event id = index), for replay."""
        return f"{self.prefix}:events:{rid}"

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


def shard_of(rid: str, num_shards: int) -> int:
    """Stable shard of a request id (same answer in every process)."""
    return zlib.crc32(rid.encode()) % max(1, num_shards)
