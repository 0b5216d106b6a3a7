#!/usr/bin/env python3
"""What the real sglang-router (0.3.2, from the cached SGLang venv) does when a prefill worker
fails a PD request in each way a prefill instance that lost a rank can (issue 30, docs/router.md).

The router is the real one; the three workers behind it are stand-ins that answer SGLang's
routes the way a prefill instance does in each case (the answers are SGLang's, but their
timing is not: this characterizes the router, not SGLang). Prefill A fails as told, prefill B
answers normally, and the decode fails a room whose prefill failed (an error event in its 200
stream, as SGLang's decode does when the room's KV cache never arrives). For each case and each prefill policy it sends requests
(streaming, as SGLang clients do) and reports what the client got and how many times each
prefill was tried.

    scripts/router-probe.py [--requests N] [--json]

Cases for prefill A:
  503-before-stream   HTTP 503 before any byte of a body (the plugin refusing a new request
                      once SGLang's launcher is shutting the instance down)
  error-in-stream     HTTP 200, then `data: {"error": ...}` and `data: [DONE]` (SGLang ending a
                      request in flight through its abort path: the 200 was already sent)
  cut-after-headers   HTTP 200, then the connection closes mid-body (the instance killed with
                      the request in flight)
  refused             nothing listens (the instance's server is gone)
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

VENV = Path(os.environ.get("ROOTRANK_SGLANG_VENV", Path.home() / ".cache/rootrank/sglang-0.5.23"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Rooms a prefill stand-in failed: the decode stand-in fails them too, as SGLang's decode does
# when the KV cache of its room never arrives (an error event in its 200 stream).
FAILED_ROOMS: set = set()


class Worker:
    """A stand-in SGLang worker: `mode` says how it answers /generate."""

    def __init__(self, name: str, mode: str = "ok"):
        self.name, self.mode, self.generate = name, mode, []
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _json(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path.startswith("/health"):
                    return self._json(200, {})
                if self.path.startswith(("/get_server_info", "/server_info")):
                    return self._json(200, {"disaggregation_mode": "prefill" if worker.name != "decode" else "decode",
                                            "tp_size": 1, "dp_size": 1, "model_path": "stand-in"})
                if self.path.startswith(("/get_model_info", "/model_info", "/v1/models")):
                    return self._json(200, {"model_path": "stand-in", "data": [{"id": "stand-in"}]})
                return self._json(404, {"error": "no such route"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length", "0"))
                req = json.loads(self.rfile.read(n) or b"{}")
                if not self.path.startswith("/generate"):
                    return self._json(404, {"error": "no such route"})
                room = req.get("bootstrap_room")
                worker.generate.append(room)
                mode = worker.mode
                if mode != "ok":
                    FAILED_ROOMS.add(room)
                if mode == "503-before-stream":
                    return self._json(503, {"error": {"message": "rootrank: prefill rank 1 was killed by a signal; SGLang is shutting this server down", "code": 503}})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def chunk(data: bytes):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()

                if mode == "cut-after-headers":
                    chunk(b'data: {"text": "', )
                    time.sleep(0.05)
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                time.sleep(0.05)
                if worker.name == "decode":
                    time.sleep(0.1)  # the prefill side has answered by now
                    if room in FAILED_ROOMS:
                        mode = "decode-failed"
                if mode == "decode-failed":
                    chunk(b'data: {"error": {"message": "KVTransferError(bootstrap_room=%d): Failed to get kvcache from prefill instance", "code": 500}}\n\n' % room)
                elif mode == "error-in-stream":
                    chunk(b'data: {"error": {"message": "rootrank: prefill rank 1 was killed by a signal", "code": 503}}\n\n')
                else:
                    chunk(b'data: {"text": "ok", "meta_info": {"id": "x"}}\n\n')
                chunk(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except Exception:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer in {timeout_s} s")


def run_case(case: str, policy: str, requests: int, log: Path) -> dict:
    a = Worker("prefill-a", "ok" if case == "refused" else case)
    b, d = Worker("prefill-b"), Worker("decode")
    a_url = a.url
    if case == "refused":
        a.server.shutdown()
        a.server.server_close()
    port = free_port()
    cmd = [str(VENV / "bin/python"), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--pd-disaggregation", "--prefill", a_url, "none", "--prefill", b.url, "none", "--decode", d.url,
           "--prefill-policy", policy, "--log-level", "warn"]
    router = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 60)
        time.sleep(1.0)
        if case != "refused":
            a.generate.clear()
        b.generate.clear()
        results = []
        for i in range(requests):
            body = json.dumps({"text": f"request {i} of the probe, a prompt of its own", "stream": True,
                               "sampling_params": {"max_new_tokens": 4}}).encode()
            t = time.monotonic()
            try:
                r = urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body,
                                                                  headers={"Content-Type": "application/json"}), timeout=30)
                status, text = r.status, r.read().decode(errors="replace")
            except urllib.error.HTTPError as e:
                status, text = e.code, e.read().decode(errors="replace")
            except Exception as e:  # a reset or a timeout
                status, text = 0, f"{type(e).__name__}: {e}"
            ok = status == 200 and '"text": "ok"' in text and '"error"' not in text
            results.append({"status": status, "ok": ok, "s": time.monotonic() - t, "text": text[:160]})
        failed = [r for r in results if not r["ok"]]
        return {
            "case": case, "prefill_policy": policy, "requests": requests,
            "client_ok": requests - len(failed), "client_failed": len(failed),
            "failed_texts": sorted({f"{r['status']} {r['text'][:120]}" for r in failed}),
            "prefill_a_attempts": len(a.generate) if case != "refused" else None,
            "prefill_b_attempts": len(b.generate), "decode_attempts": len(d.generate),
            "worst_s": max(r["s"] for r in results),
        }
    finally:
        router.terminate()
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            router.kill()
        for w in (a, b, d):
            try:
                w.server.shutdown()
            except Exception:
                pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not (VENV / "bin/python").exists():
        print(f"router-probe: no SGLang venv at {VENV} (scripts/sglang-venv.sh builds it)", file=sys.stderr)
        return 2
    out = []
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    for policy in ("cache_aware", "round_robin"):
        for case in ("ok", "503-before-stream", "error-in-stream", "cut-after-headers", "refused"):
            r = run_case(case, policy, a.requests, logs / f"router-probe-{policy}-{case}.log")
            out.append(r)
            if not a.json:
                print(f"{policy:12} {case:18} client ok {r['client_ok']:3}/{r['requests']}  "
                      f"prefill A tried {r['prefill_a_attempts']}, B {r['prefill_b_attempts']}, decode {r['decode_attempts']}  "
                      f"worst {r['worst_s']:.2f} s  {'; '.join(r['failed_texts'])[:140]}")
    if a.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
