"""The public surface and the dependency boundary of the package."""

from __future__ import annotations

import subprocess
import sys

import pjrt_rendezvous.client as client
import pjrt_rendezvous.coordinator as coordinator


def test_client_exports_exactly_the_public_api():
    """The client's __all__ is the documented API, sorted, and every name resolves."""
    assert client.__all__ == sorted(client.__all__, key=lambda n: (not n.isupper(), n[:1].islower(), n))
    for name in client.__all__:
        assert getattr(client, name) is not None
    assert {
        "init", "bind_thread", "get_ordinal", "get_local_ordinal", "get_world_size",
        "is_master_ordinal", "rendezvous", "barrier", "RendezvousError",
    } <= set(client.__all__)


def test_coordinator_exports_resolve():
    """Every name the coordinator exports exists."""
    for name in coordinator.__all__:
        assert getattr(coordinator, name) is not None


def test_coordinator_and_client_do_not_import_torch():
    """The coordinator (and the core client) run without torch: importing them loads neither torch nor torch_xla."""
    code = (
        "import sys, pjrt_rendezvous.coordinator, pjrt_rendezvous.client;"
        "from pjrt_rendezvous.coordinator import _cli;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_xla', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_errors_form_one_tree():
    """Every exception the client exports derives from RendezvousError; timeouts are also TimeoutError."""
    for name in client.__all__:
        obj = getattr(client, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, client.RendezvousError), name
    assert issubclass(client.RendezvousTimeout, TimeoutError)
    assert issubclass(client.UsageError, ValueError)
