"""Real services for the Python tests: throwaway etcd processes on random loopback ports and
real `rootrank serve` coordinators. `make test-python` installs the wheel into the venv
that runs these tests (scripts/test-python.sh)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTRANK_BIN = os.environ.get("ROOTRANK_BIN", str(REPO / "target" / "debug" / "rootrank"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except Exception as e:  # the service may not be up yet
            last = e
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


class Etcd:
    """One etcd member with a short election timeout (leases down to 1 s)."""

    def __init__(self, tmp: Path, *extra: str, hosts: tuple = ()):
        self.extra = list(extra)
        self.hosts = hosts  # more addresses to serve clients on (a network namespace's veth)
        self.dir = tmp / f"etcd-{free_port()}"
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.proc = None
        self.start()

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            ["etcd", "--name", "n0", "--data-dir", str(self.dir), "--listen-client-urls",
             ",".join([self.url, *(f"http://{h}:{self.client_port}" for h in self.hosts)]),
             "--advertise-client-urls", self.url, "--listen-peer-urls", peer,
             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"n0={peer}",
             "--heartbeat-interval", "10", "--election-timeout", "100", "--log-level", "warn", *self.extra],
            # Its warnings (slow fdatasync, slow applies) explain leases that expire together.
            stdout=subprocess.DEVNULL, stderr=open(str(self.dir) + ".log", "a"),
        )
        wait_until(lambda: self.get_prefix("/health-probe") == [], 20, "etcd to answer")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def etcdctl(self, *args: str) -> str:
        return subprocess.run(["etcdctl", "--endpoints", self.url, *args], check=True, capture_output=True,
                              text=True, env={**os.environ, "ETCDCTL_API": "3"}, timeout=10).stdout

    def get_prefix(self, prefix: str) -> list:
        out = self.etcdctl("get", "--prefix", prefix, "-w", "json")
        kvs = json.loads(out).get("kvs", [])
        import base64

        return [(base64.b64decode(kv["key"]).decode(), json.loads(base64.b64decode(kv["value"]))) for kv in kvs]


def _json(body: bytes):
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")


class Coordinator:
    def __init__(self, etcd: Etcd, tmp: Path, *extra: str, port: int | None = None):
        # A probed port can be taken before the bind: then the child exits and we retry; ready
        # means this child is listening, never another test's coordinator on the same port.
        # `port`: a restart on the port the last one had (clients reconnect to the same URL).
        for _ in range(5):
            self.port = port or free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.log_path = tmp / f"coordinator-{self.port}.log"
            self.log = open(self.log_path, "w")
            self.proc = subprocess.Popen(
                [ROOTRANK_BIN, "serve", "--etcd-endpoints", etcd.url, "--listen", f"127.0.0.1:{self.port}", *extra],
                stdout=self.log, stderr=subprocess.STDOUT,
            )
            ours = lambda: self.proc.poll() is None and "coordinator listening" in self.log_path.read_text()
            wait_until(lambda: self.proc.poll() is not None or (ours() and self.http("/readyz")[0] == 200),
                       20, "coordinator /readyz")
            if self.proc.poll() is None:
                return
        raise AssertionError(f"coordinator did not start: {self.log_path.read_text()}")

    def http(self, path: str):
        try:
            with urllib.request.urlopen(self.url + path, timeout=40) as r:
                return r.status, _json(r.read())
        except urllib.error.HTTPError as e:
            return e.code, _json(e.read())

    def verdict(self, room: int, group: str | None = None, wait_ms: int = 0) -> dict:
        q = f"?wait_ms={wait_ms}" + (f"&group={group}" if group else "")
        return self.http(f"/v1/rooms/{room}/verdict{q}")[1]

    def rank_state(self, group: str, rank: int) -> str | None:
        status, body = self.http(f"/v1/groups/{group}")
        if status != 200:
            return None
        for r in body["ranks"]:
            if r["rank"] == rank:
                return r["state"]
        return None

    def why(self, room: int, group: str) -> subprocess.CompletedProcess:
        return subprocess.run([ROOTRANK_BIN, "why", str(room), "--group", group, "--coordinator", self.url],
                              capture_output=True, text=True, timeout=30)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def etcd(tmp_path: Path):
    e = Etcd(tmp_path)
    yield e
    e.kill()


@pytest.fixture
def coordinator(etcd: Etcd, tmp_path: Path):
    c = Coordinator(etcd, tmp_path)
    yield c
    c.kill()


def spawn_python(code: str, env: dict, log: Path) -> subprocess.Popen:
    """A Python rank process (this interpreter, the wheel installed)."""
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **env},
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def node_watch_with_py_spy(etcd: Etcd, tmp: Path) -> subprocess.Popen:
    """`rootrank node-watch` on this host, reading stalled ranks' stacks with the py-spy that
    scripts/sglang-venv.sh installs next to this interpreter."""
    py_spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    assert os.access(py_spy, os.X_OK), f"{py_spy}: scripts/sglang-venv.sh installs py-spy"
    return subprocess.Popen([ROOTRANK_BIN, "node-watch", "--etcd-endpoints", etcd.url, "--py-spy", py_spy],
                            stdout=open(tmp / "node-watch.log", "w"), stderr=subprocess.STDOUT)
