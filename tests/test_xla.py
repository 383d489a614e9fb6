"""pjrt_rendezvous.client.xla on real torch_xla (PJRT_DEVICE=CPU): the xm patches, spawn with
processes x threads, broadcast_master_params, data-parallel training between threads, seed."""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import pytest

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client import xla
from pjrt_rendezvous.coordinator import Coordinator

# Never the TPU runtime here: it would query the cloud metadata server.
os.environ["PJRT_DEVICE"] = "CPU"

TRAINING_RUNS = 20
TRAINING_STEPS = 4


# --- code run by spawn() in child processes (module level: pickled by reference) -----------------


def xm_user_code(index):
    """Unmodified torch_xla-style code: nothing but ``xm`` calls."""
    import torch
    import torch_xla.core.xla_model as xm

    ordinal = xm.get_ordinal()
    world = xm.xrt_world_size()
    everyone = xm.rendezvous("hello", f"ordinal {ordinal}".encode())
    same_parity = [o for o in range(world) if o % 2 == ordinal % 2]
    half = xm.rendezvous(f"half-{ordinal % 2}", bytes([ordinal]), replicas=same_parity)
    pair = xm.rendezvous("pair", bytes([ordinal]), replicas=[0, 1]) if ordinal < 2 else None
    total = xm.mesh_reduce("total", torch.tensor([float(ordinal)]), lambda xs: float(torch.cat(xs).sum()))
    accuracy = xm.mesh_reduce("accuracy", ordinal / 10, lambda xs: sum(xs) / len(xs))
    started = time.monotonic()
    try:  # ordinal 3 skipped a call: under torch_xla's rendezvous the pod would hang here
        xm.rendezvous("eval" if ordinal == 3 else "save")
        mismatch = None
    except Exception as exc:  # noqa: BLE001 -- reported to the test
        mismatch = (type(exc).__name__, str(exc), time.monotonic() - started)
    return dict(
        index=index,
        ordinal=ordinal,
        world=world,
        local=xm.get_local_ordinal(),
        master=xm.is_master_ordinal(),
        global_master=xm.is_master_ordinal(local=False),
        device=str(xm.xla_device()),
        tensor_device=str(torch.zeros(1, device=xm.xla_device()).device),
        everyone=everyone,
        half=half,
        pair=pair,
        total=total,
        accuracy=accuracy,
        mismatch=mismatch,
    )


def xm_user_code_and_registrations(index):
    """xm_user_code, plus what the coordinator recorded (seen from ordinal 0) and a
    broadcast_master_params across processes (through the coordinator on CPU)."""
    import torch
    import torch_xla.core.xla_model as xm

    result = xm_user_code(index)
    if result["ordinal"] == 0:
        participants = pr.get_client().wait_world(timeout=30)
        result["registered"] = sorted((p.ordinal, p.thread_index, p.runtime_ordinal) for p in participants)
    model = torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        model.weight.fill_(index + 1.5)
        model.num_batches_tracked.fill_(index + 7)
    model.to(xm.xla_device())
    xla.broadcast_master_params(model)
    result["broadcast"] = {k: _bits(v) for k, v in model.state_dict().items()}
    result["aliasing"] = os.environ.get("XLA_ENABLE_PARAM_ALIASING")
    helper = {}

    def in_a_helper_thread():  # (MpDeviceLoader's, say): the job's world size, but whose ordinal?
        helper["world"] = xm.xrt_world_size()
        for name in ("get_ordinal", "get_local_ordinal", "is_master_ordinal"):
            try:
                helper[name] = getattr(xm, name)()
            except pr.UsageError as exc:
                helper[name] = str(exc)

    thread = threading.Thread(target=in_a_helper_thread, name="helper")
    thread.start()
    thread.join()
    result["helper"] = helper
    return result


def eager_replica(index):
    import torch_xla.experimental

    torch_xla.experimental.eager_mode(True)


def failing_replica(index):
    import time

    import torch_xla.core.xla_model as xm

    if xm.get_ordinal() == 2:
        time.sleep(2)  # once the others wait for it, its sibling (ordinal 3) too
        raise ValueError("ordinal 2 gave up")
    xm.rendezvous("after-the-failure")  # waits for ordinal 2, which never comes


def failing_at_once_replica(index):
    import torch_xla.core.xla_model as xm

    if xm.get_ordinal() == 1:
        raise ValueError("bad path")  # (its process may leave before the other registers)
    xm.rendezvous("first")


def sleeping_while_its_peer_waits(index):
    import time

    import torch_xla.core.xla_model as xm

    xm.rendezvous("both-bound")
    if index == 0:
        time.sleep(600)  # stopped by spawn, at its timeout
    xm.rendezvous("never")  # waits for ordinal 0


def straggling_replica(index):
    import time

    import torch_xla.core.xla_model as xm

    xm.rendezvous("both-bound")
    if index == 1:
        time.sleep(3)
    return index


def dying_replica(index):
    """Returns, leaving its process to be killed at exit (as XLA aborts one whose last step's
    collective never completes), after its reports went out."""
    import atexit
    import signal

    if index == 0:
        atexit.register(os.kill, os.getpid(), signal.SIGKILL)
    return "returned"


def crashing_replica(index, how="killed"):
    """Ordinal 1's process is killed (a segfault, an XLA abort) while ordinal 0 waits for it,
    or ``how="exited"``: it exits (code 0, as os._exit(0) in a library would) without reporting."""
    import signal
    import time

    import torch_xla.core.xla_model as xm

    if xm.get_ordinal() == 1:
        client = pr.get_client()
        while not [r for job in client.status().jobs for r in job.pending_rounds]:  # (ordinal 0 waits in it)
            time.sleep(0.05)
        if how == "exited":
            os._exit(0)
        os.kill(os.getpid(), signal.SIGKILL)
    xm.rendezvous("never-completed")


def skipping_replica(index):
    """Ordinal 0 skips the rendezvous ordinal 1 waits in, and goes on to the step's all-reduce,
    which waits for ordinal 1: XLA aborts the process after 10 s."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    if index != 0:
        xm.rendezvous("skipped")
    t = torch.ones(2, device=xm.xla_device())
    xm.all_reduce(xm.REDUCE_SUM, [t])
    torch_xla.sync()
    return t.cpu().tolist()  # (waits for the all-reduce)


def early_imported_replica(index):
    """Calls torch_xla's own rendezvous and mesh_reduce, as a name imported from xm before
    install() holds them."""
    import torch_xla.core.xla_model as xm

    early_rendezvous, early_mesh_reduce = xla._originals["rendezvous"], xla._originals["mesh_reduce"]
    assert xm.rendezvous is not early_rendezvous
    gathered = early_rendezvous("early", str(index).encode())
    reduced = early_mesh_reduce("early-reduce", index + 1, sum)
    try:
        early_rendezvous("mine" if index == 0 else "theirs")
        mismatch = "none"
    except pr.MismatchError as exc:
        mismatch = str(exc)
    return gathered, reduced, mismatch


def runtime_numbers_replica(index):
    import torch_xla
    import torch_xla.runtime as xr

    try:
        xla.bind_device(0)  # (spawn bound the thread already)
        bind = "bound again"
    except pr.UsageError as exc:
        bind = str(exc)
    return xr._ORDINAL, xr._WORLD_SIZE, torch_xla._XLAC._xla_get_default_device_ordinal(), bind


def exiting_replica(index):
    import sys

    sys.exit(0 if index == 0 else "ordinal 1 stops")


def unpicklable_replica(index):
    return threading.Lock() if index == 0 else index


def early_returning_replica(index):
    """Ordinal 0 returns at once; ordinal 1, a thread of the same process, then calls the
    collectives that need it."""
    import time

    import torch_xla.core.xla_model as xm

    from pjrt_rendezvous.client import xla

    import numpy

    if index == 0:
        return "returned"
    while 0 not in pr._api._ended:  # (ordinal 0 has returned)
        time.sleep(0.01)
    outcome = []
    calls = (
        lambda: xm.rendezvous("after", b"", [0, 1]),
        lambda: xm.mesh_reduce("after", 1, sum),
        lambda: pr.rendezvous("after", b""),
        lambda: pr.barrier("after", replicas=numpy.array([0, 1])),  # (numpy has no truth value)
    )
    for call in calls:
        started = time.monotonic()
        try:
            call()
            outcome.append("completed")
        except pr.ParticipantFailedError as exc:
            outcome.append((str(exc), time.monotonic() - started))
    outcome.append(xm.rendezvous("alone", b"x", [1]))  # a round without it is fine
    outcome.append(pr.rendezvous("alone", b"y", (o for o in [1])))  # (a generator, read once)
    for call in (lambda: xm.rendezvous("after", "a str"), lambda: pr.rendezvous("after", "a str")):
        try:  # (its own mistake first: it was told that ordinal 0 had ended)
            call()
        except TypeError as exc:
            outcome.append(str(exc))
    return outcome


def helper_thread_replica(index):
    """A thread bound to no device, started by a replica, calls the xm collectives."""
    import torch_xla.core.xla_model as xm

    errors = []

    def helper():
        for call in (lambda: xm.rendezvous("h", b"x"), lambda: xm.mesh_reduce("m", 1, sum)):
            try:
                call()
            except Exception as exc:  # noqa: BLE001 -- returned to the test
                errors.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=helper, name="helper")
    thread.start()
    thread.join(60)
    return errors


def _bits(tensor) -> bytes:
    import torch

    t = tensor.detach().cpu().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return bytes(t.contiguous().view(torch.uint8).tolist())


def _net(hidden):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(3, hidden)
            self.bn = torch.nn.BatchNorm1d(hidden)  # float buffers + an int64 0-dim counter
            self.fc2 = torch.nn.Linear(hidden, 1)
            self.register_buffer("counts", torch.zeros(hidden, dtype=torch.int32))
            self.register_buffer("flags", torch.zeros(hidden, dtype=torch.bool))
            self.register_buffer("halves", torch.zeros(hidden, dtype=torch.bfloat16))

        def forward(self, x):
            return self.fc2(torch.relu(self.bn(self.fc1(x))))

    return Net()


def _runtime_cross_check() -> str | None:
    """Binds, through bind_device, a thread of a process that claims to be task 1 of 2 with one
    device each (world 2), while the runtime (world 2, as on a pod) numbers its device 0."""
    address = pr.get_client().settings.address
    topology = pr.detect_topology(
        {"PJRT_RENDEZVOUS_TASK_ID": "1", "PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_CORES_PER_CHIP": "1"},
        address=address,
    )
    client = pr.Client(pr.Settings(address=address, job="cross-check", timeout=30), topology)
    outcome = {}

    def bind():
        try:
            xla.bind_device(0, client=client)
            outcome["error"] = None
        except pr.MismatchError as exc:
            outcome["error"] = str(exc)

    thread = threading.Thread(target=bind)
    thread.start()
    thread.join(60)
    client.close()
    return outcome.get("error", "bind_device hung")


class FreshOnPickle:
    """Pickled as a tensor its __reduce__ makes afresh (on the tensor's device)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __reduce__(self):
        return FreshOnPickle, (self.tensor * 1,)


def train_replicas(index, runs, steps):
    """Per run: models built from different seeds, broadcast_master_params, then data-parallel
    SGD with xm.optimizer_step on different data per replica. Returns what the test checks."""
    import torch
    import torch_xla.core.xla_model as xm

    ordinal = xm.get_ordinal()
    device = xm.xla_device()
    report = dict(ordinal=ordinal, broadcast_ok=[], trained_equal=[], changed=[], pending_reads=[])
    for run in range(runs):
        seeds = xla.seed(100 + run)
        hidden = 4 + run % 4  # the first runs compile new graphs in both threads at once
        model = _net(hidden)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=seeds.torch))
            model.bn.running_mean.copy_(torch.randn(hidden, generator=seeds.torch))
            model.bn.num_batches_tracked.fill_(ordinal * 5 + run)  # 0 on ordinal 0 in run 0
            model.counts.copy_(torch.randint(-9, 9, (hidden,), generator=seeds.torch, dtype=torch.int32))
            model.flags.copy_(torch.rand(hidden, generator=seeds.torch) > 0.5)
            model.halves.copy_(torch.randn(hidden, generator=seeds.torch))
        before = {k: _bits(v) for k, v in model.state_dict().items()}
        model.to(device)
        xla.broadcast_master_params(model)
        after = {k: _bits(v) for k, v in model.state_dict().items()}
        # Compare with ordinal 0's values from before the broadcast, through the coordinator.
        master_before = eval(xm.rendezvous(f"before-{run}", repr(before).encode())[0])  # noqa: S307
        report["broadcast_ok"].append(after == master_before)

        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        data = torch.Generator().manual_seed(1000 * run + ordinal)  # different data per replica
        for _ in range(steps):
            x = torch.randn(8, 3, generator=data).to(device)
            y = torch.randn(8, 1, generator=data).to(device)
            loss = ((model(x) - y) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            xm.optimizer_step(optimizer)
            xm.mark_step(wait=run % 2 == 0)
        params = {k: _bits(p) for k, p in model.named_parameters()}
        everyone = xm.rendezvous(f"trained-{run}", repr(params).encode())
        report["trained_equal"].append(all(p == everyone[0] for p in everyone))
        report["changed"].append(params != {k: master_before[k] for k in params})

        # Read on the host a tensor with a pending collective, without mark_step first, through
        # each xm call that syncs (a new shape each run: both threads compile at once).
        summed = xm.all_reduce(xm.REDUCE_SUM, (torch.arange(hidden + run, dtype=torch.float32) + ordinal).to(device))
        if run % 3 == 0:
            xm.unlazy([summed])
            read = summed.cpu()
        elif run % 3 == 1:
            path = os.path.join(tempfile.gettempdir(), f"pjrt-rendezvous-test-{os.getpid()}-{ordinal}.pt")
            xm.save(summed, path, master_only=False)
            read = torch.load(path)
            os.remove(path)
        else:
            read = xm.mesh_reduce(f"pending-{run}", summed, lambda copies: copies[ordinal])
        report["pending_reads"].append(read.tolist() == [2.0 * i + 1 for i in range(hidden + run)])

    # Cheap steps with a collective each, one replica late once (master-only work, say): a launch
    # waits for its device's last step, whose all_reduce waits for the late sibling's launch.
    w = torch.ones(4).to(device)
    for step in range(10):
        g = xm.all_reduce(xm.REDUCE_SUM, w * 2 + torch.tensor([float(ordinal)]).to(device), scale=0.5)
        w = w - 0.1 * g
        if step == 0 and ordinal == 0:
            time.sleep(0.2)
        xm.mark_step()
    report["cheap_steps"] = w.cpu().tolist()
    # Returned to spawn() as an XLA tensor whose all_reduce is still pending.
    report["pending_return"] = xm.all_reduce(xm.REDUCE_SUM, torch.tensor([float(ordinal), 1.0]).to(device))
    report["module"] = torch.nn.Linear(2, 1).to(device)  # (its parameters stay nn.Parameters)
    report["fresh_on_pickle"] = FreshOnPickle(torch.tensor([ordinal + 0.5]).to(device))

    # seed(): the XLA device RNG is per replica and reproducible.
    draws = []
    for _ in range(2):
        xla.seed(7)
        sample = torch.rand(4, device=device)
        xm.mark_step()
        draws.append(sample.cpu().tolist())
    seeds = xla.seed(7)
    report["xla_draws"] = draws
    report["seed"] = (seeds.seed, seeds.process_seed, seeds.random.random(), seeds.torch.initial_seed())
    report["cross_check"] = _runtime_cross_check() if ordinal == 0 else None
    return report


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_xla():
    return pytest.importorskip("torch_xla")


@pytest.fixture
def xm(torch_xla):
    import torch_xla.core.xla_model as xm

    xla.uninstall()
    yield xm
    xla.uninstall()


@pytest.fixture
def no_process_client():
    pr.shutdown()
    yield
    pr.shutdown()


@pytest.fixture
def coordinator():
    with Coordinator(port=0) as c:
        yield c


def _client(address, *, tasks=1, devices=2, timeout=10.0):
    topology = pr.detect_topology(
        {
            "PJRT_RENDEZVOUS_NUM_TASKS": str(tasks),
            "PJRT_RENDEZVOUS_TASK_ID": "0",
            "PJRT_RENDEZVOUS_CORES_PER_CHIP": str(devices),
        },
        address=address,
    )
    return pr.Client(pr.Settings(address=address, timeout=timeout, batch_window=0.2), topology)


def _in_threads(client, fn, count=2, timeout=60):
    """Runs fn(index) in ``count`` threads bound to indices 0..count-1; returns results/errors."""
    results, errors = {}, {}

    def run(index):
        try:
            with client.bind_thread(index):
                results[index] = fn(index)
        except BaseException as exc:  # noqa: BLE001 -- returned to the test
            errors[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return results, errors


# --- install / uninstall -------------------------------------------------------------------------


@pytest.mark.xla
def test_install_is_idempotent_and_uninstall_restores_exactly(xm, torch_xla):
    """install() twice patches once; uninstall() puts back every original and removes the
    functions torch_xla 2.7 removed."""
    names = ["get_local_ordinal", "is_master_ordinal", "xla_device", "rendezvous", "mesh_reduce"]
    originals = {n: getattr(xm, n) for n in names}
    wrapped = {n: getattr(torch_xla._XLAC, n) for n in ("_xla_step_marker", "_xla_sync_multi", "_set_use_eager_mode")}
    removed = {n: hasattr(xm, n) for n in ("get_ordinal", "xrt_world_size")}

    assert xla.install() is True and xla.install() is True
    assert xla.is_installed()
    assert all(getattr(xm, n) is not originals[n] for n in names)
    assert callable(xm.get_ordinal) and callable(xm.xrt_world_size)
    for n, original in wrapped.items():
        assert getattr(torch_xla._XLAC, n) is not original
        assert getattr(torch_xla._XLAC, n).__wrapped__ is original

    xla.uninstall()
    xla.uninstall()
    assert not xla.is_installed()
    assert all(getattr(xm, n) is originals[n] for n in names)
    assert all(getattr(torch_xla._XLAC, n) is original for n, original in wrapped.items())
    assert {n: hasattr(xm, n) for n in removed} == removed


def test_install_without_torch_xla_warns_and_does_nothing(monkeypatch):
    """Where torch_xla cannot be imported, install() is a no-op with a RuntimeWarning."""
    xla.uninstall()
    monkeypatch.setitem(sys.modules, "torch_xla", None)  # the standard "module absent" marker
    with pytest.warns(RuntimeWarning, match=r"torch_xla is not installed"):
        assert xla.install() is False
    assert not xla.is_installed()


# --- the patched xm in bound threads of this process (no XLA device used) ------------------------


@pytest.mark.xla
def test_bound_threads_answer_xm_calls_through_the_coordinator(xm, torch_xla, coordinator):
    """Bound threads get their ordinal, world, device, full and subset rendezvous and
    mesh_reduce from the coordinator, without starting the XLA runtime."""
    import torch

    xla.install()
    client = _client(coordinator.address)

    def replica(index):
        ordinal = xm.get_ordinal()
        return dict(
            ordinal=ordinal,
            world=xm.xrt_world_size(),
            local=xm.get_local_ordinal(),
            master=(xm.is_master_ordinal(), xm.is_master_ordinal(local=False)),
            everyone=xm.rendezvous("hello", bytes([ordinal])),
            alone=xm.rendezvous("solo", bytes([ordinal]), replicas=[ordinal]),
            total=xm.mesh_reduce("total", torch.tensor([ordinal + 1.0]), lambda xs: float(torch.cat(xs).sum())),
        )

    results, errors = _in_threads(client, replica)
    client.close()
    assert not errors
    for index in (0, 1):
        r = results[index]
        assert (r["ordinal"], r["world"], r["local"]) == (index, 2, index)
        assert r["master"] == ((index == 0), (index == 0))
        assert r["everyone"] == [b"\x00", b"\x01"]
        assert r["alone"] == [bytes([index])]
        assert r["total"] == 3.0
    assert not torch_xla._XLAC._xla_runtime_is_initialized()  # no device sync, no compile


@pytest.mark.xla
def test_is_master_ordinal_tells_the_local_master_from_the_global_one(xm, coordinator):
    """Task 1 of 2 (its host's first process): thread 0 is local ordinal 0 and global
    ordinal 2, the local master and not the global one; thread 1 neither. (One process of
    one host answered the same either way.)"""
    xla.install()
    topology = pr.detect_topology(
        {"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": "1", "PJRT_RENDEZVOUS_LOCAL_RANK": "0",
         "PJRT_RENDEZVOUS_CORES_PER_CHIP": "2"},
        address=coordinator.address,
    )
    client = pr.Client(pr.Settings(address=coordinator.address, timeout=10.0), topology)
    results, errors = _in_threads(client, lambda index: (
        xm.get_ordinal(), xm.get_local_ordinal(), xm.is_master_ordinal(), xm.is_master_ordinal(local=False),
    ))
    client.close()
    assert not errors, errors
    assert results == {0: (2, 0, True, False), 1: (3, 1, False, False)}


class _NotWeights:
    """An object torch.load(weights_only=True) refuses."""


@pytest.mark.xla
def test_a_mesh_reduce_copy_torch_load_refuses_says_whose_it_is(xm, coordinator):
    """A copy that torch.load (weights_only) refuses raised its UnpicklingError in every
    member, without a word of whose copy it was: its message names the ordinal, first (the
    summaries show the message, not notes). A member that called xm.rendezvous with the tag
    instead made the others raise EOFError with no message at all: they are told so. Data
    torch.save cannot save raised Python's bare pickling error: it names the call."""
    xla.install()
    client = _client(coordinator.address)

    def replica(index):
        with pytest.raises(Exception) as refused:
            xm.mesh_reduce("odd", _NotWeights() if index == 1 else 1.0, len)
        if index == 0:
            xm.rendezvous("mixed")
            with pytest.raises(Exception, match=r"^xm.mesh_reduce\('lambda'\): this replica's data cannot be saved with torch.save: "):
                xm.mesh_reduce("lambda", lambda: None, len)  # (its peer is told it ended: below)
            return refused.value, None
        with pytest.raises(EOFError) as empty:
            xm.mesh_reduce("mixed", 1.0, len)
        return refused.value, empty.value

    results, errors = _in_threads(client, replica)
    client.close()
    assert not errors, errors
    for refused, _ in results.values():
        assert str(refused).startswith("xm.mesh_reduce('odd'): the copy of ordinal 1, which every member reads: "), refused
    assert str(results[1][1]) == (
        "xm.mesh_reduce('mixed'): ordinal 0 sent 0 bytes that torch.save did not write (did it call "
        "xm.rendezvous('mixed') instead?)"
    ), results[1][1]


@pytest.mark.xla
def test_a_mesh_reduce_that_fails_names_itself_not_a_rendezvous(xm, coordinator):
    """A mesh_reduce another replica skipped timed out as "rendezvous 'total' ... timed out":
    the coordinator's words, for a call the user never made; its error starts with the call,
    in each thread that made it (the sender's exception is its siblings' too)."""
    xla.install()
    client = _client(coordinator.address, timeout=1.0)

    def replica(index):
        if index == 0:
            xm.mesh_reduce("skipped", 1.0, sum)  # ordinal 1 never makes it
        else:
            time.sleep(3)

    _, errors = _in_threads(client, replica)
    client.close()
    assert list(errors) == [0], errors
    assert isinstance(errors[0], pr.RendezvousTimeout), repr(errors[0])
    assert str(errors[0]).startswith("xm.mesh_reduce('skipped'): rendezvous 'skipped' "), errors[0]
    assert "timed out" in str(errors[0]) and "ordinal 1" in str(errors[0]), errors[0]

    client = _client(coordinator.address, timeout=10.0)  # both make it; one with another tag
    _, errors = _in_threads(client, lambda index: xm.mesh_reduce("mine" if index else "theirs", 1.0, sum))
    client.close()
    assert sorted(errors) == [0, 1], errors
    assert all(str(error).startswith("xm.mesh_reduce('" + ("mine" if index else "theirs") + "'): ")
               and str(error).count("xm.mesh_reduce") == 1 for index, error in errors.items()), errors


@pytest.mark.xla
def test_is_master_ordinal_takes_a_bool_or_0_1_and_refuses_other_types(xm, coordinator, no_process_client):
    """local=1/0 and numpy's bools are read as torch_xla reads them (their truth value); a
    str, None or 2 is a TypeError naming local, bound or not, from pr and the patched xm
    (local="no" was true: the local master's answer; None false: the global one's)."""
    np = pytest.importorskip("numpy")
    xla.install()
    client = _client(coordinator.address)

    def replica(index):
        answers = []
        for call in (pr.is_master_ordinal, xm.is_master_ordinal):
            answers.append([call(local) for local in (True, 1, np.True_, False, 0, np.False_)])
            for local in ("no", None, 2, b"\x01"):
                with pytest.raises(TypeError, match=r"is_master_ordinal\(\) local must be a bool \(True: local ordinal 0, False: global\), got "):
                    call(local)
        return answers

    results, errors = _in_threads(client, replica)
    client.close()
    assert not errors, errors
    assert results == {0: [[True] * 6] * 2, 1: [[False] * 6] * 2}, results
    for call, name in ((pr.is_master_ordinal, "is_master_ordinal()"), (xm.is_master_ordinal, "xm.is_master_ordinal()")):
        with pytest.raises(TypeError, match=re.escape(f"{name} local must be a bool (True: local ordinal 0, False: global), got 'no'")):
            call("no")  # unbound


@pytest.mark.xla
def test_patched_rendezvous_enforces_tags_payloads_and_deadlines(xm, coordinator):
    """A tag mismatch fails every member, a str payload is a TypeError, and a missed call
    times out naming the missing ordinal."""
    xla.install()
    client = _client(coordinator.address, timeout=1.0)

    def replica(index):
        outcome = {}
        try:
            xm.rendezvous("eval" if index == 1 else "save")
        except pr.MismatchError as exc:
            outcome["mismatch"] = str(exc)
        with pytest.raises(TypeError):
            xm.rendezvous("text", "not bytes")
        if index == 0:
            started = time.monotonic()
            with pytest.raises(pr.RendezvousTimeout) as info:
                xm.rendezvous("only-ordinal-0-comes")
            outcome["timeout"] = (str(info.value), time.monotonic() - started)
        return outcome

    results, errors = _in_threads(client, replica)
    client.close()
    assert not errors, errors
    for index in (0, 1):
        # (one against one: both say where they run, here the same process)
        assert re.search(r"ordinal 0 \(\S+ pid \d+\) called rendezvous\('save'\); ordinal 1 \(\S+ pid \d+\) called rendezvous\('eval'\)",
                         results[index]["mismatch"]), results[index]["mismatch"]
    message, waited = results[0]["timeout"]
    assert "missing ordinal 1" in message and waited < 5


@pytest.mark.xla
def test_unbound_thread_falls_back(xm, monkeypatch, no_process_client):
    """Unbound: get_ordinal/xrt_world_size answer for a world of one, and raise UsageError
    when the environment describes a larger world."""
    xla.install()
    assert (xm.get_ordinal(), xm.xrt_world_size()) == (0, 1)
    monkeypatch.setenv("PJRT_RENDEZVOUS_NUM_TASKS", "2")
    monkeypatch.setenv("PJRT_RENDEZVOUS_TASK_ID", "0")
    with pytest.raises(pr.UsageError, match=r"^xm\.get_ordinal\(\) needs a bound thread"):
        xm.get_ordinal()
    with pytest.raises(pr.UsageError, match=r"^xm\.xrt_world_size\(\) needs a bound thread"):
        xm.xrt_world_size()
    # torch_xla's own rendezvous (it starts the runtime: last here) takes replicas=None too.
    assert xm.rendezvous("unbound", b"x", None) == [b"x"]


@pytest.mark.xla
def test_unbound_xm_calls_beside_a_larger_job_are_refused(xm, coordinator, monkeypatch, no_process_client):
    """With a process client of a world of 2 in use, an unbound thread's xm calls were
    torch_xla's own, over the runtime's world (here this process alone): the main thread of
    every process was master ordinal 0 of a world of one, and its rendezvous waited for
    nobody (a warning once per process said so). They are refused, naming the job's world and
    the runtime's, before and after the runtime started."""
    xla.install()
    monkeypatch.setenv("PJRT_RENDEZVOUS_NUM_TASKS", "2")
    monkeypatch.setenv("PJRT_RENDEZVOUS_TASK_ID", "0")
    pr.init(address=coordinator.address)
    calls = {
        "xm.get_ordinal()": xm.get_ordinal, "xm.xrt_world_size()": xm.xrt_world_size,
        "xm.is_master_ordinal()": xm.is_master_ordinal, "xm.get_local_ordinal()": xm.get_local_ordinal,
        "xm.rendezvous()": lambda: xm.rendezvous("unbound", b"x"), "xm.mesh_reduce()": lambda: xm.mesh_reduce("unbound", 1, sum),
    }
    import torch_xla

    torch_xla.device()  # (starts the runtime: refused either way)
    for what, call in calls.items():
        with pytest.raises(pr.UsageError) as refused:
            call()
        assert str(refused.value).startswith(
            f"{what} in thread 'MainThread', bound to no ordinal, beside job 'default' of 2 ordinals: torch_xla's own "
            "would answer for the XLA runtime's world (of 1 (this process alone)), not the job's; bind the thread"
        ), refused.value
    # Bound, the same calls are the job's.
    with pr.bind_thread(0):
        assert (xm.get_ordinal(), xm.xrt_world_size(), xm.is_master_ordinal()) == (0, 2, True)


# --- spawn: 2 processes x 2 threads --------------------------------------------------------------


@pytest.fixture(scope="module")
def xm_run(torch_xla):
    mp = pytest.MonkeyPatch()
    mp.setenv("CPU_NUM_DEVICES", "2")  # the shape of a TPU v3 chip: two devices in one process
    # A shell on a TPU VM carries its host's chip bounds: a simulated chip is one per process
    # whatever they say (they once made the topology expect 4 devices per process here).
    mp.setenv("TPU_CHIPS_PER_HOST_BOUNDS", "2,2,1")
    started = time.monotonic()
    try:
        results = xla.spawn(xm_user_code_and_registrations, nprocs=2, timeout=150)
    finally:
        mp.undo()
    return results, time.monotonic() - started


@pytest.mark.xla
def test_spawn_gives_unmodified_xm_code_its_ordinal_world_and_device(xm_run):
    """2 processes x 2 threads: ordinals 0..3, world 4, local ordinals, masters, own devices."""
    results, _ = xm_run
    assert sorted(results) == [0, 1, 2, 3]
    for ordinal, r in results.items():
        assert (r["index"], r["ordinal"], r["world"], r["local"]) == (ordinal, ordinal, 4, ordinal)
        assert r["master"] == (ordinal == 0) and r["global_master"] == (ordinal == 0)
        assert r["device"] == r["tensor_device"] == f"xla:{ordinal % 2}"
        assert r["aliasing"] == "0"  # (a thread per device: aliasing off)
        # A helper thread of a replica: the job's world size; no ordinal (it was 0 of 2 in all)
        assert r["helper"]["world"] == 4, r["helper"]
        for name in ("get_ordinal", "get_local_ordinal", "is_master_ordinal"):
            assert r["helper"][name].startswith(f"xm.{name}() in thread 'helper', bound to no device, in a process of 2 "
                                                "device threads: which replica's?"), r["helper"]


@pytest.mark.xla
def test_spawn_rendezvous_and_mesh_reduce_over_the_whole_world_and_subsets(xm_run):
    """Full-world and subset rendezvous return payloads in ordinal order; mesh_reduce reduces
    every replica's data."""
    results, _ = xm_run
    for ordinal, r in results.items():
        assert r["everyone"] == [f"ordinal {o}".encode() for o in range(4)]
        assert r["half"] == [bytes([o]) for o in range(4) if o % 2 == ordinal % 2]
        assert r["pair"] == ([b"\x00", b"\x01"] if ordinal < 2 else None)
        assert r["total"] == 6.0
        assert r["accuracy"] == pytest.approx(0.15)


@pytest.mark.xla
def test_spawn_tag_mismatch_raises_promptly_in_every_thread(xm_run):
    """One replica bringing another tag fails the round at once for all four, naming both tags."""
    results, _ = xm_run
    for r in results.values():
        kind, message, waited = r["mismatch"]
        assert kind == "MismatchError"
        assert re.search(r"ordinal 3 \(\S+ pid \d+\) called rendezvous\('eval'\)", message) and "rendezvous('save')" in message
        assert waited < 10  # the default deadline is 600 s


@pytest.mark.xla
def test_spawn_passes_runtime_ordinals_to_the_coordinator(xm_run):
    """Each thread registered with the runtime's ordinal of its device (the thread index on CPU)."""
    results, _ = xm_run
    assert results[0]["registered"] == [(o, o % 2, o % 2) for o in range(4)]


@pytest.mark.xla
def test_broadcast_master_params_across_processes_goes_through_the_coordinator(xm_run):
    """Where each process is its own XLA world (CPU), every replica still gets ordinal 0's
    parameters and buffers, float and int64."""
    import torch

    results, _ = xm_run
    expected = {
        "weight": _bits(torch.full((3,), 1.5)),
        "bias": _bits(torch.zeros(3)),
        "running_mean": _bits(torch.zeros(3)),
        "running_var": _bits(torch.ones(3)),
        "num_batches_tracked": _bits(torch.tensor(7)),
    }
    for r in results.values():
        assert r["broadcast"] == expected


@pytest.mark.xla
def test_spawn_reports_a_failing_replica_with_its_ordinal(torch_xla):
    """A replica that raises is re-raised in the parent naming its ordinal; the replicas
    waiting for it, its sibling thread among them, fail at once, after it, naming it (its
    sibling waited for it until the rendezvous timeout, the others until their process was
    stopped after the grace period: its process had not left)."""
    started = time.monotonic()
    with pytest.raises(xla.SpawnError) as info:
        xla.spawn(failing_replica, nprocs=2, devices_per_process=2, timeout=150, grace=60.0)
    elapsed = time.monotonic() - started
    error = info.value
    assert list(error.failures)[0] == 2
    assert isinstance(error.failures[2], ValueError)
    assert isinstance(error.__cause__, ValueError)
    assert "first: ordinal 2 raised ValueError: ordinal 2 gave up" in str(error).splitlines()[0], str(error)
    assert "failing_replica" in error.tracebacks[2]
    assert sorted(error.failures) == [0, 1, 2, 3] and not error.terminated, (error.failures, error.terminated)
    for ordinal in (0, 1, 3):  # (3 calls before 2 ended, or is refused in its process after)
        assert isinstance(error.failures[ordinal], pr.ParticipantFailedError), error.failures
        assert "ordinal 2" in str(error.failures[ordinal]), error.failures[ordinal]
        assert "raised ValueError: ordinal 2 gave up)" in str(error.failures[ordinal]), error.failures[ordinal]
    assert elapsed < 50
    assert not multiprocessing.active_children()


@pytest.mark.xla
def test_a_replica_failing_at_once_fails_a_slower_process_s_rounds_at_once(torch_xla):
    """A replica raising at its start, its process gone before the other registered (3 runs
    of 4 in a trial): the other process started the job afresh and waited for it, until
    spawn's grace ran out ("stopped while still running"), naming "the last run's" process.
    spawn tells the coordinator the processes are of one launch: the slower one joins the run
    and its round fails at once, naming the replica that raised."""
    started = time.monotonic()
    with pytest.raises(xla.SpawnError) as info:
        xla.spawn(failing_at_once_replica, nprocs=2, devices_per_process=1, timeout=150, grace=60.0)
    error = info.value
    assert list(error.failures)[0] == 1 and isinstance(error.failures[1], ValueError), error.failures
    assert isinstance(error.failures.get(0), pr.ParticipantFailedError) and not error.terminated, str(error)
    assert "ordinal 1" in str(error.failures[0]) and "raised ValueError: bad path" in str(error.failures[0]), str(error)
    assert time.monotonic() - started < 50


@pytest.mark.xla
def test_spawn_reports_a_process_that_dies_after_its_replicas_returned(torch_xla):
    """Every replica of a process returned, then the process was killed (XLA aborts one whose
    replicas left a collective behind): a failure, with the results that came. (spawn
    returned the results as a success.)"""
    with pytest.raises(xla.SpawnError, match=r"the process of task 0 \(pid \d+\) was killed by signal 9 \(SIGKILL\) after its replicas returned") as info:
        xla.spawn(dying_replica, nprocs=2, devices_per_process=1, timeout=150)
    assert list(info.value.failures) == [-1]
    assert info.value.results == {0: "returned", 1: "returned"}


@pytest.mark.xla
@pytest.mark.parametrize("how, said", [("killed", r"was killed by signal 9 \(SIGKILL\)"), ("exited", "exited with code 0")])
def test_spawn_reports_a_crashed_process_at_once_and_first(torch_xla, how, said):
    """A process killed while its peer waits for it: spawn saw the exit only once every
    process had exited, so the peer waited for the coordinator's heartbeat timeout (60 s),
    and its ParticipantFailedError was named first. The crash is now a failure when it is
    seen: the peer is stopped after the grace, the crash named first. One that exits with
    code 0 without reporting is said so (not "killed by signal 0")."""
    started = time.monotonic()
    with pytest.raises(xla.SpawnError) as info:
        xla.spawn(functools.partial(crashing_replica, how=how), nprocs=2, devices_per_process=1, timeout=150, grace=2.0)
    elapsed = time.monotonic() - started
    error = info.value
    assert list(error.failures) == [1] and error.terminated == [0], (error.failures, error.terminated)
    assert re.search(r"first: ordinal 1: the process of task 1 \(pid \d+\) " + said + " before reporting; the coordinator's rounds waiting then: round 0 of "
                     r"all ordinals, tag 'never-completed', missing 1 of 2: ordinal 1 on ", str(error)), str(error)
    assert elapsed < 40, elapsed
    assert not multiprocessing.active_children()


@pytest.mark.xla
def test_spawn_names_the_rendezvous_a_replica_skipped_when_xla_aborts(torch_xla):
    """One replica skips a rendezvous and goes on to a collective: XLA aborts the process
    after 10 s, and spawn said only that it was killed by signal 6, twice (once per replica).
    It names the abort and the rendezvous still waiting for the replica that skipped it,
    once for the process's replicas."""
    with pytest.raises(xla.SpawnError) as info:
        xla.spawn(skipping_replica, nprocs=1, devices_per_process=2, timeout=150)
    first = str(info.value).splitlines()[0]
    assert re.search(r"first: ordinals 0-1: the process of task 0 \(pid \d+\) was killed "
                     r"by signal 6 \(SIGABRT: XLA aborts a process whose collective waits 10 s for a replica that "
                     r"does not join, its log says which; or another abort\) before reporting; the coordinator's rounds waiting then: "
                     r"round 0 of all ordinals, tag 'skipped', missing 1 of 2: ordinal 0 on ", first), first
    assert sorted(info.value.failures) == [0, 1] and len(str(info.value).splitlines()) == 1, str(info.value)


@pytest.mark.xla
def test_a_round_needing_a_sibling_replica_that_returned_fails_at_once(torch_xla):
    """Ordinal 0 returned; its process goes on running ordinal 1, whose rounds that need 0
    fail at once, naming it, through xm's calls and pjrt_rendezvous's alike (they waited out
    the rendezvous timeout, ten minutes by default: the process had not left, and the
    coordinator could not tell)."""
    results = xla.spawn(early_returning_replica, nprocs=1, devices_per_process=2, timeout=150)
    assert results[0] == "returned"
    *failures, alone, alone_again, str_payload, str_payload_again = results[1]
    assert alone == [b"x"] and alone_again == [b"y"]
    assert str_payload == str_payload_again == "payload must be bytes, got str", results[1]
    whats = ("xm.rendezvous('after')", "xm.mesh_reduce('after')", "rendezvous('after')", "barrier('after')")
    assert len(failures) == len(whats), failures
    for (message, waited), what in zip(failures, whats):
        assert message.startswith(f"{what} needs ordinal 0 of this process, whose replica (spawn's fn) has already ended (ordinal 0: returned)")
        assert waited < 5


@pytest.mark.xla
def test_spawn_caches_the_runtime_numbers_for_dynamo_as_torch_xla_does(torch_xla):
    """With one device per process, torch_xla's thread runner caches the runtime's ordinal
    (runtime._init_world_size_ordinal) so that Dynamo reads it without a graph break; spawn
    did not."""
    results = xla.spawn(runtime_numbers_replica, nprocs=2, devices_per_process=1, timeout=150)
    for ordinal, (cached, world, device_ordinal, bind) in results.items():
        assert cached == device_ordinal and world is not None, (ordinal, results)
        # (it said "unbind it first", the wrong fix)
        assert bind == f"bind_device(0): spawn() already bound this thread to ordinal {ordinal} (device xla:0); fn needs no bind_device", bind


@pytest.mark.xla
def test_a_replica_that_exits_cleanly_returns_none(torch_xla):
    """sys.exit(0) in a replica ends it as a process per device ended: cleanly, with no
    result (it was reported as a failure); any other exit status is a failure."""
    with pytest.raises(xla.SpawnError, match="ordinal 1 raised SystemExit: ordinal 1 stops") as info:
        xla.spawn(exiting_replica, nprocs=1, devices_per_process=2, timeout=150)
    assert list(info.value.failures) == [1]
    assert info.value.results == {0: None}


@pytest.mark.xla
def test_a_return_value_that_cannot_be_pickled_comes_back_as_none(torch_xla, capfd):
    """xmp.spawn returns no values, so a replica may return anything there (a trainer, a
    lock): a value that cannot be pickled is None here, with a warning; it failed the run."""
    results = xla.spawn(unpicklable_replica, nprocs=1, devices_per_process=2, timeout=150)
    assert results == {0: None, 1: 1}
    assert "the return value of ordinal 0 (lock) cannot be pickled" in capfd.readouterr().err


@pytest.mark.xla
def test_an_unbound_thread_of_a_threaded_replica_is_refused_the_xm_collectives(torch_xla):
    """A helper thread of a process of two device threads: torch_xla's own rendezvous (an XLA
    all-gather over the process's devices) would wait for the device threads for ever, until
    XLA aborted the process; refused at once, naming the thread."""
    results = xla.spawn(helper_thread_replica, nprocs=1, devices_per_process=2, timeout=150)
    for errors in results.values():
        assert len(errors) == 2, errors
        for error, what in zip(errors, ("xm.rendezvous()", "xm.mesh_reduce()")):
            assert error.startswith(f"UsageError: {what} in thread 'helper', bound to no device, in a process of 2 device threads"), error


@pytest.mark.xla
def test_spawn_with_fork_after_this_process_used_a_device_is_refused(torch_xla):
    """As xmp.spawn refuses it: the forked children would inherit a started runtime (they
    failed, each blaming a module that used a device at import)."""
    script = (
        "import torch, torch_xla\n"
        "from pjrt_rendezvous.client import UsageError, xla\n"
        "torch.ones(1, device=torch_xla.device())\n"
        "try:\n"
        "    xla.spawn(print, start_method='fork')\n"
        "except UsageError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert "this process has started its XLA runtime" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_spawn_error_wording():
    """An exception without text ends without a bare colon; one ordinal stopped is "ordinal 3";
    a process that died is not said to have raised the RuntimeError spawn made of it."""
    from pjrt_rendezvous.client.xla import _ProcessEnded, _spawn_error

    died = _ProcessEnded("the process of task 1 (pid 7) was killed by signal 9 (SIGKILL) before reporting")
    error = _spawn_error({}, {0: KeyboardInterrupt(), 2: died, 3: died}, {}, [0, 2, 3], [1], False, None)
    assert str(error).splitlines() == [
        "spawn(): 3 replica(s) failed; first: ordinal 0 raised KeyboardInterrupt",
        "  then ordinals 2-3: the process of task 1 (pid 7) was killed by signal 9 (SIGKILL) before reporting",
        "  stopped while still running: ordinal 1",
    ]
    alone = _spawn_error({}, {-2: died}, {}, [-2], [], False, None)
    assert str(alone) == f"spawn(): 1 replica(s) failed; first: {died}"


_ORPHANS = """
import os, sys, time
from pjrt_rendezvous.client import xla

def replica(index, folder):
    open(os.path.join(folder, f"{index}.pid"), "w").write(str(os.getpid()))
    time.sleep(600)

if __name__ == "__main__":
    xla.spawn(replica, args=(sys.argv[1],), nprocs=2, timeout=900)
"""


@pytest.mark.xla
def test_the_processes_of_a_spawn_whose_parent_is_killed_stop(torch_xla, tmp_path):
    """The parent of a spawn killed (SIGKILL, or a SIGTERM it does not catch: a scheduler's):
    its children ran on alone for minutes, their replicas waiting, holding their devices
    (a trial). They get the SIGTERM spawn stops them with, leaving the coordinator."""
    script = tmp_path / "orphans.py"
    script.write_text(_ORPHANS)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env={**os.environ, "PJRT_DEVICE": "CPU"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.pid"))) < 2:  # (2 processes of one device)
            assert time.monotonic() < deadline and parent.poll() is None, "the replicas did not start"
            time.sleep(0.2)
        children = {int(p.read_text()) for p in tmp_path.glob("*.pid")}
        assert len(children) == 2
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in children):
            assert time.monotonic() < deadline, f"children still running 30 s after their parent died: {children}"
            time.sleep(0.2)
    finally:
        parent.kill()
        for pid in {int(p.read_text()) for p in tmp_path.glob("*.pid")}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.xla
def test_ctrl_c_stops_a_spawn_s_processes_each_leaving_the_job_without_a_word(torch_xla, tmp_path, coordinator, caplog):
    """Ctrl-C (SIGINT to the terminal's process group): a child's main thread, waiting for
    its replicas' threads, raised KeyboardInterrupt ("Process pjrt-rendezvous-task-0:" and
    a traceback of multiprocessing's), and often the child neither left the job nor ended
    until spawn killed it 5 s later: the signal taken by another of its threads left the
    main one blocked, and spawn's SIGTERM within the handler of the SIGINT hung. Each now
    leaves, saying why, and ends; the parent raises KeyboardInterrupt."""
    caplog.set_level(logging.INFO, logger="pjrt_rendezvous.coordinator")
    script = tmp_path / "interrupted.py"
    script.write_text(_ORPHANS)
    runs = 3  # (the hang came in about half of the runs)
    for run in range(runs):
        folder = tmp_path / str(run)
        folder.mkdir()
        parent = subprocess.Popen(
            [sys.executable, str(script), str(folder)], start_new_session=True, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PJRT_DEVICE": "CPU", "PJRT_RENDEZVOUS_ADDRESS": coordinator.address,
                 "PJRT_RENDEZVOUS_JOB": f"interrupted-{run}"},
        )
        try:
            deadline = time.monotonic() + 120
            while len(list(folder.glob("*.pid"))) < 2:
                assert time.monotonic() < deadline and parent.poll() is None, "the replicas did not start"
                time.sleep(0.2)
            os.killpg(parent.pid, signal.SIGINT)
            _, err = parent.communicate(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(parent.pid, signal.SIGKILL)
        assert parent.returncode == -signal.SIGINT, err
        assert "Process pjrt-rendezvous-task" not in err and err.count("Traceback") == 1 and "spawn" in err, err
        left = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"process left in job 'interrupted-{run}'")]
        # (a child may take spawn's SIGTERM, sent on the parent's SIGINT, before its own SIGINT:
        # seen once in a CI run; it says so)
        assert len(left) == 2 and any("got SIGINT (Ctrl-C)" in m for m in left) and all(
            "got SIGINT (Ctrl-C)" in m or "got SIGTERM (xla.spawn stops every process" in m for m in left
        ), [r.getMessage() for r in caplog.records]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:  # (a zombie, its parent gone, waits for init to reap it)
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- one process x 2 threads: XLA collectives between threads -------------------------------------


@pytest.fixture(scope="module")
def training_run(torch_xla):
    started = time.monotonic()
    results = xla.spawn(
        train_replicas, args=(TRAINING_RUNS, TRAINING_STEPS), nprocs=1, devices_per_process=2, timeout=240
    )
    return results, time.monotonic() - started


@pytest.mark.xla
def test_broadcast_master_params_copies_ordinal_0_exactly(training_run):
    """After broadcast_master_params, both threads hold ordinal 0's parameters and buffers bit
    for bit (float32, bfloat16, int32, bool, BatchNorm's int64 counter), in every run."""
    results, _ = training_run
    for r in results.values():
        assert r["broadcast_ok"] == [True] * TRAINING_RUNS


@pytest.mark.xla
def test_data_parallel_training_between_threads_ends_bit_identical(training_run):
    """xm.optimizer_step across two threads leaves identical parameters, TRAINING_RUNS times
    in a row without a hang, and training did change them."""
    results, _ = training_run
    for r in results.values():
        assert r["trained_equal"] == [True] * TRAINING_RUNS
        assert r["changed"] == [True] * TRAINING_RUNS


@pytest.mark.xla
def test_host_reads_of_pending_collectives_in_both_threads_share_one_compile(training_run):
    """xm.unlazy, xm.save and mesh_reduce of a tensor whose all_reduce is still pending, in both
    threads at once without mark_step (and mark_step(wait=True)): they sync under the step lock,
    so both threads run one compilation (unwrapped, XLA aborts the process after 10 s)."""
    results, _ = training_run
    for r in results.values():
        assert r["pending_reads"] == [True] * TRAINING_RUNS


@pytest.mark.xla
def test_cheap_steps_with_a_late_replica_do_not_deadlock_on_the_step_lock(training_run):
    """A step's launch waits for its device's previous step outside the step lock: inside, it
    blocked a late sibling whose launch that step's all_reduce waited for (XLA aborted the
    process after 10 s). Both replicas end with the same weights."""
    results, _ = training_run
    assert results[0]["cheap_steps"] == results[1]["cheap_steps"]
    assert len(results[0]["cheap_steps"]) == 4


@pytest.mark.xla
def test_spawn_returns_xla_tensors_as_cpu_tensors(training_run):
    """A replica returning an XLA tensor with a pending collective gets it back on the CPU, synced
    under the step lock (pickled as it was, both threads compiled apart and XLA aborted); the
    result is pickled once, its parameters as parameters."""
    import torch

    results, _ = training_run
    for ordinal, r in results.items():
        assert isinstance(r["pending_return"], torch.Tensor) and r["pending_return"].device.type == "cpu"
        assert r["pending_return"].tolist() == [1.0, 2.0]
        # A module's parameters come back as parameters (they were plain tensors, and the
        # module broke), and a tensor made while pickling arrives (it was the number 0).
        weight = r["module"].weight
        assert type(weight) is torch.nn.Parameter and weight.requires_grad and weight.device.type == "cpu"
        assert r["module"].to("meta").weight.device.type == "meta"
        fresh = r["fresh_on_pickle"].tensor
        assert isinstance(fresh, torch.Tensor) and fresh.device.type == "cpu" and fresh.tolist() == [ordinal + 0.5]


@pytest.mark.xla
def test_eager_mode_in_threaded_replicas_is_refused_with_a_reason(torch_xla):
    """Eager mode compiles each op outside the step lock, and the threads' collectives never
    meet: spawn's replicas refuse it at once instead of an XLA abort 10 s later."""
    with pytest.raises(xla.SpawnError) as caught:
        xla.spawn(eager_replica, nprocs=1, devices_per_process=2, timeout=120)
    assert set(caught.value.failures) == {0, 1}
    assert all(isinstance(e, pr.UsageError) for e in caught.value.failures.values())
    assert "eager mode" in str(caught.value) and "step lock" in str(caught.value)


@pytest.mark.xla
def test_seed_gives_each_replica_a_distinct_reproducible_stream(training_run):
    """seed() reproduces the XLA device RNG per replica, differs between replicas, and shares
    the process-wide seed between the threads of a process."""
    results, _ = training_run
    zero, one = results[0], results[1]
    for r in (zero, one):
        assert r["xla_draws"][0] == r["xla_draws"][1]
    assert zero["xla_draws"][0] != one["xla_draws"][0]
    assert zero["seed"][0] != one["seed"][0]
    assert zero["seed"][1] == one["seed"][1] == zero["seed"][0]  # thread 0's seed is the process's
    assert zero["seed"][2] != one["seed"][2]
    assert zero["seed"][3] == zero["seed"][0]


@pytest.mark.xla
def test_runtime_ordinal_disagreement_is_refused_at_bind(training_run):
    """bind_device sends the runtime's ordinal; the coordinator refuses one that disagrees with
    the rank table, naming both numbers."""
    results, _ = training_run
    message = results[0]["cross_check"]
    assert message is not None
    assert "global ordinal 0" in message and "ordinal 1" in message


def test_spawn_rejects_bad_arguments():
    """nprocs, devices_per_process, timeout and grace are checked before any process starts."""
    with pytest.raises(pr.UsageError, match="nprocs"):
        xla.spawn(xm_user_code, nprocs=0)
    with pytest.raises(pr.UsageError, match="devices_per_process"):
        xla.spawn(xm_user_code, devices_per_process=-1)
    with pytest.raises(pr.UsageError, match="timeout"):
        xla.spawn(xm_user_code, timeout=0)
    with pytest.raises(pr.UsageError, match="grace"):
        xla.spawn(xm_user_code, grace=-1)
    assert not multiprocessing.active_children()


def test_spawn_refusing_its_function_or_start_method_leaves_no_coordinator_behind(monkeypatch):
    """A function that cannot be pickled, bad args or an unknown start method are refused
    before spawn starts its coordinator (it was left serving, its ports open)."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.delenv("PJRT_RENDEZVOUS_ADDRESS", raising=False)
    before = {t for t in threading.enumerate() if t.name.startswith("pjrt-rendezvous")}
    # (it said only "Can't pickle <function <lambda>>: attribute lookup <lambda> on __main__ failed")
    with pytest.raises(pickle.PicklingError, match=r"spawn\(\): fn cannot be sent to the processes it starts .*: fn must be a function defined at the top level of a module"):
        xla.spawn(lambda i: i)
    with pytest.raises(pickle.PicklingError, match=r"spawn\(\): args cannot be sent .*: every argument must be picklable"):
        xla.spawn(xm_user_code, args=(threading.Lock(),))
    with pytest.raises(TypeError):
        xla.spawn(xm_user_code, args=5)
    with pytest.raises(ValueError, match="nope"):
        xla.spawn(xm_user_code, start_method="nope")
    assert {t for t in threading.enumerate() if t.name.startswith("pjrt-rendezvous")} == before
    assert not multiprocessing.active_children()


def test_spawn_with_nprocs_1_warns_that_it_runs_every_cpu_device(monkeypatch):
    """xmp.spawn(nprocs=1) runs one replica in the calling process; ours, with
    CPU_NUM_DEVICES=2, two in a child: said at once (the function is refused next, so
    nothing starts). Without nprocs, or with devices_per_process, nothing is said."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    with pytest.warns(RuntimeWarning, match=r"spawn\(nprocs=1\) on CPU runs CPU_NUM_DEVICES=2 replicas"):
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            xla.spawn(lambda i: i, nprocs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kwargs in ({}, {"nprocs": 1, "devices_per_process": 2}):
            with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
                xla.spawn(lambda i: i, **kwargs)


def test_spawn_keeps_an_aliasing_setting_it_was_given_and_warns(monkeypatch):
    """XLA_ENABLE_PARAM_ALIASING set to another value than 0 with a thread per device is
    left as it is, with a warning (collectives between threads deadlock with it); 0, or
    one device per process, says nothing."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("XLA_ENABLE_PARAM_ALIASING", "1")
    with pytest.warns(RuntimeWarning, match=r"XLA_ENABLE_PARAM_ALIASING=1 with a thread per device"):
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            xla.spawn(lambda i: i, nprocs=2, devices_per_process=2)
    assert os.environ["XLA_ENABLE_PARAM_ALIASING"] == "1"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for value, devices in (("0", 2), ("1", 1)):
            monkeypatch.setenv("XLA_ENABLE_PARAM_ALIASING", value)
            with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
                xla.spawn(lambda i: i, nprocs=2, devices_per_process=devices)


@pytest.mark.xla
def test_a_run_started_again_at_once_on_a_long_lived_coordinator_runs(torch_xla):
    """A run whose processes spawn() stopped (a failure, its timeout, Ctrl-C), started again
    at once on the same coordinator: it runs. The stopped processes left the job as they
    died; killed without a word, they stayed alive there for the heartbeat timeout, and the
    new run was taken for a restart of their tasks and failed its first round. A replica
    failing as a stopped sibling leaves is stopped too, not failed."""
    with Coordinator(port=0) as coordinator:
        with pytest.raises(xla.SpawnError, match=r"timed out after 40.0 s") as info:
            xla.spawn(sleeping_while_its_peer_waits, nprocs=2, devices_per_process=1, address=coordinator.address,
                      timeout=40)
        assert not info.value.failures and info.value.terminated == [0, 1], (info.value.failures, info.value.terminated)
        results = xla.spawn(xm_user_code, nprocs=2, devices_per_process=1, address=coordinator.address, timeout=120)
        assert sorted(results) == [0, 1]
    assert not multiprocessing.active_children()


@pytest.mark.xla
def test_spawn_names_the_replicas_still_running_after_one_returned(torch_xla, monkeypatch, caplog):
    """A replica that runs on after the others returned: spawn() (no timeout) waited in
    silence; it names who still runs, once a minute (here once a second)."""
    monkeypatch.setattr(xla, "_STILL_RUNNING_EVERY", 1.0)
    caplog.set_level(logging.WARNING, logger="pjrt_rendezvous.client")
    assert xla.spawn(straggling_replica, nprocs=2, devices_per_process=1) == {0: 0, 1: 1}
    said = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert said and re.match(r"spawn\(\): ordinal 1 still running \d+ s after a replica returned \(task 1 pid \d+[;)]", said[0]), said


@pytest.mark.xla
def test_spawn_timeout_stops_a_run_that_does_not_finish(torch_xla):
    """A run still going at ``timeout`` is stopped and reported, instead of blocking the caller."""
    started = time.monotonic()
    with pytest.raises(xla.SpawnError, match=r"timed out after 2.0 s"):
        xla.spawn(xm_user_code, nprocs=2, devices_per_process=1, timeout=2)
    assert time.monotonic() - started < 30
    assert not multiprocessing.active_children()


def test_seed_in_a_world_of_one_without_torch_xla_devices(no_process_client):
    """In an unbound thread of a world of one, seed() uses ordinal 0 and is reproducible."""
    pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first, second = xla.seed(3), xla.seed(3)
    assert first.seed == second.seed == first.process_seed
    assert first.random.random() == second.random.random()
    assert xla.seed(4).seed != first.seed


@pytest.mark.xla
def test_tpu7x_cores_per_chip_come_from_the_started_runtime(torch_xla):
    """TPU7x's devices per chip are not guessed (torch_xla does not name it yet). Before torch_xla's runtime starts,
    init() refuses naming the override; once it has started, its device count in this
    process (here 2 simulated CPU devices on one chip) is used."""
    code = (
        "import pjrt_rendezvous.client as pr\n"
        "from pjrt_rendezvous.client import _api\n"
        "import os, torch_xla.core.xla_model as xm\n"
        "try:\n"
        "    _api._detect(os.environ, None)\n"
        "except pr.TopologyError as error:\n"
        "    print('before:', error)\n"
        "xm.get_xla_supported_devices()  # starts the runtime\n"
        "t = _api._detect(os.environ, None)\n"
        "print('after:', t.cores_per_chip, t.chips_per_process, t.world_size)\n"
    )
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2", TPU_ACCELERATOR_TYPE="tpu7x-2",
               TPU_CHIPS_PER_PROCESS_BOUNDS="1,1,1", PJRT_RENDEZVOUS_NUM_TASKS="1")
    env.pop("PJRT_RENDEZVOUS_CORES_PER_CHIP", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    before, after = run.stdout.strip().splitlines()
    assert "unknown TPU accelerator type 'tpu7x-2'" in before and "start torch_xla's runtime before init()" in before
    assert after == "after: 2 1 2"


_RUNTIME_SCRIPT = """
import threading
import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client import xla
from pjrt_rendezvous.coordinator import Coordinator
import torch_xla, torch_xla.core.xla_model as xm, torch_xla.runtime as xr

xla.install()
captured = xm.get_local_ordinal  # a replacement taken while installed
with Coordinator(port=0) as coordinator:
    topology = pr.detect_topology({"PJRT_RENDEZVOUS_CORES_PER_CHIP": "2"}, address=coordinator.address)
    client = pr.Client(pr.Settings(address=coordinator.address), topology)
    devices = {}

    def bound(index):
        client.bind_thread(index)  # bind_thread alone, not bind_device
        devices[index] = (str(xm.xla_device()), torch_xla._XLAC._xla_get_default_device())
        client.unbind_thread()

    threads = [threading.Thread(target=bound, args=(i,)) for i in (1, 0)]
    for t in threads:
        t.start()
        t.join()
    refused = {}

    def misbound():
        client.bind_thread(0)
        for index in (1, 5):  # bound already; out of range
            try:
                xla.bind_device(index, client=client)
            except Exception as exc:
                refused[index] = (type(exc).__name__, torch_xla._XLAC._xla_get_default_device())
        client.unbind_thread()

    thread = threading.Thread(target=misbound)
    thread.start()
    thread.join()
    client.close()
print("devices", devices[0], devices[1])
print("refused", refused[1], refused[5])
print("unbound", xm.get_ordinal(), xm.xrt_world_size(), xr.global_ordinal(), xr.world_size())
xla.uninstall()
print("captured", captured())
"""


@pytest.mark.xla
def test_xla_device_defaults_the_thread_and_unbound_calls_follow_the_runtime(torch_xla):
    """In a thread bound with bind_thread alone, xm.xla_device() makes its device the
    thread's default (syncs run there, as after torch_xla.device(n)); a refused bind_device
    leaves the thread's default device as it was; once the runtime has
    started, an unbound thread's get_ordinal / xrt_world_size are the runtime's (torch_xla
    < 2.7's answer); a replacement captured while installed still works after uninstall()."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2")
    run = subprocess.run([sys.executable, "-c", _RUNTIME_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = dict(line.split(" ", 1) for line in run.stdout.strip().splitlines())
    assert lines["devices"] == "('xla:0', 'xla:0') ('xla:1', 'xla:1')"
    # A refused bind_device leaves the thread on its device (it moved it to the one refused),
    # and an index out of range is ours to name (the runtime's C++ IndexError was raised).
    assert lines["refused"] == "('UsageError', 'xla:0') ('TopologyError', 'xla:0')"
    assert lines["unbound"] == "0 1 0 1"  # the runtime's, not a UsageError (world of 2 here)
    assert lines["captured"] == "0"


_XMP_SCRIPT = """
import functools
import os
import torch_xla.core.xla_model as xm
import torch_xla.distributed.xla_multiprocessing as xmp
import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client import xla

def fn(index):
    xla.install()
    xm.xla_device()  # (the runtime runs)
    said = []
    for name, call in (("get_ordinal", pr.get_ordinal), ("rendezvous", lambda: pr.rendezvous("t", b"x")),
                       ("seed", lambda: xla.seed(1))):
        try:
            said.append(f"{name} answered {call()!r}")
        except pr.UsageError as error:
            said.append(f"{name} refused: {error}")
    if index == 1:  # (the environment says one device per process; the runtime runs two)
        try:
            xla.bind_device(1)
        except pr.TopologyError as error:
            said.append(f"bind_device refused: {error}")
    xla._refuse_unbound("xm.rendezvous()")  # (what xm.rendezvous does before torch_xla's own, which aborts here)
    os.write(1, (f"[{index}] " + " | ".join(said) + "\\n").encode())  # (one write: the threads' prints interleaved)

if __name__ == "__main__":
    xmp.spawn(fn)
"""


@pytest.mark.xla
def test_under_torch_xla_s_own_spawn_unbound_threads_are_refused_and_told(tmp_path):
    """torch_xla's xmp.spawn runs a replica per device but binds no thread: the environment
    names no job, so every thread was answered as ordinal 0 of a world of one (the same seed
    for both, a rendezvous of one), and xm.rendezvous fell back to torch_xla's own without a
    word. They are refused, and xm.rendezvous's fallback says once what to use instead."""
    script = tmp_path / "xmp_script.py"
    script.write_text(_XMP_SCRIPT)
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2")
    for name in [n for n in env if n.startswith("PJRT_RENDEZVOUS_")]:
        del env[name]
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    lines = sorted(line for line in run.stdout.splitlines() if line.startswith("["))
    assert len(lines) == 2, run.stdout
    for line in lines:
        for name in ("get_ordinal", "rendezvous", "seed"):
            assert f"{name} refused: " in line and "needs a bound thread" in line, line
    assert "bind_device refused: " in lines[1] and "set PJRT_RENDEZVOUS_CORES_PER_CHIP=2 (or run the replicas with xla.spawn" in lines[1], lines[1]
    told = [line for line in run.stderr.splitlines() if "bound to no ordinal, in an XLA world of 2" in line]
    assert len(told) == 1 and "run the replicas with pjrt_rendezvous.client.xla.spawn" in told[0], run.stderr  # (once per process)


@pytest.mark.xla
def test_rendezvous_and_mesh_reduce_imported_before_install_go_through_the_coordinator(torch_xla):
    """`from torch_xla.core.xla_model import rendezvous` at the top of fn's module kept
    torch_xla's own: an XLA all-gather that ignores tags (a porter's tag mismatch aborted the
    process after 10 s, named as a skipped call). torch_xla's rendezvous calls
    xm.xla_rendezvous at call time, which is patched: both are ours in a bound thread."""
    results = xla.spawn(early_imported_replica, nprocs=1, devices_per_process=2, timeout=150)
    for ordinal, (gathered, reduced, mismatch) in results.items():
        assert gathered == [b"0", b"1"] and reduced == 3, results
        assert "tag mismatch in round" in mismatch and "'mine'" in mismatch and "'theirs'" in mismatch, mismatch


def test_a_note_goes_first_in_an_error_s_message_or_else_with_it():
    """mesh_reduce's note on an error (whose copy, which call) starts its message, which
    spawn's summaries show; where the message is not its args' (ImportError, UnicodeError,
    an OSError's errno), it is added as a note, the message left whole."""
    from pjrt_rendezvous.client.xla import _say_first

    errors = (EOFError(), RuntimeError("bad"), ImportError("no module", name="m"), OSError(2, "gone"),
              UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"))
    for error in errors:
        shown = str(error)
        _say_first(error, "NOTE")
        if str(error).startswith("NOTE"):
            assert str(error) in ("NOTE", f"NOTE: {shown}"), error
        else:
            assert str(error) == shown and getattr(error, "__notes__", None) == ["NOTE"], error
