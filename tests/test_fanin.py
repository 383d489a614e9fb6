"""Per-host fan-in (client/_relay.py) against a real coordinator: simulated hosts of two
processes (two threads each) in this process, each host's first process running the relay."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import threading
import time

import grpc
import pytest
from test_metrics import scrape, value

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client._demo import simulated_env
from pjrt_rendezvous.client._relay import Relay
from pjrt_rendezvous.coordinator import Coordinator
from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

HOSTS, PER_HOST, THREADS = 2, 2, 2
PROCESSES = HOSTS * PER_HOST
RDV = dict(service="pjrt_rendezvous.v1.Coordinator", method="Rendezvous", code="OK")


@pytest.fixture
def coordinator():
    with Coordinator(port=0, metrics_port=0) as c:
        yield c


def make_clients(
    address: str, *, fan_in: str = "host", processes: int = PROCESSES, hosts: int = HOSTS, **settings
) -> list[pr.Client]:
    clients = []
    for task in range(processes):
        env = simulated_env(address=address, accelerator="v3-8", task=task, processes=processes, hosts=hosts, threads=THREADS)
        topology = pr.detect_topology(env, address=address)
        settings.setdefault("timeout", 60)
        clients.append(pr.Client(pr.Settings(address=address, fan_in=fan_in, **settings), topology))
    return clients


def run_threads(clients: list[pr.Client], body) -> dict:
    """Runs ``body(client, binding)`` in a bound thread per device of every client; returns
    each ordinal's result (or exception)."""
    results: dict[int, object] = {}
    bound = threading.Barrier(len(clients) * THREADS)

    def main(client: pr.Client, index: int) -> None:
        binding = client.bind_thread(index)
        bound.wait(30)
        try:
            results[binding.ordinal] = body(client, binding)
        except Exception as exc:
            results[binding.ordinal] = exc
        finally:
            client.unbind_thread()

    threads = [threading.Thread(target=main, args=(c, i)) for c in clients for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return results


def tell(survivors: list[pr.Client]) -> None:
    """Each thread of the survivors of a restart learns of it by one failed call (refused
    where it was not heard of yet: through the relay, then directly), as a program would."""
    results = run_threads(survivors, lambda client, binding: client.rendezvous(binding, "void"))
    assert all(isinstance(r, pr.ParticipantFailedError) and "to 2" in str(r) for r in results.values()), results


def test_each_host_sends_one_call_per_round_and_every_result_is_exact(coordinator, monkeypatch):
    """After the first round (the relay learns its host's processes), the coordinator sees one
    Rendezvous call per host and round, not one per process, naming each process once (the
    coordinator says it reads that form); full and subset rounds are exact; the relay's
    socket is in a folder private to the user."""
    from pjrt_rendezvous.client import _relay

    monkeypatch.setattr(_relay, "_FORWARDED_KEPT", 5)  # (rounds whose callers a relay remembers)
    clients = make_clients(coordinator.address)
    rounds = 20

    def body(client, binding):
        out = []
        for k in range(rounds):
            out.append(client.rendezvous(binding, f"r{k}", b"%d" % binding.ordinal))
        # a subset across the hosts: ordinals 0-1 (host 0, task 0) and 4-5 (host 1, task 2)
        if binding.ordinal in (0, 1, 4, 5):
            out.append(client.rendezvous(binding, "sub", b"s%d" % binding.ordinal, replicas=[0, 1, 4, 5]))
        return out

    forms = []  # per call a relay makes: (processes named, process indexes, incarnations)
    send_one = Relay._send_one

    def record(relay, request, deadline):
        forms.append((len(request.processes), len(request.process_indexes), len(request.incarnations)))
        return send_one(relay, request, deadline)

    monkeypatch.setattr(Relay, "_send_one", record)
    before = value(scrape(coordinator.metrics_port), "pjrt_rendezvous_rpcs_total", **RDV)
    results = run_threads(clients, body)
    calls = value(scrape(coordinator.metrics_port), "pjrt_rendezvous_rpcs_total", **RDV) - before
    assert all(c.reads_process_indexes for c in clients)
    combined = [f for f in forms if f[1] > THREADS]  # calls carrying several processes' ordinals
    assert combined and all(f[0] == PER_HOST and f[2] == 0 for f in combined), forms
    world = PROCESSES * THREADS
    for ordinal, out in results.items():
        assert not isinstance(out, Exception), (ordinal, out)
        assert out[:rounds] == [[b"%d" % o for o in range(world)]] * rounds
        if ordinal in (0, 1, 4, 5):
            assert out[rounds] == [b"s%d" % o for o in (0, 1, 4, 5)]
    # Without fan-in: PROCESSES calls a round. With it: HOSTS, plus the first round's
    # uncombined calls and any process that came after the batch window.
    assert HOSTS * rounds <= calls <= HOSTS * rounds + PROCESSES + 4, calls
    relay = clients[0]._relay
    assert relay is not None and clients[1]._relay is None and clients[2]._relay is not None
    assert len(relay._forwarded) == 5, relay._forwarded
    assert stat.S_IMODE(os.stat(os.path.dirname(relay.path)).st_mode) == 0o700
    for c in clients:
        c.close()
    assert not os.path.exists(relay.path)


def test_a_process_that_avoids_its_relay_is_not_waited_for_there(coordinator):
    """A process that got UNAVAILABLE from its host's relay calls the coordinator directly for
    a while; its connection to the relay stayed open, so the relay held every round for the
    batch window (1 s) waiting for its calls. The connection is closed now, and the relay
    stops waiting for it."""
    from pjrt_rendezvous.client._session import StatusError

    clients = make_clients(coordinator.address, processes=2, hosts=1)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    assert len(clients[0]._relay._tasks) == 2
    clients[1]._relay_failed(StatusError(grpc.StatusCode.UNAVAILABLE, "the relay could not reach the coordinator"))

    def timed(client, binding):
        started = time.monotonic()
        for k in range(3):
            client.rendezvous(binding, f"r{k}")
        return time.monotonic() - started

    deadline = time.monotonic() + 10
    while len(clients[0]._relay._tasks) != 1:  # (the relay sees the end of the connection)
        assert time.monotonic() < deadline, clients[0]._relay._tasks
        time.sleep(0.01)
    took = run_threads(clients, timed)
    assert max(took.values()) < 2.5, took  # (3 rounds took 3 s)
    for c in clients:
        c.close()


def test_a_timeout_through_the_relays_names_exactly_the_missing_ordinal(coordinator):
    """A thread that never arrives: the relay sends the others after its window, so the
    coordinator names that one ordinal, not its whole host."""
    clients = make_clients(coordinator.address, batch_window=0.2)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))

    def body(client, binding):
        if binding.ordinal == 6:
            return "skipped"
        return client.rendezvous(binding, "late", timeout=3)

    results = run_threads(clients, body)
    for ordinal, out in results.items():
        if ordinal == 6:
            continue
        assert isinstance(out, pr.RendezvousTimeout), (ordinal, out)
        said = str(out).split(" (this host's relay sent the call")[0]  # (the relay's note may name 6-7: it waited for their process)
        assert "missing 1 of 8" in said or "ordinal 6 " in said, str(out)
        assert "ordinals 6" not in said and "ordinals 4-7" not in said, str(out)
    for c in clients:
        c.close()


@pytest.mark.parametrize("late", [0, 1], ids=["relay's own process late", "sibling late"])
def test_a_process_later_than_the_window_is_sent_on_at_once(coordinator, late):
    """The last process of a host to reach a round, after the relay sent its siblings' calls
    on (later than the batch window), is sent on at once: nobody else of the host is
    awaited. (It was held another whole window, and the round with it.)"""
    clients = make_clients(coordinator.address, processes=2, hosts=1, batch_window=3.0)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))

    def body(client, binding):
        if client is clients[late]:
            time.sleep(3.5)
        started = time.monotonic()
        client.rendezvous(binding, "step")
        return time.monotonic() - started

    waited = run_threads(clients, body)
    assert all(waited[o] < 2.5 for o in range(late * 2, late * 2 + 2)), waited  # (held another 3 s window)
    for c in clients:
        c.close()


def test_a_relay_does_not_wait_again_for_a_thread_its_process_held_its_call_for(coordinator, monkeypatch):
    """Ordinal 1 comes 5 s late to a round of replicas 0-1 and 4-5 (host 0's first process
    and host 1's): its process holds ordinal 0's call for the batch window (3 s), then
    sends it; the relay sends it on at once. (It waited for ordinal 1 another window: the
    round reached the coordinator 6 s in, named missing until then.)"""
    clients = make_clients(coordinator.address, batch_window=3.0)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    held = []  # (relay, round, how long it held the call)
    send = Relay._send

    def record(relay, host_round):
        held.append((relay, host_round.requests[0].round, host_round.held))
        return send(relay, host_round)

    monkeypatch.setattr(Relay, "_send", record)
    group = [0, 1, 4, 5]

    def body(client, binding):
        if binding.ordinal not in group:
            return None
        if binding.ordinal == 1:
            time.sleep(5.0)
        return client.rendezvous(binding, "step", b"%d" % binding.ordinal, replicas=group)

    results = run_threads(clients, body)
    assert all(results[o] == [b"%d" % g for g in group] for o in group), results
    host0 = [h for r, n, h in held if r is clients[0]._relay and n == 0]
    assert len(host0) == 2 and max(host0) < 2.5, held  # ordinal 0's call, then ordinal 1's (held 3 s)
    for c in clients:
        c.close()


def test_a_round_called_with_its_replicas_in_another_order_is_not_held_for_its_callers(coordinator):
    """Process 0 lists the group as [2, 1, 0], process 1 as [0, 1, 2]: the same round, but
    the relay held each list's call for the process that had not called with that list, for
    the whole batch window (a schedule of shuffled lists ran 190 times slower with fan-in);
    so with [] and a list of every ordinal."""
    clients = make_clients(coordinator.address, processes=2, hosts=1, batch_window=30.0)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))

    def body(client, binding):
        got = []
        for first, second in (([2, 1, 0], [0, 1, 2]), ([], [3, 0, 1, 2])):  # (the second: all four)
            if binding.ordinal in first or not first:
                started = time.monotonic()
                replicas = first if binding.ordinal < 2 else second
                payloads = client.rendezvous(binding, "sub", b"%d" % binding.ordinal, replicas=replicas, timeout=60)
                got.append((payloads, time.monotonic() - started))
        return got

    results = run_threads(clients, body)
    for ordinal in range(4):
        expected = [[b"0", b"1", b"2"]] * (ordinal < 3) + [[b"0", b"1", b"2", b"3"]]
        assert [payloads for payloads, _ in results[ordinal]] == expected, (ordinal, results)
        assert all(took < 10 for _, took in results[ordinal]), (ordinal, results)  # (held 30 s)
    for c in clients:
        c.close()


def test_a_relay_does_not_wait_for_a_process_whose_call_of_the_round_it_let_go_of(coordinator, monkeypatch):
    """Process 0 calls a round early (sent on after the batch window); its sibling, later,
    does more rounds of another group than the relay remembers callers of
    (_FORWARDED_KEPT), then calls that round: process 0, whose call of it still waits, was
    waited for again, for the batch window."""
    from pjrt_rendezvous.client import _relay

    monkeypatch.setattr(_relay, "_FORWARDED_KEPT", 5)
    clients = make_clients(coordinator.address, processes=2, hosts=1, batch_window=3.0)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))

    def body(client, binding):
        if client is clients[1]:
            time.sleep(4.0)  # (past the window: process 0's call went on)
            for k in range(12):
                client.rendezvous(binding, f"r{k}", replicas=[2, 3])
        started = time.monotonic()
        client.rendezvous(binding, "bye", timeout=30)
        return time.monotonic() - started

    took = run_threads(clients, body)
    assert took[0] > 3.5 and took[2] < 2 and took[3] < 2, took  # (held 3 s again)
    for c in clients:
        c.close()


def test_a_relay_does_not_wait_for_a_process_that_called_the_round_listed_otherwise_and_was_answered(coordinator):
    """Ordinal 3's replica ended: ordinal 0 calls the round of [0, 2, 3] listed [3, 2, 0] and
    fails; ordinal 2, of the other process of its host, calls it listed [0, 2, 3] later and
    was held for process 0 (its call of the round answered already) before failing too."""
    clients = make_clients(coordinator.address, processes=2, hosts=1, batch_window=30.0)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    ended = threading.Event()

    def body(client, binding):
        if binding.ordinal == 3:
            client.end_replicas([3], "ended on purpose")
            ended.set()
        if binding.ordinal not in (0, 2):
            return None
        assert ended.wait(10)
        if binding.ordinal == 2:
            time.sleep(3.0)  # (after ordinal 0's call failed)
        started = time.monotonic()
        with pytest.raises(pr.ParticipantFailedError, match="ended on purpose|failed before it came"):
            if binding.ordinal == 0:  # (held for ordinal 2 half its timeout, then failed)
                client.rendezvous(binding, "x", replicas=[3, 2, 0], timeout=2)
            else:
                client.rendezvous(binding, "x", replicas=[0, 2, 3], timeout=20)
        return time.monotonic() - started

    took = run_threads(clients, body)
    assert not any(isinstance(t, Exception) for t in took.values()), took
    assert took[2] < 5, took  # (held 10 s)
    for c in clients:
        c.close()


def test_a_relay_holds_a_round_at_most_half_the_time_left_before_its_deadline(coordinator):
    """A round with a timeout far shorter than the batch window, whose sibling process never
    comes: the relay sends it on within half its time left, so it ends at its timeout,
    naming the sibling alone. (Held for the whole window, it ended then, naming the
    relay's own ordinals missing too, or, past its caller's grace, as the coordinator
    frozen.)"""
    clients = make_clients(coordinator.address, processes=2, hosts=1, batch_window=15.0)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))

    def body(client, binding):
        if client is clients[1]:
            return None
        started = time.monotonic()
        try:
            client.rendezvous(binding, "step", timeout=1.0)
        except pr.RendezvousError as exc:
            return exc, time.monotonic() - started

    results = run_threads(clients, body)
    for ordinal in (0, 1):
        error, took = results[ordinal]
        assert isinstance(error, pr.RendezvousTimeout) and took < 5, (ordinal, error, took)
        assert "missing ordinals 2-3 " in str(error), str(error)
        # (the coordinator counts from the call's arrival, half the timeout after it was made)
        held = re.search(r"\(this host's relay sent the call ([\d.]+) s after the first of its processes' came: "
                         r"it waited for ordinals 2-3 of this host for up to the batch window\)$", str(error))
        assert held and 0.2 <= float(held[1]) < 1.0, str(error)  # (about 0.5 s: loose, for a loaded machine)
    for c in clients:
        c.close()


def test_a_tag_mismatch_reaches_every_member_through_the_relays(coordinator):
    clients = make_clients(coordinator.address)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    results = run_threads(
        clients, lambda client, binding: client.rendezvous(binding, "odd" if binding.ordinal == 5 else "even")
    )
    for ordinal, out in results.items():
        assert isinstance(out, pr.MismatchError), (ordinal, out)
        assert "'odd'" in str(out) and "'even'" in str(out)
    for c in clients:
        c.close()


@pytest.mark.parametrize("ended", [3, 1], ids=["sibling's replica", "relay process's replica"])
@pytest.mark.parametrize("order", ["waiting", "later"], ids=["round waiting", "round entered after"])
def test_a_replica_that_ends_fails_the_rounds_that_need_it_through_the_relays(coordinator, monkeypatch, ended, order):
    """One replica of host 0 ends (end_replicas, as xla.spawn says once its thread unbound)
    while its peers, on its host and on the other, all through their relays, wait in a round
    that needs it, or before they enter one: each fails within seconds of a 60 s timeout,
    with the error the direct path gives, naming the ordinal and how its replica ended. A
    round of the others without it (``replicas=``) completes through the relays, exact.
    Entered after, the round is not held by host 0's relay for the ordinal that ended (its
    process sends no call for it; the relay held the round its batch window, here 20 s)."""
    clients = make_clients(coordinator.address, batch_window=20.0 if order == "later" else 1.0)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    others = [o for o in range(PROCESSES * THREADS) if o != ended]
    told = threading.Event()
    ended_at = []
    sent = set()  # (relay, replicas, round) of each call a relay made
    send_one = Relay._send_one

    def record(relay, request, deadline):
        sent.add((relay, tuple(request.replicas), request.round))
        return send_one(relay, request, deadline)

    monkeypatch.setattr(Relay, "_send_one", record)

    def end(client, binding):
        client.unbind_thread()
        ended_at.append(time.monotonic())
        client.end_replicas([ended], "raised ValueError: gave up")
        told.set()

    def body(client, binding):
        if binding.ordinal == ended:
            if order == "waiting":  # once every other contribution reached the coordinator
                deadline = time.monotonic() + 30
                while [list(r.missing) for j in client.status().jobs for r in j.pending_rounds] != [[ended]]:
                    assert time.monotonic() < deadline, "the others never waited at the coordinator"
                    time.sleep(0.05)
            return end(client, binding)
        if order == "later":
            assert told.wait(30)
        with pytest.raises(pr.ParticipantFailedError) as raised:
            client.rendezvous(binding, "needs", b"%d" % binding.ordinal)
        failed_at = time.monotonic()
        without = client.rendezvous(binding, "without", b"%d" % binding.ordinal, replicas=others)
        return str(raised.value), failed_at, without

    results = run_threads(clients, body)
    # The coordinator's error, as every member's call pending when the round failed has it
    # (and the call that failed it); a process's call that came after has it with its own
    # ordinals, saying the round failed before it came: as each process's, made directly.
    error = (rf"rendezvous 'needs' on all ordinals \(round 1\) cannot complete: a member ended \(ordinal {ended} on "
             r"sim-host-0 pid \d+: its replica raised ValueError: gave up\)")
    for ordinal in others:
        assert isinstance(results[ordinal], tuple), (ordinal, results[ordinal])
        message, failed_at, without = results[ordinal]
        own = [o for o in range(ordinal // THREADS * THREADS, (ordinal // THREADS + 1) * THREADS) if o != ended]
        late = (f"{'ordinal' if len(own) == 1 else 'ordinals'} {'-'.join(map(str, own))} called rendezvous('needs') as "
                f"round 1 of all ordinals, which had failed before it came (its round counter "
                f"for the group moves on with its peers'): ")
        late = f"(?:{re.escape(late)})?" if order == "later" else ""
        assert re.fullmatch(late + error, message), (ordinal, message)
        assert failed_at - ended_at[0] < 5, (ordinal, failed_at - ended_at[0])
        assert without == [b"%d" % o for o in others], (ordinal, without)
    relays = [clients[0]._relay, clients[2]._relay]
    assert {(r, (), 1) for r in relays} | {(r, tuple(others), 0) for r in relays} <= sent, sent
    (job,) = clients[0].status().jobs
    assert {p.ordinal: p.ended for p in job.participants if p.ended} == {ended: "raised ValueError: gave up"}
    for c in clients:
        c.close()


def test_processes_fall_back_to_the_coordinator_when_their_relay_goes_away(coordinator):
    """Host 0's relay stops (its process keeps running): its processes' rounds still
    complete, sent directly, each once."""
    clients = make_clients(coordinator.address)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    clients[0]._relay.close()
    results = run_threads(
        clients, lambda client, binding: [client.rendezvous(binding, f"after{k}", b"%d" % binding.ordinal) for k in range(3)]
    )
    expected = [[b"%d" % o for o in range(PROCESSES * THREADS)]] * 3
    assert all(out == expected for out in results.values()), results
    (job,) = clients[1].status().jobs
    assert job.rounds_completed == 4 and not job.pending_rounds
    for c in clients:
        c.close()


@pytest.mark.parametrize(
    ("fan_in", "tasks", "per_host", "expected"),
    [("off", 64, 4, False), ("host", 2, 1, True), ("auto", 64, 4, True), ("auto", 60, 4, False), ("auto", 64, 1, False)],
)
def test_auto_fan_in_needs_many_hosts_with_several_processes(fan_in, tasks, per_host, expected):
    from pjrt_rendezvous.client._client import _fan_in

    topology = pr.detect_topology(
        {"PJRT_RENDEZVOUS_NUM_TASKS": str(tasks), "PJRT_RENDEZVOUS_TASK_ID": "0",
         "PJRT_LOCAL_PROCESS_COUNT": str(per_host), "PJRT_LOCAL_PROCESS_RANK": "0"},
        address="127.0.0.1:1",
    )
    assert _fan_in(pr.Settings(address="127.0.0.1:1", fan_in=fan_in), topology) is expected


def test_an_unknown_fan_in_mode_is_refused():
    with pytest.raises(pr.UsageError, match=r"fan_in must be one of auto, host, off \(PJRT_RENDEZVOUS_FAN_IN\)"):
        pr.Settings(address="127.0.0.1:1", fan_in="tree")


def test_a_relay_refuses_a_socket_folder_others_can_enter(tmp_path, monkeypatch):
    """The relay's folder must be the user's own and closed to others: otherwise the host's
    processes call the coordinator directly (with a warning), nothing else breaks."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    folder = tmp_path / f"pjrt-rendezvous-{os.getuid()}"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    with Coordinator(port=0) as coordinator:
        clients = make_clients(coordinator.address)
        results = run_threads(clients, lambda client, binding: client.rendezvous(binding, "r", b"%d" % binding.ordinal))
        assert all(out == [b"%d" % o for o in range(PROCESSES * THREADS)] for out in results.values()), results
        assert clients[0]._relay is None and clients[0]._relay_path is None
        for c in clients:
            c.close()


def test_a_process_that_never_reaches_its_relay_says_so(coordinator, monkeypatch, caplog):
    """A process whose relay is never there (another TMPDIR than its relay's process, that
    process gone) called the coordinator directly with no word but a DEBUG line; once every
    try failed for a while it warns, once, naming what to check."""
    from pjrt_rendezvous.client import _client

    monkeypatch.setattr(_client, "_RELAY_RETRY", 0.01)
    monkeypatch.setattr(_client, "_RELAY_RETRY_MAX", 0.32)
    clients = make_clients(coordinator.address, processes=2, hosts=1)
    clients[1]._relay_path = "/nonexistent/relay.sock"
    with caplog.at_level("DEBUG", logger="pjrt_rendezvous.client"):
        for number in range(12):
            results = run_threads(clients, lambda client, binding: client.rendezvous(binding, f"r{number}"))
            assert all(isinstance(r, list) for r in results.values()), results
            time.sleep(0.03)
    said = [r for r in caplog.records if "host relay at /nonexistent/relay.sock unavailable" in r.getMessage()]
    loud = [r for r in said if r.levelname == "WARNING"]
    assert len(said) > 4 and len(loud) == 1 and said.index(loud[0]) == 3, [(r.levelname, r.getMessage()) for r in said]  # (its 4th try)
    assert "as this process's user and with its TMPDIR" in loud[0].getMessage()
    for c in clients:
        c.close()


@pytest.mark.parametrize("case", ["symlink", "file", "open", "long"])
def test_an_unusable_relay_folder_is_said_as_found(case):
    """The relay's folder refused says what was there and what to change (it said "must be
    a folder ... (mode 0700)" of a folder of mode 0700 owned by another user, or of a link to
    a good one; "File exists" of a file; "AF_UNIX path too long" without naming TMPDIR)."""
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # (pytest's tmp_path is too long a path for a socket)
        _refused_as(pathlib.Path(short), case)


def _refused_as(tmp_path, case: str) -> None:
    from pjrt_rendezvous.client._relay import _private_folder

    folder = tmp_path / "pjrt-rendezvous-0"
    if case == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "elsewhere")
    elif case == "file":
        folder.write_text("")
    elif case == "open":
        folder.mkdir()
        folder.chmod(0o755)
    else:
        folder = tmp_path / ("x" * 100) / "pjrt-rendezvous-0"
    with pytest.raises(OSError) as info:
        _private_folder(str(folder / "relay-0123456789abcdef.sock"))
    expected = {
        "symlink": "it is a symbolic link: remove it, or set TMPDIR",
        "file": "it is not a folder: remove it, or set TMPDIR",
        "open": "it is open to others (mode 0755)",
        "long": "over the 107 a Unix socket's path takes: set TMPDIR to a shorter folder",
    }[case]
    assert expected in str(info.value), str(info.value)


def test_frames_round_trip_and_a_cut_message_waits_for_its_rest():
    from pjrt_rendezvous.client._session import frame, take_frames

    messages = [b"", b"abc", b"x" * 70_000]
    data = b"".join(map(frame, messages))
    for cut in (0, 2, 4, 5, len(frame(b"")) + 5, len(data) - 1, len(data)):
        buffer = bytearray(data[:cut])
        taken = take_frames(buffer)
        assert taken == messages[: len(taken)]
        assert bytes(buffer) == data[len(b"".join(map(frame, taken))) : cut]
        buffer += data[cut:]
        assert taken + take_frames(buffer) == messages and not buffer


def test_a_malformed_message_ends_only_its_own_connection_to_the_relay(coordinator):
    import socket

    from pjrt_rendezvous.client._session import frame, take_frames

    clients = make_clients(coordinator.address)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    with socket.socket(socket.AF_UNIX) as rogue:
        rogue.connect(clients[0]._relay.path)
        rogue.sendall(frame(b"\xff\xff\xff"))
        rogue.settimeout(10)
        # The relay says why (an answer with id 0 ends the connection), then closes it.
        (message,) = take_frames(bytearray(rogue.makefile("rb").read()))
        (answer,) = pb.SessionResponse.FromString(message).answers
        assert (answer.id, answer.code) == (0, grpc.StatusCode.INVALID_ARGUMENT.value[0])
        assert "not a valid pjrt_rendezvous.v1.SessionRequest" in answer.message
    results = run_threads(clients, lambda client, binding: client.rendezvous(binding, "after"))
    assert all(out == [b""] * (PROCESSES * THREADS) for out in results.values()), results
    for c in clients:
        c.close()


def test_a_stuck_relay_whose_process_is_declared_dead_does_not_hang_its_host(monkeypatch):
    """Host 0's relay stops forwarding and its process stops heartbeating (as if frozen):
    once the coordinator declares that process dead, its sibling's waiting round is resent
    directly and fails at once naming the dead process, instead of waiting for its deadline."""
    with Coordinator(port=0, heartbeat_timeout=3) as coordinator:
        clients = make_clients(coordinator.address)
        run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
        frozen = clients[0]
        release = threading.Event()
        monkeypatch.setattr(frozen._relay, "_send_one", lambda request, deadline: release.wait(60) and b"")
        frozen._stopped.set()  # no more heartbeats from the relay's process
        outcome = {}

        def sibling() -> None:
            binding = clients[1].bind_thread(0)
            try:
                clients[1].rendezvous(binding, "stuck", timeout=60)
            except Exception as exc:
                outcome["error"] = exc
            finally:
                clients[1].unbind_thread()

        thread = threading.Thread(target=sibling)
        thread.start()
        thread.join(30)
        release.set()
        assert not thread.is_alive(), "the sibling waited on a stuck relay"
        assert isinstance(outcome.get("error"), pr.ParticipantFailedError), outcome
        assert "a member died (ordinals 0-1 on sim-host-0" in str(outcome["error"])
        for c in clients:
            c.close(leave=False)


def test_a_frozen_relay_is_left_within_seconds_and_avoided_longer_each_time(coordinator, monkeypatch, caplog):
    """The relay's loop stops (its process frozen: a debugger, SIGSTOP) while a round waits
    in it: a ping unanswered for a second ends the session and the call is resent directly,
    well within the round's 8 s (the general keepalive would take 15, and the sibling,
    calling the coordinator directly, would time out). A relay tried again must answer a
    ping at connect (its socket still takes connections); each failure in a row keeps the
    process away twice as long."""
    from pjrt_rendezvous.client import _client

    monkeypatch.setattr(_client, "_RELAY_RETRY", 0.2)
    clients = make_clients(coordinator.address, processes=2, hosts=1, timeout=8)
    clients[1]._relay_path = None  # the sibling calls the coordinator directly
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    thawed = threading.Event()
    clients[0]._relay._loop.call_soon_threadsafe(thawed.wait, 60)
    try:
        for k in range(3):
            results = run_threads(clients, lambda client, binding: client.rendezvous(binding, f"r{k}", b"%d" % binding.ordinal))
            assert all(out == [b"%d" % o for o in range(2 * THREADS)] for out in results.values()), (k, results)
            time.sleep(0.5)  # past the time away: the next round tries the relay again
    finally:
        thawed.set()
    assert "the host relay did not answer a ping within 1 s" in caplog.text
    # Away 0.2 s after the frozen session; then two failed connects in a row: 0.2, 0.4, next 0.8.
    assert clients[0]._relay_retry[1] == 0.8
    results = run_threads(clients, lambda client, binding: client.rendezvous(binding, "thawed"))
    assert all(out == [b""] * (2 * THREADS) for out in results.values()), results
    for c in clients:
        c.close()


def test_a_relay_being_connected_holds_up_no_direct_call(coordinator, monkeypatch):
    """Connecting to the relay waits for its answer to a ping (up to a second for a frozen
    one): meanwhile the process's direct calls (key-value, heartbeats) go on. (They waited
    for the session lock the connect held.)"""
    from pjrt_rendezvous.client import _client

    clients = make_clients(coordinator.address, processes=2, hosts=1)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    sibling = clients[1]
    sibling._relay_session.close()  # its next round connects again
    connecting, release = threading.Event(), threading.Event()
    real_local = _client.SocketSession.local

    def slow_local(path):
        connecting.set()
        release.wait(30)
        return real_local(path)

    monkeypatch.setattr(_client.SocketSession, "local", staticmethod(slow_local))
    rounds = threading.Thread(target=run_threads, args=(clients, lambda client, binding: client.rendezvous(binding, "r")))
    rounds.start()
    try:
        assert connecting.wait(10)
        direct = threading.Thread(target=lambda: sibling.set("direct", b"1"))
        direct.start()
        direct.join(10)
        assert not direct.is_alive(), "a direct call waited for the relay's connect"
    finally:
        release.set()
        rounds.join(60)
    assert sibling.get("direct", wait=False) == b"1"
    for c in clients:
        c.close()


def test_a_relay_whose_process_was_replaced_still_carries_its_siblings_rounds(coordinator):
    """Host 0's relay runs in task 0's process; a new process for task 0 on that host takes
    the task over (a restart as the coordinator sees it) while the old one lives on with its
    relay. The relay's calls as the replaced process are refused, so it resends its sibling's
    call as the sibling's own: the rounds complete, exact, without the old process."""
    clients = make_clients(coordinator.address)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    env = simulated_env(address=coordinator.address, accelerator="v3-8", task=0, processes=PROCESSES, hosts=HOSTS, threads=THREADS)
    fresh = pr.Client(pr.Settings(address=coordinator.address, fan_in="off", timeout=60), pr.detect_topology(env, address=coordinator.address))
    team = [fresh, *clients[1:]]
    fresh.bind_thread(0)  # registers: the job moves to generation 2
    fresh.unbind_thread()
    tell(clients[1:])
    results = run_threads(
        team, lambda client, binding: [client.rendezvous(binding, f"after{k}", b"%d" % binding.ordinal) for k in range(3)]
    )
    expected = [[b"%d" % o for o in range(PROCESSES * THREADS)]] * 3
    assert all(out == expected for out in results.values()), results
    assert clients[0]._relay is not None and fresh.generation == 2
    for c in [*clients, fresh]:
        c.close()


def test_a_replaced_relay_resends_its_siblings_calls_at_once(coordinator):
    """As above with two siblings on the relay's host, which go on calling through it (as
    if they had not yet acted on the restart's event): each gets its call resent as its own
    at once (one after the other, the first waited for ever for the second's)."""
    clients = make_clients(coordinator.address, processes=3, hosts=1)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    for sibling in clients[1:]:
        sibling._leave_relay = lambda: None
    env = simulated_env(address=coordinator.address, accelerator="v3-8", task=0, processes=3, hosts=1, threads=THREADS)
    fresh = pr.Client(pr.Settings(address=coordinator.address, fan_in="off", timeout=20), pr.detect_topology(env, address=coordinator.address))
    fresh.bind_thread(0)  # registers: the job moves to generation 2
    fresh.unbind_thread()
    tell(clients[1:])
    results = run_threads([fresh, *clients[1:]], lambda client, binding: client.rendezvous(binding, "after", b"%d" % binding.ordinal))
    assert all(out == [b"%d" % o for o in range(3 * THREADS)] for out in results.values()), results
    for c in [*clients, fresh]:
        c.close()


def test_a_round_a_relay_holds_fails_at_once_when_the_job_moves(coordinator):
    """A relay holding a round for its host's other process (a batch window of 60 s) sends
    it as soon as its process hears that the job moved to a new generation (a process on
    another host restarted): its callers learn of the restart then, not a window later."""
    clients = make_clients(coordinator.address)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    clients[0]._relay._window = 60.0
    outcome = {}
    step = threading.Thread(target=lambda: outcome.update(run_threads(clients[:1], lambda c, b: c.rendezvous(b, "step"))))
    step.start()  # host 0's relay holds it: host 0's other process has not called
    time.sleep(0.5)
    env = simulated_env(address=coordinator.address, accelerator="v3-8", task=3, processes=PROCESSES, hosts=HOSTS, threads=THREADS)
    fresh = pr.Client(pr.Settings(address=coordinator.address, fan_in="off"), pr.detect_topology(env, address=coordinator.address))
    fresh.bind_thread(0)  # task 3 restarts on host 1: the job moves to generation 2
    fresh.unbind_thread()
    step.join(20)
    assert not step.is_alive(), "the relay held the round of the old generation"
    assert all(isinstance(e, pr.ParticipantFailedError) and "to 2" in str(e) for e in outcome.values()), outcome
    for c in [*clients, fresh]:
        c.close()


def test_a_relay_resends_no_process_s_call_once_the_round_s_deadline_passed(coordinator, monkeypatch):
    """A combined call that failed at or after its deadline (the coordinator silent on gRPC's
    transport: the call's own cut-off) is each process's outcome as it is: resent one by one
    with no time left, each failed as 'no answer within 0 s'."""
    from pjrt_rendezvous.client._relay import _HostRound
    from pjrt_rendezvous.client._session import StatusError

    clients = make_clients(coordinator.address)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    relay = clients[0]._relay
    sent = []
    failure = StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer to Rendezvous within 15 s")
    monkeypatch.setattr(relay, "_send_one", lambda request, deadline: sent.append(request.incarnation) or failure)
    host_round = _HostRound(round=("default", 0, (), 7), deadline=time.monotonic() - 1.0)
    for task, c in enumerate(clients[:2]):
        host_round.requests.append(pb.RendezvousRequest(job="default", incarnation=c.incarnation, round=7))
        host_round.rows.append((task * THREADS, "r", b"", c.incarnation))
    assert relay._send(host_round) == [failure, failure]
    assert sent == [clients[0].incarnation]  # the combined call (the relay's own process speaks)
    monkeypatch.undo()
    for c in clients:
        c.close()


def test_a_relay_removes_only_its_own_socket_and_siblings_use_only_their_users_relay(coordinator, monkeypatch):
    """A process restarted on its host starts a relay at the same path while the old one lives
    on: the old one's close leaves the new socket. A relay socket served by another user (it
    made the folder first) is not used."""
    from pjrt_rendezvous.client._session import SocketSession, StatusError

    clients = make_clients(coordinator.address)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    old = clients[0]._relay
    new = Relay(clients[0], old.path)
    old.close()
    assert os.path.exists(new.path)
    SocketSession.local(new.path).close()  # ours
    monkeypatch.setattr(os, "getuid", lambda: 4242)
    with pytest.raises(StatusError, match="runs as user"):
        SocketSession.local(new.path)
    monkeypatch.undo()
    new.close()
    assert not os.path.exists(new.path)
    for c in clients:
        c.close()


def test_a_relay_that_closes_leaves_a_new_relay_s_socket_made_while_it_looked(coordinator, monkeypatch):
    """A restarted process's relay starts at the same path just as the old one, closing, has
    found its own socket there: the old one removes its own (under the path's lock), and
    the new one binds after, so its socket stays."""
    from pjrt_rendezvous.client._session import SocketSession

    clients = make_clients(coordinator.address)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    old, closing, real_stat = clients[0]._relay, threading.current_thread(), os.stat
    started: dict = {}

    def stat(path, *args, **kwargs):
        info = real_stat(path, *args, **kwargs)
        if path == old.path and threading.current_thread() is closing and not started:
            started["thread"] = threading.Thread(target=lambda: started.setdefault("relay", Relay(clients[0], old.path)))
            started["thread"].start()
            started["thread"].join(1.0)  # (unlocked, the new relay would bind here)
        return info

    monkeypatch.setattr(os, "stat", stat)
    old.close()
    monkeypatch.undo()
    started["thread"].join(30)
    new = started["relay"]
    assert os.path.exists(new.path)
    SocketSession.local(new.path).close()
    new.close()
    assert not os.path.exists(new.path) and not os.path.exists(f"{new.path}.lock")
    for c in clients:
        c.close()


def test_a_relay_that_closes_after_the_one_that_replaced_it_leaves_no_lock_file(coordinator):
    """Two relays at one path (a process's replacement's, or two simulated hosts of one
    name): the newer one closes first and removes its socket and the path's lock; the older
    one, closing after, leaves neither (its lock made the lock file again, left behind)."""
    clients = make_clients(coordinator.address)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    old = clients[0]._relay
    new = Relay(clients[0], old.path)
    new.close()
    old.close()
    assert not os.path.exists(old.path) and not os.path.exists(f"{old.path}.lock")
    for c in clients:
        c.close()


def test_a_relay_goes_on_without_a_path_lock_held_too_long(coordinator, monkeypatch, caplog):
    """The path's lock held by a process frozen in the middle of its change: a relay waits
    for it only a while, then starts without it, saying so."""
    import fcntl

    from pjrt_rendezvous.client import _relay

    clients = make_clients(coordinator.address)
    run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm"))
    path = clients[0]._relay.path
    monkeypatch.setattr(_relay, "_PATH_LOCK_WAIT", 0.3)
    fd = os.open(f"{path}.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        started = time.monotonic()
        new = Relay(clients[0], path)
        assert 0.3 <= time.monotonic() - started < 10
    finally:
        os.close(fd)
    assert f"{path}.lock has been held for 0.3 s; changing the relay's socket without it" in caplog.text
    new.close()
    for c in clients:
        c.close()


def test_the_path_lock_is_held_only_on_the_file_at_its_path(tmp_path, monkeypatch):
    """A relay that got the lock of a file its holder removed meanwhile (as a closing relay
    removes it) takes the lock of the file at the path instead."""
    import fcntl

    from pjrt_rendezvous.client import _relay

    path, real, tries = str(tmp_path / "relay.sock"), fcntl.flock, []

    def flock(fd, operation):
        if not tries:
            os.unlink(f"{path}.lock")  # the holder removes it just before it lets go
        tries.append(fd)
        return real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    with _relay._path_lock(path):
        fd = os.open(f"{path}.lock", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                real(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert len(tries) == 2


_RELAYING_PROCESS = """
import sys, time
import pjrt_rendezvous.client as pr
client = pr.init()
binding = client.bind_thread(0)
print("bound", flush=True)
if sys.argv[1] == "relay":
    sys.stdin.readline()  # exits normally while its relay carries the sibling's waiting round
else:
    try:
        client.rendezvous(binding, "never", b"", timeout=60)  # its relay's process never comes
    except pr.RendezvousError as exc:
        print(type(exc).__name__, flush=True)
"""


def test_a_process_whose_relay_carries_a_waiting_round_exits_at_once_and_leaves(coordinator):
    """A relay's sending threads do not hold its process's exit: it leaves the job at exit, as
    without fan-in, so the round fails at once for its members (it waited out their timeout)."""
    def start(task: int, role: str) -> subprocess.Popen:
        env = simulated_env(address=coordinator.address, accelerator="v3-8", task=task, processes=2, hosts=1, threads=1)
        env.update(PJRT_RENDEZVOUS_FAN_IN="host")
        proc = subprocess.Popen(
            [sys.executable, "-c", _RELAYING_PROCESS, role], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "bound"
        return proc

    relay = start(0, "relay")
    sibling = start(1, "sibling")
    try:
        time.sleep(1.0)  # the sibling's round waits at the relay for ordinal 0, which never comes
        started = time.monotonic()
        relay.stdin.close()
        assert relay.wait(30) == 0
        assert time.monotonic() - started < 20
        assert sibling.stdout.readline().strip() == "ParticipantFailedError"
        assert time.monotonic() - started < 30
    finally:
        for proc in (relay, sibling):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_a_relay_passes_on_why_the_coordinator_could_not_be_reached():
    """The relay answers a call it could not carry with the gRPC error's details alone (its
    process's client raises without chaining them, and keeps them for it), not the client's
    whole error with its hints, which the caller adds itself."""
    from pjrt_rendezvous.client._relay import _answer

    client = pr.Client(pr.Settings(address="127.0.0.1:1", connect_timeout=1.0), pr.detect_topology({}, address="127.0.0.1:1"))
    try:
        with pytest.raises(pr.CoordinatorUnavailableError) as unreachable:
            client.count()
    finally:
        client.close()
    assert unreachable.value.__cause__ is None and unreachable.value._rpc_details
    import pickle  # (xla.spawn sends a replica's error so: a gRPC error kept on it did not pickle)

    assert pickle.loads(pickle.dumps(unreachable.value))._rpc_details == unreachable.value._rpc_details
    answer = pb.SessionAnswer.FromString(_answer(5, unreachable.value)[0])
    assert answer.message.startswith("the host relay could not reach the coordinator: ") and "Is `pjrt-rendezvous serve`" not in answer.message, answer
    # A call the relay's process cancelled (it closes) or could not send: the caller is told
    # UNAVAILABLE, and retries on the coordinator directly; the coordinator's own refusals pass
    for code, told in (("CANCELLED", "UNAVAILABLE"), ("UNAVAILABLE", "UNAVAILABLE"), ("ABORTED", "ABORTED")):
        answer = pb.SessionAnswer.FromString(_answer(5, pr.RemoteError("the reason", code=code))[0])
        assert answer.code == grpc.StatusCode[told].value[0] and answer.message.endswith("the reason"), (code, answer)


def test_close_while_a_binding_starts_the_relay_closes_the_relay(coordinator, monkeypatch):
    """close() in another thread while bind_thread starts the host's relay: close() found no
    relay yet, and the relay, made after, served a closed client for good (its thread, loop and
    socket). Now the relay is closed as soon as it is made, and the binding refused."""
    (client,) = make_clients(coordinator.address, processes=1, hosts=1)
    made = []

    def relay_then_close(owner, path):
        made.append(Relay(owner, path))
        closer = threading.Thread(target=owner.close)
        closer.start()
        closer.join(10)
        return made[-1]

    monkeypatch.setattr("pjrt_rendezvous.client._client.Relay", relay_then_close)
    with pytest.raises(pr.UsageError, match="was closed"):
        client.bind_thread(0)
    (relay,) = made
    deadline = time.monotonic() + 10
    while relay._loop.is_running():
        assert time.monotonic() < deadline, "the relay still serves a closed client"
        time.sleep(0.01)
    assert client._relay is None and not os.path.exists(relay.path)
