"""The package's version: its one source (pyproject.toml reads it when the package is built).

A client tells its build (:func:`build`) to the coordinator at registration, which names a
process whose client is of another; read here, a process does not scan ``sys.path`` for the
installed distribution's metadata (``importlib.metadata``, tens of milliseconds of each
process's start).
"""

import functools
import hashlib

VERSION = "0.1.0"


@functools.cache
def build() -> str:
    """VERSION with a digest of the protocol's messages, as ``0.1.0+proto.1a2b3c4d``: builds
    of one release whose messages differ (checkouts between releases) are told apart. What a
    client tells the coordinator, and what ``status``, ``pjrt-rendezvous --version`` and the metrics show."""
    from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

    return f"{VERSION}+proto.{hashlib.blake2b(pb.DESCRIPTOR.serialized_pb, digest_size=4).hexdigest()}"
