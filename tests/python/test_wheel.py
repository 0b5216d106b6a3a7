"""The wheel as an operator gets it: auditwheel calls it manylinux, and a fresh venv on a
machine's own Python, with no Rust toolchain on PATH, gets the `rootrank` command from
`pip install`: `serve` (with its private etcd), a rank registered through the package's Agent,
`why` naming the rank that failed a room, `status`. scripts/test-python.sh passes the wheel it
built in ROOTRANK_WHEEL."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port, wait_until

WHEEL = os.environ.get("ROOTRANK_WHEEL", "")
# A manylinux tag as old as this, so pip installs it where SGLang runs (glibc 2.28: RHEL 8,
# Ubuntu 20.04 and later).
OLDEST_GLIBC = 28


@pytest.fixture(scope="module")
def wheel() -> Path:
    if not WHEEL:
        pytest.fail("ROOTRANK_WHEEL is not set: run tests/python through scripts/test-python.sh (make test-python)")
    path = Path(WHEEL)
    assert path.is_file(), path
    return path


def test_auditwheel_calls_the_wheel_manylinux(wheel):
    out = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    text = " ".join(out.stdout.split())
    m = re.search(r'consistent with the following platform tag: "manylinux_2_(\d+)_x86_64"', text)
    assert m, text
    assert int(m.group(1)) <= OLDEST_GLIBC, text
    # The file name says it too (pip elsewhere trusts the name), no newer than auditwheel found.
    tag = re.search(r"-manylinux_2_(\d+)_x86_64\.whl$", wheel.name)
    assert tag and int(tag.group(1)) >= int(m.group(1)), (wheel.name, text)


def test_a_fresh_venv_without_cargo_gets_the_rootrank_command(wheel, tmp_path):
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    assert system_python, "the machine's own python3"
    venv = tmp_path / "venv"
    subprocess.run([system_python, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    str(wheel)], check=True, timeout=300)
    path = f"{venv / 'bin'}:/usr/bin:/bin"
    assert shutil.which("cargo", path=path) is None and shutil.which("rustc", path=path) is None, path
    env = {"PATH": path, "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    rootrank = str(venv / "bin" / "rootrank")

    version = subprocess.run([rootrank, "--version"], env=env, capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("rootrank "), version

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    serve = subprocess.Popen([rootrank, "serve", "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "data")],
                             env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def ready() -> bool:
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(lambda: serve.poll() is not None or ready(), 60, "rootrank serve from the wheel: /readyz")
        assert serve.poll() is None, log.read_text()
        etcd = re.search(r"started a private etcd \(pid \d+\) at (\S+),", log.read_text())
        assert etcd, log.read_text()
        # A rank of the fresh venv's own interpreter fails room 42; its sibling saw only the
        # generic error.
        rank = textwrap.dedent(f"""
            import rootrank
            with rootrank.Agent("wheel-0", 1, 2, etcd_endpoints={etcd.group(1)!r}) as a:
                assert a.wait_registered(10) is not None
                a.record_failure(42, "nixl_error", "NIXL transfer encountered ERR room=42")
                assert a.flush(10)
            with rootrank.Agent("wheel-0", 0, 2, etcd_endpoints={etcd.group(1)!r}) as b:
                assert b.wait_registered(10) is not None
                b.record_failure(42, "other", "Failed due to an unknown reason from another rank", origin="propagated")
                assert b.flush(10)
        """)
        subprocess.run([str(venv / "bin" / "python"), "-c", rank], env=env, check=True, timeout=120)
        why = subprocess.run([rootrank, "why", "42", "--group", "wheel-0", "--wait-ms", "10000", "--coordinator", url],
                             env=env, capture_output=True, text=True, timeout=60)
        assert why.returncode == 0, why.stdout + why.stderr
        assert "culprit: wheel-0 rank 1" in why.stdout and "nixl_error" in why.stdout, why.stdout
        status = subprocess.run([rootrank, "status", "--coordinator", url], env=env, capture_output=True, text=True,
                                timeout=60)
        assert status.returncode == 0 and "wheel-0" in status.stdout, status.stdout + status.stderr
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
    # SIGTERM stops it cleanly, the private etcd with it.
    assert serve.returncode == 0, log.read_text()
    assert "coordinator stopped" in log.read_text(), log.read_text()
