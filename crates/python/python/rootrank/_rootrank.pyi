"""Type stubs for the native module (crates/python/src/lib.rs)."""

from __future__ import annotations

from types import TracebackType
from typing import Literal, Mapping, Sequence, TypedDict, Union

AGENT_VERSION: str

class Peer(TypedDict, total=False):
    group: str
    rank: int
    agent: str
    endpoint: str

class Agent:
    """The rank-side agent: liveness and failure records in etcd, never blocking the host."""

    def __init__(
        self,
        group: str,
        rank: int,
        group_size: int,
        *,
        etcd_endpoints: Union[str, Sequence[str], None] = None,
        prefix: str | None = None,
        lease_ttl_ms: int = 5000,
        role: Literal["prefill", "decode"] | None = None,
        retention_s: float = 600.0,
        queue_capacity: int = 10000,
        host: str | None = None,
        nixl_agent: str | None = None,
        gpu: str | None = None,
        endpoints: Sequence[str] | None = None,
        stall_after_ms: int | None = None,
        etcd_cacert: str | None = None,
        etcd_cert: str | None = None,
        etcd_key: str | None = None,
        etcd_user: str | None = None,
        etcd_password_file: str | None = None,
    ) -> None:
        """etcd_* (each defaulting to its ROOTRANK_ETCD_* variable): TLS to https://
        endpoints (the CA, an optional client certificate and key) and etcd's user auth."""
    def record_failure(
        self,
        room: int,
        reason: str,
        detail: str = "",
        *,
        origin: Literal["local", "propagated", "peer_reported"] = "local",
        peer: Peer | Mapping[str, object] | None = None,
    ) -> bool:
        """Enqueue a room failure record; False when the queue was full (dropped)."""
    def progress(self) -> None:
        """One iteration of the rank's loop (v3 stalls): one atomic add, no lock."""
    def record_down(self, reason: str, detail: str = "", *, log_tail: list[str] | None = None) -> bool:
        """Enqueue this incarnation's down certificate (a fatal error)."""
    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait (GIL released) until everything enqueued is in etcd."""
    def wait_registered(self, timeout_s: float = 5.0) -> str | None:
        """Wait (GIL released) for the first registration; the incarnation or None
        (at once when refused: see registration_error)."""
    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Clean exit: shutdown certificate, flush, revoke the lease; bounded by timeout_s."""
    @property
    def incarnation(self) -> str | None: ...
    @property
    def registration_error(self) -> str | None:
        """Why the rank is not registered (another live process holds its live key), or None."""
    @property
    def etcd_error(self) -> str | None:
        """Why etcd refuses this agent (TLS, user or password, a role without the key), or None."""
    @property
    def dropped(self) -> int: ...
    @property
    def rejected(self) -> int: ...
    @property
    def published(self) -> int: ...
    @property
    def stopped(self) -> bool: ...
    @property
    def group(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def group_size(self) -> int: ...
    def __enter__(self) -> Agent: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool: ...

def classify_fatal(traceback: str) -> str:
    """``"peer_lost"`` when a fatal traceback's exception says a peer of the rank's collective
    vanished (a victim, SPEC rule 7), else ``"python_exception"``."""
    ...

def cli(argv: list[str]) -> int:
    """Runs one `rootrank` command line (``argv[0]`` is the program name) in this process and
    returns its exit code (``rootrank.cli.main``, the package's console script)."""
    ...
