"""pjrt-rendezvous client: ordinals, tagged rendezvous and a key-value store per thread.

Every thread of every process calls :func:`bind_thread` with its device index; from then
on the plain calls answer for that thread::

    import pjrt_rendezvous.client as pr

    pr.init()                       # address, job and topology from the environment
    with pr.bind_thread(index):
        ordinal = pr.get_ordinal()  # task id x devices per process + index
        payloads = pr.rendezvous("checkpoint", b"...")   # ordinal order

Optional submodules, not imported here because their dependencies are optional:
``pjrt_rendezvous.client.xla`` (torch_xla: ``install``, ``spawn``, ``broadcast_master_params``,
``seed``) and ``pjrt_rendezvous.client.torch_store`` (torch: a ``torch.distributed.Store`` and the
``pjrt-rendezvous://`` init method).
"""

import os

# gRPC's C core logs at INFO (a failed TLS handshake, each retry) to stderr unless told
# its documented default level, ERROR: said first, before anything imports grpc.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from ._api import (
    barrier,
    bind_thread,
    get_client,
    get_local_ordinal,
    get_ordinal,
    get_world_size,
    init,
    is_master_ordinal,
    rendezvous,
    shutdown,
    unbind_thread,
)
from ._client import Binding, Client, current_binding
from ._config import DEFAULT, Settings
from ._errors import (
    AuthenticationError,
    CoordinatorUnavailableError,
    DuplicateOrdinalError,
    InvalidArgumentError,
    LimitExceededError,
    MismatchError,
    ParticipantFailedError,
    RemoteError,
    RendezvousError,
    RendezvousTimeout,
    TopologyError,
    UnknownJobError,
    UsageError,
)
from ._topology import DEFAULT_PORT, Topology, detect_topology

__all__ = [
    "DEFAULT",
    "DEFAULT_PORT",
    "AuthenticationError",
    "Binding",
    "Client",
    "CoordinatorUnavailableError",
    "DuplicateOrdinalError",
    "InvalidArgumentError",
    "LimitExceededError",
    "MismatchError",
    "ParticipantFailedError",
    "RemoteError",
    "RendezvousError",
    "RendezvousTimeout",
    "Settings",
    "Topology",
    "TopologyError",
    "UnknownJobError",
    "UsageError",
    "barrier",
    "bind_thread",
    "current_binding",
    "detect_topology",
    "get_client",
    "get_local_ordinal",
    "get_ordinal",
    "get_world_size",
    "init",
    "is_master_ordinal",
    "rendezvous",
    "shutdown",
    "unbind_thread",
]
