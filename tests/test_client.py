"""The client against a real coordinator on loopback: key-value, errors, retries, settings."""

from __future__ import annotations

import concurrent.futures
import contextlib
import faulthandler
import gc
import importlib.util
import logging
import multiprocessing
import os
import re
import subprocess
import queue
import signal
import socket
import sys
import threading
import time

import pytest
from _watch import watch_opened

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client._client import _Batch, _ThreadFailed, _allocate_lock, _pass_on
from pjrt_rendezvous.client._config import Settings
from pjrt_rendezvous.client._version import build
from pjrt_rendezvous.coordinator import Coordinator, Limits
from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb


@pytest.fixture
def coordinator(request):
    with Coordinator(port=0, limits=Limits(max_payload_bytes=1024), **getattr(request, "param", {})) as c:
        yield c


def _unused_port() -> int:
    """A loopback port nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_taken(port: int) -> bool:
    """Whether something listens on ``port`` of localhost (IPv4 or IPv6)."""
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            with socket.socket(family) as s:
                s.settimeout(1.0)
                if s.connect_ex((host, port)) == 0:
                    return True
        except OSError:  # no IPv6 here
            pass
    return False


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


def test_check_asks_whether_keys_exist_without_their_values(client, coordinator):
    """Store.check's call is answered with whether each key exists, not its value (it
    fetched values of any size only to test them)."""
    import grpc

    from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb
    from pjrt_rendezvous.protos.v1 import coordinator_pb2_grpc as pb_grpc

    client.set("big", b"x" * 100_000)
    assert client.check(["big"]) and not client.check(["big", "missing"])
    with grpc.insecure_channel(coordinator.address) as channel:
        request = pb.KvGetRequest(job=client.settings.job, keys=["big", "missing"], found_only=True)
        answer = pb_grpc.CoordinatorStub(channel).KvGet(request, timeout=10)
    assert [(v.found, v.value) for v in answer.values] == [(True, b""), (False, b"")]


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


def test_key_value_calls_refuse_what_the_wire_cannot_carry_by_name(client):
    """A key, prefix or job that is not text, a key that is not UTF-8, a delta outside 64
    bits: refused before the call, naming what is wrong (they raised protobuf's bare
    TypeError, a UnicodeEncodeError or ValueError('Value out of range'))."""
    refused = [
        (lambda: client.set(1, b"x"), TypeError, "key must be str, got int"),
        (lambda: client.get(b"k", wait=False), TypeError, "key must be str, got bytes"),
        (lambda: client.delete(5), TypeError, "key must be str"),
        (lambda: client.add("n", "1"), TypeError, "delta must be an int"),
        (lambda: client.add("n", True), TypeError, "delta must be an int, got bool"),  # (was added as 1)
        (lambda: client.add("n", 2**70), pr.UsageError, "outside the 64-bit integers"),
        (lambda: client.set("\udcff", b"x"), pr.UsageError, "is not valid text"),
        (lambda: client.compare_set("\udcff", b"", b"x"), pr.UsageError, "is not valid text"),
        (lambda: client.append("\udcff", b"x"), pr.UsageError, "is not valid text"),
        (lambda: client.list("\udcff"), pr.UsageError, "prefix '\\udcff' is not valid text"),
        (lambda: client.count(3), TypeError, "prefix must be str"),
        (lambda: client.status(job=5), TypeError, "job must be str"),
        (lambda: client.get("k", wait=False, timeout="x"), TypeError, "timeout must be a number"),  # (not read)
        (lambda: client.set("k", "text"), TypeError, "value must be bytes, got str"),  # (said "payload")
        (lambda: client.compare_set("k", b"", "text"), TypeError, "desired must be bytes, got str"),
    ]
    for call, error, words in refused:
        with pytest.raises(error, match=re.escape(words)):
            call()
    assert client.add("n", 2**63 - 1) == 2**63 - 1 and client.count() == 1
    client.multi_set(["g"], iter([b"1"]))  # values from an iterator (a TypeError: no len())
    assert client.get("g", wait=False) == b"1"


def test_settings_spawn_seed_and_store_of_the_wrong_type_are_type_errors(client):
    """"An argument of the wrong type is a TypeError" (README): settings given as arguments,
    spawn's counts, seed's base and a Store's prefix were UsageErrors; a value of the right
    type out of range stays a UsageError."""
    from pjrt_rendezvous.client import xla

    wrong = [
        (lambda: pr.Settings(address=7481), "address must be a str, got 7481"),
        (lambda: pr.Settings(address="127.0.0.1:1", job=5), "job must be a str, got 5"),
        (lambda: pr.Settings(address="127.0.0.1:1", batch_window="1"), "batch_window must be a number of seconds, got '1'"),
        (lambda: pr.Settings(address="127.0.0.1:1", fan_in=1), "fan_in must be a str, got 1"),
        (lambda: pr.Settings(address="127.0.0.1:1", transport=None), "transport must be a str, got None"),
        (lambda: xla.spawn(print, nprocs="2"), "nprocs must be a positive int, got '2'"),
        (lambda: xla.spawn(print, grace="1"), "grace must be a number of seconds, got '1'"),
        (lambda: xla.seed("x"), "base_seed must be an int, got 'x'"),
    ]
    if importlib.util.find_spec("torch") is not None:  # (a Store is a torch.distributed Store)
        from pjrt_rendezvous.client._store import Store

        wrong += [
            (lambda: Store(client, prefix=5), "prefix must be a str, got 5"),
            (lambda: Store(client, timeout="x"), "timeout must be a timedelta or a number of seconds, got 'x'"),  # (float()'s ValueError)
        ]
    for call, words in wrong:
        with pytest.raises(TypeError, match=re.escape(words)):
            call()
    for call in (lambda: pr.Settings(address="127.0.0.1:1", batch_window=-1.0), lambda: xla.spawn(print, nprocs=0)):
        with pytest.raises(pr.UsageError):
            call()
    # Half of mutual TLS, and no address, are refused by name
    for settings, said in (
        ({"address": ""}, "address must be 'host:port', got ''"),
        ({"tls_ca": "ca.pem", "tls_cert": "c.pem"}, "mutual TLS needs both tls_cert and tls_key"),
        ({"tls_cert": "c.pem", "tls_key": "k.pem"}, "a client certificate needs tls_ca too"),
    ):
        with pytest.raises(pr.UsageError, match=re.escape(said)):
            pr.Settings(**{"address": "127.0.0.1:1", **settings})
    # What None means, where it may be given (heartbeat_interval=0 said "None waits forever", then refused None).
    for name, means in [("timeout", "None waits forever"), ("progress_interval", "None: never")]:
        with pytest.raises(pr.UsageError, match=re.escape(f"{name} must be > 0 seconds ({means}), got 0")):
            pr.Settings(address="127.0.0.1:1", **{name: 0})
    # The two that must end say so, and where their cap is (1814400 was "not finite"; 'none' in
    # the variable passed the variable's check, then failed as "got None").
    for name, variable in (("connect_timeout", "PJRT_RENDEZVOUS_CONNECT_TIMEOUT"), ("heartbeat_interval", "PJRT_RENDEZVOUS_HEARTBEAT_INTERVAL")):
        for value in (0, -1, 21 * 86400, float("nan")):
            with pytest.raises(pr.UsageError, match=re.escape(f"{name} must be a number of seconds > 0 and under 21 days (init({name}=), {variable}), got ")):
                pr.Settings(address="127.0.0.1:1", **{name: value})
        with pytest.raises(pr.UsageError, match=re.escape(f"{variable}='none' is not a number of seconds")):
            pr.Settings.resolve({variable: "none"}, address="127.0.0.1:1")
        assert getattr(pr.Settings.resolve({variable: "20"}, address="127.0.0.1:1"), name) == 20.0


def test_a_client_warns_once_of_a_variable_nothing_reads(coordinator, monkeypatch, caplog):
    """A misspelt client setting (PJRT_RENDEZVOUS_TIMOUT) was ignored without a word, while
    serve warned of the same mistake: a client says so once per process; serve's variables,
    set beside it from a shared file, are known."""
    from pjrt_rendezvous.client import _client

    monkeypatch.setattr(_client, "_variables_checked", set())
    monkeypatch.setenv("PJRT_RENDEZVOUS_TIMOUT", "5")
    monkeypatch.setenv("PJRT_RENDEZVOUS_STATE_FILE", "/var/lib/x")
    with caplog.at_level(logging.WARNING, logger="pjrt_rendezvous.client"):
        for _ in range(2):
            make_client(coordinator.address).close()
    warned = [r.getMessage() for r in caplog.records if "not a variable" in r.getMessage()]
    assert warned == [
        "PJRT_RENDEZVOUS_TIMOUT is not a variable pjrt-rendezvous reads (did you mean PJRT_RENDEZVOUS_TIMEOUT?): ignored"
    ]


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


def test_a_first_waiting_get_of_keys_given_as_an_iterator_waits_for_them(coordinator):
    """A client's first waiting call asks once without waiting first (to learn the job's
    store): keys given as an iterator were used up by that ask, and the wait asked for no
    keys at all, returning [] at once."""
    waiting, other = make_client(coordinator.address), make_client(coordinator.address)
    try:
        setter = threading.Timer(0.3, lambda: other.set("late", b"here"))
        setter.start()
        assert waiting.multi_get(iter(["late"]), timeout=10) == [b"here"]
        setter.join()
    finally:
        waiting.close()
        other.close()


@pytest.mark.parametrize("coordinator", [{"heartbeat_timeout": None}], indirect=True)
def test_gets_waiting_on_one_key_each_end_at_their_own_timeout(coordinator):
    """Two gets wait for the same key, the first to come with the shorter timeout: each
    times out at its own (the later deadline must not take the earlier one's place; without
    a heartbeat timeout no liveness wake-up each second hides it)."""
    hasty, patient = make_client(coordinator.address), make_client(coordinator.address)
    ended = {}

    def get(client, name, timeout):
        started = time.monotonic()
        with pytest.raises(pr.RendezvousTimeout, match="'shared'"):
            client.get("shared", timeout=timeout)
        ended[name] = time.monotonic() - started

    try:
        first = threading.Thread(target=get, args=(hasty, "hasty", 1.0))
        first.start()
        time.sleep(0.3)  # (its wait reaches the coordinator first)
        second = threading.Thread(target=get, args=(patient, "patient", 4.0))
        second.start()
        first.join(20)
        second.join(20)
        assert 1.0 <= ended["hasty"] < 3.0 and ended["patient"] >= 4.0, ended
    finally:
        hasty.close()
        patient.close()


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
        for payload in (bytearray(b"ab"), memoryview(b"xabx")[1:3]):  # taken as the bytes they hold
            assert client.rendezvous(binding, f"as-{type(payload).__name__}", payload) == [b"ab"]
        with pytest.raises(pr.UsageError, match="timeout must be > 0"):
            client.rendezvous(binding, "t", b"", timeout=0)
        with pytest.raises(pr.UsageError, match="already bound"):
            client.bind_thread(0)
        # The wrong type is a TypeError, as the README says (they were UsageErrors).
        with pytest.raises(TypeError, match="timeout must be a number of seconds or None, got '5'"):
            client.rendezvous(binding, "t", b"", timeout="5")
        with pytest.raises(TypeError, match="thread_index must be an int, got '0'"):
            client.bind_thread("0")
        with pytest.raises(pr.UsageError, match=r"runtime_ordinal must be an int in \[0, 2\*\*31\), got 1099511627776"):
            client.bind_thread(0, runtime_ordinal=2**40)  # (protobuf's bare ValueError)
    finally:
        client.unbind_thread()
    numpy = pytest.importorskip("numpy")
    with client.bind_thread(numpy.int64(0)) as binding:  # numpy's ints, as for replicas
        assert binding.thread_index == 0 and type(binding.thread_index) is int
    with pytest.raises(pr.UsageError, match="unknown setting"):
        Settings.resolve({}, address="x:1", colour="blue")


def test_an_index_whose_thread_ended_bound_can_be_bound_again(coordinator):
    """A thread that binds (no `with`, no unbind) and ends: another thread takes its index,
    with the same ordinal (it was "already bound by another thread" for the client's life);
    a live holder still refuses it."""
    client = make_client(coordinator.address, devices=2, timeout=10)
    try:
        first = threading.Thread(target=client.bind_thread, args=(1,))
        first.start()
        first.join(10)
        holder_ready, release = threading.Event(), threading.Event()

        def holder():
            with client.bind_thread(0):
                holder_ready.set()
                release.wait(10)

        live = threading.Thread(target=holder)
        live.start()
        holder_ready.wait(10)
        with pytest.raises(pr.UsageError, match="thread index 0 is already bound by another thread"):
            client.bind_thread(0)
        with client.bind_thread(1) as again:
            assert again.ordinal == 1
        release.set()
        live.join(10)
    finally:
        client.close()


def test_world_of_one_binding_returns_own_payload(client):
    """A bound thread in a world of one gets [payload] back."""
    with client.bind_thread(0) as binding:
        assert binding.world_size == 1
        assert client.rendezvous(binding, "solo", b"me") == [b"me"]


def test_a_released_binding_entered_again_is_refused(client, coordinator):
    """A binding's with block entered again after it ended did nothing, and the next call
    found the thread unbound: it is refused, saying to bind again; so is one of another thread."""
    binding = client.bind_thread(0)
    with binding:
        pass
    with pytest.raises(pr.UsageError, match=r"this binding of ordinal 0 is not the calling thread's \(released at the end of its with block"):
        with binding:
            pass
    with client.bind_thread(0) as again:
        assert pr.current_binding() is again
        other = concurrent.futures.ThreadPoolExecutor(1)
        with pytest.raises(pr.UsageError, match="not the calling thread's"):
            other.submit(again.__enter__).result()
        other.shutdown()
        assert pr.current_binding() is again  # (the refusal unbound nothing)
    assert pr.current_binding() is None
    # The module's unbind_thread, as the README names it (only Client.unbind_thread existed).
    client.bind_thread(0)
    pr.unbind_thread()
    assert pr.current_binding() is None and 0 not in client._bindings
    pr.unbind_thread()  # (none: nothing to do)
    # The binding of a client closed since, which calls name until it is forgotten: forgotten.
    other = make_client(coordinator.address)
    other.bind_thread(0)
    other.close()
    with pytest.raises(pr.UsageError, match="through a client that was closed since"):
        pr.get_ordinal()
    pr.unbind_thread()
    assert pr.get_ordinal() == 0  # (unbound, in a world of one)


def test_payload_over_limit_is_resource_exhausted_for_the_caller_and_its_waiting_peer(coordinator):
    """A payload over the coordinator's limit fails with the limit and the size in the
    message, at once for the peer already waiting in the round too (not after its timeout,
    naming the refused ordinal as missing); the next round runs."""
    client = make_client(coordinator.address, tasks=2, timeout=30)
    peer = make_client(coordinator.address, tasks=2, task=1, timeout=30)
    waiting = concurrent.futures.ThreadPoolExecutor(1)  # one thread: the peer's, bound there
    peer_binding = waiting.submit(peer.bind_thread, 0).result()
    with client.bind_thread(0) as binding:
        started = time.monotonic()
        outcome = waiting.submit(peer.rendezvous, peer_binding, "big", b"small")
        while not client.status().jobs[0].pending_rounds:
            time.sleep(0.01)
        with pytest.raises(pr.LimitExceededError, match=r"2000 bytes, over the limit of 1024 bytes"):
            client.rendezvous(binding, "big", b"x" * 2000)
        with pytest.raises(pr.LimitExceededError, match=r"ordinal 0 is 2000 bytes.*fails for every member"):
            outcome.result(timeout=20)
        assert time.monotonic() - started < 20
        after = waiting.submit(peer.rendezvous, peer_binding, "next", b"p1")
        assert client.rendezvous(binding, "next", b"p0") == [b"p0", b"p1"] == after.result(timeout=20)
    waiting.submit(peer.unbind_thread).result()
    waiting.shutdown()
    client.close()
    peer.close()


def test_a_member_late_for_rounds_its_peer_timed_out_in_gets_each_timeout_then_rounds_run(coordinator):
    """Ordinal 0 catches its timeouts and goes on, three rounds without ordinal 1 (a data
    stall, say): ordinal 1, late, gets each one's timeout (RendezvousTimeout, as its peer
    did, naming itself as missing), then the next round is whole. Round 0 was 'finished long
    ago and its result is gone', a MismatchError (a group kept two failed rounds)."""
    client = make_client(coordinator.address, tasks=2, timeout=30)
    peer = make_client(coordinator.address, tasks=2, task=1, timeout=30)
    peer_thread = concurrent.futures.ThreadPoolExecutor(1)  # one thread: the late one's, bound there
    late = peer_thread.submit(peer.bind_thread, 0).result()
    with client.bind_thread(0) as binding:
        for step in range(3):
            with pytest.raises(pr.RendezvousTimeout, match=rf"rendezvous 'step-{step}' .* timed out after 0.2 s"):
                client.rendezvous(binding, f"step-{step}", b"p0", timeout=0.2)
        for step in range(3):
            with pytest.raises(pr.RendezvousTimeout, match=(
                rf"ordinal 1 called rendezvous\('step-{step}'\) as round {step} of all ordinals, which had failed before it came"
                r".*missing ordinal 1"
            )):
                peer_thread.submit(peer.rendezvous, late, f"step-{step}", b"p1").result(timeout=20)
        caught_up = peer_thread.submit(peer.rendezvous, late, "step-3", b"p1")
        assert client.rendezvous(binding, "step-3", b"p0") == [b"p0", b"p1"] == caught_up.result(timeout=20)
    peer_thread.submit(peer.unbind_thread).result()
    peer_thread.shutdown()
    client.close()
    peer.close()


def test_a_round_whose_answer_passes_max_round_bytes_fails_for_every_thread_and_the_next_runs():
    """Each payload within its limit, the round's together over max_round_bytes (the
    answer every member receives): every thread is told, naming the size and the limit,
    not left to an answer that cannot be sent; the group's next round runs."""
    with Coordinator(port=0, limits=Limits(max_round_bytes=3000)) as coordinator:
        client = make_client(coordinator.address, devices=2, timeout=30)

        def thread(index: int) -> list:
            outcomes = []
            with client.bind_thread(index) as binding:
                for payload in (b"x" * 2000, b"small"):
                    try:
                        outcomes.append(client.rendezvous(binding, "gather", payload))
                    except pr.LimitExceededError as exc:
                        outcomes.append(str(exc))
            return outcomes

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(thread, range(2)))
        client.close()
    for big, small in outcomes:
        assert "would be 4012 bytes, over the limit of 3000 bytes (max_round_bytes" in big
        assert small == [b"small", b"small"]


def test_a_set_resent_after_another_clients_set_is_not_applied_again(client):
    """A set's answer lost and the set resent (the client's retry sends the same request)
    after another client set the key: the newer value stays (it was overwritten)."""
    client.set("warm", b"x")  # (the job exists; the request names its store)
    request = pb.KvSetRequest(job=client.settings.job, entries=[pb.KvEntry(key="k", value=b"first")], request_id="r1")
    client._call("KvSet", request)
    client.set("k", b"newer")
    client._call("KvSet", request)
    assert client.get("k", wait=False) == b"newer"


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


def test_unreachable_coordinator_is_retried_then_reported(monkeypatch, caplog):
    """With nothing listening, calls retry until connect_timeout and then name the address;
    meanwhile a warning says so once the outage has lasted a while (it was silent for the
    whole connect_timeout, a minute by default)."""
    from pjrt_rendezvous.client import _client

    monkeypatch.setattr(_client, "_STILL_TRYING_AFTER", 0.5)
    # Retries at most 0.2 s apart: with the default cap (2 s, random waits) the last retry
    # before the 1.5 s budget may come before 0.5 s, and nothing is said (CI saw it once).
    monkeypatch.setattr(_client, "_BACKOFF_CAP", 0.2)
    monkeypatch.setattr(_client, "_still_trying_said", {})
    monkeypatch.setattr(_client, "_failing", {})
    port = _unused_port()
    client = make_client(f"127.0.0.1:{port}", connect_timeout=1.5)
    started = time.monotonic()
    with pytest.raises(pr.CoordinatorUnavailableError, match=f"127.0.0.1:{port} unavailable.*is that its address"):
        client.set("k", b"v")
    assert time.monotonic() - started >= 1.4
    # (this client's: another test's left open, whose coordinator is gone, warns too)
    warned = [r.getMessage() for r in caplog.records if f"coordinator at 127.0.0.1:{port} has not answered for" in r.getMessage()]
    assert warned and all(
        "KvSet" in m and re.search(r"tries again for up to [01] s more \(connect_timeout, 2 s from its first failure\)", m)
        for m in warned
    ), warned
    assert len(warned) <= 3, warned  # once in 0.5 s at most (retried every 0.2 s: about 5)
    client.close()

    # A call made as the last gave up has its budget whole, and its warning counts the
    # outage from the first failure, not its own ("for 2 s" after 4 s without an answer).
    caplog.clear()
    again = make_client(f"127.0.0.1:{port}", connect_timeout=2.5)
    with pytest.raises(pr.CoordinatorUnavailableError):
        again.set("k", b"v")
    assert time.monotonic() - started >= 3.9
    said = [
        int(m.group(1)) for r in caplog.records
        if (m := re.search(f"coordinator at 127.0.0.1:{port} has not answered for (\\d+) s", r.getMessage()))
    ]
    assert said and max(said) >= 3, said
    again.close()


def test_an_answer_ends_the_outage_the_retry_warning_counts(coordinator, monkeypatch):
    """Failures within seconds of each other are one outage for the warning (above); an
    answer in between ends it: a coordinator that failed again seconds after it came back
    was said not to have answered for the whole time since the first outage began."""
    from pjrt_rendezvous.client import _client

    monkeypatch.setattr(_client, "_failing", {coordinator.address: (time.monotonic() - 30, time.monotonic())})
    client = make_client(coordinator.address, heartbeat_interval=0.2)
    client.bind_thread(0)  # (its heartbeats start)
    deadline = time.monotonic() + 10
    while coordinator.address in _client._failing:  # (a heartbeat answered)
        assert time.monotonic() < deadline, _client._failing
        time.sleep(0.05)
    client.unbind_thread()
    client.close()


def test_a_proxy_in_the_environment_is_not_used(coordinator, monkeypatch):
    """http_proxy, https_proxy and grpc_proxy (set for the internet) are not used to reach
    the coordinator: every gRPC call went through the proxy, loopback's too, and failed
    for the whole connect timeout where nothing listened at the proxy's address."""
    proxy = f"http://127.0.0.1:{_unused_port()}"
    for name in ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(name, proxy)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    client = make_client(coordinator.address, connect_timeout=5, transport="grpc")
    client.set("k", b"v")
    assert client.get("k") == b"v"
    client.close()
    health = subprocess.run(
        [sys.executable, "-m", "pjrt_rendezvous.coordinator", "health", "--address", coordinator.address, "--timeout", "5"],
        env=dict(os.environ), capture_output=True, text=True, timeout=60,
    )
    assert health.returncode == 0, health.stdout + health.stderr


def test_a_closing_client_does_not_report_its_own_departure(coordinator, caplog):
    """close() says Leave; the Watch stream, still open, brought the job's event of it
    back, and the closing process logged its own departure as news ("job default:
    ordinal 0 (... pid <its own>) left: its client closed"). Its peers still hear of it."""
    caplog.set_level(logging.INFO, logger="pjrt_rendezvous.client")
    peer = make_client(coordinator.address, tasks=2, task=1)
    closing = make_client(coordinator.address, tasks=2, task=0)
    pools = [concurrent.futures.ThreadPoolExecutor(1) for _ in range(2)]
    opened = [watch_opened(client) for client in (peer, closing)]
    for pool, client in zip(pools, (peer, closing)):
        pool.submit(client.bind_thread, 0).result(30)
    assert all(event.wait(30) for event in opened)  # (a stream opened after the Leave never hears of it)
    pools[1].submit(closing.unbind_thread).result(30)
    closing.close()
    deadline = time.monotonic() + 10

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "left: its client closed" in r.getMessage()]

    while not said():  # (the peer's line: appended to its events, then logged)
        assert time.monotonic() < deadline, "the peer did not hear of the departure"
        time.sleep(0.05)
    lines = said()
    assert len(lines) == 1 and f"pid {os.getpid()}, task 0" in lines[0], lines  # the peer's line alone
    pools[0].submit(peer.unbind_thread).result(30)
    peer.close()
    for pool in pools:
        pool.shutdown()


def test_another_grpc_server_at_the_address_is_named_as_such():
    """A client pointed at a gRPC server that is not the coordinator (or at an older one)
    fails at once, naming the address and what to check (it said "Method not found!")."""
    import grpc
    from concurrent import futures

    other = grpc.server(futures.ThreadPoolExecutor(1))
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        client = make_client(f"127.0.0.1:{port}", connect_timeout=30)
        started = time.monotonic()
        with pytest.raises(pr.RemoteError) as raised:
            client.get("k", wait=False)
        assert time.monotonic() - started < 10  # (not retried for the connect timeout)
        message = str(raised.value)
        assert f"127.0.0.1:{port} does not serve " in message and "Method not found!" in message, message
        assert "gRPC port of `pjrt-rendezvous serve`" in message and f"this client's ({build()}) from before" in message, message
        assert "run one build everywhere" in message, message  # (it asked whether the versions differed: they may not)
        client.close()
    finally:
        other.stop(None)


def test_an_unreachable_default_address_says_it_was_the_default():
    """Nothing named the coordinator (no address, PJRT_RENDEZVOUS_ADDRESS or worker
    hostnames): the client dials localhost:7481, and in a world spanning hosts only host 0
    finds it there. The error says so, and what to set on the other hosts (it named the
    possible sources, not that none was given)."""
    if _port_taken(7481):
        pytest.skip("port 7481 is in use here")
    env = {"PJRT_RENDEZVOUS_NUM_TASKS": "4", "PJRT_RENDEZVOUS_TASK_ID": "2", "PJRT_RENDEZVOUS_LOCAL_WORLD_SIZE": "2",
           "PJRT_RENDEZVOUS_LOCAL_RANK": "0"}
    topology = pr.detect_topology(env)
    assert (topology.address, topology.address_defaulted) == ("localhost:7481", True)
    client = pr.Client(pr.Settings(address=topology.address, connect_timeout=1.0), topology)
    with pytest.raises(pr.CoordinatorUnavailableError) as raised:
        client.get("k", wait=False)
    assert str(raised.value).endswith(
        " Nothing named the coordinator, so this client looked on its own host (localhost:7481); in a world of 4 "
        "tasks on more than one host, set PJRT_RENDEZVOUS_ADDRESS (or TPU_WORKER_HOSTNAMES) on every host but the "
        "coordinator's."
    ), str(raised.value)
    client.close()
    # Named, even as the default is: nothing to add (it told a user who had set the variable to set it).
    named = pr.detect_topology({**env, "PJRT_RENDEZVOUS_ADDRESS": "localhost:7481"})
    assert (named.address, named.address_defaulted) == ("localhost:7481", False)
    client = pr.Client(pr.Settings(address=named.address, connect_timeout=1.0), named)
    with pytest.raises(pr.CoordinatorUnavailableError) as raised:
        client.get("k", wait=False)
    assert "Nothing named" not in str(raised.value)
    client.close()


def test_retries_end_at_connect_timeout_not_a_backoff_after_it():
    """The last wait before the budget runs out is cut to what is left of it: with the
    default backoff (random, up to 2 s) a 1.5 s budget ended after 2.6-3.3 s."""
    port = _unused_port()
    client = make_client(f"127.0.0.1:{port}", connect_timeout=1.5)
    for _ in range(3):
        started = time.monotonic()
        with pytest.raises(pr.CoordinatorUnavailableError):
            client.get("k", wait=False)
        assert 1.4 <= time.monotonic() - started < 2.5  # (before: up to 3.3 s, at random)
    client.close()


def test_a_given_up_round_a_coordinator_does_not_serve_is_warned_of(coordinator, monkeypatch, caplog):
    """A coordinator older than GiveUpRound answers it UNIMPLEMENTED: the round's peers then
    wait out their timeout, so the process says so (a WARNING; it was a DEBUG line), and its
    next call goes on."""
    from pjrt_rendezvous.client import _client

    client = make_client(coordinator.address)
    request = pb.GiveUpRoundRequest(job="default", incarnation=client.incarnation, round=3)
    _client._given_up[client] = [request]
    real = _client.Client._call

    def older(self, method, *args, **kwargs):
        if method == "GiveUpRound":
            raise pr.RemoteError("127.0.0.1 does not serve GiveUpRound", code="UNIMPLEMENTED")
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(_client.Client, "_call", older)
    caplog.set_level("DEBUG", logger="pjrt_rendezvous.client")
    client.set("k", b"v")
    (told,) = [r for r in caplog.records if "was given up" in r.getMessage()]
    assert told.levelname == "WARNING" and "could not tell the coordinator that round 3 was given up" in told.getMessage()
    assert client not in _client._given_up and client.get("k") == b"v"
    client.close()


def test_a_waiting_get_gives_up_on_an_unreachable_coordinator_at_its_timeout():
    """A client's first waiting get learns the job's store with a call of its own, which had
    no deadline: against a coordinator down it retried for the whole connect_timeout (a
    torch Store's get with a timeout of 3 s took 60 s), at every call while it stayed down."""
    port = _unused_port()
    client = make_client(f"127.0.0.1:{port}", connect_timeout=30)
    for _ in range(2):
        started = time.monotonic()
        with pytest.raises(pr.RemoteError):
            client.get("k", timeout=1.0)
        assert time.monotonic() - started < 10
    client.close()


def test_calls_wait_for_a_coordinator_that_starts_late():
    """A client started before its coordinator retries until the coordinator is up, then succeeds."""
    port = _unused_port()
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
    assert (s.heartbeat_interval, s.progress_interval) == (5.0, 60.0)  # (README's defaults)
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


def test_init_refuses_arguments_of_the_wrong_type_by_name(coordinator, tmp_path):
    """An address, topology or env of the wrong type, a token that is not a str, a token or TLS
    file that is not a path: a TypeError naming the argument, before and after a client exists
    (an int address raised AttributeError: 'strip' from the address parser, a str topology or
    env AttributeError too; an int token_file or tls_ca was opened as that file descriptor)."""
    pr.shutdown()
    refused = [
        ((5,), {}, "init() address must be a str 'host:port' or None, got 5"),
        ((b"127.0.0.1:1",), {}, "init() address must be a str 'host:port' or None, got b'127.0.0.1:1'"),
        ((), {"topology": "v4-8"}, "init() topology must be a Topology or None, got 'v4-8'"),
        ((), {"env": ["PJRT_RENDEZVOUS_JOB=x"]}, "init() env must be a mapping of variable names to values or None, got list"),
        ((), {"token": 5}, "token must be a str or None, got int"),
        ((), {"token_file": 5}, "token_file must be a path (str or os.PathLike) or None, got 5"),
        ((), {"tls_ca": 5}, "tls_ca must be a path (str or os.PathLike) or None, got 5"),
    ]
    try:
        for args, kwargs, words in refused:
            with pytest.raises(TypeError, match=re.escape(words)):
                pr.init(*args, **{"env": {}, **kwargs})
        first = pr.init(coordinator.address, env={})
        for args, kwargs, words in refused[:4]:
            with pytest.raises(TypeError, match=re.escape(words)):
                pr.init(*args, **kwargs)
        assert pr.get_client() is first
        (tmp_path / "token").write_text("secret")
        settings = Settings.resolve({}, address="h:1", token_file=tmp_path / "token")  # a Path is a path
        assert settings.token == "secret"
        with pytest.raises(TypeError, match=re.escape("token must be a str or None, got bytes")):
            Settings(address="h:1", token=b"secret")
    finally:
        pr.shutdown()


def test_init_with_what_an_init_without_arguments_already_chose_returns_its_client(coordinator, monkeypatch):
    """A client made by init() without arguments (a Store's, spawn's) is what init(address)
    with the same address asks for, however written, and the same job or timeout (it was
    refused as "already called with other arguments"); a different one is still refused."""
    pr.shutdown()
    host, port = coordinator.address.rsplit(":", 1)
    monkeypatch.setenv("PJRT_RENDEZVOUS_ADDRESS", coordinator.address)
    monkeypatch.setenv("PJRT_RENDEZVOUS_TIMEOUT", "30")
    try:
        first = pr.init()
        assert pr.init(coordinator.address) is first and pr.init(f" {host}:{port}") is first
        assert pr.init(job="default", timeout=30, env=dict(os.environ)) is first
        for args, kwargs, named in [
            ((f"{host}:{int(port) + 1}",), {}, "['address']"),
            ((coordinator.address,), {"job": "other"}, "['job']"),
            ((), {"timeout": 31, "batch_window": 1.0}, "['timeout']"),
        ]:
            with pytest.raises(pr.UsageError, match=re.escape(f"with other arguments (now {named})")):
                pr.init(*args, **kwargs)
        with pytest.raises(pr.UsageError, match=re.escape("unknown setting(s) ['bogus']")):  # (not "other arguments")
            pr.init(bogus=1)
        assert pr.init(fan_in="AUTO") is first  # (any case, as from its variable)
    finally:
        pr.shutdown()


def test_a_closed_process_client_is_replaced_by_init_and_its_threads_may_bind_again(coordinator):
    """init() after the process client was closed by hand makes a new one (it returned the
    closed one, whose error said to call init() again); a thread bound to the closed client
    counts as unbound and binds to the new one, but its xm-style calls are refused until it
    does (as an unbound thread's, they answered for a world of one: ordinal 0, its process's
    master); an address given beside a topology is used."""
    pr.shutdown()
    try:
        first = pr.init(coordinator.address, env={})
        binding = pr.bind_thread(0)
        assert pr.current_binding() is binding
        first.close()
        assert pr.current_binding() is None
        with pytest.raises(pr.UsageError, match="bound as ordinal 0 through a client that was closed since"):
            pr.get_ordinal()
        second = pr.init(coordinator.address, env={})
        assert second is not first and not second._closed
        assert pr.bind_thread(0).client is second and pr.get_ordinal() == 0
        second.unbind_thread()
        pr.shutdown()
        assert pr.get_ordinal() == 0  # unbound by hand: a world of one's answer
        topology = pr.detect_topology({}, address="127.0.0.1:1")
        third = pr.init(coordinator.address, topology=topology, env={})
        assert third.settings.address == coordinator.address
    finally:
        pr.shutdown()


def test_still_waiting_counts_from_the_call_across_a_resend(coordinator, caplog):
    """A call resent on a new connection (this one cut at 1.5 s) goes on counting its wait
    from the call: the count started again from 0 at each resend. A wait under a second is
    written in figures that show it."""
    client = make_client(coordinator.address, tasks=2, progress_interval=0.4)
    caplog.set_level(logging.WARNING, logger="pjrt_rendezvous.client")
    with client.bind_thread(0) as binding:
        cut = threading.Timer(1.5, lambda: client._current_session.close("cut by the test"))
        cut.start()
        with pytest.raises(pr.RendezvousTimeout):
            client.rendezvous(binding, "slow", b"", timeout=3.0)
        cut.join()
    waited = [float(m.group(1)) for r in caplog.records if (m := re.search(r"still waiting after ([\d.]+) s.*tag 'slow'", r.getMessage()))]
    assert len(waited) >= 4 and waited == sorted(waited) and waited[-1] >= 2, waited
    assert waited[0] > 0.3, waited  # in figures that show it below a second: it said "after 0 s"
    client.close()


def test_settings_read_variables_as_written_by_hand():
    """Enum variables are read in any case and with stray spaces, a token without its line
    end; a batch window must be a finite number of seconds; a job name with a stray space is
    refused, and refusals name the variable and the value."""
    env = {"PJRT_RENDEZVOUS_FAN_IN": " HOST ", "PJRT_RENDEZVOUS_TRANSPORT": "gRPC\n", "PJRT_RENDEZVOUS_TOKEN": "s3cret\n"}
    settings = Settings.resolve(env, address="127.0.0.1:1")
    assert (settings.fan_in, settings.transport, settings.token) == ("host", "grpc", "s3cret")
    for bad in ("nan", "inf", "-1"):
        with pytest.raises(pr.UsageError, match="batch_window"):
            Settings.resolve({"PJRT_RENDEZVOUS_BATCH_WINDOW": bad}, address="127.0.0.1:1")
    with pytest.raises(TypeError, match="batch_window"):  # (a bool is no number of seconds)
        Settings(address="127.0.0.1:1", batch_window=True)
    with pytest.raises(pr.UsageError, match="job 'train ' has spaces at an end"):
        Settings.resolve({"PJRT_RENDEZVOUS_JOB": "train "}, address="127.0.0.1:1")
    for bad in ("tr\rain", "tr\x85ain", "tr\u2028ain"):  # (C1 and line separators: refused at the first bind)
        with pytest.raises(pr.UsageError, match="holds a control character"):
            Settings.resolve({"PJRT_RENDEZVOUS_JOB": bad}, address="127.0.0.1:1")
    with pytest.raises(pr.UsageError, match=r"PJRT_RENDEZVOUS_CONNECT_TIMEOUT='none' is not a number of seconds"):
        Settings.resolve({"PJRT_RENDEZVOUS_CONNECT_TIMEOUT": "none"}, address="127.0.0.1:1")


def test_still_waiting_lines_name_the_missing_ordinals(coordinator, caplog):
    """While blocked, the client logs a periodic 'still waiting' line naming who is missing."""
    client = make_client(coordinator.address, tasks=2, progress_interval=0.3)
    caplog.set_level(logging.WARNING, logger="pjrt_rendezvous.client")
    with client.bind_thread(0) as binding:
        with pytest.raises(pr.RendezvousTimeout):
            client.rendezvous(binding, "slow", b"", timeout=1.2)
    lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage() and "'slow'" in r.getMessage()]
    assert len(lines) >= 2
    assert "tag 'slow', missing 1 of 2: ordinal 1 never registered" in lines[0]
    client.close()


def test_still_waiting_lines_name_groups_and_ordinals_as_ranges_as_the_coordinator_does(coordinator, caplog):
    """The line named the round's group and the process's ordinals as Python lists
    ("replicas [0, 1, 2] (ordinals [0, 1] here)") where the coordinator's log and errors
    name the same round "replicas [0-2]": now ranges, as everywhere else."""
    client = make_client(coordinator.address, tasks=2, devices=2, progress_interval=0.3)
    caplog.set_level(logging.WARNING, logger="pjrt_rendezvous.client")
    errors = []
    bound = threading.Barrier(2)

    def member(index: int) -> None:
        with client.bind_thread(index) as binding:
            bound.wait(30)  # (both bound first: one call for the process)
            try:
                client.rendezvous(binding, "sub", b"", replicas=[0, 1, 2], timeout=1.5)
            except pr.RendezvousTimeout as exc:
                errors.append(str(exc))

    threads = [threading.Thread(target=member, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(errors) == 2 and "rendezvous 'sub' on replicas [0-2] (round 0)" in errors[0], errors
    lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage() and "'sub'" in r.getMessage()]
    assert lines and all("in round 0 of replicas [0-2] (ordinals 0-1 here): " in line for line in lines), lines
    assert "(ordinals 0-1 here): tag 'sub', missing 1 of 3: ordinal 2 never registered" in lines[0], lines
    client.close()


def test_a_blocking_get_or_wait_says_every_interval_which_keys_are_still_not_set(coordinator, caplog):
    """A get or wait blocked on keys nobody sets said nothing until its timeout (torch's
    Store waits up to 30 minutes in init_process_group): now, as a round does, a "still
    waiting" line every progress_interval naming the keys still not set."""
    client = make_client(coordinator.address, progress_interval=0.3)
    caplog.set_level(logging.WARNING, logger="pjrt_rendezvous.client")
    with pytest.raises(pr.RendezvousTimeout, match="still not set"):
        client.get("ckpt/step", timeout=1.0)
    lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage() and "ckpt/step" in r.getMessage()]
    assert lines and "for key 'ckpt/step' of job 'default': not set yet" in lines[0], lines
    caplog.clear()
    client.set("a", b"1")
    with pytest.raises(pr.RendezvousTimeout, match="2 keys of job 'default' still not set"):
        client.wait(["a", "b", "c/d"], timeout=1.0)
    lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage() and "3 keys" in r.getMessage()]
    assert lines and "for 3 keys of job 'default': 2 not set yet: 'b', 'c/d'" in lines[0], lines
    quiet = make_client(coordinator.address, progress_interval=None)
    caplog.clear()
    with pytest.raises(pr.RendezvousTimeout):
        quiet.get("ckpt/step", timeout=0.5)
    assert not [r for r in caplog.records if "still waiting" in r.getMessage() and "ckpt/step" in r.getMessage()]
    client.close()
    quiet.close()


@pytest.mark.parametrize("wait", [False, True], ids=["plain-get", "blocking-get"])
def test_a_value_is_read_only_once_it_is_on_disk(tmp_path, monkeypatch, wait):
    """With a state file, a get (plain, or blocked until the key is set) answers a value only
    once the write that set it is on disk: a crash in between cannot take back what a
    reader acted on. (It was answered from memory, before the writer was.)"""
    from test_state import slow_disk

    writing, release = slow_disk(monkeypatch, "append", b"late")  # the disk is slow for this one
    with Coordinator(port=0, state_file=tmp_path / "state.json") as coordinator:
        writer, reader = make_client(coordinator.address, timeout=30), make_client(coordinator.address, timeout=30)
        writer.set("early", b"1")  # (the state file is written whole once: later changes are appended)
        got = {}
        if wait:
            blocked = in_thread(lambda: got.update(read=reader.get("late")))
            time.sleep(0.3)
        setter = in_thread(lambda: writer.set("late", b"v"))
        assert writing.wait(10)
        if not wait:
            blocked = in_thread(lambda: got.update(read=reader.get("late", wait=False)))
        blocked.join(1.0)
        assert "read" not in got, got  # not before it is on disk
        release.set()
        blocked.join(10)
        setter.join(10)
        assert got == {"read": b"v"}
        writer.close()
        reader.close()


def in_thread(body) -> threading.Thread:
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


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


@pytest.mark.parametrize("coordinator", [{"heartbeat_timeout": None}], indirect=True)
def test_a_refused_caller_releases_waiting_peers_at_once(coordinator):
    """A caller outside `replicas` fails the round its peers wait in; they learn it at once,
    not at their deadline (without a heartbeat timeout: the liveness watch's wake-up each
    second hid a refusal that woke nobody)."""
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


def test_replicas_out_of_range_count_as_a_round_of_the_ordinals_in_range(coordinator):
    """A replicas list naming ordinals outside the world is refused by the coordinator, which
    fails the round of the ordinals in range; each client counts the call on that same group,
    so its members' next round meets (counted on a group of its own, the next call met a
    round already failed). A list with no ordinal in range is refused without counting."""
    clients = [make_client(coordinator.address, tasks=2, task=t, timeout=30) for t in range(2)]

    def calls(t):
        def run():
            c = clients[t]
            b = c.bind_thread(0)
            with pytest.raises(pr.InvalidArgumentError, match=r"replicas \[2\] are out of range \[0, 2\)"):
                c.rendezvous(b, "bad", b"", replicas=[0, 1, 2])
            with pytest.raises(pr.InvalidArgumentError, match=r"replicas \[5, 7\] are out of range"):
                c.rendezvous(b, "none-in-range", b"", replicas=[7, 5])
            # Past 32 bits, on one side only: the round fails for both members too (it was
            # refused in its thread alone, the other waiting out its timeout, then out of step),
            # naming the wire's largest value as a bound (it was named as the value given).
            with pytest.raises(pr.InvalidArgumentError, match=r"replicas \[2147483647 or more\] are out of range"):
                c.rendezvous(b, "huge", b"", replicas=[0, 1, 2**40] if t else [0, 1])
            return c.rendezvous(b, "good", b"%d" % t)

        return run

    try:
        assert _threads({t: calls(t) for t in range(2)}) == {0: [b"0", b"1"], 1: [b"0", b"1"]}
    finally:
        for c in clients:
            c.close()


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


def test_a_registration_says_how_long_ago_its_process_started():
    """The coordinator tells a relaunch after a kill from a process whose connection was cut
    by when each started: a process's age is its own, a spawned child's too."""
    from pjrt_rendezvous.client._client import _process_age

    before = _process_age()
    fresh = subprocess.run(
        [sys.executable, "-c", "import time; from pjrt_rendezvous.client._client import _process_age; "
         "time.sleep(0.5); print(_process_age())"],
        capture_output=True, text=True, check=True, timeout=60,
    )
    assert 0.5 <= float(fresh.stdout) < 60
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        spawned = pool.submit(_process_age).result(timeout=60)
    assert 0 < spawned <= _process_age() - before + 0.1  # (started during this test, not with pytest)


def _threads(bodies: dict) -> dict:
    """Runs each body in a thread of its own; returns each one's result or exception."""
    results: dict = {}

    def run(name, body) -> None:
        try:
            results[name] = body()
        except Exception as exc:
            results[name] = exc

    threads = [threading.Thread(target=run, args=item) for item in bodies.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return results


def test_replicas_may_be_a_numpy_array(coordinator):
    """``replicas`` may be any sequence of ints, a numpy array too (its truth value raised
    numpy's own ValueError before the round)."""
    np = pytest.importorskip("numpy")
    client = make_client(coordinator.address, devices=2)

    def member(index: int):
        binding = client.bind_thread(index)
        return [client.rendezvous(binding, "np", b"%d" % index, replicas) for replicas in (np.arange(2), np.array([0, 1], np.int32))]

    try:
        results = _threads({0: lambda: member(0), 1: lambda: member(1)})
        assert results == {0: [[b"0", b"1"]] * 2, 1: [[b"0", b"1"]] * 2}, results
        with pytest.raises(TypeError, match="replicas must be a sequence of ints"):
            client.rendezvous(None, "t", b"", 5)
    finally:
        client.close()


def test_replicas_may_not_be_a_str_bytes_or_mapping(client):
    """A dict, str or bytes is not a list of ordinals: a TypeError naming replicas (a dict
    was taken as its keys, bytes as its byte values: b"\\x00" as [0]; a str said "must be
    ints, got ['0']"). A range, a tuple and a set are sequences of ordinals (the coordinator
    reads the group as a set)."""
    with client.bind_thread(0) as binding:
        for replicas, words in [
            ({0: 1}, "replicas must be a sequence of ints, got dict {0: 1}"),
            (b"\x00", "replicas must be a sequence of ints, got bytes b'\\x00'"),
            (bytearray(1), "replicas must be a sequence of ints, got bytearray bytearray(b'\\x00')"),
            ("0", "replicas must be a sequence of ints, got str '0'"),
        ]:
            with pytest.raises(TypeError, match=re.escape(words)):
                client.rendezvous(binding, "t", b"x", replicas)
        for replicas in (range(1), (0,), {0}, frozenset([0])):
            assert client.rendezvous(binding, "t", b"x", replicas) == [b"x"]


def _ends_ordinal_1(clients, end, why: str) -> list:
    """Task 1's two threads wait in a round that needs ordinal 1 (task 0's thread 1); ``end()``
    ends it: they fail at once naming it and ``why`` (they waited out their timeout of 60 s:
    its process had not left), and the coordinator's status shows it ended. Returns task 1's
    bindings."""
    waiters = _threads({t: (lambda t=t: clients[1].bind_thread(t)) for t in (0, 1)})
    outcome = {}

    def waiting(index: int) -> None:
        started = time.monotonic()
        with pytest.raises(pr.ParticipantFailedError) as raised:
            clients[1].rendezvous(waiters[index], "needs-1")
        outcome[index] = (str(raised.value), time.monotonic() - started)

    threads = [in_thread(lambda i=i: waiting(i)) for i in (0, 1)]
    deadline = time.monotonic() + 30
    while sum(len(r.missing) for j in clients[0].status().jobs for r in j.pending_rounds) != 2:
        assert time.monotonic() < deadline, "task 1 never waited"
        time.sleep(0.05)
    end()
    for t in threads:
        t.join(30)
    assert _ended(clients[0]) == ["", why, "", ""]
    for index in (0, 1):
        message, waited = outcome[index]
        assert "cannot complete: a member ended (ordinal 1 on " in message, message
        assert message.endswith(f": its replica {why})"), message
        assert waited < 20, waited
    return waiters


def _ended(client) -> list[str]:
    """How each participant's replica ended, in ordinal order ("" while it runs)."""
    (job,) = client.status().jobs
    return [p.ended for p in job.participants]


def _two_tasks(coordinator) -> list:
    return [make_client(coordinator.address, tasks=2, devices=2, task=t, timeout=60, batch_window=0.01) for t in (0, 1)]


def test_a_replica_that_ends_fails_the_rounds_waiting_for_it_at_once(coordinator):
    """Task 0's thread 1 is done (end_replicas, as xla.spawn says when a replica returns or
    raises) while task 1's threads wait in a round that needs it, one bound thread of task 0
    still running: they fail at once naming it. A round without it still completes."""
    clients = _two_tasks(coordinator)
    try:
        bindings = _threads({t: (lambda t=t: clients[0].bind_thread(t)) for t in (0, 1)})
        why = "raised ValueError: gave up"
        waiters = _ends_ordinal_1(clients, lambda: clients[0].end_replicas([1], why), why)
        paired = _threads({
            0: lambda: clients[0].rendezvous(bindings[0], "pair", b"p0", [0, 2]),
            2: lambda: clients[1].rendezvous(waiters[0], "pair", b"p2", [0, 2]),
        })
        assert paired == {0: [b"p0", b"p2"], 2: [b"p0", b"p2"]}, paired
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("unbinds", [True, False], ids=["unbound", "still-bound"])
def test_a_sibling_waiting_for_a_thread_that_ends_its_replica_sends_its_round_at_once(coordinator, unbinds):
    """A thread waits in a round for its sibling thread, which ends its replica instead,
    unbinding (xla.spawn's replica returning) or still bound (end_replicas alone): the batch
    was sent a batch window later (30 s here), where the other processes were told of the
    end at once (a stress trial found the second); it fails as soon as theirs."""
    client = make_client(coordinator.address, devices=2, timeout=60, batch_window=30)
    outcome: dict = {}
    bound, failed = threading.Event(), threading.Event()

    def waiting() -> None:
        binding = client.bind_thread(0)
        bound.wait(30)
        time.sleep(0.3)
        try:
            client.rendezvous(binding, "needs-1")
        except pr.RendezvousError as exc:
            outcome["error"] = exc
        failed.set()

    def ending() -> None:
        with client.bind_thread(1):
            bound.set()
            time.sleep(1.0)  # (thread 0 in its batch, waiting for this one)
            if unbinds:
                client.unbind_thread()
            client.end_replicas([1], "ended by the supervisor")
            failed.wait(25)

    try:
        started = time.monotonic()
        threads = [in_thread(waiting), in_thread(ending)]
        assert failed.wait(20), "the round waited for the ended replica"
        for thread in threads:
            thread.join(10)
        assert isinstance(outcome.get("error"), pr.ParticipantFailedError), outcome
        assert "ended by the supervisor" in str(outcome["error"]) and time.monotonic() - started < 20, outcome
    finally:
        client.close()


def test_a_sibling_with_a_nearer_deadline_shortens_the_batch_s_wait(coordinator):
    """The first thread of a batch waits for its siblings at most half the time left before
    the batch's deadline; a sibling that came later with a shorter timeout lowered the
    deadline but not that wait: its 0.6 s timeout came after the batch window (5 s here),
    or when the last sibling came (a stress trial)."""
    client = make_client(coordinator.address, devices=3, timeout=60, batch_window=5)
    outcome: dict = {}
    bound = threading.Barrier(3)

    def member(index: int, delay: float, timeout: float) -> None:
        with client.bind_thread(index) as binding:
            bound.wait(30)
            time.sleep(delay)
            started = time.monotonic()
            try:
                client.rendezvous(binding, "r", timeout=timeout)
            except pr.RendezvousError as exc:
                outcome[index] = (exc, time.monotonic() - started)

    try:
        threads = [in_thread(lambda a=a: member(*a)) for a in ((0, 0.0, 60), (1, 0.5, 0.6), (2, 4.0, 60))]
        for thread in threads:
            thread.join(30)
        assert not any(t.is_alive() for t in threads), "a thread hung"
        error, waited = outcome[1]
        assert isinstance(error, pr.RendezvousTimeout) and "missing ordinal 2" in str(error), error
        assert waited < 2.5, waited  # (it took 3.5 s: until ordinal 2 came)
    finally:
        client.close()


def test_a_thread_that_leaves_its_binding_on_an_exception_ends_its_replica(coordinator):
    """A thread whose ``with bind_thread(...)`` block raises is out of its rounds: the rounds
    that need it, in another process, fail at once naming the exception (they waited for it
    until their timeout, 10 minutes by default). A block left cleanly, or by ``sys.exit(0)``,
    ends nothing; bound again, the thread is back."""
    clients = _two_tasks(coordinator)
    try:
        _threads({0: lambda: clients[0].bind_thread(0)})

        def leaves(exc: BaseException | None) -> None:
            with clients[0].bind_thread(1):
                if exc is not None:
                    raise exc

        for exc in (None, SystemExit(0), SystemExit(None), GeneratorExit()):
            with contextlib.suppress(SystemExit, GeneratorExit):
                leaves(exc)
            assert _ended(clients[0]) == ["", ""]  # (task 1 not registered yet)

        def fails() -> None:
            with pytest.raises(ValueError):
                leaves(ValueError("bad batch\nsecond line"))
            assert pr.current_binding() is None  # unbound all the same

        waiters = _ends_ordinal_1(clients, fails, "raised ValueError: bad batch")

        # Bound again, it is back: a round that needs it completes.
        def pair(client, binding, index):
            return client.rendezvous(binding, "pair", b"%d" % index, [1, 2])

        def rebound():
            with clients[0].bind_thread(1) as binding:
                back.set()  # (a round called before its registration fails: ordinal 1 ended)
                return pair(clients[0], binding, 1)

        def other():
            assert back.wait(30)
            return pair(clients[1], waiters[0], 2)

        back = threading.Event()
        paired = _threads({1: rebound, 2: other})
        assert paired == {1: [b"1", b"2"], 2: [b"1", b"2"]}, paired
        assert _ended(clients[0]) == ["", "", "", ""]
        with pytest.raises(SystemExit):
            leaves(SystemExit(1))  # (an exit with an error code is a failure)
        assert _ended(clients[0]) == ["", "raised SystemExit: 1", "", ""]
    finally:
        for c in clients:
            c.close()


def test_a_thread_that_dies_bound_ends_its_replica(coordinator, monkeypatch):
    """A thread bound without a ``with`` block that dies of an uncaught exception ends its
    replica and unbinds (``threading.excepthook``), then the hook set before ours reports the
    exception: its peers' rounds fail at once naming it; its index is free again."""
    reported = []
    monkeypatch.setattr(threading, "excepthook", reported.append)
    clients = _two_tasks(coordinator)
    try:
        _threads({0: lambda: clients[0].bind_thread(0)})

        def dies() -> None:
            clients[0].bind_thread(1)
            raise KeyError("step 7")

        def end() -> None:
            thread = threading.Thread(target=dies)
            thread.start()
            thread.join(30)

        _ends_ordinal_1(clients, end, "raised KeyError: 'step 7'")
        assert [type(args.exc_value) for args in reported] == [KeyError], reported
        assert 1 not in clients[0]._bindings
        ours = threading.excepthook
        assert isinstance(ours, _ThreadFailed) and ours.before == reported.append, ours
        # A hook set later that calls the one it replaced (ours), itself put behind ours at the
        # next bind: each failure goes through the chain once, to its end.
        passed = []
        threading.excepthook = lambda args: (passed.append(args), ours(args))
        end()
        assert isinstance(threading.excepthook, _ThreadFailed) and threading.excepthook is not ours
        assert len(passed) == 1 and [type(args.exc_value) for args in reported] == [KeyError, KeyError]
        assert _ended(clients[0]) == ["", "raised KeyError: 'step 7'", "", ""]
    finally:
        for c in clients:
            c.close()


_MAIN_DIES_BOUND = """
import sys, threading
import pjrt_rendezvous.client as pr

address = sys.argv[1]
env = {"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": "0", "PJRT_RENDEZVOUS_CORES_PER_CHIP": "2"}
client = pr.Client(pr.Settings(address=address, timeout=30, batch_window=0.01), pr.detect_topology(env, address=address))
client.bind_thread(1)  # the main thread, without a `with` block


def worker():
    with client.bind_thread(0) as binding:
        try:
            client.rendezvous(binding, "step")
        except pr.ParticipantFailedError as exc:
            print("worker:", exc, flush=True)


threading.Thread(target=worker).start()  # not a daemon: the process lives on for it
raise ValueError("loss is nan")
"""


def test_a_main_thread_that_returns_bound_ends_nothing_for_an_exception_caught_before(coordinator):
    """The exit hook takes ``sys.last_value`` for the main thread's death only when its
    traceback starts at the bottom of the main thread's stack: one that pytest, code.interact
    or tkinter set for an exception they caught, in a main thread that then returns, ends
    nothing (it ended the replica, naming that old exception)."""
    script = _MAIN_DIES_BOUND.split("def worker")[0] + (
        "def handled():\n"
        "    try:\n"
        "        raise ValueError('handled long ago')\n"
        "    except ValueError as exc:  # as pytest keeps a failed test's, for post-mortem debugging\n"
        "        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__\n"
        "def worker():  # keeps the process alive past the exit hooks, which run before the main thread is stopped\n"
        "    while threading.main_thread().is_alive():\n"
        "        threading.Event().wait(0.01)\n"
        "    print('main ended', flush=True)\n"
        "    sys.stdin.readline()\n"
        "threading.Thread(target=worker).start()\n"
        "handled()\n"
    )
    client = make_client(coordinator.address, tasks=2, devices=2, task=1, timeout=30)
    task0 = subprocess.Popen(
        [sys.executable, "-c", script, coordinator.address],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert task0.stdout.readline() == "main ended\n", task0.stderr.read()
        (job,) = client.status().jobs
        assert [(p.ordinal, p.alive, p.ended) for p in job.participants] == [(1, True, "")]
    finally:
        out, err = task0.communicate("\n", timeout=60)
        client.close()
    assert task0.returncode == 0, err


@pytest.mark.parametrize("worker", ["thread", "pool"])
def test_a_main_thread_that_dies_bound_ends_its_replica(coordinator, worker):
    """A process's main thread bound without a ``with`` block dies of an uncaught exception
    while a worker thread (not a daemon, or a thread pool's, whose module, imported after the
    main thread bound, joins it at exit) keeps the process alive: at the interpreter's exit,
    before it waits for the worker, its replica ends, so the rounds that need it fail at once
    naming the exception, in its own process and in others (they waited for it until their
    timeout); the exception is reported as ever and the process exits."""
    script = _MAIN_DIES_BOUND
    if worker == "pool":
        script = script.replace(
            "threading.Thread(target=worker).start()",
            "import concurrent.futures; concurrent.futures.ThreadPoolExecutor(1).submit(worker)",
        )
        assert script != _MAIN_DIES_BOUND
    client = make_client(coordinator.address, tasks=2, devices=2, task=1, timeout=30, batch_window=0.01)
    try:
        bindings = _threads({t: (lambda t=t: client.bind_thread(t)) for t in (0, 1)})
        task0 = subprocess.Popen(
            [sys.executable, "-c", script, coordinator.address],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        outcome = _threads({t: (lambda t=t: client.rendezvous(bindings[t], "step")) for t in (0, 1)})
        out, err = task0.communicate(timeout=60)
    finally:
        client.close()
    why = "its replica raised ValueError: loss is nan)"
    for error in outcome.values():
        assert isinstance(error, pr.ParticipantFailedError), error
        assert "a member ended (ordinal 1 on " in str(error) and str(error).endswith(why), error
    assert task0.returncode == 1 and err.rstrip().endswith("ValueError: loss is nan"), err
    assert out.startswith("worker: ") and out.rstrip().endswith(why), out


_MAIN_INTERRUPTED = """
import sys, threading, time
import pjrt_rendezvous.client as pr

address = sys.argv[1]
env = {"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": "0", "PJRT_RENDEZVOUS_CORES_PER_CHIP": "2"}
client = pr.Client(pr.Settings(address=address, timeout=60, batch_window=0.01), pr.detect_topology(env, address=address))
said = threading.Lock()  # (two threads' prints interleave)


def worker(index):
    with client.bind_thread(index) as binding:
        try:
            client.rendezvous(binding, "step")
        except pr.ParticipantFailedError as exc:
            with said:
                print("worker:", exc, flush=True)


threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
for t in threads:
    t.start()
while not any(j.pending_rounds for j in client.status().jobs):
    time.sleep(0.05)
print("waiting", flush=True)
for t in threads:  # the main thread, bound to nothing, joins (Ctrl-C comes here)
    t.join()
"""


def test_ctrl_c_while_the_main_thread_joins_bound_threads_ends_their_replicas(coordinator):
    """The README's pattern: the main thread, bound to nothing, joins threads bound and waiting
    in a round for another process. Ctrl-C stopped the main thread alone; the interpreter then
    waited for the workers, and they and the other process for each other, until a second
    Ctrl-C. At the exit their replicas end: the rounds fail everywhere naming the interrupt,
    and the process exits."""
    client = make_client(coordinator.address, tasks=2, devices=2, task=1, timeout=60)
    try:
        bindings = _threads({t: (lambda t=t: client.bind_thread(t)) for t in (0, 1)})
        task0 = subprocess.Popen([sys.executable, "-c", _MAIN_INTERRUPTED, coordinator.address],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert task0.stdout.readline() == "waiting\n", task0.stderr.read()
        task0.send_signal(signal.SIGINT)
        out, err = task0.communicate(timeout=30)
        outcome = _threads({t: (lambda t=t: client.rendezvous(bindings[t], "step")) for t in (0, 1)})
    finally:
        client.close()
    why = "its replica ended when the process's main thread was interrupted (KeyboardInterrupt)"
    assert task0.returncode != 0 and "KeyboardInterrupt" in err, err  # (-SIGINT: Python ends so)
    # (both workers' rounds fail; the one the main thread was joining may be cut short in its
    # print: Python 3.11's join, interrupted, takes that thread for ended and the exit does
    # not wait for it)
    assert out.startswith("worker: ") and why in out, out
    for error in outcome.values():
        assert isinstance(error, pr.ParticipantFailedError) and why in str(error), error


def test_a_thread_that_ended_bound_is_named_when_its_siblings_wait_for_it(coordinator, caplog):
    """A thread that ended bound without an exception (no ``with`` block, no unbind_thread)
    still holds its ordinal: when a sibling's round waits out the batch window for it, the
    process says so, once per binding, naming the thread (it said nothing: the round only
    timed out naming the ordinal missing, its process alive)."""
    client = make_client(coordinator.address, devices=2, timeout=1, batch_window=0.05)
    try:
        _threads({1: lambda: client.bind_thread(1)})  # its thread returns, bound
        binding = _threads({0: lambda: client.bind_thread(0)})[0]
        with caplog.at_level(logging.WARNING, logger="pjrt_rendezvous.client"):
            for tag in ("first", "second"):
                outcome = _threads({0: lambda tag=tag: client.rendezvous(binding, tag)})[0]
                assert isinstance(outcome, pr.RendezvousTimeout), outcome
        said = [r.getMessage() for r in caplog.records if "ended without unbinding" in r.getMessage()]
        assert len(said) == 1, said
        assert said[0].startswith("ordinal 1 (thread index 1) was bound by thread 'Thread-"), said
    finally:
        client.close()


def test_end_replicas_refuses_arguments_of_the_wrong_type_by_name(client):
    """Ordinals that are not a sequence of ints or a reason that is not a str: a TypeError
    naming the argument, before anything is sent (protobuf's bare TypeError: "'str' object
    cannot be interpreted as an integer", "must assign iterable"; a bytes reason was taken)."""
    refused = [
        ((5, "returned"), TypeError, "ordinals must be a sequence of ints, got int 5"),
        (("ab", "returned"), TypeError, "ordinals must be a sequence of ints, got str 'ab'"),
        ((["0"], "returned"), TypeError, "ordinals must be ints, got ['0']"),
        (([True], "returned"), TypeError, "ordinals must be ints, got [True]"),
        (([0], 5), TypeError, "reason must be str, got int"),
        (([0], b"returned"), TypeError, "reason must be str, got bytes"),
        (([0], "\udcff"), pr.UsageError, "reason '\\udcff' is not valid text"),
        (([2**40], "returned"), pr.UsageError, "ordinals must be in [0, 2**31), got [1099511627776]"),
    ]
    for args, error, words in refused:
        with pytest.raises(error, match=re.escape(words)):
            client.end_replicas(*args)


def test_a_timeout_spent_in_the_batch_window_says_so(coordinator):
    """A sibling thread that does not come: the first thread waits for it (the batch window)
    before it sends, and the coordinator, counting from the call's arrival, said "timed out
    after 0.0014 s" of a timeout of 0.5; the error now says where the rest went."""
    client = make_client(coordinator.address, devices=2, timeout=20, batch_window=2.0)
    warm = threading.Barrier(2)
    caught = []

    def thread(index: int):
        with client.bind_thread(index) as binding:
            client.rendezvous(binding, "warm")
            warm.wait(10)
            if index == 0:
                with pytest.raises(pr.RendezvousTimeout) as raised:
                    client.rendezvous(binding, "alone", timeout=2.0)
                caught.append(str(raised.value))
            warm.wait(10)  # bound, not calling, until thread 0 has its answer

    try:
        threads = [threading.Thread(target=thread, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        (message,) = caught
        assert "missing ordinal 1" in message, message
        # (held at most half the time left, 1 s: the rest is the coordinator's, counted from the call)
        held = re.search(r"\(this process sent its call ([\d.]+) s after its first thread arrived: it waited for "
                         r"ordinal 1 of its own for up to the batch window\)$", message)
        assert held and 0.9 <= float(held[1]) < 1.9, message
    finally:
        client.close()


def test_a_timeout_names_the_ordinals_of_the_process_that_no_thread_is_bound_to(coordinator):
    """Thread 1 unbinds (its with block ended) while thread 0 goes on: the coordinator,
    which sees a live process, names ordinal 1 as missing and "last seen 0.1 s ago"; the
    process knows no thread is bound to it, and says so."""
    client = make_client(coordinator.address, devices=2, timeout=20)

    def bound_a_while():
        with client.bind_thread(1):
            pass

    with concurrent.futures.ThreadPoolExecutor(1) as other:
        other.submit(bound_a_while).result()
        with client.bind_thread(0) as binding:
            with pytest.raises(pr.RendezvousTimeout) as raised:
                client.rendezvous(binding, "alone", timeout=0.5)
    client.close()
    message = str(raised.value)
    assert "missing ordinal 1 on " in message, message
    assert message.endswith("(no thread of this process is bound to ordinal 1)"), message


def test_a_timeout_names_the_ordinals_of_the_process_bound_since_its_call_went_out(coordinator):
    """Thread 0 calls alone (nothing else bound: its call goes out at once), and thread 1
    binds while it waits but does not call: the coordinator names ordinal 1 as missing of a
    live process, and the process says it is bound but did not come (it said nothing)."""
    client = make_client(coordinator.address, devices=2, timeout=20)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bound_first = pool.submit(client.bind_thread, 0).result()
        started = time.monotonic()
        waiting = pool.submit(client.rendezvous, bound_first, "alone", b"", timeout=1.0)
        while not client.status().jobs[0].pending_rounds:
            time.sleep(0.01)
        pool.submit(client.bind_thread, 1).result()
        with pytest.raises(pr.RendezvousTimeout) as raised:
            waiting.result(timeout=20)
        assert time.monotonic() - started < 10
    client.close()
    message = str(raised.value)
    assert "missing ordinal 1 on " in message, message
    assert message.endswith("(ordinal 1 of this process is bound but did not come to this round)"), message


def test_a_timeout_does_not_name_as_unbound_a_sibling_that_came_to_the_round_in_another_call(coordinator):
    """Threads 0 and 1 come to a round in two calls (their replicas lists differ in order)
    and both time out (task 1 never comes); thread 0 leaves its with block before thread 1's
    error is made: ordinal 0 came, and was named as "no thread of this process is bound"."""
    client = make_client(coordinator.address, tasks=2, devices=2, timeout=20)
    left, messages = threading.Event(), {}
    local_timeout = client._local_timeout

    def after_thread_0_left(exc, held, batch):
        if 1 in batch.contributions:
            assert left.wait(20)
        return local_timeout(exc, held, batch)

    client._local_timeout = after_thread_0_left

    def thread(index: int, replicas: list[int]) -> None:
        try:
            with client.bind_thread(index) as binding:
                if index == 1:
                    while not client.status().jobs[0].pending_rounds:  # (thread 0's call)
                        time.sleep(0.01)
                client.rendezvous(binding, "t", replicas=replicas, timeout=8)
        except pr.RendezvousTimeout as exc:
            messages[index] = str(exc)
        finally:
            if index == 0:
                left.set()

    try:
        threads = [threading.Thread(target=thread, args=args) for args in ((0, [0, 1, 2, 3]), (1, [3, 2, 1, 0]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert "missing ordinals 2-3" in messages[1] and "bound to" not in messages[1], messages
    finally:
        client.close()


def test_a_process_holds_a_round_for_a_sibling_at_most_half_the_time_left_before_its_deadline(coordinator):
    """Task 1's threads call with a timeout of 4 s; task 0's thread 0 comes 1 s later, its
    thread 1 never. Waiting for its sibling for the whole batch window (15 s) but for its
    deadline (at 5 s), task 0 sent its call after the round's deadline (at 4 s), so every
    member was told ordinals 0-1 were missing: ordinal 0, which came in time, too. As a host
    relay does, a process now holds a round at most half the time left before its deadline
    (it sends at 3 s: a second to spare on a loaded machine)."""
    clients = [make_client(coordinator.address, tasks=2, devices=2, task=t, timeout=60, batch_window=15.0) for t in (0, 1)]
    bound = threading.Barrier(4)
    errors: dict[int, str] = {}
    done = threading.Event()

    def thread(client: pr.Client, index: int) -> None:
        with client.bind_thread(index) as binding:
            bound.wait(10)
            if binding.ordinal == 1:
                done.wait(30)  # bound, never comes
                return
            if binding.ordinal == 0:
                time.sleep(1.0)
            try:
                client.rendezvous(binding, "quick", timeout=4.0)
            except pr.RendezvousTimeout as exc:
                errors[binding.ordinal] = str(exc)
            if binding.ordinal == 0:
                done.set()

    threads = [threading.Thread(target=thread, args=(c, i)) for c in clients for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert sorted(errors) == [0, 2, 3], errors
        for ordinal, message in errors.items():
            assert re.search(r"with 3 of 4 arrived; missing ordinal 1 on vm \(pid \d+, last seen", message), (ordinal, message)
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize("watch", [True, False], ids=["watch-heard-it", "watch-silent"])
def test_a_restart_fails_each_surviving_thread_once_then_all_meet_in_the_new_generation(coordinator, watch):
    """Task 1 restarts while the survivor's thread 0 waits in a round (its batch window)
    and its thread 1 is between calls. Each survivor thread gets one ParticipantFailedError
    for the move, the waiting one for its round, the other for its next call, whether or not
    the survivor's Watch has heard of the move (without it, the failed round itself tells
    the client the new generation), and their next calls meet the replacement's. (Before:
    a call made before the Watch's event was refused as void and its retry too, the
    replacement timing out blaming the survivor; a thread between calls joined the new
    generation silently, a call out of step with its sibling.)"""
    survivor = make_client(coordinator.address, tasks=2, devices=2, task=0, timeout=20, batch_window=3.0)
    if not watch:
        survivor._background_started = True  # no heartbeat, no Watch: nothing heard but answers
    crashed = make_client(coordinator.address, tasks=2, devices=2, task=1, timeout=20)
    warm, stepping, moved = threading.Barrier(4), threading.Event(), threading.Event()
    everyone = [b"0", b"1", b"2", b"3"]

    def survivor_thread(index: int):
        with survivor.bind_thread(index) as binding:
            assert survivor.rendezvous(binding, "warm", b"%d" % binding.ordinal) == everyone
            warm.wait(10)
            if index == 1:
                assert moved.wait(20)
            else:
                stepping.set()
            outcome = []
            for tag in ("step", "resync", "next"):
                try:
                    outcome.append(survivor.rendezvous(binding, tag, b"%d" % binding.ordinal))
                except pr.ParticipantFailedError as exc:
                    outcome.append(exc)
            return outcome

    def crashed_thread(index: int):
        with crashed.bind_thread(index) as binding:
            crashed.rendezvous(binding, "warm", b"%d" % binding.ordinal)
            warm.wait(10)

    def replacement_threads():
        assert stepping.wait(20)
        time.sleep(0.3)  # the survivor's thread 0 is in its batch window
        crashed.close(leave=False)  # task 1's process crashes and is relaunched on its host
        replacement = make_client(coordinator.address, tasks=2, devices=2, task=1, timeout=20)

        def thread(index: int):
            with replacement.bind_thread(index) as binding:
                while watch and survivor.generation < 2:  # the survivor has heard of it
                    time.sleep(0.01)
                moved.set()
                return [replacement.rendezvous(binding, tag, b"%d" % binding.ordinal) for tag in ("resync", "next")]

        try:
            return _threads({0: lambda: thread(0), 1: lambda: thread(1)})
        finally:
            replacement.close()

    results = _threads({
        0: lambda: survivor_thread(0), 1: lambda: survivor_thread(1),
        "crashed 0": lambda: crashed_thread(0), "crashed 1": lambda: crashed_thread(1),
        "new": replacement_threads,
    })
    survivor.close()
    assert results["new"] == {0: [everyone, everyone], 1: [everyone, everyone]}, results
    for index in (0, 1):
        failed, *rest = results[index]
        assert isinstance(failed, pr.ParticipantFailedError) and "to 2" in str(failed), results
        assert rest == [everyone, everyone], results


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


def _main_thread_interrupted_in_a_round(coordinator, main_at: float, *, absent: int | None = None, timeout: float = 20) -> dict:
    """A round of 2 processes x 4 threads in which the main thread is ordinal 0, arrives
    ``main_at`` seconds in and is interrupted by a SIGINT at 1 s (``_Interrupted``). Task
    0's threads 1-3 arrive at 0.1, 0.3 and 0.5 s (thread ``absent`` not at all), task 1's at
    1.6 s, so the round is pending at the coordinator when the signal comes; the batch
    window is 2 s. Then every thread that came makes a second round. Returns what the
    other ordinals got from each round (their payloads, or the exception)."""
    clients = [
        make_client(coordinator.address, tasks=2, devices=4, task=task, timeout=timeout, batch_window=2.0)
        for task in range(2)
    ]
    results: dict[int, list] = {}
    bound = threading.Barrier(8)  # every thread bound before any round, as spawn does
    finished = threading.Event()

    def thread_main(client: pr.Client, index: int, delay: float) -> None:
        binding = client.bind_thread(index)
        try:
            bound.wait(10)
            if delay is None:  # bound, but never comes to the round
                finished.wait(60)
                return
            time.sleep(delay)
            for tag in ("r", "again"):
                try:
                    outcome = client.rendezvous(binding, tag, b"%d" % binding.ordinal)
                except pr.RendezvousError as exc:
                    outcome = exc
                results.setdefault(binding.ordinal, []).append(outcome)
        finally:
            client.unbind_thread()

    delays = {(0, 1): 0.1, (0, 2): 0.3, (0, 3): 0.5, **{(1, i): 1.6 for i in range(4)}}
    if absent is not None:
        delays[(0, absent)] = None
    threads = [
        threading.Thread(target=thread_main, args=(clients[task], index, delay)) for (task, index), delay in delays.items()
    ]
    for thread in threads:
        thread.start()
    binding = clients[0].bind_thread(0)
    timer = None
    try:
        bound.wait(10)
        timer = _interrupt_main_after(1.0)
        time.sleep(main_at)
        with pytest.raises(_Interrupted):
            clients[0].rendezvous(binding, "r", b"0")
        if absent is None:  # in step with its siblings: its next call is their next round
            assert clients[0].rendezvous(binding, "again", b"0") == [b"%d" % i for i in range(8)]
        for thread, delay in zip(threads, delays.values()):
            if delay is not None:
                thread.join(30 if absent is None else timeout + 10)
        finished.set()
        for thread in threads:
            thread.join(10)
        assert not any(thread.is_alive() for thread in threads)
    finally:
        if timer is not None:
            timer.cancel()
        finished.set()
        clients[0].unbind_thread()
        for client in clients:
            client.close()
    return results


@pytest.mark.parametrize("main_at", [0.0, 0.2, 0.7], ids=["main-thread-first", "main-thread-second", "main-thread-sends"])
def test_the_main_thread_interrupted_in_a_round_keeps_none_of_its_siblings_waiting(
    coordinator, sigint_raises_interrupted, main_at
):
    """The main thread (the one a signal interrupts) interrupted in a round, as its batch's
    first thread, as a later one, or as the one whose arrival completes the batch (its
    sender): the round goes on for the other seven, with its contribution, and its next call
    is their next round."""
    results = _main_thread_interrupted_in_a_round(coordinator, main_at)
    every = [b"%d" % i for i in range(8)]
    assert results == {o: [every, every] for o in range(1, 8)}


def test_the_main_thread_interrupted_in_the_batch_window_leaves_no_sibling_waiting_for_ever(
    coordinator, sigint_raises_interrupted
):
    """The main thread comes first and is interrupted while it waits out the batch window for
    a sibling that never comes: the batch is still sent when the window ends, so the round
    times out for everyone, naming the absent ordinal, instead of its siblings waiting for a
    sender for ever."""
    results = _main_thread_interrupted_in_a_round(coordinator, 0.0, absent=3, timeout=4)
    assert sorted(results) == [1, 2, 4, 5, 6, 7]
    for ordinal, (first, second) in results.items():
        assert isinstance(first, pr.RendezvousTimeout), (ordinal, first)
        assert "missing ordinal 3 " in str(first), str(first)


def _bind_main_with_a_sibling(client: pr.Client, tag: str) -> tuple[pr.Binding, threading.Thread]:
    """Binds the main thread to ordinal 0 and starts a sibling thread, bound to ordinal 1
    before this returns, that makes one round ``tag`` (payload b"1") and unbinds."""
    bound = threading.Barrier(2)

    def sibling_main() -> None:
        with client.bind_thread(1) as binding:
            bound.wait(10)
            client.rendezvous(binding, tag, b"1")

    binding = client.bind_thread(0)
    sibling = threading.Thread(target=sibling_main, name="sibling")
    sibling.start()
    bound.wait(10)
    return binding, sibling


def test_the_main_thread_keeps_its_stand_in_once_it_has_one(coordinator):
    """Once the main thread has had siblings, its rounds all run on the stand-in thread, in
    order, even alone (a round it made itself could overtake one still queued there); the
    thread ends when the client is closed."""
    client = make_client(coordinator.address, devices=2, timeout=10)
    ran_on = []
    gathered = client._gathered

    def recorded(batch):  # asked by each arrival, on the thread that arrives
        ran_on.append((batch.group, threading.current_thread().name))
        return gathered(batch)

    client._gathered = recorded
    binding, sibling = _bind_main_with_a_sibling(client, "both")
    assert client.rendezvous(binding, "both", b"0") == [b"0", b"1"]
    sibling.join(10)
    assert client._local_ordinals() == {0}  # the sibling is gone
    assert client.rendezvous(binding, "alone", b"0", replicas=[0]) == [b"0"]
    assert sorted(ran_on) == [((), "pjrt-rendezvous-stand-in"), ((), "sibling"), ((0,), "pjrt-rendezvous-stand-in")]
    (stand_in,) = [t for t in threading.enumerate() if t.name == "pjrt-rendezvous-stand-in"]
    client.unbind_thread()
    client.close()
    stand_in.join(10)
    assert not stand_in.is_alive()


def test_the_stand_in_keeps_nothing_of_a_done_round(coordinator):
    """Once the main thread's call returns or raises, neither its payload nor its result
    stays referenced by the stand-in (a large all-gather's memory would stay held until the
    main thread's next round)."""
    client = make_client(coordinator.address, devices=2, timeout=10)
    binding, sibling = _bind_main_with_a_sibling(client, "x")
    payload = b"m" * 1000
    held = sys.getrefcount(payload)
    result = client.rendezvous(binding, "x", payload)
    sibling.join(10)
    assert result == [payload, b"1"]
    assert sys.getrefcount(result) == 2  # ours (and the call's argument) only
    del result
    assert sys.getrefcount(payload) == held
    # A round that fails (ordinal 1 never comes): the exception, raised here, keeps nothing.
    with pytest.raises(pr.RendezvousTimeout):
        client.rendezvous(binding, "y", payload, timeout=0.5)
    gc.collect()
    assert sys.getrefcount(payload) == held
    client.unbind_thread()
    client.close()


def _in_forked_child(results, client) -> None:
    faulthandler.dump_traceback_later(50, exit=True)  # stuck: where, in the test's output
    outcome = []
    try:
        binding = pr.current_binding()
        outcome.append(binding.ordinal)  # what the thread knows of itself still answers here
        for call, what in (
            (lambda: client.rendezvous(binding, "in-child", b"c", timeout=30), "rendezvous('in-child')"),
            (lambda: pr.barrier("in-child"), "barrier('in-child')"),  # (it said "rendezvous")
            (lambda: client.get("k", wait=False), "KvGet"),
        ):
            started = time.monotonic()
            try:
                call()
                outcome.append("answered")
            except pr.UsageError as exc:
                outcome.append((round(time.monotonic() - started), str(exc).startswith(f"{what}: ") and "forked process" in str(exc)))
        # A client of its own binds the thread (it was refused: bound already), and its
        # unbind_thread forgets the parent's binding (it did nothing).
        own = make_client(client.settings.address, job="fork-child")
        own.unbind_thread()
        outcome.append(pr.current_binding())
        outcome.append(own.bind_thread(0).ordinal)
        own.unbind_thread()
        own.close()
        outcome.append(pr.current_binding())
        client.close()  # the parent's registration and connection are not this process's to end
        outcome.append("closed")
    except BaseException as exc:
        outcome.append(repr(exc))
    results.put(outcome)


def test_a_forked_child_refuses_its_parent_s_client():
    """A forked child (a fork DataLoader worker, say) inherits its parent's client and its
    threads' bindings, but the client's connection, threads and ordinals are the parent's.
    Its rendezvous went to the main thread's stand-in, which does not exist in the child,
    and hung for its timeout with a wrong reason; other calls shared the parent's session
    socket; close() told the coordinator the parent had left. Now each call refuses at once,
    naming the fork, and close() leaves the parent alone; a client of the child's own binds
    the thread (it was refused as bound already). (The coordinator runs in a process
    of its own: gRPC survives a fork only while no thread of the process is inside it.)"""
    server = subprocess.Popen(
        [sys.executable, "-m", "pjrt_rendezvous.coordinator", "serve", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        address = re.search(r"listening on (127\.0\.0\.1:\d+)", server.stdout.readline()).group(1)
        client = make_client(address, devices=2, job="fork")
        binding = client.bind_thread(0)
        sibling = concurrent.futures.ThreadPoolExecutor(1)  # one thread: bound as ordinal 1
        bound_sibling = sibling.submit(client.bind_thread, 1).result()
        assert bound_sibling.ordinal == 1
        first = sibling.submit(client.rendezvous, bound_sibling, "before", b"1", timeout=30)
        assert client.rendezvous(binding, "before", b"0", timeout=30) == [b"0", b"1"] == first.result()
        context = multiprocessing.get_context("fork")
        for _ in range(3):
            results = context.Queue()
            child = context.Process(target=_in_forked_child, args=(results, client))
            child.start()
            outcome, deadline = None, time.monotonic() + 60
            try:
                while outcome is None and time.monotonic() < deadline:
                    alive = child.is_alive()
                    try:
                        outcome = results.get(timeout=0.5 if alive else 1)
                    except queue.Empty:
                        if not alive:
                            break
            finally:
                child.join(30)
            # gRPC's own limit, not ours: a child forked while a parent thread is inside gRPC
            # (its Watch stream's) may abort in gRPC's poller on its first call (SIGABRT, "Check
            # failed ... g_active_poller"; seen under load): fork again.
            if not (outcome is None and child.exitcode == -signal.SIGABRT):
                break
        assert outcome == [0, (0, True), (0, True), (0, True), None, 0, None, "closed"], outcome
        for tag in ("after", "again"):  # the parent's rounds go on, on its own connection
            later = sibling.submit(client.rendezvous, bound_sibling, tag, b"1", timeout=30)
            assert client.rendezvous(binding, tag, b"0", timeout=30) == [b"0", b"1"] == later.result()
        sibling.shutdown()
        client.close()
    finally:
        server.terminate()
        server.wait(30)


def _own_client_in_forked_child(results, address) -> None:
    """A forked child's client of its own: key-value calls, and a bind_thread of its parent's task."""
    faulthandler.dump_traceback_later(50, exit=True)
    try:
        own = make_client(address, devices=2, job="fork")
        own.set(f"child-{os.getpid()}", b"c")
        transport = type(own._current_session).__name__
        try:
            own.bind_thread(1)
            bound = "bound"
        except pr.UsageError as exc:
            bound = "is registered by this process's parent" in str(exc)
        own.close()
        results.put((transport, bound))
    except BaseException as exc:
        results.put(repr(exc))


def test_a_forked_childs_own_client_uses_the_session_port_and_not_its_parents_task():
    """A forked child's client of its own calls on the session port its parent's clients
    used: through gRPC, whose threads the parent had inside it (its Watch stream, a Store's
    client), about one child in ten aborted ("Check failed ... g_active_poller"; a DataLoader
    with fork workers failed 8 runs in 10 in a trial). And it does not register its parent's
    task (the child reads the parent's environment): the coordinator took it for the task's
    process restarted, and the parent, replaced, failed with the rest of its job."""
    server = subprocess.Popen(
        [sys.executable, "-m", "pjrt_rendezvous.coordinator", "serve", "--port", "0", "--session-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        address = re.search(r"listening on (127\.0\.0\.1:\d+)", server.stdout.readline()).group(1)
        client = make_client(address, devices=2, job="fork")
        store_like = make_client(address, job="fork")  # a client that never registers: on gRPC
        store_like.set("parent", b"p")
        bindings = [client.bind_thread(0)]
        sibling = concurrent.futures.ThreadPoolExecutor(1)
        bindings.append(sibling.submit(client.bind_thread, 1).result())
        context = multiprocessing.get_context("fork")
        for number in range(6):
            other = sibling.submit(client.rendezvous, bindings[1], f"r{number}", b"1", timeout=30)  # in flight at the fork
            results = context.Queue()
            child = context.Process(target=_own_client_in_forked_child, args=(results, address))
            child.start()
            outcome = results.get(timeout=60)
            child.join(30)
            assert child.exitcode == 0 and outcome == ("SocketSession", True), (child.exitcode, outcome)
            assert client.rendezvous(bindings[0], f"r{number}", b"0", timeout=30) == [b"0", b"1"] == other.result(30)
        assert store_like.get("parent") == b"p" and client.status().jobs[0].generation == 1
        sibling.submit(client.unbind_thread).result()
        sibling.shutdown()
        store_like.close()
        client.close()
    finally:
        server.terminate()
        server.wait(30)


def test_a_client_has_fewer_than_30_attributes(client):
    """From 30 attributes on, CPython 3.11-3.13 stop sharing an instance's keys with its
    class, and attribute and method access on it falls off its specialized fast path: every
    thread's rendezvous pays for it (callgrind: +3 % client instructions per round at 2x8)."""
    assert len(vars(client)) < 30, sorted(vars(client))


def test_the_wake_chain_wakes_each_waiter_in_turn():
    """The hand-off itself (real threads and locks, no coordinator): the sender wakes the
    first waiter, each woken waiter the next."""
    batch = _Batch((), 0, 0, frozenset(range(4)))
    batch.waiters = [_allocate_lock() for _ in range(4)]
    for lock in batch.waiters:
        lock.acquire()
    woke = []

    def wait(lock):  # as rendezvous() does
        lock.acquire()
        woke.append(batch.waiters.index(lock))
        _pass_on(batch, lock)

    threads = [threading.Thread(target=wait, args=(lock,)) for lock in reversed(batch.waiters)]
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    assert woke == []
    _pass_on(batch)  # as the sender does, once the round is done
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)
    assert woke == [0, 1, 2, 3]


def test_a_call_queued_behind_an_interrupted_one_still_keeps_its_timeout(coordinator, sigint_raises_interrupted):
    """The main thread's rounds run on its stand-in, in order: interrupted in a round that
    waits for ever, its next call (timeout 2 s) raises RendezvousTimeout at its deadline,
    instead of waiting for the first one (or 10 s more, the grace an answer on its way is
    given: none is)."""
    client = make_client(coordinator.address, tasks=2, devices=2, timeout=None)
    stop = threading.Event()

    def sibling_main() -> None:
        with client.bind_thread(1):
            stop.wait(60)

    sibling = threading.Thread(target=sibling_main)
    sibling.start()
    try:
        wait_until = time.monotonic() + 10
        while client._local_ordinals() != {1} and time.monotonic() < wait_until:
            time.sleep(0.02)
        binding = client.bind_thread(0)
        timer = _interrupt_main_after(1.0)
        with pytest.raises(_Interrupted):
            client.rendezvous(binding, "stuck", b"0", replicas=[0, 2])  # ordinal 2 never comes
        timer.join()
        started = time.monotonic()
        with pytest.raises(pr.RendezvousTimeout, match=r"rendezvous\('next'\) of ordinal 0 timed out before it started"):
            client.rendezvous(binding, "next", b"0", replicas=[0, 1], timeout=2)
        assert time.monotonic() - started < 8
    finally:
        stop.set()
        sibling.join(10)
        client.close()


def test_a_main_thread_call_its_stand_in_starts_late_keeps_its_round(coordinator, monkeypatch):
    """The stand-in thread slow to start a main-thread call (the GIL busy elsewhere) past the
    call's short timeout, with no earlier call in the way: the main thread waits for it (it
    said "timed out before it started ... interrupted" though nothing was, while the
    stand-in completed the round for its peers)."""
    from pjrt_rendezvous.client import _client as module

    client = make_client(coordinator.address, devices=2, timeout=30)
    run = module._stand_in_round

    def slow(*args):
        time.sleep(0.5)
        return run(*args)

    monkeypatch.setattr(module, "_stand_in_round", slow)
    sibling = concurrent.futures.ThreadPoolExecutor(1)
    try:
        sibling.submit(client.bind_thread, 1).result(10)
        arrived = sibling.submit(lambda: client.rendezvous(pr.current_binding(), "r", b"1", timeout=10))
        binding = client.bind_thread(0)
        assert client.rendezvous(binding, "r", b"0", timeout=0.2) == [b"0", b"1"]
        assert arrived.result(10) == [b"0", b"1"]
    finally:
        client.unbind_thread()
        sibling.submit(client.unbind_thread).result(10)
        sibling.shutdown()
        client.close()


def test_keys_timeouts_tags_and_closed_clients_are_refused_before_anything_is_sent(coordinator):
    """A key given alone where a list belongs (its letters would be keys), a tag that is not
    UTF-8 (refused before its round counts: its peers do not wait for it), a timeout longer
    than every wait can measure (waits without a limit, as torch's long store timeouts do),
    and a thread binding on a closed client."""
    from datetime import timedelta

    pytest.importorskip("torch")
    from pjrt_rendezvous.client._store import Store

    client = make_client(coordinator.address, tasks=1, devices=2, timeout=10)
    client.set("ready", b"1")
    for call in (lambda: client.check("ready"), lambda: client.wait("ready"), lambda: client.multi_set("ab", [b"1", b"2"])):
        with pytest.raises(TypeError, match="got the single key 'ready'|got the single key 'ab'"):
            call()
    store = Store(client=client, timeout=timedelta(days=30))
    with pytest.raises(TypeError, match="single key"):
        store.check("ready")
    assert client.get("ready", timeout=30 * 86400) == b"1" and client.get("ready", timeout=10**400) == b"1"
    store.set("s", b"2")
    assert store.get("s") == b"2"

    errors = []

    def sibling_main() -> None:
        with client.bind_thread(1) as binding:
            try:
                errors.append(client.rendezvous(binding, "t", b"1", timeout=10))
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

    with client.bind_thread(0) as binding:
        sibling = threading.Thread(target=sibling_main)
        sibling.start()
        with pytest.raises(pr.UsageError, match="is not valid text"):
            client.rendezvous(binding, "\ud800", b"0")
        assert client.rendezvous(binding, "t", b"0", timeout=10) == [b"0", b"1"]  # still in step
        sibling.join(10)
    assert errors == [[b"0", b"1"]]
    client.close()
    with pytest.raises(pr.UsageError, match="this client was closed"):
        client.bind_thread(0)


def test_init_reads_a_host_without_port_as_clients_do_and_replaces_a_closed_client(coordinator):
    env = {"PJRT_RENDEZVOUS_NUM_TASKS": "1", "PJRT_RENDEZVOUS_TASK_ID": "0", "PJRT_RENDEZVOUS_CORES_PER_CHIP": "1"}
    try:
        assert pr.init(" 127.0.0.1 ", env=env).settings.address == "127.0.0.1:7481"
    finally:
        pr.shutdown()
    host, port = coordinator.address.rsplit(":", 1)
    first = pr.init(f"{host}:{port}", env=env)
    try:
        first.close()
        assert pr.get_client() is not first and not pr.get_client()._closed
    finally:
        pr.shutdown()


def test_close_while_calls_wait_says_the_client_was_closed_on_both_transports(coordinator):
    for transport in ("auto", "grpc"):
        client = make_client(coordinator.address, timeout=30, transport=transport)
        client.set("x", b"1")  # connected
        outcome = []
        waiting = threading.Thread(target=lambda: outcome.append(_raised(lambda: client.get("never"))))
        waiting.start()
        time.sleep(0.5)
        client.close()
        waiting.join(10)
        assert outcome and isinstance(outcome[0], pr.UsageError) and "was closed" in str(outcome[0]), (transport, outcome)


def test_close_ends_a_call_s_wait_between_retries_at_once():
    """A call retrying an unreachable coordinator waits between attempts (its backoff); a
    close() meanwhile ends that wait and the call, saying the client was closed, instead of
    after the wait (up to the backoff's cap; stretched here to a minute)."""
    client = make_client(f"127.0.0.1:{_unused_port()}", timeout=30, connect_timeout=120)
    waits = []
    retry_wait = client._retry_wait

    def long_wait(seconds):
        waits.append(seconds)
        retry_wait(60.0)

    client._retry_wait = long_wait
    outcome = []
    calling = threading.Thread(target=lambda: outcome.append(_raised(lambda: client.set("k", b"v"))))
    calling.start()
    deadline = time.monotonic() + 20
    while not waits:
        assert time.monotonic() < deadline, "the call did not retry"
        time.sleep(0.05)
    time.sleep(0.2)
    client.close()
    calling.join(10)
    assert not calling.is_alive(), "close() did not end the wait between retries"
    assert len(waits) == 1 and isinstance(outcome[0], pr.UsageError) and "was closed" in str(outcome[0]), (waits, outcome)


def test_a_call_s_waits_between_retries_end_by_its_deadline():
    """Against an unreachable coordinator (connect_timeout 120 s), a get with a 0.5 s timeout
    retries until its deadline, and no wait between attempts outlasts it (the backoff, up to
    2 s, is cut to what is left), so the call ends at its deadline, not up to 2 s after."""
    client = make_client(f"127.0.0.1:{_unused_port()}", connect_timeout=120)
    deadlines, late = [], []
    deadline_of, retry_wait = client._deadline, client._retry_wait

    def noted_deadline(timeout):
        deadlines.append(deadline_of(timeout))
        return deadlines[-1]

    def noted_wait(seconds):
        late.append(time.monotonic() + seconds - deadlines[-1])
        retry_wait(seconds)

    client._deadline, client._retry_wait = noted_deadline, noted_wait
    try:
        for _ in range(4):
            with pytest.raises(pr.RendezvousError):
                client.get("k", timeout=0.5)
    finally:
        client.close()
    assert len(deadlines) == 4 and len(late) > 4, (deadlines, late)
    assert max(late) < 0.2, late  # (a wait ends by the deadline, give or take the time to start it)


def _raised(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 -- returned to the test
        return exc
    return None


def test_close_while_a_round_waits_says_the_client_was_closed_even_when_its_leave_is_answered_late(coordinator):
    """close() fails this process's waiting rounds through its Leave; their answers come while
    the Leave's own answer is still on its way, and they said this process had died (about
    one close in four): the client counts as closed before it leaves."""
    client = make_client(coordinator.address, tasks=2, timeout=30)
    binding = client.bind_thread(0)
    leave = client._stub.Leave

    def slow_leave(*args, **kwargs):  # (its answer late, as on a busy network)
        answer = leave(*args, **kwargs)
        time.sleep(1.0)
        return answer

    client._stub.Leave = slow_leave
    outcome = []
    waiting = threading.Thread(target=lambda: outcome.append(_raised(lambda: client.rendezvous(binding, "r"))))
    waiting.start()
    while not client.status().jobs[0].pending_rounds:
        time.sleep(0.01)
    client.close()
    waiting.join(10)
    assert outcome and isinstance(outcome[0], pr.UsageError) and "was closed" in str(outcome[0]), outcome


@pytest.mark.parametrize("when", ["answered", "bound"])
def test_close_while_a_thread_registers_leaves_the_job_and_refuses_the_binding(coordinator, monkeypatch, when):
    """close() in another thread while a thread's registration is under way (``answered``:
    its answer on its way back; ``bound``: answered, the binding being made): it sent no Leave
    in the first case (the process stayed registered until declared dead), and the binding was
    given out on a closed client. Now close() waits for the answer and leaves, and the
    binding is refused."""
    client = make_client(coordinator.address, tasks=2, timeout=30)
    closer = threading.Thread(target=client.close)
    if when == "answered":
        call = client._call

        def close_meanwhile(method, *args, **kwargs):
            answer = call(method, *args, **kwargs)
            if method == "Register":
                closer.start()
                while not client._closed:
                    time.sleep(0.001)
            return answer

        monkeypatch.setattr(client, "_call", close_meanwhile)
    else:
        adopt = client._adopt_generation

        def close_meanwhile(*args, **kwargs):
            closer.start()
            closer.join(10)
            return adopt(*args, **kwargs)

        monkeypatch.setattr(client, "_adopt_generation", close_meanwhile)
    with pytest.raises(pr.UsageError, match="was closed"):
        client.bind_thread(0)
    closer.join(10)
    assert pr.current_binding() is None
    other = make_client(coordinator.address)
    try:
        (participant,) = other.status().jobs[0].participants
        assert not participant.alive and participant.left, participant
    finally:
        other.close()
