"""SGLang's failure strings, classified into SPEC reasons (section 3).

SGLang records free text (``kv_mgr.failure_records[room]``); rootrank publishes a reason
from a closed vocabulary an operator can count and alert on, and keeps the text as detail.
The patterns are SGLang's real strings (``../shared/SGLANG-FACTS.md``, "Reasons a rank
records"), most specific first.
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

_BOOTSTRAP_ADDR = re.compile(r"bootstrap_addr:?\s*([A-Za-z0-9_.\-\[\]:]+?:\d+)")
_PREFILL_ENDPOINT = re.compile(r"to prefill ([A-Za-z0-9_.\-\[\]:]+?:\d+) failed")

# (needle in the lower-cased text, reason)
_RULES = (
    ("in kvpoll.bootstrapping", "bootstrap_timeout"),
    ("in kvpoll.waitingforinput", "transfer_timeout"),
    ("timed out waiting for prefill completion", "transfer_timeout"),
    ("left a handle running", "transfer_timeout"),
    ("lost connection with prefill instance", "peer_disconnect"),
    ("is healthy before, but now it is down", "peer_disconnect"),
    ("failed to get kvcache from prefill instance", "peer_disconnect"),
    ("could not fetch bootstrap info", "bootstrap_timeout"),
    ("could not fetch prefill parallel info", "bootstrap_timeout"),
    ("prefill bootstrap failed", "bootstrap_timeout"),
    ("aborted by", "aborted"),
    ("duplicate", "aborted"),
    ("cancelled bootstrap room", "aborted"),
    ("nixlremotedisconnect", "peer_disconnect"),
    ("nixl_err_remote_disconnect", "peer_disconnect"),
    ("remote disconnect", "peer_disconnect"),
    ("ucx", "ucx_error"),
    ("nixl", "nixl_error"),
    ("failed to create", "nixl_error"),
    ("failed to post", "nixl_error"),
    ("timed out", "transfer_timeout"),
    ("timeout", "transfer_timeout"),
    ("out of memory", "oom_gpu"),
)


def classify(text: str) -> Tuple[str, Optional[Dict[str, str]]]:
    """``(reason, peer)`` for one of SGLang's failure strings. ``peer`` holds what the text
    names of the other side (an ``endpoint``), or ``None``; unknown text is ``other``."""
    text = str(text)
    lower = text.lower()
    reason = "other"
    for needle, r in _RULES:
        if needle in lower:
            reason = r
            break
    peer = None
    m = _BOOTSTRAP_ADDR.search(text) or _PREFILL_ENDPOINT.search(text)
    if m:
        peer = {"endpoint": m.group(1)}
    return reason, peer


def names_prefill_peer(text: str) -> bool:
    """Whether a decode rank's failure text says the prefill instance went away (decode's
    heartbeat, ``Lost connection with prefill instance (bootstrap_addr: X)``, and its kin):
    the prefill's failure as decode learned it, published ``peer_reported``."""
    lower = str(text).lower()
    return bool(_BOOTSTRAP_ADDR.search(text) or _PREFILL_ENDPOINT.search(text)) and any(
        n in lower for n in ("lost connection with prefill instance", "is healthy before, but now it is down",
                             "failed to get kvcache from prefill instance"))
