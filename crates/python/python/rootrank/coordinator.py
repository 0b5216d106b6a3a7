"""A client for the coordinator's HTTP API (SPEC section 6), with replica failover.

Standard library only (``http.client``), so a rank process gains no dependency. One
keep-alive connection per replica; a replica that refuses, resets, times out or answers 503
is skipped for the next one, and the last replica that answered is tried first next time.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from rootrank.errors import CoordinatorError, CoordinatorUnavailable, InvalidInput, NotFound

MAX_WAIT_MS = 30_000
# Added to a long poll's wait for the network and the server's own answer.
_SLACK_S = 2.0


def _parse_urls(urls: Union[str, Sequence[str], None]) -> List[str]:
    if urls is None:
        urls = os.environ.get("ROOTRANK_COORDINATOR", "")
    if isinstance(urls, str):
        urls = urls.split(",")
    out = []
    for u in urls:
        u = str(u).strip().rstrip("/")
        if not u:
            continue
        if "://" not in u:
            u = "http://" + u
        parsed = urllib.parse.urlsplit(u)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise InvalidInput(f"coordinator URL {u!r} must look like http://host:port or https://host:port")
        out.append(u)
    if not out:
        raise InvalidInput(
            "no coordinator URL: pass urls= or set ROOTRANK_COORDINATOR (e.g. http://rootrank:9750)"
        )
    return out


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


class _Resolution:
    def __init__(self, previous: Optional[str]):
        self.address = previous  # the last answer, served while a refresh runs
        self.error: Optional[str] = None
        self.done = threading.Event()
        self.at = time.monotonic()


class _Resolver:
    """Hostnames resolved on a helper thread. ``getaddrinfo`` takes no timeout, so a caller
    that resolved inline could wait on a slow resolver for as long as it takes; here it waits
    at most its own timeout (a scheduler thread: its verdict budget), and a known answer is
    served at once while it is refreshed every ``REFRESH_S``."""

    REFRESH_S = 30.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: Dict[Tuple[str, int], _Resolution] = {}

    def address(self, host: str, port: int, timeout_s: float) -> str:
        if _is_ip(host):
            return host
        key = (host, port)
        with self._lock:
            r = self._known.get(key)
            if r is None or (r.done.is_set() and (r.address is None or time.monotonic() - r.at > self.REFRESH_S)):
                r = _Resolution(r.address if r is not None else None)
                self._known[key] = r
                threading.Thread(target=self._resolve, args=(key, r), name="rootrank-resolve", daemon=True).start()
        if r.address is not None:
            return r.address
        r.done.wait(max(0.0, timeout_s))
        if r.address is not None:
            return r.address
        raise OSError(r.error or f"resolving {host} took over {timeout_s:.3f} s (still resolving in the background)")

    @staticmethod
    def _resolve(key: Tuple[str, int], r: _Resolution) -> None:
        try:
            infos = socket.getaddrinfo(key[0], key[1], type=socket.SOCK_STREAM)
            r.address = str(infos[0][4][0])
            r.error = None
        except (OSError, IndexError) as e:
            r.error = f"cannot resolve {key[0]}: {e}"
        r.at = time.monotonic()
        r.done.set()


_resolver = _Resolver()


class _HTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to an address resolved beforehand (within the timeout, see _Resolver), with the
    certificate checked against the URL's host name."""

    def __init__(self, host: str, address: str, port: int, *, timeout: float, context: ssl.SSLContext):
        super().__init__(host, port, timeout=timeout, context=context)
        self._address = address
        self._tls = context

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._tls.wrap_socket(sock, server_hostname=self.host)


def _read_token(path: str) -> str:
    try:
        with open(path, "rb") as f:
            first = f.read(8192).decode("utf-8", "replace").splitlines()
    except OSError as e:
        raise InvalidInput(f"cannot read the coordinator token file {path}: {e}") from e
    token = first[0].strip() if first else ""
    if not token:
        raise InvalidInput(f"the coordinator token file {path} is empty: put the token on its first line")
    return token


class _Auth:
    """What every request to the coordinators carries: the bearer token, and the CA that
    signs their HTTPS certificates."""

    def __init__(self, token_file: Optional[str], cacert: Optional[str]):
        token_file = token_file or os.environ.get("ROOTRANK_TOKEN_FILE") or None
        cacert = cacert or os.environ.get("ROOTRANK_CACERT") or None
        self.headers: Dict[str, str] = {}
        if token_file:
            self.headers["Authorization"] = "Bearer " + _read_token(token_file)
        try:
            self.context = ssl.create_default_context(cafile=cacert)
        except (OSError, ssl.SSLError) as e:
            raise InvalidInput(f"cannot use the CA bundle {cacert}: {e}") from e

    def connection(self, replica: "_Replica", address: str, timeout_s: float) -> http.client.HTTPConnection:
        if replica.scheme == "https":
            return _HTTPSConnection(replica.host, address, replica.port, timeout=timeout_s, context=self.context)
        return http.client.HTTPConnection(address, replica.port, timeout=timeout_s)


class _Replica:
    def __init__(self, url: str, auth: _Auth):
        self.url = url
        parsed = urllib.parse.urlsplit(url)
        self.scheme = parsed.scheme
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self.base = parsed.path.rstrip("/")
        self.auth = auth
        self.conn: Optional[http.client.HTTPConnection] = None

    def request(self, path: str, timeout_s: float) -> tuple:
        deadline = time.monotonic() + timeout_s
        reused = self.conn is not None
        try:
            return self._request_once(path, timeout_s)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            # A kept-alive connection the server closed while it sat idle (the coordinator
            # ends idle connections after --header-timeout-ms): GET is idempotent, so one
            # more try on a fresh connection, within what is left of the same timeout.
            left = deadline - time.monotonic()
            if not reused or left <= 0:
                raise
            return self._request_once(path, left)

    def _request_once(self, path: str, timeout_s: float) -> tuple:
        if self.conn is None:
            # DNS within the timeout too (see _Resolver); the connect is bounded by it.
            started = time.monotonic()
            address = _resolver.address(self.host, self.port, timeout_s)
            timeout_s = max(0.001, timeout_s - (time.monotonic() - started))
            self.conn = self.auth.connection(self, address, timeout_s)
        else:
            self.conn.timeout = timeout_s
            if self.conn.sock is not None:
                self.conn.sock.settimeout(timeout_s)
        try:
            self.conn.request("GET", self.base + path, headers={"Accept": "application/json", **self.auth.headers})
            resp = self.conn.getresponse()
            body = resp.read()
            return resp.status, body
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            finally:
                self.conn = None


class Coordinator:
    """Asks rootrank coordinators (one URL, or several replicas: a comma-separated string or
    a list; default ``ROOTRANK_COORDINATOR``). Replicas are tried in turn on connection
    errors and 503s; every replica answers the same (verdicts are a function of etcd state).
    A coordinator run with ``--auth-token-file`` wants its token: ``token_file`` (default
    ``ROOTRANK_TOKEN_FILE``); HTTPS replicas are verified against ``cacert`` (default
    ``ROOTRANK_CACERT``, else the system's CAs). Thread-safe."""

    def __init__(
        self,
        urls: Union[str, Sequence[str], None] = None,
        *,
        timeout_s: float = 5.0,
        token_file: Optional[str] = None,
        cacert: Optional[str] = None,
    ):
        auth = _Auth(token_file, cacert)
        self._replicas = [_Replica(u, auth) for u in _parse_urls(urls)]
        self._timeout_s = float(timeout_s)
        self._preferred = 0
        self._lock = threading.Lock()

    @property
    def urls(self) -> List[str]:
        return [r.url for r in self._replicas]

    def verdict(
        self,
        room: int,
        *,
        group: Optional[str] = None,
        wait_ms: int = 0,
        view: Optional[str] = None,
        asking_rank: Optional[int] = None,
        min_revision: Optional[int] = None,
        timeout_s: Optional[float] = None,
    ) -> Dict[str, Any]:
        """The verdict for ``room`` (SPEC section 5), restricted to ``group`` if given. With
        ``wait_ms`` (0..=30000) the coordinator answers as soon as the verdict resolves.
        ``timeout_s`` bounds the whole call, failover included (default: wait + 2 s).

        Its ``retry`` says whether the failed request may be sent elsewhere and where not
        (docs/contract.md, "Retry advice")::

            v = coordinator.verdict(room, wait_ms=500, view="compact")
            if v["retry"]["safe"]:
                avoid = {e for a in v["retry"]["avoid"] for e in a["endpoints"]}
                # send it to a prefill instance whose bootstrap host:port is not in ``avoid``
        """
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= 2**63 - 1:
            raise InvalidInput(f"room {room!r} must be an integer in 0..=2^63-1")
        if isinstance(wait_ms, bool) or not isinstance(wait_ms, int) or not 0 <= wait_ms <= MAX_WAIT_MS:
            raise InvalidInput(f"wait_ms {wait_ms!r} must be an integer in 0..={MAX_WAIT_MS}")
        query = {}
        if group is not None:
            query["group"] = group
        if wait_ms:
            query["wait_ms"] = str(wait_ms)
        if view is not None:
            query["view"] = view
        if asking_rank is not None:
            query["asking_rank"] = str(asking_rank)
        if min_revision is not None:
            query["min_revision"] = str(min_revision)
        path = f"/v1/rooms/{room}/verdict"
        if query:
            path += "?" + urllib.parse.urlencode(query)
        if timeout_s is None:
            timeout_s = wait_ms / 1000.0 + _SLACK_S
        return self._get(path, timeout_s)

    def groups(self) -> List[Dict[str, Any]]:
        """Every group: size, live, down, missing, role."""
        return self._get("/v1/groups", self._timeout_s)["groups"]

    def group(self, name: str) -> Dict[str, Any]:
        """One group's ranks: state, host, pid, incarnation, since, last failure."""
        return self._get("/v1/groups/" + urllib.parse.quote(name, safe=""), self._timeout_s)

    def failures(self, *, group: Optional[str] = None, limit: Optional[int] = None) -> List[Dict[str, Any]]:
        """Recent root causes, newest first."""
        query = {}
        if group is not None:
            query["group"] = group
        if limit is not None:
            query["limit"] = str(limit)
        path = "/v1/failures" + ("?" + urllib.parse.urlencode(query) if query else "")
        body = self._get(path, self._timeout_s)
        return body["failures"] if isinstance(body, dict) and "failures" in body else body

    def health(self, groups: Union[str, Sequence[str]]) -> Dict[str, Any]:
        """``GET /v1/health`` (v3): ``{"healthy": True}`` when every rank of ``groups`` (one
        name or several: an SGLang instance is one group per DP replica and role) is live and
        advancing, else ``{"healthy": False, "ranks": [...]}`` naming the ranks that are
        down, missing or stalled, and why."""
        names = [groups] if isinstance(groups, str) else list(groups)
        if not names:
            raise InvalidInput("health() needs at least one group")
        path = "/v1/health?" + urllib.parse.urlencode([("group", g) for g in names])
        return self._get(path, self._timeout_s, answers=(200, 503), healthy_503=True)

    def events(
        self,
        since: Optional[int] = None,
        group: Optional[str] = None,
        *,
        idle_timeout_s: float = 45.0,
        stop: Optional[threading.Event] = None,
    ) -> Iterator[Dict[str, Any]]:
        """Follows ``GET /v1/events`` (v3): yields each event (a dict with ``"event"``:
        ``"rank"`` or ``"resolved"``, and ``"revision"``) from after revision ``since`` (from
        now with ``None``). Reconnects on its own, to the next replica too, resuming after the
        last revision it yielded; a coordinator that no longer has that revision answers 410
        and this raises :class:`CoordinatorError` with ``code == "compacted"`` (reload with
        :meth:`groups`, whose answer carries ``revision``, then call again with it). Ends
        when ``stop`` is set (checked at least every ``idle_timeout_s``; the coordinator sends
        a keep-alive every 15 s)."""
        last = since
        pause = 0.2
        i = self._preferred
        while stop is None or not stop.is_set():
            replica = self._replicas[i % len(self._replicas)]
            query = []
            if last is not None:
                query.append(("since", str(last)))
            if group is not None:
                query.append(("group", group))
            path = replica.base + "/v1/events" + ("?" + urllib.parse.urlencode(query) if query else "")
            conn: Optional[http.client.HTTPConnection] = None
            try:
                address = _resolver.address(replica.host, replica.port, idle_timeout_s)
                conn = replica.auth.connection(replica, address, idle_timeout_s)
                conn.request("GET", path, headers={"Accept": "text/event-stream", **replica.auth.headers})
                resp = conn.getresponse()
                if resp.status != 200:
                    err = _error_from(replica.url, resp.status, resp.read())
                    if resp.status in (400, 401, 404, 410):
                        raise err
                    raise OSError(str(err))
                pause = 0.2
                data: List[str] = []
                event_id: Optional[str] = None
                while stop is None or not stop.is_set():
                    raw = resp.fp.readline(1 << 20)
                    if not raw:
                        break  # the server ended the stream: resume
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    if line == "":
                        if event_id is not None and event_id.isdigit():
                            # An id with no data (the stream's first line) is where it starts.
                            last = int(event_id)
                        if data:
                            body = "\n".join(data)
                            data = []
                            try:
                                ev = json.loads(body)
                            except ValueError:
                                continue
                            if isinstance(ev, dict) and ev.get("event") == "error":
                                break  # cut off (a slow reader, a reload): resume
                            yield ev
                        event_id = None
                        continue
                    if line.startswith(":"):
                        continue
                    field, _, value = line.partition(":")
                    value = value[1:] if value.startswith(" ") else value
                    if field == "data":
                        data.append(value)
                    elif field == "id":
                        event_id = value
            except (OSError, http.client.HTTPException):
                i += 1  # the next replica, after a pause
                if stop is not None:
                    if stop.wait(pause):
                        return
                else:
                    time.sleep(pause)
                pause = min(pause * 2, 2.0)
            finally:
                if conn is not None:
                    conn.close()

    def _get(self, path: str, timeout_s: float, *, answers: tuple = (200,), healthy_503: bool = False) -> Any:
        deadline = time.monotonic() + max(0.0, timeout_s)
        last_error: Optional[BaseException] = None
        with self._lock:
            n = len(self._replicas)
            for i in range(n):
                idx = (self._preferred + i) % n
                replica = self._replicas[idx]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    status, body = replica.request(path, remaining)
                except (OSError, http.client.HTTPException) as e:
                    last_error = e
                    continue
                if status == 503 and not (healthy_503 and b'"healthy"' in body):
                    last_error = _error_from(replica.url, status, body)
                    continue
                self._preferred = idx
                if status in answers:
                    try:
                        return json.loads(body)
                    except ValueError as e:
                        raise CoordinatorError(f"{replica.url} answered with invalid JSON: {e}", status=status, url=replica.url)
                raise _error_from(replica.url, status, body)
        urls = ", ".join(r.url for r in self._replicas)
        if isinstance(last_error, CoordinatorError):
            raise CoordinatorUnavailable(
                f"no coordinator replica could answer ({urls}): {last_error}",
                status=last_error.status,
                code=last_error.code,
                url=last_error.url,
            ) from last_error
        raise CoordinatorUnavailable(
            f"no coordinator replica could answer ({urls}): {last_error or 'timed out'}; "
            "check that `rootrank serve` runs and ROOTRANK_COORDINATOR points at it"
        ) from last_error

    def close(self) -> None:
        with self._lock:
            for r in self._replicas:
                r.close()

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"rootrank.Coordinator({','.join(self.urls)!r})"


def _error_from(url: str, status: int, body: bytes) -> CoordinatorError:
    code, message = None, body.decode("utf-8", "replace")[:500]
    try:
        err = json.loads(body)["error"]
        code, message = err.get("code"), err.get("message", message)
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    cls = NotFound if status == 404 else InvalidInput if status == 400 else CoordinatorError
    if cls is InvalidInput:
        return InvalidInput(f"{url}: {message}")
    return cls(f"{url} answered {status} {code or ''}: {message}".replace("  ", " "), status=status, code=code, url=url)
