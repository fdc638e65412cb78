"""The beat of a scheduler that is still loading: its model, then timing kernels, compiling
or recording graphs can take minutes, before its loop (and its own beats) exist. Meanwhile a
thread beats state="loading" with a progress text, the last INFO line the scheduler's
modules logged ("loading model weights ...", "kernel by step size ..."; under a log level
above INFO it stays "starting"), so /health can say why no scheduler is ready yet and
`redserve up` / `redserve status` can show how far it is.

The loop's first beat overwrites it (state "ready"); a load that fails deletes it."""

from __future__ import annotations

import logging
import threading
from types import TracebackType

from shared import heartbeat
from shared.keys import HEARTBEAT_EVERY_S, Keys
from shared.redis_conn import REDIS_FAILURES, connect_sync

logger = logging.getLogger(__name__)

PROGRESS_LOGGER = "workers.scheduler"  # every module of the scheduler logs under it
MAX_PROGRESS_CHARS = 200


class LoadingBeat:
    """`with LoadingBeat(url, keys, worker_id): load()` beats while `load()` runs (`cluster`:
    the URL names a Redis Cluster node)."""

    def __init__(
        self,
        redis_url: str,
        keys: Keys,
        worker_id: str,
        every_s: float = HEARTBEAT_EVERY_S,
        cluster: bool = False,
    ) -> None:
        self.redis_url, self.keys, self.worker_id = redis_url, keys, worker_id
        self.cluster = cluster
        self.every_s = every_s
        self.progress = "starting"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loading-beat", daemon=True)
        self._handler = _ProgressHandler(self)

    def __enter__(self) -> LoadingBeat:
        logging.getLogger(PROGRESS_LOGGER).addHandler(self._handler)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        logging.getLogger(PROGRESS_LOGGER).removeHandler(self._handler)
        self._stop.set()
        self._thread.join(timeout=5)
        if exc_type is not None:  # the load failed: nobody is loading any more
            self._send(forget=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._send(forget=False)
            self._stop.wait(self.every_s)

    def _send(self, forget: bool) -> None:
        try:
            r = connect_sync(self.redis_url, self.cluster)
            try:
                pipe = r.pipeline(transaction=False)
                if forget:
                    heartbeat.forget(pipe, self.keys, self.worker_id, heartbeat.SCHEDULER)
                else:
                    heartbeat.beat(pipe, self.keys, self.worker_id, self.beat())
                pipe.execute()
            finally:
                r.close()
        except REDIS_FAILURES as e:  # Redis away: the next beat tries again
            logger.debug("loading beat failed: %r", e)

    def beat(self) -> heartbeat.SchedulerBeat:
        return heartbeat.SchedulerBeat(
            num_running=0,
            num_waiting=0,
            num_free_blocks=0,
            num_total_blocks=0,
            state="loading",
            progress=self.progress,
        )


class _ProgressHandler(logging.Handler):
    """Makes each INFO (or louder) line of the scheduler's modules the progress text."""

    def __init__(self, beat: LoadingBeat) -> None:
        super().__init__(logging.INFO)
        self._beat = beat

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._beat.progress = record.getMessage()[:MAX_PROGRESS_CHARS]
        except Exception:  # a bad format string must not break the load
            self.handleError(record)
