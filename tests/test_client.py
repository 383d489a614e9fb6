"""The client against a real coordinator on loopback: key-value, errors, retries, settings."""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time

import pytest

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client import _client as client_module
from pjrt_rendezvous.client._client import _Batch, _allocate_lock, _pass_on
from pjrt_rendezvous.client._config import Settings
from pjrt_rendezvous.coordinator import Coordinator, Limits


@pytest.fixture
def coordinator():
    with Coordinator(port=0, limits=Limits(max_payload_bytes=1024)) as c:
        yield c


def make_client(address, *, tasks=1, devices=1, task=0, **settings):
    topology = pr.detect_topology(
        {
            "PJRT_RENDEZVOUS_NUM_TASKS": str(tasks),
            "PJRT_RENDEZVOUS_TASK_ID": str(task),
            "PJRT_RENDEZVOUS_CORES_PER_CHIP": str(devices),
        },
        address=address,
    )
    return pr.Client(Settings(address=address, **settings), topology)


@pytest.fixture
def client(coordinator):
    c = make_client(coordinator.address, timeout=10)
    yield c
    c.close()


def test_key_value_operations(client):
    """set/get/multi, add, compare_set, append, delete, list and count behave like torch's Store."""
    client.set("a", b"1")
    client.multi_set(["b/x", "b/y"], [b"2", b"3"])
    assert client.get("a") == b"1"
    assert client.multi_get(["a", "b/x", "b/y"]) == [b"1", b"2", b"3"]
    assert client.get("missing", wait=False) is None
    assert client.check(["a", "b/x"]) and not client.check(["a", "missing"])
    assert client.add("n", 5) == 5 and client.add("n", -2) == 3 and client.get("n") == b"3"
    assert client.compare_set("cas", b"", b"v1") == b"v1"  # missing key + empty expected: set
    assert client.compare_set("cas", b"nope", b"v2") == b"v1"  # mismatch: current value
    assert client.compare_set("cas", b"v1", b"v2") == b"v2"
    assert client.compare_set("absent", b"x", b"y") == b"x"  # missing key + expected: expected back
    client.append("log", b"ab")
    client.append("log", b"cd")
    assert client.get("log") == b"abcd"
    assert client.list("b/") == {"b/x": b"2", "b/y": b"3"}
    assert client.count("b/") == 2 and client.count() == 6
    assert client.delete("a") is True and client.delete("a") is False


def test_blocking_get_is_released_by_a_later_set(client, coordinator):
    """A waiting get returns the value set afterwards by another client."""
    other = make_client(coordinator.address)
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("v", client.get("late", timeout=10)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()
    other.set("late", b"here")
    waiter.join(10)
    assert result["v"] == b"here"
    other.close()


def test_get_timeout_names_missing_keys(client):
    """A blocking get that times out says which keys are still missing."""
    client.set("k1", b"")
    with pytest.raises(pr.RendezvousTimeout, match=r"1 key of job 'default' still not set after .* 'k2'"):
        client.wait(["k1", "k2"], timeout=0.3)


def test_add_on_non_integer_is_invalid(client):
    """Adding to a non-integer value is INVALID_ARGUMENT naming the key and value."""
    client.set("text", b"abc")
    with pytest.raises(pr.InvalidArgumentError, match="cannot add to key 'text'"):
        client.add("text", 1)


def test_bad_arguments_are_refused_locally(client, coordinator):
    """Zero timeouts, str payloads and unknown settings fail before anything is sent."""
    binding = client.bind_thread(0)
    try:
        with pytest.raises(TypeError, match="payload must be bytes"):
            client.rendezvous(binding, "t", "text")
        with pytest.raises(pr.UsageError, match="timeout must be > 0"):
            client.rendezvous(binding, "t", b"", timeout=0)
        with pytest.raises(pr.UsageError, match="already bound"):
            client.bind_thread(0)
    finally:
        client.unbind_thread()
    with pytest.raises(pr.UsageError, match="unknown setting"):
        Settings.resolve({}, address="x:1", colour="blue")


def test_world_of_one_binding_returns_own_payload(client):
    """A bound thread in a world of one gets [payload] back."""
    with client.bind_thread(0) as binding:
        assert binding.world_size == 1
        assert client.rendezvous(binding, "solo", b"me") == [b"me"]


def test_payload_over_limit_is_resource_exhausted(coordinator):
    """A payload over the coordinator's limit fails with the limit and the size in the message."""
    client = make_client(coordinator.address, tasks=2, timeout=5)
    with client.bind_thread(0) as binding:
        with pytest.raises(pr.LimitExceededError, match=r"2000 bytes, over the limit of 1024 bytes"):
            client.rendezvous(binding, "big", b"x" * 2000)
    client.close()


def test_unknown_job_is_not_found(client):
    """Asking for a job nobody created is NOT_FOUND, naming the job."""
    with pytest.raises(pr.UnknownJobError, match="job 'nope' is not known"):
        client.status("nope")


def test_conflicting_world_size_is_a_mismatch(coordinator):
    """A process declaring another world size than the job's is refused, naming both numbers."""
    first = make_client(coordinator.address, tasks=2)
    second = make_client(coordinator.address, tasks=3, task=1)
    first.bind_thread(0)
    first.unbind_thread()
    with pytest.raises(pr.MismatchError, match=r"has world size 2 .* declares 3 tasks x 1 devices = 3"):
        second.bind_thread(0)
    first.close()
    second.close()


def test_unreachable_coordinator_is_retried_then_reported():
    """With nothing listening, calls retry until connect_timeout and then name the address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = make_client(f"127.0.0.1:{port}", connect_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(pr.CoordinatorUnavailableError, match=f"127.0.0.1:{port} unavailable"):
        client.set("k", b"v")
    assert time.monotonic() - started >= 0.4
    client.close()


def test_calls_wait_for_a_coordinator_that_starts_late():
    """A client started before its coordinator retries until the coordinator is up, then succeeds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = make_client(f"127.0.0.1:{port}", connect_timeout=20)
    late = Coordinator(port=port)
    timer = threading.Timer(1.0, late.start)
    timer.start()
    try:
        client.set("k", b"v")
        assert client.get("k") == b"v"
    finally:
        timer.join()
        late.stop()
        client.close()


def test_settings_from_environment():
    """Keyword arguments win over PJRT_RENDEZVOUS_* variables, which win over defaults."""
    env = {"PJRT_RENDEZVOUS_JOB": "envjob", "PJRT_RENDEZVOUS_TIMEOUT": "none", "PJRT_RENDEZVOUS_BATCH_WINDOW": "0"}
    s = Settings.resolve(env, address="h:1")
    assert (s.job, s.timeout, s.batch_window, s.connect_timeout) == ("envjob", None, 0.0, 60.0)
    s = Settings.resolve(env, address="h:1", job="kw", timeout=5)
    assert (s.job, s.timeout) == ("kw", 5.0)
    with pytest.raises(pr.UsageError, match="PJRT_RENDEZVOUS_TIMEOUT must be > 0"):
        Settings.resolve({"PJRT_RENDEZVOUS_TIMEOUT": "0"}, address="h:1")
    with pytest.raises(pr.UsageError, match="not a number"):
        Settings.resolve({"PJRT_RENDEZVOUS_TIMEOUT": "soon"}, address="h:1")


def test_init_is_idempotent_and_refuses_different_arguments(coordinator):
    """init() returns the same client; different arguments need shutdown() first."""
    pr.shutdown()
    try:
        first = pr.init(coordinator.address, env={})
        assert pr.init() is first and pr.init(coordinator.address, env={}) is first
        with pytest.raises(pr.UsageError, match="already called"):
            pr.init("127.0.0.1:1", env={})
    finally:
        pr.shutdown()


def test_still_waiting_lines_name_the_missing_ordinals(coordinator, caplog):
    """While blocked, the client logs a periodic 'still waiting' line naming who is missing."""
    client = make_client(coordinator.address, tasks=2, progress_interval=0.3)
    caplog.set_level(logging.WARNING, logger="pjrt_rendezvous.client")
    with client.bind_thread(0) as binding:
        with pytest.raises(pr.RendezvousTimeout):
            client.rendezvous(binding, "slow", b"", timeout=1.2)
    lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert len(lines) >= 2
    assert "tag 'slow', missing 1 of 2: 1 never registered" in lines[0]
    client.close()


def test_a_long_wait_keeps_its_full_retry_budget_across_a_coordinator_restart(tmp_path):
    """A round waiting longer than connect_timeout still retries for connect_timeout when the
    coordinator restarts from its state file, and then completes."""
    state = tmp_path / "state.json"
    first = Coordinator(port=0, state_file=state).start()
    port = first.port
    a = make_client(first.address, tasks=2, task=0, connect_timeout=5, timeout=60)
    b = make_client(first.address, tasks=2, task=1, connect_timeout=5, timeout=60)
    results = {}

    def wait_in_a():
        with a.bind_thread(0) as binding_a:
            results["a"] = a.rendezvous(binding_a, "r", b"a")

    waiter = threading.Thread(target=wait_in_a)
    waiter.start()
    time.sleep(6)  # longer than connect_timeout
    first.stop(grace=0)
    second = Coordinator(port=port, state_file=state).start()
    try:
        with b.bind_thread(0) as binding_b:
            results["b"] = b.rendezvous(binding_b, "r", b"b")
        waiter.join(30)
        assert results == {"a": [b"a", b"b"], "b": [b"a", b"b"]}
    finally:
        a.close()
        b.close()
        second.stop()


def test_a_refused_caller_releases_waiting_peers_at_once(coordinator):
    """A caller outside `replicas` fails the round its peers wait in; they learn it at once, not at their deadline."""
    peer = make_client(coordinator.address, tasks=3, task=0, timeout=30)
    outsider = make_client(coordinator.address, tasks=3, task=2, timeout=30)
    outcome = {}

    def wait_in_pair():
        with peer.bind_thread(0) as binding:
            started = time.monotonic()
            try:
                peer.rendezvous(binding, "pair", b"", replicas=[0, 1])
            except pr.InvalidArgumentError as exc:
                outcome["error"], outcome["after"] = str(exc), time.monotonic() - started

    waiter = threading.Thread(target=wait_in_pair)
    waiter.start()
    deadline = time.monotonic() + 10
    while not outsider.status("").jobs or not outsider.status("").jobs[0].pending_rounds:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with outsider.bind_thread(0) as binding:
        with pytest.raises(pr.InvalidArgumentError, match="ordinal 2 called rendezvous"):
            outsider.rendezvous(binding, "pair", b"", replicas=[0, 1])
    waiter.join(30)
    assert "ordinal 2 called rendezvous('pair') with replicas [0-1] but is not among them" in outcome["error"]
    assert outcome["after"] < 10
    peer.close()
    outsider.close()


def test_a_second_run_of_a_job_starts_afresh(coordinator):
    """Processes that close their clients leave the job; the next run registers the same
    tasks on the same coordinator and meets in a new generation."""
    for run in range(3):
        clients = [make_client(coordinator.address, tasks=2, task=t, timeout=30) for t in range(2)]
        results = {}

        def member(t):
            with clients[t].bind_thread(0) as binding:
                results[t] = clients[t].rendezvous(binding, "hello", b"run%d-%d" % (run, t))

        threads = [threading.Thread(target=member, args=(t,)) for t in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == {t: [b"run%d-0" % run, b"run%d-1" % run] for t in range(2)}
        assert clients[0].generation == run + 1
        for c in clients:
            c.close()


class _Interrupted(Exception):
    pass


def _interrupt_main_after(seconds: float) -> threading.Timer:
    """Sends SIGINT to the main thread (which a blocked lock acquire there gets) after ``seconds``."""
    timer = threading.Timer(seconds, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    return timer


@pytest.fixture
def sigint_raises_interrupted():
    def handler(signum, frame):
        raise _Interrupted

    previous = signal.signal(signal.SIGINT, handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _main_thread_interrupted_in_a_round(coordinator, main_arrives: int, interrupt_after: float | None) -> dict:
    """One round of 2 processes x 4 threads in which the main thread is ordinal 0 and is
    interrupted (``_Interrupted``): by a SIGINT after ``interrupt_after`` seconds, or by
    whatever the caller patched. Returns the other seven ordinals' results."""
    clients = [make_client(coordinator.address, tasks=2, devices=4, task=task, timeout=20) for task in range(2)]
    results: dict[int, list[bytes]] = {}
    bound = threading.Barrier(8)  # every thread bound before any round, as spawn does

    def thread_main(client: pr.Client, index: int, delay: float) -> None:
        binding = client.bind_thread(index)
        try:
            bound.wait(10)
            time.sleep(delay)
            results[binding.ordinal] = client.rendezvous(binding, "r", b"%d" % binding.ordinal)
        finally:
            client.unbind_thread()

    # Task 0: the main thread (ordinal 0) and thread 1 arrive first, in either order, then 2
    # and 3 (whose arrival sends the batch); task 1 comes a second later, so the round is
    # pending at the coordinator meanwhile.
    delays = {(0, 1): 0.1 - 0.1 * main_arrives, (0, 2): 0.3, (0, 3): 0.35, **{(1, i): 1.0 for i in range(4)}}
    threads = [
        threading.Thread(target=thread_main, args=(clients[task], index, delay)) for (task, index), delay in delays.items()
    ]
    for thread in threads:
        thread.start()
    binding = clients[0].bind_thread(0)
    bound.wait(10)
    timer = _interrupt_main_after(interrupt_after) if interrupt_after is not None else None
    try:
        time.sleep(0.1 * main_arrives)
        with pytest.raises(_Interrupted):
            clients[0].rendezvous(binding, "r", b"0")
    finally:
        if timer is not None:
            timer.cancel()
        clients[0].unbind_thread()
    for thread in threads:
        thread.join(30)
    for client in clients:
        client.close()
    assert not any(thread.is_alive() for thread in threads)
    return results


@pytest.mark.parametrize("main_arrives", [0, 1], ids=["main-thread-first", "main-thread-second"])
def test_a_waiting_thread_interrupted_does_not_keep_its_siblings_waiting(coordinator, sigint_raises_interrupted, main_arrives):
    """A round's waiting threads are woken one after another; the main thread (the one a
    signal interrupts), interrupted while it waits among them, keeps none of them waiting."""
    results = _main_thread_interrupted_in_a_round(coordinator, main_arrives, interrupt_after=0.6)
    assert results == {o: [b"%d" % i for i in range(8)] for o in range(1, 8)}


def test_the_main_thread_interrupted_as_it_joins_the_waiters_keeps_none_waiting(coordinator, monkeypatch):
    """An interrupt can come as the main thread's waiter is made (a handler runs at a call):
    the waiter is marked as the main thread's before it is listed, so it is never listed
    unmarked, where the chain would wake it and wait for it to wake the next."""
    main = threading.main_thread().ident

    def interrupted_in_the_main_thread() -> int:
        ident = threading.get_ident()
        if ident == main:
            raise _Interrupted
        return ident

    monkeypatch.setattr(client_module, "_get_ident", interrupted_in_the_main_thread)
    results = _main_thread_interrupted_in_a_round(coordinator, 1, interrupt_after=None)
    assert results == {o: [b"%d" % i for i in range(8)] for o in range(1, 8)}


def test_the_wake_chain_skips_the_main_threads_waiter():
    """The hand-off itself (real threads and locks, no coordinator): the sender releases the
    main thread's waiter itself and starts the chain; each woken waiter wakes the next,
    skipping the main thread's, so a main thread that never wakes (interrupted) holds up
    none of them."""
    batch = _Batch((), 0, 0, frozenset(range(4)))
    batch.waiters = [_allocate_lock() for _ in range(4)]
    for lock in batch.waiters:
        lock.acquire()
    first, main, third, last = batch.waiters
    batch.main = main
    woke = []

    def wait(lock):  # as rendezvous() does
        lock.acquire()
        _pass_on(batch, lock)
        woke.append(batch.waiters.index(lock))

    others = [threading.Thread(target=wait, args=(lock,)) for lock in (first, third, last)]
    for thread in others:
        thread.start()
    time.sleep(0.1)
    assert woke == []
    batch.main.release()  # as the sender does, once the round is done
    _pass_on(batch)
    for thread in others:
        thread.join(10)
    assert not any(thread.is_alive() for thread in others)
    assert woke == [0, 2, 3]
    assert main.acquire(False)  # released once, by the sender
