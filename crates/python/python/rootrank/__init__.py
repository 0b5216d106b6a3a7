"""rootrank: names the tensor-parallel rank that really failed an SGLang PD transfer, and why.

- :class:`Agent` runs inside a rank process: it registers the rank's liveness in etcd and
  publishes its room failure records, from a Rust thread that never needs the GIL.
- :class:`Coordinator` asks a rootrank coordinator (one URL or several replicas) for verdicts.
- :mod:`rootrank.sglang` is the SGLang plugin; SGLang's ``load_plugins()`` loads it in every
  scheduler process through the ``sglang.srt.plugins`` entry point.

Importing this package needs neither torch nor sglang.
"""

from __future__ import annotations

from rootrank._rootrank import AGENT_VERSION, Agent
from rootrank.coordinator import Coordinator
from rootrank.errors import (
    AgentStopped,
    CoordinatorError,
    CoordinatorUnavailable,
    InvalidInput,
    NotFound,
    RootrankError,
)

__version__ = AGENT_VERSION.rsplit("/", 1)[-1]

__all__ = [
    "AGENT_VERSION",
    "Agent",
    "AgentStopped",
    "Coordinator",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "InvalidInput",
    "NotFound",
    "RootrankError",
]
