"""TEST-ONLY SGLang plugin for the real-server tier (tests/python/test_server.py), found
through rootrank_test_standins-0.0.0.dist-info on the test processes' PYTHONPATH only.

SGLang registers its KV pool with NIXL as "VRAM"; on a machine without CUDA, UCX refuses it
("VRAM memory is detected as host by UCX"). This aliases NIXL's VRAM memory type to DRAM in
every nixl_agent the process creates, so the KV really moves host to host over UCX tcp.
Never ship this: on GPUs the pool is VRAM and NIXL must say so.

Also, with ROOTRANK_TEST_FAIL_POLLS_FILE set: while that file exists and holds this
scheduler's TP tag (e.g. "TP1"), this one scheduler turns on SGLang's own fault injection
(SGLANG_TEST_DISAGG_FAILURE_PROB=1, read on every poll), so one rank of the group fails its
polls, with no reason, and the others see only SGLang's all-reduced Failed. SGLang reads the
variable per process but sets it for a whole instance; this is how the tier fails one rank."""

import os
import threading
import time


def register() -> None:
    if os.environ.get("ROOTRANK_TEST_FAIL_POLLS_FILE"):
        threading.Thread(target=_fail_polls_while_file_says, args=(os.environ["ROOTRANK_TEST_FAIL_POLLS_FILE"],),
                         name="rootrank-test-fail-polls", daemon=True).start()
    from nixl._api import nixl_agent

    if getattr(nixl_agent.__init__, "_vram_as_dram", False):
        return
    original = nixl_agent.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.nixl_mems["VRAM"] = self.nixl_mems["DRAM"]
        self.nixl_mems["cuda"] = self.nixl_mems["DRAM"]

    __init__._vram_as_dram = True
    nixl_agent.__init__ = __init__


def _fail_polls_while_file_says(path: str) -> None:
    import setproctitle

    while True:
        try:
            tag = open(path).read().strip()
        except OSError:
            tag = ""
        # SGLang titles a scheduler "sglang::scheduler_TP1" once it runs (after plugins load).
        mine = bool(tag) and setproctitle.getproctitle().endswith("_" + tag)
        if mine:
            os.environ["SGLANG_TEST_DISAGG_FAILURE_PROB"] = "1"
        else:
            os.environ.pop("SGLANG_TEST_DISAGG_FAILURE_PROB", None)
        time.sleep(0.2)
