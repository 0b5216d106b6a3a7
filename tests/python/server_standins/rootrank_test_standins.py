"""TEST-ONLY SGLang plugin for the real-server tier (tests/python/test_server.py), found
through rootrank_test_standins-0.0.0.dist-info on the test processes' PYTHONPATH only.

SGLang registers its KV pool with NIXL as "VRAM"; on a machine without CUDA, UCX refuses it
("VRAM memory is detected as host by UCX"). This aliases NIXL's VRAM memory type to DRAM in
every nixl_agent the process creates, so the KV really moves host to host over UCX tcp.
Never ship this: on GPUs the pool is VRAM and NIXL must say so."""


def register() -> None:
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
