"""What a scheduler times at load, kept on disk so the next start skips the timing.

At load the scheduler times each projection's kernels per step size (layers/tiered.py) and
the attention kernels (layers/attention_tuning.py): seconds to tens of seconds on a small
CPU, paid again by every restart, a crash recovery's included. The choices depend only on
the machine, the software and the model's shapes and settings, so they are stored as one
JSON file per key under `{cache_dir}/tuning/`. The key names everything the timing depends
on: the CPU (model name and flags), the torch version, the checkpoint (its files' names,
sizes and modification times), the source of the tuning code and kernels, and the settings
that shape the model (dtype, KV cache dtype, quantization, threads, block size). A changed
key is another file: the scheduler times again and stores that too. A record that does not
fit the model (another set of kernels) is ignored and overwritten. Schedulers starting
together on one machine (`--scale scheduler=N` over a shared cache, a restart beside a
start) time one at a time under a lock per key: the first times, the others wait and take
its record, rather than all timing at once on shared cores (slower, and noisier choices).

Inductor's compiled graphs and C++ builds (`--enable-torch-compile`) go to
`{cache_dir}/inductor`: Inductor's own cache, keyed by Inductor itself; the C kernels'
builds to `{cache_dir}/kernels` (kernels/c_build.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from workers.scheduler.kernels.c_build import cpu_identity

logger = logging.getLogger(__name__)

# The tuning code and the kernels it times: a change to any of them retunes.
_SOURCES = Path(__file__).parents[1]
_SOURCE_GLOBS = (
    "layers/*.py",
    "kernels/*.py",
    "kernels/csrc/*",
    "engine/model_runner.py",
    "engine/kernel_choices.py",
    "engine/fused_step.py",
)


def tuning_key(model_path: str, settings: dict[str, Any]) -> dict[str, Any]:
    """What the kernel choices depend on, as a JSON-able dict."""
    return {
        "cpu": cpu_identity(),
        "torch": torch.__version__,
        "model": _files_digest(Path(model_path), ("config.json", "*.safetensors")),
        "code": _files_digest(_SOURCES, _SOURCE_GLOBS, content=True),
        **settings,
    }


def _files_digest(folder: Path, globs: tuple[str, ...], content: bool = False) -> str:
    """A digest of the files matching `globs` under `folder`: their names, sizes and
    modification times, or with `content` their bytes."""
    digest = hashlib.sha256()
    for pattern in globs:
        for path in sorted(folder.glob(pattern)):
            if not path.is_file():
                continue
            digest.update(str(path.relative_to(folder)).encode())
            if content:
                digest.update(path.read_bytes())
            else:
                stat = path.stat()
                digest.update(f":{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:24]


class TuningCache:
    """The kernel choices by key, in `directory` (one JSON file per key)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, key: dict[str, Any]) -> Path:
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        return self.directory / f"{name}.json"

    @contextlib.contextmanager
    def timing_alone(self, key: dict[str, Any]) -> Iterator[None]:
        """Holds the key's lock (a flock, let go when its holder exits, however) while the
        caller looks for a record and times one; waits, saying so, while another process
        holds it. A directory that refuses a lock file only costs the wait."""
        path = self.path(key).with_suffix(".lock")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            lock = open(path, "a")  # noqa: SIM115 (held across the yield)
        except OSError as e:
            logger.warning("timing without the lock %s: %r", path, e)
            lock = None
        if lock is None:
            yield
            return
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("another process on this machine is timing these kernels: waiting")
                fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def load(self, key: dict[str, Any]) -> dict[str, Any] | None:
        """The choices stored under `key`, or None (none stored, or unreadable)."""
        path = self.path(key)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            logger.warning("ignoring the unreadable tuning record %s: %r", path, e)
            return None
        if not isinstance(record, dict) or record.get("key") != key:
            return None
        choices: dict[str, Any] = record["choices"]
        return choices

    def save(self, key: dict[str, Any], choices: dict[str, Any]) -> None:
        """Stores `choices` under `key` (written whole or not at all); a disk that refuses
        only costs the next start its timing."""
        path = self.path(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"key": key, "choices": choices}, indent=1))
            tmp.replace(path)
        except OSError as e:
            logger.warning("could not store the kernel choices in %s: %r", path, e)
