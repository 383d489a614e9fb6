"""``torch.distributed`` on the coordinator: a key-value ``Store`` and the ``pjrt-rendezvous://``
``init_method``. Needs torch (the ``[torch]`` extra), not torch_xla.

Importing this module registers the URL scheme::

    import torch.distributed as dist
    import pjrt_rendezvous.client.torch_store  # registers pjrt-rendezvous://

    dist.init_process_group("gloo", init_method="pjrt-rendezvous://10.0.0.2:7481?job=train",
                            rank=rank, world_size=world_size)

or pass a store yourself::

    from pjrt_rendezvous.client.torch_store import Store

    dist.init_process_group("gloo", store=Store(prefix="run-42"), rank=rank, world_size=world_size)
"""

from ._store import (
    DEFAULT_PREFIX, DEFAULT_TIMEOUT, SCHEME, Store, StoreError, StoreTimeout, StoreUnavailable, rendezvous_handler,
)

__all__ = [
    "DEFAULT_PREFIX", "DEFAULT_TIMEOUT", "SCHEME", "Store", "StoreError", "StoreTimeout", "StoreUnavailable",
    "rendezvous_handler",
]
