"""A real SGLang 0.5.23 PD deployment on this CPU-only machine, for the real-server tier
(tests/python/test_server.py): `python -m sglang.launch_server` prefill (TP=2) and decode
(TP=1), KV over NIXL (UCX tcp on loopback), `sglang-router` (PD, no retries) in front, with
or without the rootrank plugin. What each setting is for: ../shared/SGLANG-FACTS.md, "A real
SGLang PD server on a CPU-only machine".

Two TEST-ONLY stand-ins ride on the SGLang processes' PYTHONPATH (server_standins/, never
shipped): a plain-torch `sgl_kernel` (its CPU build is not on PyPI) and a tiny SGLang plugin
that aliases NIXL's VRAM memory type to DRAM (UCX without CUDA refuses "VRAM").

`python server_kit.py make-model` builds the tiny random-weight Llama and its byte-level BPE
tokenizer once, under ~/.cache/rootrank (scripts/test-server.sh runs it)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
STANDINS = HERE / "server_standins"
CACHE = Path(os.environ.get("ROOTRANK_CACHE_DIR", Path.home() / ".cache" / "rootrank"))
MODEL = CACHE / "tiny-llama-128-v1"
# Ports below SGLang's own 22000-29999 and below the ephemeral range (32768+): either clash
# with a start here ("address already in use").
PORTS = (12000, 21999)


def model_dir() -> Path:
    if not (MODEL / ".ready").exists():
        raise AssertionError(f"the tiny model is missing: run `{sys.executable} {__file__} make-model` "
                             f"(scripts/test-server.sh does)")
    return MODEL


def make_model() -> Path:
    """A random-weight Llama (2 layers, hidden 128, vocab 512) and a byte-level BPE tokenizer
    trained here, so no hub is needed. Seeded: the same weights every time it is made."""
    if (MODEL / ".ready").exists():
        return MODEL
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    work = MODEL.with_name(MODEL.name + f".tmp{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["The quick brown fox jumps over the lazy dog.", "A rank of a tensor-parallel group failed.",
              "Prefill sends the KV cache to decode over NIXL.", "Which rank really failed this request?",
              "Hello, world! Numbers: 0 1 2 3 4 5 6 7 8 9."] * 50
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(work)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(work)
    (work / ".ready").write_text("ok\n")
    shutil.rmtree(MODEL, ignore_errors=True)
    work.rename(MODEL)
    return MODEL


def free_port(taken: set) -> int:
    for _ in range(1000):
        port = random.randint(*PORTS)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise AssertionError(f"no free port in {PORTS}")


def http(url: str, body: dict | None = None, timeout: float = 10.0):
    """(status, parsed body) for a GET (body None) or a JSON POST; errors are answers too."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def generate(router: str, prompt: str, max_new_tokens: int = 8, timeout: float = 300.0) -> dict:
    """One greedy /generate through the router: what a client gets, and how long it took."""
    t0 = time.monotonic()
    try:
        status, body = http(f"{router}/generate", {"text": prompt, "sampling_params": {
            "temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}, timeout=timeout)
    except Exception as e:  # a connection the router dropped is an answer as well
        status, body = None, f"{type(e).__name__}: {e}"
    return {"prompt": prompt, "status": status, "body": body, "seconds": time.monotonic() - t0,
            "done_at": time.monotonic()}


def stream_generate(router: str, prompt: str, max_new_tokens: int = 8, timeout: float = 300.0) -> dict:
    """The same request streamed, as a streaming client reads it: `body` is the last event
    (an error event's body, a 200 stream's last output) or the error text."""
    t0 = time.monotonic()
    data = json.dumps({"text": prompt, "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}).encode()
    req = urllib.request.Request(f"{router}/generate", data=data, headers={"Content-Type": "application/json"})
    status, body = None, "no event"
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status = r.status
            for line in r:
                line = line.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    try:
                        body = json.loads(line[len(b"data: "):])
                    except ValueError:
                        body = line.decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", "replace")
    except Exception as e:  # a connection the router dropped is an answer as well
        body = f"{type(e).__name__}: {e}"
    return {"prompt": prompt, "status": status, "body": body, "seconds": time.monotonic() - t0,
            "done_at": time.monotonic(), "stream": True}


def failed(r: dict) -> bool:
    """What a client counts as failed: no 200, or a body that is an error or an abort."""
    body = r["body"]
    return r["status"] != 200 or not isinstance(body, dict) or "error" in body or \
        (body.get("meta_info") or {}).get("finish_reason", {}).get("type") == "abort"


class Stack:
    """prefill (TP=2) + decode (TP=1) + router, each in its own process group, at nice 10 (idle
    SGLang schedulers busy-poll; on 2 cores they would starve etcd and the coordinator).

    `second_prefill`: a second prefill instance (TP=1, "prefill-b") behind the same router
    (issue 30's survival scenario). `retries`: the router's own default (retries on) instead of
    `--disable-retries` (one request, one room, which the tier's assertions rely on)."""

    def __init__(self, tmp: Path, name: str, env: dict, second_prefill: bool = False, retries: bool = False,
                 router_args: tuple = ()):
        self.tmp, self.name = tmp, name
        self.second_prefill, self.retries, self.router_args = second_prefill, retries, list(router_args)
        self.procs: dict[str, subprocess.Popen] = {}
        taken: set = set()
        self.prefill_port, self.bootstrap_port, self.prefill_nccl = (free_port(taken) for _ in range(3))
        self.decode_port, self.decode_nccl = free_port(taken), free_port(taken)
        self.router_port, self.router_metrics = free_port(taken), free_port(taken)
        self.prefill_b_port, self.bootstrap_b_port, self.prefill_b_nccl = (free_port(taken) for _ in range(3))
        self.prefill_url = f"http://127.0.0.1:{self.prefill_port}"
        self.prefill_b_url = f"http://127.0.0.1:{self.prefill_b_port}"
        self.decode_url = f"http://127.0.0.1:{self.decode_port}"
        self.router = f"http://127.0.0.1:{self.router_port}"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("ROOTRANK_", "SGLANG_"))}
        base.update(
            HF_HUB_OFFLINE="1", SGLANG_CACHE_DIR=str(tmp / f"{name}-sglang-cache"),
            # The TEST-ONLY stand-ins, for these processes only.
            PYTHONPATH=os.pathsep.join([str(STANDINS), *filter(None, [os.environ.get("PYTHONPATH")])]),
            SGLANG_USE_CPU_ENGINE="1",  # else is_cpu() is false and CUDA paths are taken
            SGLANG_NCCL_SO_PATH="/nonexistent/libnccl.so.2",  # pynccl's non-GPU branch
            SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX="0",  # a prefix hit records a CUDA event
            UCX_TLS="tcp,self,sm",
            **env,
        )
        self.env = base
        self._stop = threading.Event()
        self._renicer: threading.Thread | None = None

    def _spawn(self, what: str, cmd: list, env: dict) -> None:
        log = open(self.tmp / f"{self.name}-{what}.log", "w")
        p = subprocess.Popen(["nice", "-n", "10", *cmd], env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs[what] = p
        # A new session is a new scheduler autogroup (Linux, when sched_autogroup_enabled): nice
        # then only ranks threads within the session, and each session gets an equal share of the
        # CPU, etcd's and the coordinator's included. The session's own nice makes nice 10 real.
        try:
            Path(f"/proc/{p.pid}/autogroup").write_text("10")
        except OSError:
            pass

    def log(self, what: str) -> str:
        p = self.tmp / f"{self.name}-{what}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def start(self, timeout_s: float = 420.0) -> float:
        """Starts everything; returns the seconds until the router served a first request."""
        t0 = time.monotonic()
        self._renicer = threading.Thread(target=self._renice_rootrank_threads, daemon=True)
        self._renicer.start()
        model = str(model_dir())
        common = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
                  "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
                  "--dtype", "bfloat16", "--max-total-tokens", "2048", "--mem-fraction-static", "0.05",
                  "--max-running-requests", "8", "--disaggregation-transfer-backend", "nixl",
                  # SGLang's own PD warm-up takes ~60 s here; the first request below is ours.
                  "--skip-server-warmup", "--log-level", "info"]
        self._spawn("prefill", [*common, "--disaggregation-mode", "prefill", "--tp-size", "2",
                                "--port", str(self.prefill_port), "--nccl-port", str(self.prefill_nccl),
                                "--disaggregation-bootstrap-port", str(self.bootstrap_port)],
                    {**self.env, "SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
        if self.second_prefill:
            self._spawn("prefill-b", [*common, "--disaggregation-mode", "prefill", "--tp-size", "1",
                                      "--port", str(self.prefill_b_port), "--nccl-port", str(self.prefill_b_nccl),
                                      "--disaggregation-bootstrap-port", str(self.bootstrap_b_port)],
                        {**self.env, "SGLANG_CPU_OMP_THREADS_BIND": "0"})
        self._spawn("decode", [*common, "--disaggregation-mode", "decode", "--tp-size", "1",
                               "--port", str(self.decode_port), "--nccl-port", str(self.decode_nccl),
                               # the default host pool calls torch.cuda.cudart()
                               "--disaggregation-decode-retraction-backup", "cpu_tensor"],
                    {**self.env, "SGLANG_CPU_OMP_THREADS_BIND": "1"})
        # The router starts with them: it registers its workers once they answer.
        prefills = ["--prefill", self.prefill_url, str(self.bootstrap_port)]
        if self.second_prefill:
            prefills += ["--prefill", self.prefill_b_url, str(self.bootstrap_b_port)]
        self._spawn("router", [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                               *prefills, "--decode", self.decode_url,
                               "--host", "127.0.0.1", "--port", str(self.router_port),
                               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.router_metrics),
                               "--worker-startup-timeout-secs", str(int(timeout_s)),
                               # one request is one room: a retry would mint a second one
                               *([] if self.retries else ["--disable-retries"]),
                               *self.router_args, "--log-level", "warn"], self.env)
        deadline = t0 + timeout_s
        urls = [("prefill", self.prefill_url), ("decode", self.decode_url), ("router", self.router)]
        if self.second_prefill:
            urls.insert(1, ("prefill-b", self.prefill_b_url))
        for what, url in urls:
            self._wait(what, lambda: http(f"{url}/health", timeout=5)[0] == 200, deadline)
        # Ready means a first request came back through the whole path (router, prefill, NIXL,
        # decode); until the router has registered both workers it answers 503.
        first = None
        while time.monotonic() < deadline:
            first = generate(self.router, "warm up", 2, timeout=max(10.0, deadline - time.monotonic()))
            if first["status"] != 503:
                break
            time.sleep(1.0)
        assert first and first["status"] == 200, f"{self.name}: the first request failed: {first}\n{self.tails()}"
        return time.monotonic() - t0

    def _renice_rootrank_threads(self) -> None:
        """nice 10 is this machine's protection of etcd and the coordinator, not part of what
        is tested: rootrank's agent threads inside the SGLang processes (rootrank-agent-*) go
        back to nice 0, as in a deployment, or the other developer's load on these 2 cores
        starves them past their lease (seen: the decode rank's lease expired every ~30 s)."""
        while not self._stop.wait(1.0):
            for p in list(self.procs.values()):
                for pid in _group_pids(p.pid):
                    for task in Path(f"/proc/{pid}/task").glob("*"):
                        try:
                            if (task / "comm").read_text().startswith("rootrank-agent") and \
                                    os.getpriority(os.PRIO_PROCESS, int(task.name)) != 0:
                                os.setpriority(os.PRIO_PROCESS, int(task.name), 0)
                        except OSError:
                            pass

    def _wait(self, what: str, ready, deadline: float) -> None:
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise AssertionError(f"{self.name}: {name} exited with {p.returncode} while starting\n{self.tails()}")
            try:
                if ready():
                    return
            except Exception:
                pass
            time.sleep(1.0)
        raise AssertionError(f"{self.name}: {what} not ready in time\n{self.tails()}")

    def tails(self, lines: int = 40) -> str:
        def tail(what: str) -> str:
            kept = [ln[:300] for ln in self.log(what).splitlines() if "server_args=" not in ln and "GET /health" not in ln]
            return "\n".join(kept[-lines:])

        return "\n".join(f"--- {w} log (tail) ---\n{tail(w)}" for w in self.procs)

    def stop(self) -> None:
        """Ends every process group this stack started, by its id."""
        self._stop.set()
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass


def _group_pids(pgid: int) -> list:
    """The processes of process group ``pgid`` (a stack member's session)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the comm: state, ppid, pgrp, ...
            out.append(int(stat.parent.name))
    return out


def run_concurrently(fn, args_list: list) -> list:
    """fn(*args) for each args in threads; results in order."""
    out = [None] * len(args_list)

    def one(i, args):
        out[i] = fn(*args)

    threads = [threading.Thread(target=one, args=(i, a), daemon=True) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["make-model"]:
        print(make_model())
    else:
        sys.exit(f"usage: {sys.argv[0]} make-model")
