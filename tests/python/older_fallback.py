"""The fallback hook on an older SGLang's own failure_exception (0.5.18, 0.5.22), run in a
process whose `sglang` is that version's unpacked wheel (PYTHONPATH), everything else from
the 0.5.23 venv. SGLang's ``load_plugins()`` loads the plugin from the installed wheel's
entry point; the sender and receiver are built with ``__new__`` plus the fields the method
reads, as SGLang's own CPU tests do. Prints one JSON line per case.

    python older_fallback.py ROOM_KNOWN ROOM_PENDING CULPRIT_GROUP
"""

import json
import sys
import threading

import transformers

# 0.5.18 registers a config name that transformers 5.19 already has; let the older line win
# quietly (only the registry, nothing of the code under test).
_register = transformers.AutoConfig.register
transformers.AutoConfig.register = staticmethod(lambda *a, **k: _register(*a, **{**k, "exist_ok": True}))

import sglang  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()

import rootrank.sglang as plugin  # noqa: E402
from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVReceiver, NixlKVSender  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402

known, pending, group = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
print(json.dumps({"version": sglang.__version__,
                  "sender_hooked": hasattr(NixlKVSender.__dict__["failure_exception"], "__wrapped__"),
                  "receiver_hooked": hasattr(NixlKVReceiver.__dict__["failure_exception"], "__wrapped__")}), flush=True)

kv_mgr = NixlKVManager.__new__(NixlKVManager)
kv_mgr.failure_records = {}
kv_mgr.failure_lock = threading.Lock()
kv_mgr.exceptions = {}
kv_mgr.disaggregation_mode = DisaggregationMode.PREFILL
# A multi-node instance: its dist_init_addr names the group on every node.
kv_mgr.bootstrap_host, kv_mgr.bootstrap_port, kv_mgr.dist_init_addr = "10.0.0.5", 8998, "10.0.0.5:8998"
kv_mgr.attn_tp_rank, kv_mgr.attn_tp_size, kv_mgr.attn_dp_rank = 0, 2, 0
plugin._plugin.on_kv_manager(kv_mgr)
assert kv_mgr._rootrank_rank.group == group, kv_mgr._rootrank_rank.group
kv_mgr._rootrank_rank.agent.wait_registered(10)


def run(cls, room):
    obj = cls.__new__(cls)
    obj.kv_mgr, obj.bootstrap_room, obj.conclude_state = kv_mgr, room, None
    obj._send_error = None
    obj.clear = lambda: None
    plugin._plugin.epoch += 1  # a new scheduler iteration: a fresh budget
    try:
        obj.failure_exception()
    except Exception as e:
        return {"class": cls.__name__, "type": type(e).__name__, "module": type(e).__module__, "room": e.bootstrap_room,
                "is_from_another_rank": e.is_from_another_rank, "str": str(e)}


for cls in (NixlKVSender, NixlKVReceiver):
    for room in (known, pending):
        print(json.dumps(run(cls, room)), flush=True)
