"""pjrt-rendezvous coordinator: a gRPC service issuing ordinals, running tagged rendezvous
rounds and a key-value store per job. It needs neither torch nor torch_xla.

Run it with ``pjrt-rendezvous serve``, or embed it::

    from pjrt_rendezvous.coordinator import Coordinator

    with Coordinator(port=0) as coordinator:
        print(coordinator.address)
"""

import os

# gRPC's C core logs at INFO (a failed TLS handshake, each retry) to stderr unless told
# its documented default level, ERROR: said first, before anything imports grpc.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from ._core import ALL, Code, Core, CoreError, Limits, format_ranges
from ._server import DEFAULT_JOB, Coordinator, RunningServer, ServerOptions, serve_forever, start_server
from ._state import StateFileError

__all__ = [
    "ALL",
    "DEFAULT_JOB",
    "Code",
    "Coordinator",
    "Core",
    "CoreError",
    "Limits",
    "RunningServer",
    "ServerOptions",
    "StateFileError",
    "format_ranges",
    "serve_forever",
    "start_server",
]
