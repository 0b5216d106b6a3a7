"""SPEC section 7 from Python: the rank's Agent against an etcd with auth on and the least
roles of scripts/etcd-roles.sh (credentials as keyword arguments, and as the ROOTRANK_ETCD_*
variables the SGLang plugin's Agent reads), and rootrank.Coordinator against a coordinator
that serves HTTPS and wants a bearer token (certificates made here with openssl)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

import rootrank
from conftest import ROOTRANK_BIN, Coordinator, free_port, spawn_python, wait_until

REPO = Path(__file__).resolve().parents[2]
PREFIX = "/rootrank/v1"


def secret_file(path: Path, text: str) -> str:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def auth_etcd(etcd):
    subprocess.run(
        ["bash", str(REPO / "scripts/etcd-roles.sh"), PREFIX],
        check=True, capture_output=True, timeout=60,
        env={**os.environ, "ETCDCTL_ENDPOINTS": etcd.url, "ROOTRANK_ROOT_PASSWORD": "root-pw",
             "ROOTRANK_RANK_PASSWORD": "rank-pw", "ROOTRANK_COORDINATOR_PASSWORD": "coord-pw",
             "ROOTRANK_NODE_PASSWORD": "node-pw"},
    )
    return etcd


def test_an_agent_with_the_rank_role_publishes_and_a_wrong_password_is_said(auth_etcd, tmp):
    coord = Coordinator(auth_etcd, tmp, "--etcd-user", "rootrank-coordinator",
                        "--etcd-password-file", secret_file(tmp / "coord.pw", "coord-pw"))
    try:
        rank_pw = secret_file(tmp / "rank.pw", "rank-pw")
        # Keyword arguments.
        with rootrank.Agent("py-auth", 0, 2, etcd_endpoints=auth_etcd.url, lease_ttl_ms=1000,
                            etcd_user="rootrank-rank", etcd_password_file=rank_pw) as a:
            assert a.wait_registered(10) is not None, a.etcd_error
            assert a.etcd_error is None
            # The plugin's way: no keyword arguments, the ROOTRANK_ETCD_* variables.
            code = (
                "import rootrank\n"
                "a = rootrank.Agent('py-auth', 1, 2, lease_ttl_ms=1000)\n"
                "assert a.wait_registered(10) is not None, a.etcd_error\n"
                "a.record_failure(99, 'nixl_error', 'NIXL_ERR_BACKEND', origin='local')\n"
                "assert a.flush(10)\n"
                "print('published', flush=True)\n"
            )
            proc = spawn_python(code, {"ROOTRANK_ETCD_ENDPOINTS": auth_etcd.url, "ROOTRANK_ETCD_USER": "rootrank-rank",
                                       "ROOTRANK_ETCD_PASSWORD_FILE": rank_pw}, tmp / "env-rank.log")
            assert proc.wait(30) == 0, (tmp / "env-rank.log").read_text()
            assert a.record_failure(99, "other", "NIXL KVSender Exception", origin="propagated")
            v = wait_until(lambda: (v := coord.verdict(99, "py-auth")) and v["status"] == "resolved" and v, 20, "verdict")
            assert v["culprit"]["rank"] == 1, v

        # A wrong password: the agent says so (once, in its log), never registers, and the
        # host is not blocked (construction returned at once).
        started = time.monotonic()
        bad = rootrank.Agent("py-auth-bad", 0, 1, etcd_endpoints=auth_etcd.url, lease_ttl_ms=1000,
                             etcd_user="rootrank-rank", etcd_password_file=secret_file(tmp / "bad.pw", "nope"))
        constructed = time.monotonic() - started
        why = wait_until(lambda: bad.etcd_error, 10, "the agent to say etcd refuses it")
        print(f"agent constructed in {constructed * 1000:.1f} ms; refusal known after "
              f"{(time.monotonic() - started) * 1000:.0f} ms: {why}")
        assert "authentication failed" in why and "rootrank-rank" in why, why
        assert bad.incarnation is None
        assert bad.shutdown(5)
    finally:
        coord.kill()


def test_bad_credentials_raise_value_error_before_anything_starts(etcd, tmp):
    for kwargs, needle in [
        ({"etcd_user": "u"}, "--etcd-password-file"),
        ({"etcd_user": "u", "etcd_password_file": str(tmp / "missing")}, "cannot read"),
        ({"etcd_cacert": str(tmp / "missing.pem")}, "https://"),
    ]:
        with pytest.raises(ValueError, match=needle):
            rootrank.Agent("py-bad-cred", 0, 1, etcd_endpoints=etcd.url, **kwargs)


def openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def make_pki(tmp: Path) -> None:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate it signed."""
    openssl(tmp, "req", "-x509", *EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca")
    (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    (tmp / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, ext in [("server", "san.ext"), ("client", "client.ext")]:
        openssl(tmp, "req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        openssl(tmp, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", ext)


def test_an_agent_over_etcd_tls_with_a_client_certificate(tmp):
    make_pki(tmp)
    port, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{port}"
    etcd = subprocess.Popen(
        ["etcd", "--name", "n0", "--data-dir", str(tmp / "etcd"), "--listen-client-urls", url,
         "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}", "--initial-cluster", f"n0=http://127.0.0.1:{peer}",
         "--heartbeat-interval", "10", "--election-timeout", "100", "--log-level", "warn",
         "--cert-file", str(tmp / "server.pem"), "--key-file", str(tmp / "server.key"),
         "--client-cert-auth", "--trusted-ca-file", str(tmp / "ca.pem")],
        stdout=subprocess.DEVNULL, stderr=open(tmp / "etcd.log", "w"))
    try:
        tls = {"etcd_cacert": str(tmp / "ca.pem"), "etcd_cert": str(tmp / "client.pem"), "etcd_key": str(tmp / "client.key")}
        with rootrank.Agent("py-tls", 0, 1, etcd_endpoints=url, lease_ttl_ms=1000, **tls) as a:
            assert a.wait_registered(20) is not None, a.etcd_error
            assert a.record_failure(3, "nixl_error", "NIXL_ERR_BACKEND", origin="local") and a.flush(10)
        # Without the client certificate: refused, and said.
        bad = rootrank.Agent("py-tls", 1, 2, etcd_endpoints=url, lease_ttl_ms=1000, etcd_cacert=str(tmp / "ca.pem"))
        why = wait_until(lambda: bad.etcd_error, 10, "the refusal")
        assert "TLS" in why and "certificate" in why.lower(), why
        bad.shutdown(5)
        # What the good agent wrote is there, read back with etcdctl over TLS.
        out = subprocess.run(["etcdctl", "--endpoints", url, "--cacert", str(tmp / "ca.pem"), "--cert",
                              str(tmp / "client.pem"), "--key", str(tmp / "client.key"), "get", "--prefix", "--keys-only",
                              PREFIX + "/groups/py-tls/rooms/"], capture_output=True, text=True, timeout=10,
                             env={**os.environ, "ETCDCTL_API": "3"})
        assert PREFIX + "/groups/py-tls/rooms/3/ranks/0" in out.stdout, out.stdout + out.stderr
    finally:
        etcd.kill()
        etcd.wait()


def test_coordinator_client_over_https_with_a_token(etcd, tmp):
    make_pki(tmp)
    token = secret_file(tmp / "token", "py-t0ken")
    port = free_port()
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen([ROOTRANK_BIN, "serve", "--etcd-endpoints", etcd.url, "--listen", f"127.0.0.1:{port}",
                             "--tls-cert", str(tmp / "server.pem"), "--tls-key", str(tmp / "server.key"),
                             "--auth-token-file", token], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"https://localhost:{port}"  # the certificate's DNS name, resolved by the client
        c = rootrank.Coordinator(url, token_file=token, cacert=str(tmp / "ca.pem"))
        wait_until(lambda: c.groups() is not None, 20, "the coordinator over HTTPS")
        with rootrank.Agent("py-https", 0, 1, etcd_endpoints=etcd.url, lease_ttl_ms=1000) as a:
            assert a.record_failure(5, "nixl_error", "NIXL_ERR_BACKEND", origin="local")
            assert a.flush(10)
            v = c.verdict(5, group="py-https", wait_ms=10_000)
            assert v["status"] == "resolved" and v["culprit"]["rank"] == 0, v
            # The environment variables, as a scheduler would configure it.
            os.environ["ROOTRANK_TOKEN_FILE"], os.environ["ROOTRANK_CACERT"] = token, str(tmp / "ca.pem")
            try:
                assert rootrank.Coordinator(url).verdict(5, group="py-https")["status"] == "resolved"
            finally:
                del os.environ["ROOTRANK_TOKEN_FILE"], os.environ["ROOTRANK_CACERT"]
            # Without the token: 401, said as such (not a failover to nowhere).
            with pytest.raises(rootrank.CoordinatorError) as e:
                rootrank.Coordinator(url, cacert=str(tmp / "ca.pem")).verdict(5, group="py-https")
            assert e.value.status == 401 and "token" in str(e.value), e.value
            # Without the CA: the certificate is not trusted.
            with pytest.raises(rootrank.CoordinatorUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
                rootrank.Coordinator(url, token_file=token, timeout_s=2).verdict(5)
            # A token file that is not there is a clear error at construction.
            with pytest.raises(rootrank.InvalidInput, match="cannot read the coordinator token file"):
                rootrank.Coordinator(url, token_file=str(tmp / "nope"))
            a.shutdown(5)
    finally:
        proc.kill()
        proc.wait()
