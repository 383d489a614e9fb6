"""The public surface and the dependency boundary of the package."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pjrt_rendezvous.client as client
import pjrt_rendezvous.coordinator as coordinator
from pjrt_rendezvous.client._version import VERSION


def test_client_exports_exactly_the_public_api():
    """The client's __all__ is the documented API, sorted, and every name resolves."""
    assert client.__all__ == sorted(client.__all__, key=lambda n: (not n.isupper(), n[:1].islower(), n))
    for name in client.__all__:
        assert getattr(client, name) is not None
    assert {
        "init", "bind_thread", "unbind_thread", "get_ordinal", "get_local_ordinal", "get_world_size",
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


def test_a_client_process_loads_no_part_of_the_coordinator():
    """A training process's client, bound and through a round with a peer, loads neither
    the coordinator's server (its gRPC services, reflection, health checking) nor its core:
    importing them cost every process tens of milliseconds of its start (a job name's check
    imported the whole coordinator package). The client uses the core's wording of its
    errors only when it has one to word."""
    from pjrt_rendezvous.client._demo import simulated_env
    from pjrt_rendezvous.coordinator import Coordinator

    code = (
        "import sys, pjrt_rendezvous.client as pr;"
        "pr.init(timeout=60);"
        "b = pr.bind_thread(0); out = pr.rendezvous('hello', b'x'); pr.shutdown();"
        # (grpc's own import names the top packages of grpc_health and grpc_reflection)
        "print(out, sorted(m for m in sys.modules if m.startswith(('pjrt_rendezvous.coordinator.', 'grpc_health.', "
        "'grpc_reflection.'))))"
    )
    with Coordinator(port=0) as coordinator:
        runs = [
            subprocess.Popen(
                [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=simulated_env(address=coordinator.address, accelerator="v4-16", task=task, processes=2, hosts=2, threads=None),
            )
            for task in range(2)
        ]
        outs = [run.communicate(timeout=120) for run in runs]
    for run, (out, err) in zip(runs, outs):
        assert run.returncode == 0, err
        assert out.strip() == "[b'x', b'x'] []", out


def test_errors_form_one_tree():
    """Every exception the client exports derives from RendezvousError; timeouts are also TimeoutError."""
    for name in client.__all__:
        obj = getattr(client, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, client.RendezvousError), name
    assert issubclass(client.RendezvousTimeout, TimeoutError)
    assert issubclass(client.UsageError, ValueError)


def test_a_wheel_holds_only_the_package_and_runs_without_the_source_tree(tmp_path):
    """The package-dir mapping works for ``pip install .`` (the image's) as for the
    editable install the suite runs on, and installs no generic top-level names: the wheel
    holds ``pjrt_rendezvous/`` and its metadata alone, with the PEP 561 markers of the
    client and the coordinator and without the development script that regenerates the
    protos (it shipped as pjrt_rendezvous/protos/generate.py), and, installed elsewhere, a
    coordinator from it serves (its protos, its native module where a compiler is)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    source = tmp_path / "source"
    for name in ("coordinator", "client", "protos"):
        shutil.copytree(root / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"pjrt_rendezvous", f"pjrt_rendezvous-{VERSION}.dist-info"}, names
    for expected in ("coordinator/_core.py", "client/_native.c", "protos/v1/coordinator_pb2.py",
                     "protos/pjrt_rendezvous/v1/coordinator.proto", "protos/v1/coordinator_pb2.pyi",
                     "client/py.typed", "coordinator/py.typed"):
        assert f"pjrt_rendezvous/{expected}" in names, expected
    assert not [n for n in names if "generate" in n.rsplit("/", 1)[-1]], names
    site = tmp_path / "site"
    install = subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    code = (
        f"import sys; sys.path.insert(0, {str(site)!r});"
        "import pjrt_rendezvous.client as client, pjrt_rendezvous.coordinator as coordinator;"
        "from pjrt_rendezvous.client import _session;"
        "c = coordinator.Coordinator().start(); c.stop();"
        "print(coordinator.__file__); print(client.__file__); print(_session._native is not None)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    coordinator_file, client_file, native = run.stdout.split()
    assert coordinator_file.startswith(str(site)) and client_file.startswith(str(site))
    compiled = any(n.startswith("pjrt_rendezvous/client/_native.") and n.endswith((".so", ".pyd")) for n in names)
    assert native == str(compiled)
