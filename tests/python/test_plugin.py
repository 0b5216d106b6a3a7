"""The plugin's own logic, without SGLang: reason classification of SGLang's real strings,
group identity, and the promise that an exception inside the plugin never reaches SGLang."""

from __future__ import annotations

import logging
import types

import pytest

import rootrank.sglang as plugin
from rootrank.reasons import classify


@pytest.mark.parametrize("text,reason,peer", [
    ("NIXL transfer encountered ERR room=123", "nixl_error", None),
    ("KVSender failed to create transfer", "nixl_error", None),
    ("KVSender failed to post transfer", "nixl_error", None),
    ("NIXL transfer for room 5 left a handle running after 30s", "transfer_timeout", None),
    ("Aborted by decode-side abort notification.", "aborted", None),
    ("Aborted by AbortReq.", "aborted", None),
    ("Request 77 timed out after 300.0s in KVPoll.Bootstrapping", "bootstrap_timeout", None),
    ("Request 77 timed out after 300.0s in KVPoll.WaitingForInput", "transfer_timeout", None),
    ("Lost connection with prefill instance (bootstrap_addr: 10.0.0.5:8998)", "peer_disconnect", {"endpoint": "10.0.0.5:8998"}),
    ("Prefill server with bootstrap_addr: 10.0.0.7:8998 is healthy before, but now it is down. Request (bootstrap_room: 1) has been marked as failed.",
     "peer_disconnect", {"endpoint": "10.0.0.7:8998"}),
    ("Failed to get kvcache from prefill instance, it might be dead", "peer_disconnect", None),
    ("Could not fetch prefill parallel info from bootstrap_addr: 10.0.0.9:8998", "bootstrap_timeout", {"endpoint": "10.0.0.9:8998"}),
    ("Duplicate decode bootstrap room", "aborted", None),
    ("UCX error: Endpoint timeout", "ucx_error", None),
    ("KVSender failed to post prepped transfer: NIXL_ERR_REMOTE_DISCONNECT", "peer_disconnect", None),
    ("KV transfer failed", "other", None),
    ("something new", "other", None),
])
def test_sglang_reason_strings_are_classified(text, reason, peer):
    assert classify(text) == (reason, peer)


def test_group_identity_from_the_kv_manager(monkeypatch):
    """SPEC section 9 v3: one group per instance x DP replica over every TP x CP x PP rank; the
    instance is dist_init_addr or this host's name with the port, never --host."""
    import socket

    monkeypatch.delenv("ROOTRANK_INSTANCE", raising=False)
    host = socket.gethostname()
    mode = types.SimpleNamespace(value="prefill")
    # DP attention: the attention-DP rank is the replica.
    mgr = types.SimpleNamespace(disaggregation_mode=mode, bootstrap_host="0.0.0.0", bootstrap_port=8998,
                                dist_init_addr=None, attn_tp_size=4, attn_tp_rank=3, attn_cp_size=2,
                                attn_cp_rank=1, attn_dp_size=4, attn_dp_rank=2, system_dp_rank=0, pp_size=1)
    assert plugin.group_of(mgr) == (f"prefill-{host}:8998-dp2", 7, 8, "prefill")
    # Plain DP (attention DP off): the system DP rank is the replica, so replicas never share.
    plain = [types.SimpleNamespace(**{**vars(mgr), "attn_dp_size": 1, "attn_dp_rank": 0, "system_dp_rank": d}) for d in (0, 1)]
    assert [plugin.group_of(m)[0] for m in plain] == [f"prefill-{host}:8998-dp0", f"prefill-{host}:8998-dp1"]
    # PP: one group over the stages (SGLang's consensus spans them), rank pp * cp * tp + cp * tp + tp.
    decode = types.SimpleNamespace(disaggregation_mode=types.SimpleNamespace(value="decode"), dist_init_addr="10.0.1.1:5000",
                                   attn_tp_size=2, attn_tp_rank=1, attn_dp_rank=0, pp_size=2, pp_rank=1)
    assert plugin.group_of(decode) == ("decode-10.0.1.1:5000-dp0", 3, 4, "decode")
    monkeypatch.setenv("ROOTRANK_INSTANCE", "prefill pool/a")
    assert plugin.group_of(mgr)[0] == "prefill-prefill_pool_a-dp2"
    # What decode knows the prefill by: loopback too when it serves on every address.
    assert plugin.endpoints_of(mgr)[-1] == "127.0.0.1:8998" and f"{host}:8998" in plugin.endpoints_of(mgr)


@pytest.mark.parametrize("text", [
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:8355. This is typically caused by a remote worker crashing.",
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:4997: Connection reset by peer.",
])
def test_a_lost_collective_is_peer_lost_and_a_python_socket_is_not(text):
    from rootrank._rootrank import classify_fatal

    assert classify_fatal(f"Traceback (most recent call last):\n  File \"x\", line 1, in f\n{text}\n") == "peer_lost"
    assert classify_fatal("ConnectionResetError: [Errno 104] Connection reset by peer") == "python_exception"


def test_a_prefill_status_names_the_prefill_rank_in_rootrank_terms():
    """SGLang's status message carries ``_prefill_unique_rank`` (tp * pp * cp + pp * cp + cp);
    the peer is named by bootstrap address and rootrank's rank (pp * cp * tp + cp * tp + tp)."""
    info = types.SimpleNamespace(attn_tp_size=4, attn_cp_size=1, pp_size=2)
    mgr = types.SimpleNamespace(addr_to_rooms_tracker={"10.0.0.5:8998": {77}}, prefill_info_table={"10.0.0.5:8998": info})
    # tp 3, pp 1 -> unique 3 * 2 + 1 = 7 -> rootrank 1 * 4 + 3 = 7; tp 1, pp 1 -> 3 -> 5.
    assert plugin.prefill_peer(mgr, 77, 7) == {"endpoint": "10.0.0.5:8998", "rank": 7}
    assert plugin.prefill_peer(mgr, 77, 3) == {"endpoint": "10.0.0.5:8998", "rank": 5}
    assert plugin.prefill_peer(mgr, 78, 3) == {}


def test_an_exception_inside_the_plugin_never_reaches_sglang(caplog):
    class BrokenAgent:
        def record_failure(self, *a, **k):
            raise RuntimeError("agent exploded")

    rank = plugin._Rank(BrokenAgent(), "g", 0)
    records = plugin._FailureRecords()
    records._rootrank_rank, records._rootrank_mgr = rank, object()
    before = plugin.stats()["errors"]
    with caplog.at_level(logging.WARNING, logger="rootrank.sglang"):
        records[1] = "NIXL transfer encountered ERR room=1"  # SGLang's record_failure
        assert records.setdefault(2, "KV transfer failed") == "KV transfer failed"  # conclude_failure
        assert records.setdefault(2, "later") == "KV transfer failed"  # first reason kept, as dict does
    assert dict(records) == {1: "NIXL transfer encountered ERR room=1", 2: "KV transfer failed"}
    assert records.pop(1) == "NIXL transfer encountered ERR room=1"  # failure_exception's pop
    assert plugin.stats()["errors"] == before + 2
    assert sum("internal error in failure_records write" in r.message for r in caplog.records) <= 1


def test_culprit_text():
    v = {"status": "resolved", "culprit": {"group": "prefill-0", "rank": 3, "reason": "oom_host",
                                           "source": "down_certificate", "detail": "killed by the OOM killer"}}
    assert plugin.culprit_text(v) == "failed at prefill-0 rank 3: oom_host (down_certificate): killed by the OOM killer"
    v["cause"] = {"group": "decode-0", "rank": 3, "reason": "oom_host"}
    assert plugin.culprit_text(v).endswith("killed by the OOM killer; cause: decode-0 rank 3: oom_host")
    assert plugin.culprit_text({"status": "pending", "culprit": None}) is None
    assert plugin.culprit_text(None) is None


def test_register_without_endpoints_is_inactive(monkeypatch):
    monkeypatch.delenv("ROOTRANK_ETCD_ENDPOINTS", raising=False)
    monkeypatch.setattr(plugin, "_plugin", None)
    plugin.register()
    assert plugin._plugin is None


GOOD = """
import rootrank
a: rootrank.Agent = rootrank.Agent("prefill-0", 1, 8, etcd_endpoints="http://etcd:2379", role="prefill")
ok: bool = a.record_failure(42, "nixl_error", "detail", origin="local", peer={"group": "decode-0", "rank": 1})
inc: "str | None" = a.incarnation
import typing
v: typing.Dict[str, typing.Any] = rootrank.Coordinator("http://a:9750,http://b:9750").verdict(42, group="prefill-0", wait_ms=100)
"""
BAD = """
import rootrank
a = rootrank.Agent("prefill-0", 1, 8)
a.record_failure("42", 3)
"""


def test_type_stubs_are_seen_by_mypy(tmp_path):
    import subprocess
    import sys

    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "bad.py").write_text(BAD)
    run = lambda f: subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(tmp_path / f)],
                                   capture_output=True, text=True, cwd=tmp_path)
    good = run("good.py")
    assert good.returncode == 0, good.stdout
    bad = run("bad.py")
    assert bad.returncode == 1 and 'incompatible type "str"; expected "int"' in bad.stdout, bad.stdout


def test_a_slow_resolver_costs_a_caller_its_timeout_and_no_more(monkeypatch):
    """getaddrinfo takes no timeout: a scheduler thread asking a coordinator by name waits for
    DNS at most its own timeout (its verdict budget), never for the resolver; once the name is
    resolved (on a helper thread) every call uses the answer."""
    import http.server
    import ipaddress
    import json
    import socket
    import threading

    from rootrank import coordinator as c
    from rootrank.errors import CoordinatorUnavailable

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"room": "1", "status": "unknown"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    release, asked = threading.Event(), []
    real = socket.getaddrinfo

    def slow_dns(host, port, *args, **kwargs):
        try:
            ipaddress.ip_address(host)
            return real(host, port, *args, **kwargs)  # a literal needs no resolver
        except ValueError:
            asked.append(host)
            release.wait(60)  # a resolver that does not answer
            return real("127.0.0.1", port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow_dns)
    monkeypatch.setattr(c, "_resolver", c._Resolver())
    try:
        client = c.Coordinator(f"http://coordinator.rootrank.test:{server.server_address[1]}")
        with pytest.raises(CoordinatorUnavailable, match="resolving coordinator.rootrank.test"):
            client.verdict(1, timeout_s=0.2)
        with pytest.raises(CoordinatorUnavailable, match="resolving"):
            client.verdict(1, timeout_s=0.2)  # the same lookup, still running: not a second one
        assert asked == ["coordinator.rootrank.test"], asked
        release.set()
        assert client.verdict(1, timeout_s=10)["status"] == "unknown"
        assert client.verdict(1, timeout_s=10)["status"] == "unknown"
        assert asked == ["coordinator.rootrank.test"], asked
    finally:
        release.set()
        server.shutdown()
