"""PyTorch/XLA integration: the plain ``xm`` calls answer per thread, and a thread-per-device runner.

Needs the ``[xla]`` extra (torch 2.9.0 + torch_xla 2.9.0). Importing this module does not import
torch_xla; :func:`install` and :func:`spawn` do.

What :func:`install` replaces, and why
--------------------------------------

In ``torch_xla.core.xla_model`` (``xm``), each replacement answers for the calling thread when it
is bound (:func:`pjrt_rendezvous.client.bind_thread`, :func:`bind_device`, or :func:`spawn`) and
falls back to the original otherwise:

=============================  ==============================================  ==========================
function                       bound thread                                    unbound thread
=============================  ==============================================  ==========================
``get_ordinal(defval=0)``      the thread's global ordinal. Removed from       the original where it
                               torch_xla in 2.7; FSDP, MoCo and countless      exists (< 2.7); else the
                               scripts still call it.                          XLA runtime's once it has
                                                                               started (as < 2.7); else
                                                                               0 in a world of one, else
                                                                               ``UsageError``; in a
                                                                               helper thread of a
                                                                               process of several
                                                                               device threads,
                                                                               ``UsageError`` (whose?)
``xrt_world_size(defval=1)``   the job's world size (tasks x devices per       as ``get_ordinal``, but
                               process). Removed in 2.7, as above.             the job's in such a
                                                                               helper thread
``get_local_ordinal()``        the thread's ordinal on its host                the original; such a
                                                                               helper: ``UsageError``
``is_master_ordinal(local)``   local ordinal 0 / global ordinal 0              as ``get_local_ordinal``
``xla_device(n=None, ...)``    no ``n``: the thread's own device               the original
                               ``xla:<device index>`` (the original returns
                               the thread's default device: ``xla:0`` in a
                               thread torch_xla's runner did not start)
``rendezvous(tag, payload,     through the coordinator: tags enforced,         the original
replicas)``                    subsets allowed, a deadline, and errors naming  (an XLA all-gather);
                               the missing ordinals; no device sync, no        ``UsageError`` in a
                               compile. The original is an XLA all-gather that helper thread of a
                               ignores the tag, refuses subsets, has no        process of several
                               timeout and hangs on a skipped call.            device threads
``mesh_reduce(tag, data,       ``torch.save`` to bytes, :func:`rendezvous`,    as ``rendezvous``
reduce_fn)``                   ``torch.load`` (as torch_xla),
                               ``reduce_fn`` -- torch_xla's contract
``xla_rendezvous(payload,      as ``rendezvous`` (torch_xla's ``rendezvous``   as ``rendezvous``
ordinals, tag)``               calls it, looked up at call time: a
                               ``rendezvous`` imported before :func:`install`
                               comes here)
=============================  ==============================================  ==========================

Beside a process client of a job of several ordinals (``init()``), an unbound thread's
``get_ordinal``, ``xrt_world_size``, ``get_local_ordinal``, ``is_master_ordinal``,
``rendezvous`` and ``mesh_reduce`` raise ``UsageError`` unless the XLA runtime's world is the
job's (a TPU pod; the runtime is started to know, but by the first two): torch_xla's own answer for the runtime's world (a CPU
simulation: the process alone) made every process's main thread master ordinal 0 of a world
of one. Without one, in an XLA world larger than one (torch_xla's own ``xmp.spawn``), an
unbound ``rendezvous`` says once that :func:`install` binds no thread and names :func:`spawn`.

Functions that ``xm`` calls internally (``xm.save``, ``xm.master_print``) look these names up at
call time and so use the replacements too; ``xm.do_on_ordinals`` chooses by the runtime's
``global_ordinal()`` instead (below). ``xla_device()`` also makes the device the thread's
default, as ``torch_xla.device(n)`` does, so its syncs run there.

Two more replacements make XLA collectives between the threads of a process work (one compile,
shared: rule 2 below): ``torch_xla._XLAC._xla_step_marker``, the single call through which
``torch_xla.sync()``, ``xm.mark_step()``, ``xm.optimizer_step(barrier=True)`` and the parallel
loaders launch a graph, and ``torch_xla._XLAC._xla_sync_multi``, through which ``xm.save``,
``xm.unlazy`` and ``mesh_reduce`` sync the tensors they read, are wrapped in one process-wide
lock. When two threads miss the compile cache at once they compile the same graph twice, with
different collective op ids, and never meet (XLA aborts after 10 s). Under the lock the second
thread finds the first thread's compilation. The lock covers compile and launch only: a thread
waits for its own devices outside the lock, before a launch (torch_xla launches a device's next
graph only once its last one is done, and that one's collectives may wait for a sibling's
launch) and after one with ``wait=True``; step closures run outside it too. Wrapping these two
rather than ``torch_xla.sync``/``xm.mark_step`` also covers references taken before
:func:`install` (``from torch_xla import sync``).

Eager mode (``torch_xla.experimental.eager_mode(True)``) is refused in :func:`spawn`'s replicas
when a process runs more than one device: each op then compiles on its own, outside the lock.

Not replaced, on purpose: ``torch_xla.runtime.global_ordinal()``/``world_size()``. They are the XLA
runtime's own numbers, which XLA collectives use (``reduce_gradients`` scales by
``runtime.world_size()``). On a TPU pod they equal ours: :func:`bind_device` registers them, and
the coordinator refuses a thread whose runtime ordinal or world size differs from ours. In a CPU
simulation each process is its own XLA world: XLA collectives, ``reduce_gradients`` and
``do_on_ordinals`` stay within the process there, while the replaced calls span the job.

Rules for XLA collectives between threads (measured)
----------------------------------------------------

:func:`spawn` takes care of the first three; the last is the user's:

1. Replication is set before anything reads the runtime's world size (it caches its first answer,
   and at 1 every ``all_reduce`` is a silent no-op).
2. One compile, shared: the step lock above.
3. ``XLA_ENABLE_PARAM_ALIASING=0`` before torch_xla starts (with aliasing, 7 of 10 runs deadlocked).
4. Every thread must trace the same graph. A per-replica Python number or 0-dim tensor that is 0 or
   1 becomes a constant in one thread and a parameter in another: bring per-replica values in as
   1-D tensors copied from the CPU (as :func:`broadcast_master_params` does), use
   ``all_gather(pin_layout=False)`` (``pin_layout=True`` pads by the ordinal), and call
   ``xm.mark_step()`` before reading a tensor with pending collectives on the host with ``.cpu()``
   or ``.item()`` (they compile in C++, outside the lock; ``xm.save``, ``xm.unlazy`` and
   ``xm.mesh_reduce`` take it).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import io
import logging
import os
import pickle
import queue as queue_module
import random
import signal
import sys
import threading
import time
import traceback
import warnings
from itertools import chain
from typing import Any, Callable, Sequence

from . import _api
from ._client import Binding, Client, _copy_error, current_binding, describe_round, how_it_ended, pending_rounds, xm_binding
from ._config import LAUNCH_VARIABLE, Settings, check_timeout
from ._errors import RendezvousError, TopologyError, UsageError
from ._session import clip

log = logging.getLogger("pjrt_rendezvous.client")

__all__ = [
    "ReplicaSeed",
    "SpawnError",
    "bind_device",
    "broadcast_master_params",
    "install",
    "is_installed",
    "seed",
    "spawn",
    "uninstall",
]

_MISSING = object()

# -- install / uninstall -----------------------------------------------------------------------

# Guards _patches; held only while patching or restoring.
_install_lock = threading.Lock()
# (owner, attribute, original or _MISSING) for every patched attribute, in patch order.
_patches: list[tuple[Any, str, Any]] = []
_originals: dict[str, Any] = {}  # xm attribute -> original (absent when it did not exist)
# Process-wide: one graph compiled and launched at a time (see the module docstring). Reentrant
# so that a thread can never deadlock on itself.
_step_lock = threading.RLock()


def is_installed() -> bool:
    """True while the :func:`install` patches are in place."""
    return bool(_patches)


def install() -> bool:
    """Makes ``torch_xla.core.xla_model`` answer per bound thread (see the module docstring).

    Idempotent and thread-safe. :func:`spawn` calls it in every process it starts.

    Returns:
        True when the patches are in place; False (with a ``RuntimeWarning``) where torch_xla
        is not installed.

    Raises:
        ImportError: torch_xla is installed but does not import (for example with a torch
            version other than the one it was built for).
    """
    try:
        import torch_xla
        import torch_xla.core.xla_model as xm
    except ModuleNotFoundError as exc:
        if exc.name != "torch_xla":
            raise  # torch_xla is there but broken: say so, do not hide it behind a warning
        warnings.warn(
            "pjrt_rendezvous.client.xla.install() does nothing: torch_xla is not installed "
            "(pip install '.[xla]' in a pjrt-rendezvous checkout)",
            RuntimeWarning,
            stacklevel=2,
        )
        return False

    with _install_lock:
        if _patches:
            return True
        replacements = {
            "get_ordinal": _get_ordinal,
            "xrt_world_size": _xrt_world_size,
            "get_local_ordinal": _get_local_ordinal,
            "is_master_ordinal": _is_master_ordinal,
            "xla_device": _xla_device,
            "rendezvous": _rendezvous,
            "mesh_reduce": _mesh_reduce,
            "xla_rendezvous": _xla_rendezvous,
        }
        if not hasattr(xm, "xla_rendezvous"):  # (patched where torch_xla's rendezvous calls it)
            del replacements["xla_rendezvous"]
        for name, replacement in replacements.items():
            original = getattr(xm, name, _MISSING)
            if original is not _MISSING:
                _originals[name] = original
            _patches.append((xm, name, original))
            setattr(xm, name, replacement)
        xlac = torch_xla._XLAC
        wrappers = (
            ("_xla_step_marker", _locked_step_marker),
            ("_xla_sync_multi", _locked_sync_multi),
            ("_set_use_eager_mode", _eager_mode_refused),
        )
        for name, wrap in wrappers:
            original = getattr(xlac, name)
            _patches.append((xlac, name, original))
            setattr(xlac, name, wrap(original, xlac))
        return True


def uninstall() -> None:
    """Restores every attribute :func:`install` replaced, exactly (removed ones are removed again).

    Idempotent; a no-op when nothing is installed.
    """
    with _install_lock:
        while _patches:
            owner, name, original = _patches.pop()
            if original is _MISSING:
                if hasattr(owner, name):
                    delattr(owner, name)
            else:
                setattr(owner, name, original)
        # _originals stay: a replacement captured while installed (``from ... import
        # rendezvous``) still falls back to them in an unbound thread.


def _locked_step_marker(original: Callable, xlac: Any) -> Callable:
    def _xla_step_marker(device: str = "", devices: Sequence[str] = (), wait: bool = True, reset_scope: bool = True):
        own = [device or xlac._xla_get_default_device()]
        _launch_locked(xlac, own, wait, lambda: original(device, list(devices), wait=False, reset_scope=reset_scope))

    _xla_step_marker.__wrapped__ = original  # type: ignore[attr-defined]
    return _xla_step_marker


def _locked_sync_multi(original: Callable, xlac: Any) -> Callable:
    def _xla_sync_multi(tensors: Sequence[Any], devices: Sequence[str], wait: bool = True, sync_xla_data: bool = True):
        own = sorted({str(t.device) for t in tensors})  # (``devices``: replication, siblings' too)
        _launch_locked(xlac, own, wait, lambda: original(tensors, list(devices), wait=False, sync_xla_data=sync_xla_data))

    _xla_sync_multi.__wrapped__ = original  # type: ignore[attr-defined]
    return _xla_sync_multi


def _launch_locked(xlac: Any, own: list[str], wait: bool, launch: Callable[[], None]) -> None:
    """``launch`` (compile and launch, not waiting) under the step lock, with the waits for
    the thread's ``own`` devices outside it (:func:`_wait_device_ops`)."""
    _wait_device_ops(xlac, own)
    with _step_lock:
        launch()
    if wait:
        _wait_device_ops(xlac, own)


# Device threads in this process, when spawn() runs them (eager mode is refused beyond one).
_device_threads = 0
_job_world_size = 0  # (spawn's children: the job's, for a thread or a forked process bound to no device)
_EAGER_REFUSED = (
    "eager mode (torch_xla.experimental.eager_mode(True)) cannot run with a thread per device: each "
    "op compiles on its own, outside the step lock, so the threads' collectives get different ids and "
    "never meet (XLA aborts the process after 10 s); leave it off in spawn()'s replicas "
    "(torch_xla.compile still works)"
)


def _eager_mode_refused(original: Callable, xlac: Any) -> Callable:
    def _set_use_eager_mode(enable: bool) -> None:
        if enable and _device_threads > 1:
            raise UsageError(_EAGER_REFUSED)
        original(enable)

    _set_use_eager_mode.__wrapped__ = original  # type: ignore[attr-defined]
    return _set_use_eager_mode


def _wait_device_ops(xlac: Any, devices: list[str]) -> None:
    """Waits, outside the step lock (why: the module docstring), for what was launched on these
    devices, the calling thread's own, and only these: a sibling's device may hold its next
    step, waiting for ours."""
    if devices:  # (none: nothing to launch; the runtime would wait for every device)
        xlac._xla_wait_device_ops(xlac._xla_real_devices(devices))  # "xla:1" -> "CPU:1"/"TPU:1"


def _get_ordinal(defval: int = 0) -> int:
    """The calling thread's global ordinal (pjrt_rendezvous; restored after torch_xla 2.7 removed it)."""
    binding = xm_binding("xm.get_ordinal()")
    if binding is not None:
        return binding.ordinal
    _refuse_whose("xm.get_ordinal()", start=False)  # (not started: refused below, world > 1)
    if "get_ordinal" in _originals:
        return _originals["get_ordinal"](defval)
    runtime = _api.started_xla_runtime()  # torch_xla < 2.7 answered with its numbers
    if runtime is not None:
        return runtime.global_ordinal()
    _api._binding("xm.get_ordinal")  # unbound: refused outside a world of one
    return 0


def _xrt_world_size(defval: int = 1) -> int:
    """The job's world size (pjrt_rendezvous; restored after torch_xla 2.7 removed it)."""
    binding = xm_binding("xm.xrt_world_size()")
    if binding is not None:
        return binding.world_size
    if _device_threads > 1:  # (a helper thread of spawn's, or a worker it forked: the job's, every replica's)
        return _job_world_size
    _refuse_other_world("xm.xrt_world_size()", start=False)
    if "xrt_world_size" in _originals:
        return _originals["xrt_world_size"](defval)
    runtime = _api.started_xla_runtime()
    if runtime is not None:
        return runtime.world_size()
    _api._binding("xm.xrt_world_size")
    return 1


def _get_local_ordinal() -> int:
    """The calling thread's ordinal among this host's devices (pjrt_rendezvous)."""
    binding = xm_binding("xm.get_local_ordinal()")
    if binding is not None:
        return binding.local_ordinal
    _refuse_whose("xm.get_local_ordinal()")
    return _originals["get_local_ordinal"]()


def _is_master_ordinal(local: bool = True) -> bool:
    """True for local ordinal 0 (``local=True``) or global ordinal 0 (pjrt_rendezvous).
    ``local`` as torch_xla takes it, but for what is not a bool or 0/1 (TypeError)."""
    local = _api.master_local(local, "xm.is_master_ordinal()")
    binding = xm_binding("xm.is_master_ordinal()")
    if binding is not None:
        return (binding.local_ordinal if local else binding.ordinal) == 0
    _refuse_whose("xm.is_master_ordinal()")
    return _originals["is_master_ordinal"](local)


def _xla_device(n: int | None = None, devkind: str | None = None):
    """Without ``n``, the calling thread's own device (pjrt_rendezvous); else torch_xla's."""
    binding = None if n is not None else xm_binding("xm.xla_device()")
    if binding is None:
        return _originals["xla_device"](n, devkind)
    import torch
    import torch_xla

    device = f"xla:{binding.device_index}"
    # As torch_xla.device(n) does: the thread's syncs and the runtime's ordinal follow it
    # (a thread bound with bind_thread alone would otherwise sync device 0).
    torch_xla._XLAC._xla_set_default_device(device)
    return torch.device(device)


def _rendezvous(tag: str, payload: bytes = b"", replicas: Sequence[int] = ()) -> list[bytes]:
    """Waits until every ordinal in ``replicas`` (default all) made its matching call (its
    k-th on that group; each brings ``tag``), through the pjrt-rendezvous coordinator;
    returns the payloads in ordinal order.

    See :func:`pjrt_rendezvous.client.rendezvous` for the errors.
    """
    binding = xm_binding("xm.rendezvous()")
    if binding is None:
        _refuse_unbound("xm.rendezvous()")
        return _originals["rendezvous"](tag, payload, [] if replicas is None else list(replicas))  # (None too, as torch_xla's)
    if _api._ended:
        replicas = _api._check_ended("xm.rendezvous", tag, replicas, payload)
    return binding.client.rendezvous(binding, tag, payload, replicas)


def _xla_rendezvous(payload: bytes = b"", ordinals: Sequence[int] | None = None, tag: str | None = None) -> list[bytes]:
    """torch_xla's all-gather, which its ``rendezvous`` looks up at call time: in a bound
    thread, through the coordinator as :func:`_rendezvous` (so a ``rendezvous`` imported from
    ``xm`` before :func:`install` is ours too); else the original."""
    if xm_binding("xm.xla_rendezvous()") is None:
        _refuse_unbound("xm.xla_rendezvous()")
        return _originals["xla_rendezvous"](payload, ordinals, tag=tag)
    return _rendezvous("" if tag is None else tag, payload, ordinals or ())


def _refuse_other_world(what: str, *, start: bool = True) -> None:
    """With a process client of a job of several ordinals in use, torch_xla's own answer in a
    thread bound to none is the XLA runtime's, for a world that is not the job's where the
    runtime's is another size (a CPU simulation: the process alone): the main thread of every
    process was master ordinal 0 of a world of one, and its rendezvous waited for nobody (a
    download meant for one process ran in all). With ``start``, the runtime is started to
    know (the original, about to run, would start it: on a TPU pod its world is the job's);
    without, one not started is let be (the caller refuses that itself)."""
    client = _api._client
    if client is None or client._closed or client.topology.world_size <= 1:
        return
    runtime = _api.started_xla_runtime()
    if runtime is None and not start:
        return
    if runtime is None:
        import torch_xla.runtime as runtime
    size = runtime.world_size()  # (starts it)
    if size == client.topology.world_size:
        return
    runtime_world = f"of {size}" + (" (this process alone)" if size == client.topology.devices_per_process else "")
    raise UsageError(
        f"{what} in thread {threading.current_thread().name!r}, bound to no ordinal, beside job "
        f"{client.settings.job!r} of {client.topology.world_size} ordinals: torch_xla's own would answer for the XLA "
        f"runtime's world ({runtime_world}), not the job's; bind the thread (bind_thread, bind_device) or run the "
        "replicas with xla.spawn, and ask there"
    )


def _refuse_whose(what: str, *, start: bool = True) -> None:
    """In a process of several device threads (``spawn``), a thread bound to none (a helper
    thread: ``MpDeviceLoader``'s, which starts the DataLoader's workers, or one of the
    program's) is no replica: torch_xla's answer, the XLA runtime's for the thread's default
    device, was ordinal 0 of a world of the process's devices in every replica's helpers,
    and silently wrong for a dataset sharded by it."""
    if _device_threads > 1:
        raise UsageError(
            f"{what} in thread {threading.current_thread().name!r}, bound to no device, in a process "
            f"of {_device_threads} device threads: which replica's? Ask in a replica's thread (the one "
            "spawn() runs fn in) and pass the value on (to a Dataset, a DistributedSampler)"
        )
    _refuse_other_world(what, start=start)


def _refuse_unbound(what: str) -> None:
    """In a process of several device threads (``spawn``), torch_xla's own rendezvous is an
    XLA all-gather over every device of the process: from a thread bound to none (a helper
    thread) it waits for the device threads' part, which never comes, until XLA aborts the
    process. Beside a process client of a job whose world the runtime's is not, it is refused
    (_refuse_other_world). Elsewhere it runs, and in an XLA world larger than one (torch_xla's
    own runner) says once that install() binds no thread."""
    global _told_unbound
    if _device_threads > 1:
        raise UsageError(
            f"{what} in thread {threading.current_thread().name!r}, bound to no device, in a process "
            f"of {_device_threads} device threads: torch_xla's own would wait for every device's "
            "thread and never complete; make the call in a replica's thread (the one spawn() runs "
            "fn in)"
        )
    _refuse_other_world(what)
    if _told_unbound:
        return
    runtime = _api.started_xla_runtime()
    if runtime is not None and runtime.world_size() > 1:  # torch_xla's own runner: xmp.spawn, torch_xla.launch
        _told_unbound = True
        log.warning(
            "%s in thread %r, bound to no ordinal, in an XLA world of %d: torch_xla's own runs (an XLA "
            "all-gather: the tag ignored, no timeout; between the threads of a process it aborts after 10 s, "
            "torch_xla 2.9 on CPU), not pjrt_rendezvous's. install() alone binds no thread: run the replicas "
            "with pjrt_rendezvous.client.xla.spawn, which binds each (said once per process)",
            what, threading.current_thread().name, runtime.world_size(),
        )


_told_unbound = False


def _mesh_reduce(tag: str, data: Any, reduce_fn: Callable[[list], Any]) -> Any:
    """Gathers ``data`` from every ordinal (through the coordinator) and returns
    ``reduce_fn(list of the copies, in ordinal order)`` -- torch_xla's contract.

    XLA tensors in ``data`` are moved to the CPU first; call ``xm.mark_step()`` before if they
    have pending collectives. Copies are read with ``torch.load`` as torch_xla 2.9 reads them
    (torch's default ``weights_only=True``: tensors, numbers, strings, lists, tuples and dicts;
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` lifts it, as for torch_xla).
    """
    binding = xm_binding("xm.mesh_reduce()")
    if binding is None:
        _refuse_unbound("xm.mesh_reduce()")
        return _originals["mesh_reduce"](tag, data, reduce_fn)
    if _api._ended:
        _api._check_ended("xm.mesh_reduce", tag)
    import torch
    import torch_xla.core.xla_model as xm

    to_cpu = getattr(xm, "_maybe_convert_to_cpu", None)
    cpu_data = to_cpu(data) if to_cpu is not None else data
    buffer = io.BytesIO()
    try:
        torch.save(cpu_data, buffer)
    except Exception as exc:  # (a lambda, a lock: Python's bare pickling error, naming no call)
        _say_first(exc, f"xm.mesh_reduce({tag!r}): this replica's data cannot be saved with torch.save")
        raise
    try:
        payloads = binding.client.rendezvous(binding, tag, buffer.getvalue())
    except RendezvousError as exc:  # (the coordinator's names a rendezvous: the call was this one)
        mine = _copy_error(exc)  # (the sending thread's is its siblings' too)
        _say_first(mine, f"xm.mesh_reduce({tag!r})")
        raise mine.with_traceback(exc.__traceback__) from exc.__cause__
    copies = []
    for ordinal, payload in enumerate(payloads):
        try:
            copies.append(torch.load(io.BytesIO(payload)))
        except Exception as exc:  # (weights_only refused it: every member raises, and said not whose)
            if payload[:4] == _TORCH_SAVED:
                whose = f"the copy of ordinal {ordinal}, which every member reads"
            else:  # (an empty one raised EOFError with no message at all)
                whose = f"ordinal {ordinal} sent {len(payload)} bytes that torch.save did not write (did it call xm.rendezvous({tag!r}) instead?)"
            _say_first(exc, f"xm.mesh_reduce({tag!r}): {whose}")
            raise
    return reduce_fn(copies) if copies else cpu_data


_TORCH_SAVED = b"PK\x03\x04"  # how torch.save's files begin (a zip archive)


def _say_first(exc: BaseException, note: str) -> None:
    """Puts ``note`` at the start of ``exc``'s message, which spawn's summaries show (a note
    added with ``add_note`` is shown only under a traceback), keeping its type."""
    original = exc.args
    if not original or isinstance(original[0], str):
        exc.args = (f"{note}: {original[0]}" if original and original[0] else note, *original[1:])
        if note in str(exc):
            return
        exc.args = original  # (its message is not its args': ImportError's, SyntaxError's, UnicodeError's)
    if hasattr(exc, "add_note"):
        exc.add_note(note)


# -- binding a thread to its device ------------------------------------------------------------


def bind_device(thread_index: int, *, client: Client | None = None) -> Binding:
    """Makes ``xla:<thread_index>`` the calling thread's default device and binds the thread.

    The XLA runtime's own global ordinal of that device and its world size go with the
    registration, and the coordinator cross-checks them against the rank table: where the
    runtime's world is ours (a TPU pod) its ordinal must equal ours; where the runtime sees only
    this process (PJRT on CPU) it must equal the thread index.

    Args:
        thread_index: the device index within this process (``xla:<thread_index>``).
        client: the client to bind with (default: the process client).

    Returns:
        The :class:`~pjrt_rendezvous.client.Binding` (a context manager that unbinds).

    Raises:
        MismatchError: the runtime numbers the device differently from the rank table; the
            message names both numbers (InvalidArgumentError: its number is out of the
            job's range); or its world is one device while this process drives several
            (outside ``spawn``, replication not set: its collectives would be no-ops).
        UsageError: ``spawn`` bound this thread already; and see :meth:`Client.bind_thread`.
        DuplicateOrdinalError: see :meth:`Client.bind_thread`.
    """
    import torch_xla

    bound = current_binding()
    if bound is not None and _device_threads:
        raise UsageError(
            f"bind_device({thread_index}): spawn() already bound this thread to ordinal {bound.ordinal} "
            f"(device xla:{bound.device_index}); fn needs no bind_device"
        )
    client = client or _api.get_client()
    try:
        client.topology.ordinal(thread_index)  # (out of range: our TopologyError, not the runtime's IndexError)
    except TopologyError as exc:
        devices = _api._runtime_devices()
        if devices is not None and devices > client.topology.devices_per_process:
            chips = client.topology.chips_per_process
            value = f"={devices // chips}" if devices % chips == 0 else " (the devices per chip)"
            raise TopologyError(
                f"{exc}; the XLA runtime runs {devices} devices in this process: set "
                f"PJRT_RENDEZVOUS_CORES_PER_CHIP{value} (or run the replicas with xla.spawn, which sets it)"
            ) from None
        raise
    xlac = torch_xla._XLAC
    before = xlac._xla_get_default_device()
    xlac._xla_set_default_device(f"xla:{thread_index}")
    try:
        return _bind_current_device(thread_index, client=client)
    except BaseException:
        xlac._xla_set_default_device(before)  # refused (bound already, say): the thread keeps its device
        raise


def _bind_current_device(thread_index: int, *, client: Client | None = None) -> Binding:
    """Binds with the runtime's numbers for the calling thread's current default device."""
    import torch_xla.runtime as xr

    client = client or _api.get_client()
    # As torch_xla's thread runner: with one device per process, the runtime's ordinal and
    # world size are cached for Dynamo, which reads them then without a graph break (before
    # world_size() below, which caches only itself).
    getattr(xr, "_init_world_size_ordinal", lambda: None)()
    return client.bind_thread(
        thread_index, runtime_ordinal=xr.global_ordinal(), runtime_world_size=xr.world_size()
    )


# -- spawn -------------------------------------------------------------------------------------


class SpawnError(RendezvousError):
    """One or more replicas run by :func:`spawn` raised, or a process died or hung.

    Attributes:
        failures: ordinal -> the exception it raised (rebuilt in the parent; ``RuntimeError``
            with the text when it could not be pickled). A process that died before reporting
            appears under each of its unreported ordinals; under ``-(task + 1)`` when it died
            before its threads had ordinals, when its setup raised, or when it exited with a
            failure after its replicas returned.
        tracebacks: ordinal -> the formatted traceback from the child ("" for a process that
            died; the calling process's, marked so, for a result it could not unpickle).
        results: ordinal -> return value of the replicas that finished.
        terminated: ordinals still running when their processes were stopped after the
            failure or timeout (``-(task + 1)`` for a process stopped before it reported its
            ordinals).
    """

    def __init__(
        self,
        message: str,
        *,
        failures: dict[int, BaseException],
        tracebacks: dict[int, str],
        results: dict[int, Any],
        terminated: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self.failures = failures
        self.tracebacks = tracebacks
        self.results = results
        self.terminated = sorted(terminated)


def spawn(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int | None = None,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
    *,
    devices_per_process: int | None = None,
    address: str | None = None,
    job: str | None = None,
    timeout: float | None = None,
    grace: float = 5.0,
) -> dict[int, Any]:
    """Runs ``fn(ordinal, *args)`` in one thread per XLA device, one process per chip.

    Shaped like ``torch_xla.distributed.xla_multiprocessing.spawn`` (its positional
    arguments too) and its thread runner ``torch_xla._internal.pjrt.run_multiprocess``. In
    each process, before ``fn`` runs: with a thread per device, ``XLA_ENABLE_PARAM_ALIASING=0``
    is set before the runtime starts (unless the environment sets it), replication is set over
    the process's devices (``initialize_multiprocess``, as torch_xla does), :func:`install`
    patches ``xm``, and each thread is bound with :func:`bind_device` to ``xla:<thread index>``
    and its global ordinal. ``fn`` receives the global ordinal, like
    ``xmp.spawn``'s index.

    ``PJRT_DEVICE=CPU`` simulates chips: ``nprocs`` processes (default 1) with
    ``devices_per_process`` devices each (default ``CPU_NUM_DEVICES``, else 1), numbered as
    ``PJRT_RENDEZVOUS_TASK_ID`` x devices + thread. ``PJRT_DEVICE=TPU`` runs one process per
    local chip (``nprocs`` must be None) with the devices the runtime reports.

    The coordinator: ``address``, else ``PJRT_RENDEZVOUS_ADDRESS``, else one started here for
    the call on loopback with an ephemeral port -- except on a multi-host TPU slice, where the
    processes look for it at worker 0's default port (run ``pjrt-rendezvous serve`` there).

    Args:
        fn: a picklable (module-level) function called as ``fn(ordinal, *args)``.
        args: further arguments (picklable).
        nprocs: processes on this host (CPU: default 1, each with ``devices_per_process``
            replicas: ``xmp.spawn``'s ``nprocs=1``, one replica, is ``devices_per_process=1``
            here, and ``nprocs=1`` with more devices warns; TPU: must be None).
        join, daemon: accepted and ignored, as torch_xla 2.9's ``xmp.spawn`` does: the call
            waits for the replicas and returns their results.
        start_method: the multiprocessing start method; ``spawn`` (default) or ``forkserver``
            give each process a fresh XLA runtime. ``fork`` only works while this process has
            not started one.
        devices_per_process: CPU only: devices (threads) per process.
        address: the coordinator ``host:port``.
        job: the coordinator job (default ``PJRT_RENDEZVOUS_JOB``, else ``default``).
        timeout: seconds for the whole run; None waits for ever.
        grace: after the first failure, seconds to let the other replicas finish or fail
            before their processes are stopped (a replica waiting for a failed one would
            otherwise wait out its rendezvous deadline).

    Returns:
        ``{ordinal: fn's return value}`` for every replica (XLA tensors in them come back as
        CPU tensors, parameters as parameters; a value that cannot be pickled comes back as
        None, with a warning: ``xmp.spawn`` returns none).

    Raises:
        SpawnError: a replica raised (the message names its ordinal and carries its
            traceback), a process died (before reporting, or with a failure after its
            replicas returned), a result could not be unpickled, or ``timeout`` passed.
        UsageError: bad arguments, or an unsupported ``PJRT_DEVICE``.
        TypeError: ``nprocs`` or ``devices_per_process`` not an int, ``grace`` not a number.
        pickle.PicklingError: ``fn`` or ``args`` cannot be pickled (a lambda, a nested
            function), before anything starts.
    """
    import multiprocessing

    timeout = check_timeout(timeout)
    if isinstance(grace, bool) or not isinstance(grace, (int, float)):
        raise TypeError(f"grace must be a number of seconds, got {grace!r}")
    if not grace >= 0:
        raise UsageError(f"grace must be >= 0 seconds, got {grace!r}")
    device_type = _device_type()
    env: dict[str, str] = {}
    topology = None
    if device_type == "CPU":
        ported = nprocs == 1 and devices_per_process is None  # (xmp.spawn's one device in this process)
        nprocs = 1 if nprocs is None else nprocs
        if devices_per_process is None:
            text = os.environ.get("CPU_NUM_DEVICES", "").strip() or "1"
            if not text.isdigit():
                raise UsageError(f"CPU_NUM_DEVICES={text!r} is not a number of devices")
            devices_per_process = int(text)
            if ported and devices_per_process > 1:
                warnings.warn(
                    f"spawn(nprocs=1) on CPU runs CPU_NUM_DEVICES={devices_per_process} replicas in one "
                    "child process, where xmp.spawn(nprocs=1) runs one in the calling process: pass "
                    "devices_per_process=1 for one replica",
                    RuntimeWarning,
                    stacklevel=2,
                )
        _check_count("nprocs", nprocs)
        _check_count("devices_per_process", devices_per_process)
        env.update(
            PJRT_DEVICE="CPU",
            CPU_NUM_DEVICES=str(devices_per_process),
            PJRT_RENDEZVOUS_NUM_TASKS=str(nprocs),
            PJRT_RENDEZVOUS_CORES_PER_CHIP=str(devices_per_process),
            PJRT_RENDEZVOUS_LOCAL_WORLD_SIZE=str(nprocs),
        )
        # One simulated chip per process, whatever chip bounds the environment (or, on a TPU
        # VM, the metadata server) gives the host: they would multiply the devices per process.
        env["TPU_CHIPS_PER_PROCESS_BOUNDS"] = "1,1,1"
        threaded = devices_per_process > 1
    else:  # TPU
        if nprocs is not None or devices_per_process is not None:
            raise UsageError(
                "on TPU, spawn() runs one process per local chip with the devices the runtime "
                "reports: leave nprocs and devices_per_process unset (limit chips with "
                "TPU_VISIBLE_CHIPS / TPU_NUM_DEVICES; unlike xmp.spawn, nprocs=1 does not run one "
                "device in this process)"
            )
        from torch_xla._internal import tpu

        nprocs = tpu.num_local_processes()
        topology = _api._detect(os.environ, address)
        threaded = topology.cores_per_chip > 1
    if threaded:
        aliasing = os.environ.get("XLA_ENABLE_PARAM_ALIASING")
        if aliasing is None:
            env["XLA_ENABLE_PARAM_ALIASING"] = "0"  # rule 3 of the module docstring
        elif aliasing.strip().lower() not in ("0", "false"):
            warnings.warn(
                f"XLA_ENABLE_PARAM_ALIASING={aliasing} with a thread per device: collectives "
                "between threads deadlock in sync() with parameter aliasing on (measured on "
                "torch_xla 2.9); unset it to let spawn() turn aliasing off",
                RuntimeWarning,
                stacklevel=2,
            )

    if job is not None:
        env["PJRT_RENDEZVOUS_JOB"] = job
    if (start_method == "fork" or device_type != "CPU") and "torch_xla" in sys.modules:
        import torch_xla

        if torch_xla._XLAC._xla_runtime_is_initialized():
            # A forked child inherits the started runtime; on TPU this process holds the
            # chips the children need (xmp.spawn refuses a started runtime for every method;
            # on CPU a fresh process may still start its own).
            raise UsageError(
                f"spawn(start_method={start_method!r}): this process has started its XLA runtime "
                "(it used an XLA device), "
                + ("which a forked child would inherit: " if start_method == "fork" else "and holds the TPU its processes need: ")
                + "call spawn before using a device"
            )
    args = tuple(args)
    try:
        payload = pickle.dumps((fn, args))  # refused here, before anything is started
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        what = "fn" if _unpicklable(fn) else "args"
        raise pickle.PicklingError(
            f"spawn(): {what} cannot be sent to the processes it starts ({type(exc).__name__}: {exc}): "
            + ("fn must be a function defined at the top level of a module (not a lambda, a nested "
               "function or a method of a local class)" if what == "fn" else "every argument must be picklable")
        ) from exc
    context = multiprocessing.get_context(start_method)
    reports = context.Queue()
    coordinator = None
    address = address or os.environ.get("PJRT_RENDEZVOUS_ADDRESS") or None
    processes = []
    try:
        if address is None and (device_type == "CPU" or len(topology.worker_hostnames) <= 1):
            from pjrt_rendezvous.coordinator import Coordinator

            coordinator = Coordinator(port=0).start()
            address = coordinator.address
        if address is not None:
            env["PJRT_RENDEZVOUS_ADDRESS"] = address
        env[LAUNCH_VARIABLE] = f"xla.spawn {os.getpid()} {time.time_ns()}"  # (one run: see Core._register)
        # else a multi-host TPU slice: every process finds the coordinator at worker 0's default port
        for task in range(nprocs):
            child_env = dict(env)
            if device_type == "CPU":
                child_env.update(
                    PJRT_RENDEZVOUS_TASK_ID=str(task), PJRT_RENDEZVOUS_LOCAL_RANK=str(task)
                )
            process = context.Process(
                target=_child_main,
                args=(task, nprocs, child_env, payload, reports, os.getpid()),
                name=f"pjrt-rendezvous-task-{task}",
                daemon=False,
            )
            process.start()
            processes.append(process)
        # On CPU the parent knows every process's ordinals; on TPU each child reports its own.
        expected = (
            {t: list(range(t * devices_per_process, (t + 1) * devices_per_process)) for t in range(nprocs)}
            if device_type == "CPU"
            else {}
        )
        waiting = _rounds_waiting({**os.environ, **env}, address or (topology.address if topology else None))
        return _supervise(processes, reports, expected=expected, timeout=timeout, grace=grace, waiting=waiting)
    finally:
        _stop(processes)
        reports.close()
        reports.join_thread()
        if coordinator is not None:
            coordinator.stop(grace=0)


def _unpicklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
        return False
    except Exception:  # noqa: BLE001 -- whatever pickling raises
        return True


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise UsageError(f"{name} must be a positive int, got {value!r}")


def _device_type() -> str:
    device = os.environ.get("PJRT_DEVICE", "").strip().upper()
    if not device:
        import torch_xla.runtime as xr  # picks its default (TPU where libtpu is installed)

        device = (xr.device_type() or "").upper()
    if device not in ("CPU", "TPU"):
        raise UsageError(
            f"spawn() supports PJRT_DEVICE=TPU and PJRT_DEVICE=CPU (simulated chips), got "
            f"PJRT_DEVICE={device or '(unset)'!r}"
        )
    if device == "TPU" and "torch_xla" in sys.modules:
        import torch_xla

        if torch_xla._XLAC._xla_runtime_is_initialized():
            raise UsageError(
                "the XLA runtime is already running in this process and holds the TPU: do not "
                "use an XLA device before calling spawn() (as with xmp.spawn)"
            )
    return device


_STILL_RUNNING_EVERY = 60.0  # seconds: how often spawn() names the replicas still running after one returned


def _stop(processes, wait: float = 5.0) -> list:
    """Stops the processes still alive, all at once (each leaves the job as it goes: its
    SIGTERM handler), killing those still there after ``wait``; returns them."""
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        process.terminate()
    end = time.monotonic() + wait
    for process in alive:
        process.join(max(0.0, end - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(wait)
    return alive


# A replica that skipped a rendezvous (or took another branch) leaves the others' collective
# waiting for it: XLA ends such a process with SIGABRT after 10 s (torch_xla 2.9, measured).
_ABORT_HINT = " (SIGABRT: XLA aborts a process whose collective waits 10 s for a replica that does not join, its log says which; or another abort)"
_ROUNDS_NAMED = 3  # the rounds a crash's report names, of those still waiting
_GROUP_CHARACTERS = 200  # a named round's group is cut past this (a strided group of thousands)


def _rounds_waiting(env: dict[str, str], address: str | None) -> Callable[[], str]:
    """A function saying which of the job's rounds wait for whom, for a crashed process's
    report: a crash in a collective often follows a rendezvous one replica skipped, which the
    coordinator still waits for (best effort: '' when none, or the coordinator does not answer
    within 2 s)."""
    try:
        settings = Settings.resolve(env, address=address) if address else None
    except (RendezvousError, ValueError):  # (the children say what is wrong with the settings)
        settings = None

    def describe() -> str:
        import grpc

        from pjrt_rendezvous.coordinator._core import describe_group

        if settings is None:
            return ""
        try:
            rounds = pending_rounds(settings)
        except (grpc.RpcError, RendezvousError, OSError):  # (RendezvousError: its TLS files unreadable)
            return ""
        named = [
            f"round {r.round} of {describe_group(tuple(r.replicas), _GROUP_CHARACTERS)}, {clip(describe_round(r))}"
            for r in rounds[:_ROUNDS_NAMED]
        ]
        more = f"; and {len(rounds) - _ROUNDS_NAMED} more" if len(rounds) > _ROUNDS_NAMED else ""
        return f"; the coordinator's rounds waiting then: {'; '.join(named)}{more}" if named else ""

    return describe


def _supervise(
    processes,
    reports,
    *,
    expected: dict[int, list[int]],
    timeout: float | None,
    grace: float,
    waiting: Callable[[], str] = lambda: "",
) -> dict[int, Any]:
    """Collects every replica's report; stops the processes after a failure (plus ``grace``)
    or at ``timeout``; raises SpawnError naming the failed ordinals (and, for a process that
    crashed, ``waiting()``: what the coordinator's rounds wait for)."""
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    results: dict[int, Any] = {}
    failures: dict[int, BaseException] = {}
    tracebacks: dict[int, str] = {}
    order: list[tuple[float, int]] = []  # (when it was reported, failed ordinal)
    ordinals_of: dict[int, list[int]] = dict(expected)  # task -> its ordinals, when known
    finished: set[int] = set()  # tasks that reported every thread
    first_failure_at: float | None = None
    first_result_at: float | None = None  # (when a replica first returned: then say who runs on)
    stopping_at: float | None = None  # (when the processes left running were stopped)
    still_running_said = 0.0
    timed_out = False

    def handle(message) -> None:
        nonlocal first_result_at
        kind, task, at, *rest = message
        if kind == "ordinals":
            ordinals_of[task] = rest[0]
        elif kind == "result":
            first_result_at = first_result_at or time.monotonic()
            ordinal, blob = rest
            try:
                results[ordinal] = pickle.loads(blob)
            except Exception as exc:  # noqa: BLE001 -- reported as that replica's failure
                error = UsageError(
                    f"spawn(): the return value of ordinal {ordinal} cannot be unpickled in the calling "
                    f"process: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
                )
                record(ordinal, error, _IN_PARENT + traceback.format_exc(), at)
        elif kind == "error":
            if stopping_at is not None and at >= stopping_at:
                return  # a replica failing as its process or a sibling's leaves, stopped: not a failure of its own
            ordinal, blob, text = rest
            try:
                error = pickle.loads(blob)
            except Exception:  # noqa: BLE001 -- keep the text at least
                error = RuntimeError(text.strip().splitlines()[-1] if text.strip() else "unknown error")
            record(ordinal, error, text, at)
        elif kind == "done":
            finished.add(task)

    def record(ordinal: int, error: BaseException, text: str, at: float | None = None) -> None:
        nonlocal first_failure_at
        failures[ordinal] = error
        tracebacks[ordinal] = text
        order.append((time.monotonic() if at is None else at, ordinal))
        if first_failure_at is None:
            first_failure_at = time.monotonic()

    def drain(wait: float) -> int:
        """Handles the reports that come within ``wait``; how many."""
        end, handled = time.monotonic() + wait, 0
        while True:
            try:
                handle(reports.get(timeout=max(0.0, end - time.monotonic())))
                handled += 1
            except queue_module.Empty:
                return handled
            except (EOFError, OSError):
                return handled

    def settle() -> None:
        """Handles what exited processes sent, however long it takes to read (a large
        result), until nothing more comes for a moment."""
        while drain(0.5):
            pass

    crashed: set[int] = set()  # tasks whose process exited before reporting every thread

    def exited(process) -> str:
        code = process.exitcode
        if code is None or code >= 0:
            return f"exited with code {code}"
        try:
            name = f" ({signal.Signals(-code).name})" if -code != signal.SIGABRT else _ABORT_HINT
        except ValueError:
            name = ""
        return f"was killed by signal {-code}{name}"

    def unreported(task: int) -> list[int]:
        return [o for o in ordinals_of.get(task, []) if o not in results and o not in failures]

    def crash(task: int, process) -> None:
        # Exited on its own without reporting every thread: it crashed (XLA aborts with
        # SIGABRT when a collective waits 10 s for a sibling that never arrives).
        crashed.add(task)
        error = _ProcessEnded(f"the process of task {task} (pid {process.pid}) {exited(process)} before reporting{waiting()}")
        for ordinal in unreported(task) or [-(task + 1)]:
            record(ordinal, error, "")

    while True:
        drain(0.05)
        if all(not p.is_alive() for p in processes):
            settle()  # the last messages of processes that just exited
            break
        for task, process in enumerate(processes):
            # A crash is a failure as soon as it is seen: its peers waiting for it are stopped
            # after the grace (not left to the coordinator's heartbeat timeout), and named
            # after the crash that failed them.
            if task not in finished and task not in crashed and not process.is_alive():
                settle()  # what it sent before it exited
                if task not in finished:
                    crash(task, process)
        now = time.monotonic()
        if first_failure_at is not None and now - first_failure_at >= grace:
            break
        if first_result_at is not None and now - max(first_result_at, still_running_said) >= _STILL_RUNNING_EVERY:
            from pjrt_rendezvous.coordinator._core import format_ranges

            still_running_said = now
            running = {task: unreported(task) for task in ordinals_of if task not in finished and unreported(task)}
            ordinals = [o for task_ordinals in running.values() for o in task_ordinals]
            lingering = [task for task, p in enumerate(processes) if p.is_alive() and task not in running]
            where = [f"task {task} pid {processes[task].pid}" for task in running]
            where += [f"the process of task {task} (pid {processes[task].pid}), its replicas done, not ended" for task in lingering]
            if where:
                log.warning(
                    "spawn(): %s still running %.0f s after a replica returned (%s); spawn() waits for every "
                    "replica and process (its timeout= bounds the run)",
                    f"ordinal{'s' if len(ordinals) != 1 else ''} {format_ranges(ordinals)}" if ordinals else "processes",
                    now - first_result_at, "; ".join(where),
                )
        if deadline is not None and now >= deadline:
            timed_out = True
            break

    stopping_at = time.monotonic()  # (failures reported from here on are the stop's: see handle)
    stopped = {processes.index(p) for p in _stop(processes)}
    drain(0.2)  # what the stopped processes sent before they stopped
    terminated: list[int] = []
    for task in sorted(stopped):
        terminated += unreported(task) if task in ordinals_of else [-(task + 1)]
    for task, process in enumerate(processes):
        if task in stopped or task in crashed:
            continue
        code = process.exitcode
        if task not in finished:
            crash(task, process)
        elif code != 0 and not any(o in failures for o in [*ordinals_of.get(task, []), -(task + 1)]):
            # Every thread reported, then the process died: what its replicas left behind
            # (a collective of their last step that never completed, say) failed.
            record(-(task + 1), _ProcessEnded(
                f"the process of task {task} (pid {process.pid}) {exited(process)} after its replicas returned "
                "(in what they left running: a last step's collectives, threads, atexit handlers)"
            ), "")

    if not failures and not timed_out:
        return dict(sorted(results.items()))
    ordered = [ordinal for _, ordinal in sorted(order)]
    failures = {ordinal: failures[ordinal] for ordinal in ordered}
    raise _spawn_error(results, failures, tracebacks, ordered, terminated, timed_out, timeout)


def _spawn_error(results, failures, tracebacks, order, terminated, timed_out, timeout) -> SpawnError:
    from pjrt_rendezvous.coordinator._core import format_ranges

    lines = []
    if failures:
        groups: list[tuple[BaseException, list[int]]] = []  # the replicas of one crash share its error
        for ordinal in order:
            if groups and failures[ordinal] is groups[-1][0] and ordinal >= 0:
                groups[-1][1].append(ordinal)
            else:
                groups.append((failures[ordinal], [ordinal]))
        for i, (error, ordinals) in enumerate(groups):
            who = _who(ordinals[0]) if len(ordinals) == 1 else f"ordinals {format_ranges(ordinals)}"
            if isinstance(error, _ProcessEnded):  # (not raised: the text names the process)
                said = str(error) if ordinals[0] < 0 else f"{who}: {error}"
            else:
                said = f"{who} raised {type(error).__name__}" + (f": {error}" if str(error) else "")
            lines.append(f"spawn(): {len(failures)} replica(s) failed; first: {said}" if i == 0 else f"  then {said}")
    if timed_out:
        lines.append(f"spawn(): timed out after {timeout} s")
    known = [o for o in terminated if o >= 0]
    if known:
        lines.append(f"  stopped while still running: ordinal{'s' if len(known) > 1 else ''} {format_ranges(known)}")
    for unknown in sorted((o for o in terminated if o < 0), reverse=True):
        lines.append(f"  stopped while still starting: {_who(unknown)}")
    if failures and tracebacks.get(order[0]):
        text = tracebacks[order[0]]
        where = "the calling process" if text.startswith(_IN_PARENT) else "its process"
        lines.append(f"\nTraceback of {_who(order[0])} (in {where}):\n{text.removeprefix(_IN_PARENT).rstrip()}")
    spawn_error = SpawnError(
        "\n".join(lines), failures=failures, tracebacks=tracebacks, results=dict(sorted(results.items())),
        terminated=terminated,
    )
    if failures:
        spawn_error.__cause__ = failures[order[0]]
    return spawn_error


class _ProcessEnded(RuntimeError):
    """A failure of spawn's: a process that ended without its replicas' reports, or after."""


def _who(ordinal: int) -> str:
    return f"ordinal {ordinal}" if ordinal >= 0 else f"the process of task {-ordinal - 1}"


def _child_main(task: int, nprocs: int, env: dict, payload: bytes, reports, parent: int) -> None:
    """One process: set the environment before torch_xla starts, then a thread per device."""
    _stop_with(parent)
    os.environ.update(env)
    put = _reporter(task, reports)
    try:
        import torch_xla
        import torch_xla.core.xla_model as xm
        from torch_xla._internal import pjrt

        if torch_xla._XLAC._xla_runtime_is_initialized():
            raise UsageError(
                "the XLA runtime started before spawn() could configure it (a module imported by "
                "the child used an XLA device at import time): keep device use inside fn"
            )
        # Rule 1 of the module docstring: replication before anything reads (and caches) the
        # runtime's world size.
        pjrt.initialize_multiprocess(int(os.environ.get("PJRT_RENDEZVOUS_LOCAL_RANK", task)), nprocs)
        install()
        client = _api.init()
        signal.signal(signal.SIGTERM, _leave_and_die)
        signal.signal(signal.SIGINT, _leave_and_die)  # (Ctrl-C: the replicas' threads never see it)
        devices = xm.get_xla_supported_devices()
        if len(devices) != client.topology.devices_per_process:
            raise TopologyError(
                f"the XLA runtime gives this process {len(devices)} device(s) but the topology "
                f"says {client.topology.devices_per_process} ({client.topology.cores_per_chip} "
                f"core(s) per chip x {client.topology.chips_per_process} chip(s)); set "
                "PJRT_RENDEZVOUS_CORES_PER_CHIP to the devices per chip, or TPU_CHIPS_PER_PROCESS_BOUNDS "
                "to the process's chips"
            )
        ordinals = [client.topology.ordinal(i) for i in range(len(devices))]
        put("ordinals", ordinals)
        global _device_threads, _job_world_size
        _device_threads, _job_world_size = len(devices), client.topology.world_size
        if len(devices) > 1 and torch_xla._XLAC._get_use_eager_mode():  # (turned on at import)
            raise UsageError(_EAGER_REFUSED)
        fn, args = pickle.loads(payload)
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent as this task's failure
        put("error", -(task + 1), _pickled_error(exc), traceback.format_exc())
        put("done")
        return

    def run(index: int) -> None:
        ordinal = ordinals[index]
        bound, how = False, "returned"
        try:
            binding = bind_device(index, client=client)  # devices[index] is xla:<index>
            bound = True
            try:  # (not `with binding`: a raise would end the replica before its report, below)
                try:
                    result = fn(binding.ordinal, *args)
                except SystemExit as exc:
                    if exc.code not in (None, 0):
                        raise
                    result = None  # a clean exit, as a process per device's sys.exit(0) was
                blob = _pickled_result(result, torch_xla._XLAC, ordinal)
            finally:
                client.unbind_thread()
            put("result", ordinal, blob)
        except BaseException as exc:  # noqa: BLE001 -- every failure goes to the parent
            put("error", ordinal, _pickled_error(exc), traceback.format_exc())
            how = how_it_ended(exc)
        finally:  # after its report (the parent orders reports by when they were put)
            _api._ended[ordinal] = how  # its siblings' later calls fail here (_check_ended)
            if bound:  # and the rounds already waiting for it, anywhere, and later ones
                client.end_replicas([ordinal], how)

    threads = [
        threading.Thread(target=run, args=(i,), name=f"pjrt-rendezvous-device-{i}")
        for i in range(len(devices))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():  # (a signal another thread took runs its handler here only once
            thread.join(0.25)     # this thread runs: blocked in join, spawn's SIGTERM waited 5 s for its kill)
    put("done")
    _api.shutdown()


def _stop_with(parent: int) -> None:
    """A child gets SIGTERM, as spawn() stops it, when its parent dies (killed, or a SIGTERM
    the parent does not catch: a scheduler's, `timeout`'s): it ran on alone, holding its
    devices, its replicas waiting for siblings that had gone. Linux only (``prctl``'s
    PR_SET_PDEATHSIG, fired when the thread that started it ends: spawn's, which waits for it)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGTERM, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):  # (not Linux)
        return
    try:  # (the parent may have gone before that: no signal would come)
        os.kill(parent, 0)
    except (ProcessLookupError, PermissionError):  # (gone; or its pid another user's process's)
        os.kill(os.getpid(), signal.SIGTERM)


def _leave_and_die(signum: int, frame) -> None:
    """A child's SIGTERM (spawn() stopping it after a failure, at its timeout or on Ctrl-C)
    or SIGINT (Ctrl-C reaches every process of the terminal's): it tells the coordinator it
    leaves, then dies of the signal. Killed without a word, its ordinals stayed alive on a
    long-lived coordinator for the heartbeat timeout, so a run started again at once was
    taken for a restart of some of them and failed its first round, naming the dead run's
    pids. (A SIGINT raised KeyboardInterrupt in the main thread, waiting for the replicas'
    threads: multiprocessing printed "Process pjrt-rendezvous-task-0:" and its traceback, and
    the process waited for those threads until spawn killed it 5 s later.)"""
    global _leaving
    signal.signal(signum, signal.SIG_DFL)  # (a second one ends it at once)
    if _leaving:  # (Ctrl-C's SIGINT, then spawn's SIGTERM: a close within the close hung on its lock)
        return
    _leaving = True
    try:
        client = _api._client  # (not through init()'s lock: the main thread may hold it)
        if client is not None:  # (its Leave waits 2 s at most)
            client.close(why=(
                "its process got SIGINT (Ctrl-C)" if signum == signal.SIGINT else
                f"its process got {signal.Signals(signum).name} (xla.spawn stops every process once one failed, at "
                "its timeout, or on Ctrl-C; or from outside)"
            ))
    finally:
        os.kill(os.getpid(), signum)


_leaving = False


def _pickled_result(result: Any, xlac: Any, ordinal: int) -> bytes:
    """``result`` pickled with its XLA tensors as CPU tensors (the calling process has no XLA
    runtime), all synced at once under the step lock: a tensor with a pending collective,
    pickled as it is, compiles in each thread apart. The rest is pickled as it is, once
    (tuples stay tuples, unlike ``xm._maybe_convert_to_cpu``; a tensor an object's
    ``__reduce__`` makes is met like any other); an ``nn.Parameter`` stays one. A result that
    cannot be pickled is None, with a warning: ``xmp.spawn`` returns nothing, so a replica may
    return anything there, and a finished run is not failed for a value only this spawn hands
    back (a failure of the result's computation, in the sync below, still fails it)."""
    import torch

    tensors: list[Any] = []  # the XLA tensors met, kept alive: their ids stay theirs
    indexes: dict[int, int] = {}  # id -> index in tensors

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if not (isinstance(obj, torch.Tensor) and obj.device.type == "xla"):
                return None
            if id(obj) not in indexes:
                indexes[id(obj)] = len(tensors)
                tensors.append(obj)
            return indexes[id(obj)]

    buffer = io.BytesIO()
    try:
        Pickler(buffer, pickle.DEFAULT_PROTOCOL).dump(result)
    except Exception as exc:  # noqa: BLE001 -- whatever its own __reduce__ raises
        log.warning(
            "spawn(): the return value of ordinal %d (%s) cannot be pickled (%s): its result is None",
            ordinal, type(result).__name__, exc,
        )
        return pickle.dumps(None)
    if not tensors:
        return buffer.getvalue()
    xlac._xla_sync_multi(tensors, [], wait=True, sync_xla_data=False)  # the locked one (install)
    copies = [
        torch.nn.Parameter(copy, requires_grad=tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else copy
        for tensor, copy in zip(tensors, xlac._xla_get_cpu_tensors(tensors))
    ]
    return pickle.dumps(_WithTensors(buffer.getvalue(), copies))


class _WithTensors:
    """A pickle whose XLA tensors are persistent ids, with their CPU copies: unpickled (by
    ``pickle.loads``, in the calling process) as the result itself."""

    def __init__(self, stream: bytes, tensors: list) -> None:
        self.stream, self.tensors = stream, tensors

    def __reduce__(self):
        return _unpickled_with_tensors, (self.stream, self.tensors)


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, stream: bytes, tensors: list) -> None:
        super().__init__(io.BytesIO(stream))
        self._tensors = tensors

    def persistent_load(self, index):
        return self._tensors[index]


def _unpickled_with_tensors(stream: bytes, tensors: list) -> Any:
    return _TensorUnpickler(stream, tensors).load()


_IN_PARENT = "(in the calling process)\n"  # marks a traceback of the parent's, not the replica's


def _reporter(task: int, reports) -> Callable[..., None]:
    """Puts a report with the time it was put: a queue's put returns before its bytes are
    written (a thread of the queue's writes them), so a replica failing for another, in
    another process, could reach the parent first."""
    lock = threading.Lock()

    def put(kind: str, *rest) -> None:
        with lock:
            reports.put((kind, task, time.monotonic(), *rest))  # (one clock for the host's processes)

    return put


def _pickled_error(exc: BaseException) -> bytes:
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
        return blob
    except Exception:  # noqa: BLE001 -- fall back to a plain RuntimeError with the text
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))


# -- broadcast_master_params -------------------------------------------------------------------

_BROADCAST_TAG = "pjrt_rendezvous.xla.broadcast_master_params"


def broadcast_master_params(model) -> None:
    """Copies the parameters and buffers of ordinal 0 into every replica's ``model``, in place.

    Build models with different seeds per replica, then call this in every replica at the same
    point, with models of the same structure.

    Where the XLA runtime's world is ours (a TPU pod; one process with a thread per device) it
    is one XLA ``all_reduce`` SUM over every tensor, with the non-master replicas contributing
    zeros. Every dtype comes through exactly, since the others add zero: floats narrower than 32
    bits are reduced in float32 (there is no bfloat16 all-reduce on CPU), unsigned ints wider
    than 8 bits in int64, ``bool`` as uint8, the rest as they are. The master
    flag is a 1-D tensor copied from the CPU, so every thread traces the same graph (rule 4 of
    the module docstring); pending work is synced first for the same reason. A signed zero of
    ordinal 0 arrives as +0.0. Where the runtime sees only this process (a CPU simulation with
    several processes) the values of ordinal 0 travel through the coordinator instead.

    Args:
        model: a ``torch.nn.Module`` whose tensors are on this thread's XLA device (or on the
            CPU, which goes through the coordinator).

    Raises:
        UsageError: through the coordinator, the model's tensors do not match ordinal 0's in
            number, shapes or dtypes (on the XLA path, a pod's, a mismatch fails in XLA's
            all-reduce, as torch_xla's own broadcast does); complex tensors on the XLA path.
    """
    import torch

    tensors = list(chain(model.parameters(), model.buffers()))
    if not tensors:
        return
    binding = current_binding()
    on_xla = all(t.device.type == "xla" for t in tensors)
    if on_xla:
        import torch_xla.runtime as xr

        if binding is None or xr.world_size() == binding.world_size:
            _broadcast_by_all_reduce(tensors, master=xr.global_ordinal() == 0)
            return
    if binding is None:
        if _api.get_world_size() == 1:
            return
        raise UsageError("broadcast_master_params() needs a bound thread (see spawn / bind_device)")
    _broadcast_by_coordinator(torch, tensors, binding)


# Floats narrower than this are reduced in float32: no bfloat16 all-reduce on CPU, and every
# value is exact in float32.
_WIDER_FLOAT_BITS = 32


def _reduce_dtype(torch, dtype):
    if dtype == torch.bool:
        return torch.uint8
    if dtype.is_complex:
        raise UsageError(f"broadcast_master_params() does not support {dtype} tensors on XLA devices")
    if dtype.is_floating_point:
        return torch.float32 if torch.finfo(dtype).bits < _WIDER_FLOAT_BITS else dtype
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        return torch.int64
    return dtype


def _broadcast_by_all_reduce(tensors, *, master: bool) -> None:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()  # materialise pending per-thread work: the graph below must be the same everywhere
    device = tensors[0].device
    flag = torch.tensor([master]).to(device)  # 1-D from the CPU: a parameter in every thread
    contributions = []
    with torch.no_grad():
        for t in tensors:
            kind = _reduce_dtype(torch, t.dtype)
            value = t.detach().to(kind)
            mask = flag.reshape((1,) * value.dim()) if value.dim() else flag.reshape(())
            contributions.append(torch.where(mask, value, torch.zeros_like(value)))
        xm.all_reduce(xm.REDUCE_SUM, contributions)  # in place, one collective, no scale
        for t, reduced in zip(tensors, contributions):
            t.copy_(reduced != 0 if t.dtype == torch.bool else reduced.to(t.dtype))
    torch_xla.sync()


def _broadcast_by_coordinator(torch, tensors, binding: Binding) -> None:
    payload = b""
    if binding.ordinal == 0:
        if any(t.device.type == "xla" for t in tensors):
            import torch_xla

            torch_xla.sync()
        buffer = io.BytesIO()
        torch.save([t.detach().cpu() for t in tensors], buffer)
        payload = buffer.getvalue()
    master = binding.client.rendezvous(binding, _BROADCAST_TAG, payload)[0]
    values = torch.load(io.BytesIO(master), weights_only=True)
    if len(values) != len(tensors) or any(
        v.shape != t.shape or v.dtype != t.dtype for v, t in zip(values, tensors)
    ):
        raise UsageError(
            f"broadcast_master_params(): ordinal {binding.ordinal}'s model does not match ordinal 0's "
            f"({len(tensors)} tensors here, {len(values)} there, or different shapes/dtypes)"
        )
    with torch.no_grad():
        for t, v in zip(tensors, values):
            t.copy_(v.to(t.device))
    if any(t.device.type == "xla" for t in tensors):
        import torch_xla

        torch_xla.sync()


# -- seed --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReplicaSeed:
    """What :func:`seed` set, plus generators private to the calling replica.

    Attributes:
        seed: this replica's seed (also the XLA device RNG's state).
        process_seed: the seed of the process-wide generators (the seed of the process's first
            replica).
        random: a ``random.Random`` of this replica alone.
        torch: a CPU ``torch.Generator`` of this replica alone (``DataLoader(generator=...)``).
        numpy: a ``numpy.random.Generator`` of this replica alone (None without NumPy).
    """

    seed: int
    process_seed: int
    random: random.Random = dataclasses.field(repr=False)
    torch: Any = dataclasses.field(repr=False)
    numpy: Any = dataclasses.field(repr=False)


def _derive(base_seed: int, ordinal: int) -> int:
    digest = hashlib.blake2b(f"pjrt-rendezvous/{base_seed}/{ordinal}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seed(base_seed: int) -> ReplicaSeed:
    """Seeds every random number generator for the calling replica, reproducibly.

    Per replica (per thread): the XLA device RNG of the thread's device
    (``xm.set_rng_state``), and the returned generators. Process-wide: Python's ``random``,
    NumPy's global RNG and torch's CPU generator are shared by every thread of a process, so
    they get the seed of the process's first replica, set by that replica (thread index 0)
    alone. In one-device-per-process worlds (TPU v4 and later) that is each replica's own seed;
    under thread-per-device (v2/v3, CPU simulation) the threads of a process share those
    streams, and their draws are reproducible only if the threads draw in a fixed order: use the
    returned per-replica generators for draws that must be.

    Seeds are derived by hashing ``(base_seed, ordinal)``: distinct per replica, the same on
    every run.

    Args:
        base_seed: any int.

    Returns:
        :class:`ReplicaSeed`.

    Raises:
        UsageError: unbound thread in a world of more than one.
        TypeError: ``base_seed`` not an int.
    """
    if isinstance(base_seed, bool) or not isinstance(base_seed, int):
        raise TypeError(f"base_seed must be an int, got {base_seed!r}")
    binding = current_binding()
    ordinal = binding.ordinal if binding is not None else _api.get_ordinal()
    thread_index = binding.thread_index if binding is not None else 0
    replica_seed = _derive(base_seed, ordinal)
    process_seed = _derive(base_seed, ordinal - thread_index)

    try:
        import numpy
    except ImportError:
        numpy = None
    import torch

    if thread_index == 0:
        random.seed(process_seed)
        if numpy is not None:
            numpy.random.seed(process_seed % 2**32)
        torch.manual_seed(process_seed)
    if binding is not None and "torch_xla" in sys.modules:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(replica_seed, device=f"xla:{binding.device_index}")
    elif "torch_xla" in sys.modules and sys.modules["torch_xla"]._XLAC._xla_runtime_is_initialized():
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(replica_seed)  # the default device; never starts the runtime
    generator = torch.Generator()
    generator.manual_seed(replica_seed)
    return ReplicaSeed(
        seed=replica_seed,
        process_seed=process_seed,
        random=random.Random(replica_seed),
        torch=generator,
        numpy=numpy.random.default_rng(replica_seed) if numpy is not None else None,
    )
