"""Chaos with real processes: killed participants, restarts, and the coordinator's answers."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from _watch import watch_opened

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client._client import _store_ids
from pjrt_rendezvous.client._demo import simulated_env
from pjrt_rendezvous.coordinator import Coordinator
from pjrt_rendezvous.coordinator._core import DISCONNECTED_GRACE
from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

WORKER = pathlib.Path(__file__).with_name("pod_worker.py")
# Short enough for quick trials, long enough that a loaded 2-core machine does not delay a
# live process's heartbeats (every timeout / 3) past it.
HEARTBEAT_TIMEOUT = 3.0
KILL_TRIALS = int(os.environ.get("PJRT_RENDEZVOUS_KILL_TRIALS", "5"))


def start(address, scenario, task, *, processes):
    env = simulated_env(address=address, accelerator="v4-8", task=task, processes=processes, hosts=processes, threads=1)
    return subprocess.Popen([sys.executable, str(WORKER), scenario], env=env, stdout=subprocess.PIPE, text=True)


def observer(address):
    topology = pr.detect_topology({}, address=address)
    return pr.Client(pr.Settings(address=address, timeout=30), topology)


def pair_client(address: str, task: int) -> pr.Client:
    """The client of task ``task`` of a job of two processes of one device each."""
    env = {"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": str(task)}
    return pr.Client(pr.Settings(address=address, timeout=30), pr.detect_topology(env, address=address))


@contextlib.contextmanager
def bound(clients):
    """A thread of its own for each client (run there with ``pool.submit``), bound to its
    device 0; unbound, and the clients closed, after."""
    pools = [concurrent.futures.ThreadPoolExecutor(1) for _ in clients]
    try:
        for pool, client in zip(pools, clients):
            pool.submit(client.bind_thread, 0).result()  # registers; heartbeats from here
        yield pools
    finally:
        for pool, client in zip(pools, clients):
            pool.submit(client.unbind_thread).result()
            pool.shutdown()
            client.close(leave=False)


def bind_again(pools, clients) -> None:
    """Each client's bound thread unbinds and binds device 0 again: it registers again."""
    for pool, client in zip(pools, clients):
        pool.submit(client.unbind_thread).result()
        pool.submit(client.bind_thread, 0).result()


def meet(pools, clients, tag: str) -> list:
    """Each client's bound thread calls ``rendezvous(tag, b"x")``; their results."""
    rounds = [pool.submit(lambda c=c: c.rendezvous(pr.current_binding(), tag, b"x")) for pool, c in zip(pools, clients)]
    return [r.result(timeout=30) for r in rounds]


def finish(child, timeout=60):
    out, _ = child.communicate(timeout=timeout)
    return [json.loads(line) for line in out.splitlines()]


def until_watching(coordinator, incarnation: str) -> None:
    """Until the process ``incarnation`` has its Watch stream open: a close (a kill) is seen
    by the stream's end, and a stream opened later starts from then (its events before it
    unsent)."""
    watching = coordinator._running._servicer._watching  # (job, incarnation) -> its streams open
    deadline = time.monotonic() + 30
    while not watching[("default", incarnation)]:
        assert time.monotonic() < deadline, f"the Watch stream of {incarnation} did not open"
        time.sleep(0.02)


def kill_and_replace(heartbeat_timeout: float, *, after_death: bool):
    """The survivor (task 0) waits in a round while the victim (task 1) is killed with
    SIGKILL; a replacement for task 1 starts on the victim's host, once the coordinator has
    declared the victim dead (``after_death``) or at once. Returns the survivor's and the
    replacement's records, and the seconds from the kill to the death being seen (None
    when not waited for)."""
    from test_cli import wait_until

    with Coordinator(port=0, heartbeat_timeout=heartbeat_timeout) as coordinator:
        watcher = observer(coordinator.address)
        survivor = start(coordinator.address, "survivor", 0, processes=2)
        victim = start(coordinator.address, "hang", 1, processes=2)
        detected = None
        try:
            watcher.wait(["ready/0", "ready/1"], timeout=30)
            wait_until(lambda: watcher.status().jobs[0].pending_rounds, what="the survivor's round")  # ('before-death')
            until_watching(coordinator, coordinator.core.jobs["default"].members[1].incarnation)  # (the victim's)
            killed_at = time.monotonic()
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            if after_death:
                deadline = time.monotonic() + min(heartbeat_timeout, DISCONNECTED_GRACE) + 10
                while watcher.status().jobs[0].participants[1].alive and time.monotonic() < deadline:
                    time.sleep(0.05)
                detected = time.monotonic() - killed_at
            replacement = start(coordinator.address, "replacement", 1, processes=2)
            (after,) = finish(replacement)
            (record,) = finish(survivor)
        finally:
            for child in (survivor, victim):
                child.kill()
        watcher.close()
    return record, after, detected


@pytest.mark.parametrize("trial", range(KILL_TRIALS))
def test_killed_process_aborts_the_round_and_its_replacement_starts_a_new_generation(trial):
    """SIGKILL of a participant mid-round: its peer gets ABORTED naming it within the heartbeat
    timeout; a replacement process takes over the task in a new generation and the job goes on."""
    record, after, detected = kill_and_replace(HEARTBEAT_TIMEOUT, after_death=True)
    assert detected < HEARTBEAT_TIMEOUT + 4.0
    assert record["first"].startswith("ParticipantFailedError: rendezvous 'before-death' on all ordinals")
    assert "ordinal 1 on sim-host-1 pid" in record["first"] and "its connection closed" in record["first"]
    assert record["aborted_after"] < 30
    assert after == dict(thread=0, ordinal=1, local_ordinal=0, pid=after["pid"], after=["s0", "r1"], generation=2)
    assert record["after"] == ["s0", "r1"]
    assert any("died: its connection closed" in e for e in record["events"])
    assert any("restarted" in e for e in record["events"])


def test_a_killed_process_is_declared_dead_when_its_connection_closes_not_after_the_heartbeat_timeout():
    """Its peers hear of a SIGKILL after DISCONNECTED_GRACE (10 s), not the 60 s timeout."""
    record, _, detected = kill_and_replace(60.0, after_death=True)
    assert DISCONNECTED_GRACE < detected < DISCONNECTED_GRACE + 4.0
    assert "its connection closed" in record["first"] and "killed, crashed" in record["first"]


def test_watch_stream_reports_deaths_to_idle_processes():
    """A process that is not waiting still learns of a peer's death through the watch stream."""
    with Coordinator(port=0, heartbeat_timeout=HEARTBEAT_TIMEOUT) as coordinator:
        topology = pr.detect_topology({"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": "0"}, address=coordinator.address)
        idle = pr.Client(pr.Settings(address=coordinator.address, timeout=30), topology)
        idle.bind_thread(0)
        victim = start(coordinator.address, "hang", 1, processes=2)
        try:
            idle.wait(["ready/1"], timeout=30)
            victim.send_signal(signal.SIGKILL)
            deadline = time.monotonic() + HEARTBEAT_TIMEOUT + 5
            while not idle.events and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            victim.kill()
        (event,) = idle.events
        assert event.kind == event.PROCESS_DEAD and list(event.ordinals) == [1] and event.host == "sim-host-1"
        with pytest.raises(pr.ParticipantFailedError, match="a member died"):
            idle.rendezvous(pr.current_binding(), "later", b"", timeout=5)
        idle.unbind_thread()
        idle.close()


def test_duplicate_task_while_holder_lives_hints_at_heartbeat_timeout():
    """A second process claiming a live task from another local rank is refused; the message
    says when a replacement may register."""
    with Coordinator(port=0, heartbeat_timeout=30) as coordinator:
        env = {"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": "0"}
        first = pr.Client(pr.Settings(address=coordinator.address), pr.detect_topology(env, address=coordinator.address))
        other_rank = pr.detect_topology(
            {**env, "PJRT_RENDEZVOUS_LOCAL_RANK": "1", "PJRT_RENDEZVOUS_LOCAL_WORLD_SIZE": "2"}, address=coordinator.address
        )
        second = pr.Client(pr.Settings(address=coordinator.address), other_rank)
        first.bind_thread(0)
        first.unbind_thread()
        with pytest.raises(pr.DuplicateOrdinalError, match=r"elsewhere once it is declared dead \(30 s without heartbeat\)"):
            second.bind_thread(0)
        first.close()
        second.close()


def test_a_process_restarted_on_its_host_takes_over_its_task_at_once():
    """A participant killed mid-round and started again on its host with its local rank,
    long before the heartbeat timeout: the new process registers at once, the job moves to a
    new generation, the round its peer waits in fails naming the restart, and the two meet
    in the next round (a claim from another host is still refused: test_integration)."""
    record, after, _ = kill_and_replace(60, after_death=False)
    assert record["first"].startswith("ParticipantFailedError: job 'default' moved to generation 2: task 1")
    assert "restarted: sim-host-1 pid" in record["first"] and "which was last heard from" in record["first"]
    assert record["aborted_after"] < 30  # not the 60 s heartbeat timeout
    assert after == dict(thread=0, ordinal=1, local_ordinal=0, pid=after["pid"], after=["s0", "r1"], generation=2)
    assert record["after"] == ["s0", "r1"]
    assert not any("died" in e for e in record["events"]) and any("restarted" in e for e in record["events"])


def test_a_coordinator_held_up_longer_than_the_heartbeat_timeout_declares_nobody_dead():
    """The coordinator's own event loop stalls past the heartbeat timeout (a busy or paused
    host, or an embedded coordinator starved by its training process) while every client
    keeps heartbeating: the heartbeats that came in meanwhile count before anyone is judged,
    so nobody is declared dead and the next round runs."""
    with Coordinator(port=0, heartbeat_timeout=3.0) as coordinator:
        clients = [pair_client(coordinator.address, task) for task in range(2)]
        with bound(clients) as pools:  # heartbeats every second
            time.sleep(1.0)
            stalled = threading.Event()
            coordinator._loop.call_soon_threadsafe(lambda: (stalled.set(), time.sleep(4.5)))
            assert stalled.wait(10)
            time.sleep(6.5)  # the stall, then two seconds of heartbeats after it
            status = clients[0].status()
            assert all(p.alive for p in status.jobs[0].participants), status
            assert not clients[0].events
            assert meet(pools, clients, "after") == [[b"x", b"x"]] * 2


def test_a_replaced_process_is_told_so_and_warned_once(caplog):
    """Two clients of one task on one host and local rank: the second takes the task over
    (a restart as the coordinator sees it). The first one's calls fail saying it was
    replaced, naming the duplicate-task mistake it may be; it cannot bind again to take the
    task back, and its refused heartbeats are warned of once, not at every interval."""
    with Coordinator(port=0) as coordinator:
        env = {"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": "0", "PJRT_RENDEZVOUS_CORES_PER_CHIP": "2"}
        topology = pr.detect_topology(env, address=coordinator.address)
        settings = pr.Settings(address=coordinator.address, timeout=10, heartbeat_interval=0.1)
        old, new = pr.Client(settings, topology), pr.Client(settings, topology)
        with concurrent.futures.ThreadPoolExecutor(1) as other:
            old_binding = other.submit(old.bind_thread, 0).result()
            new.bind_thread(0)
            with pytest.raises(pr.MismatchError, match=r"was replaced: task 0 \(ordinals 0-1\) restarted.*share one task id"):
                other.submit(old.rendezvous, old_binding, "t", b"").result()
            with concurrent.futures.ThreadPoolExecutor(1) as another, pytest.raises(pr.MismatchError, match="was replaced"):
                another.submit(old.bind_thread, 1).result()  # cannot take the task back
            time.sleep(1.0)  # ten heartbeat intervals
            failed = [r for r in caplog.records if r.getMessage().startswith(f"heartbeat to {coordinator.address} ")]  # (not a leftover's)
            assert len(failed) == 1 and "was replaced" in failed[0].getMessage(), failed
            assert [p.pid for p in new.status().jobs[0].participants] == [os.getpid()]
            other.submit(old.unbind_thread).result()
        new.unbind_thread()
        old.close()
        new.close()


def test_a_coordinator_stopped_and_continued_past_the_heartbeat_timeout_declares_nobody_dead():
    """``serve`` is stopped (SIGSTOP: Ctrl-Z, a frozen container) for longer than the
    heartbeat timeout while its clients keep heartbeating, then continued: the heartbeats
    waiting in its sockets count before anyone is judged. (After a stop, the loop ran the
    overdue liveness check before reading them, and declared every process dead.) Likewise
    a round that the calls waiting there complete is not logged late, and a round or a key
    wait whose deadline passed during the stop is completed by them (the overdue alarm
    failed both, naming as missing a member whose call was on time)."""
    from test_cli import Serve, wait_until

    with Serve("--heartbeat-timeout", "2", "--late-after", "2") as server:
        clients = [pair_client(server.address, task) for task in range(2)]
        with bound(clients) as pools, concurrent.futures.ThreadPoolExecutor(2) as kv:
            time.sleep(1.0)  # heartbeats every 2/3 s
            first = pools[0].submit(lambda: clients[0].rendezvous(pr.current_binding(), "during", b"x", timeout=2.5))
            read = kv.submit(clients[0].multi_get, ["during", "during-too"], timeout=2.5)
            wait_until(lambda: clients[0].status().jobs[0].pending_rounds, what="the round")
            time.sleep(0.2)  # (waiting in the round and for the key)
            server.proc.send_signal(signal.SIGSTOP)
            second = pools[1].submit(lambda: clients[1].rendezvous(pr.current_binding(), "during", b"x"))
            setting = kv.submit(lambda: [clients[1].set(key, b"v") for key in ("during", "during-too")])  # (one by one)
            time.sleep(4.5)  # (the deadlines pass some 2 s before the end: held up, by HELD_UP's measure)
            server.proc.send_signal(signal.SIGCONT)
            assert first.result(10) == second.result(10) == [b"x", b"x"]
            assert read.result(10) == [b"v", b"v"] and setting.result(10) == [None, None]
            time.sleep(2.0)
            status = clients[0].status()
            assert all(p.alive for p in status.jobs[0].participants), status
            assert "died" not in server.stderr() and "round late" not in server.stderr(), server.stderr()
            assert meet(pools, clients, "after") == [[b"x", b"x"]] * 2
        server.stop()


@pytest.mark.parametrize("how", ["stop", "stop without grace", "stop without grace, gRPC alone", "with"])
def test_an_embedded_coordinator_that_stops_fails_its_pending_rounds_at_once_saying_why(how):
    """An embedded coordinator stopped (``stop()``, with no grace too, or its ``with`` block
    left on an exception: a Ctrl-C in task 0) while a round, a get of keys and a wait for
    the world wait: each caller is told at once that it stopped, and why. (Their calls were
    cancelled, and each looked for a coordinator until its connect_timeout, 60 s, then asked
    whether `pjrt-rendezvous serve` was running.) A call made after the stop looks for it
    for 5 s, not connect_timeout, then is told the same."""
    from test_cli import wait_until

    coordinator = Coordinator(port=0, **({"session_port": None} if how.endswith("gRPC alone") else {})).start()
    client = pair_client(coordinator.address, 1)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        binding = pool.submit(client.bind_thread, 0).result(10)
        waiting = pool.submit(client.rendezvous, binding, "r", b"x")  # task 0 never comes
        getting = pool.submit(client.get, "never set")
        world = pool.submit(client.wait_world)
        waits = coordinator._running._servicer._waiters
        wait_until(
            lambda: client.status().jobs[0].pending_rounds and ("kv", "default", "never set") in waits and ("world", "default") in waits,
            what="the three waits",
        )
        started = time.monotonic()
        if how.startswith("stop"):
            coordinator.stop(**({"grace": None} if how.startswith("stop without grace") else {}))
        else:
            with pytest.raises(KeyboardInterrupt), coordinator:
                raise KeyboardInterrupt
        with pytest.raises(pr.ParticipantFailedError) as failed:
            waiting.result(10)
        assert time.monotonic() - started < 5
        why = "Coordinator.stop() was called" if how.startswith("stop") else "left the `with Coordinator(...)` block on KeyboardInterrupt"
        assert f"rendezvous 'r' on all ordinals (round 0) fails: the coordinator embedded in process {os.getpid()}" in str(failed.value)
        assert why in str(failed.value), str(failed.value)
        for future, what in ((getting, "1 key of job 'default' ('never set')"), (world, "the world of job 'default'")):
            with pytest.raises(pr.ParticipantFailedError) as failed:
                future.result(10)
            assert f"the wait for {what} fails: the coordinator embedded in process {os.getpid()}" in str(failed.value)
            assert why in str(failed.value), str(failed.value)
        assert time.monotonic() - started < 5
        if how in ("stop", "stop without grace, gRPC alone"):  # (the session port, and gRPC)
            calls = (lambda: client.rendezvous(binding, "again", b"x"), lambda: client.get("k"), client.wait_world)
            for name, took, message in [f.result(30) for f in [pool.submit(_timed, call) for call in calls]]:
                assert name == "CoordinatorUnavailableError" and 4.5 < took < 15, (name, took, message)
                assert f"the coordinator embedded in process {os.getpid()}" in message and why in message, message
                assert "nothing was started there again (given up after " in message, message
        pool.submit(client.unbind_thread).result(10)
    client.close(leave=False)


def _timed(call) -> tuple[str, float, str]:
    """The name of the error ``call()`` raised ("answered" if none), how long it took, and
    the error's message."""
    started = time.monotonic()
    try:
        call()
    except pr.RendezvousError as exc:
        return type(exc).__name__, time.monotonic() - started, str(exc)
    return "answered", time.monotonic() - started, ""


def test_a_frozen_coordinator_fails_calls_within_their_budgets(monkeypatch):
    """``serve`` stopped for good (SIGSTOP; a frozen VM or a dropped network likewise): its
    connections stay open and nothing answers, so each session fails only once its ping goes
    unanswered. A call without a deadline gives up after connect_timeout from the first
    failure (an attempt that lasted longer than 2 s counted as one that got through, so the
    outage began again at each ping timeout, for ever), and a round with a timeout ends
    near it (its "still waiting" warning asked the coordinator's status in the waiting
    thread, through the same endless retries, long past the round's timeout)."""
    from test_cli import Serve

    from pjrt_rendezvous.client import _session

    monkeypatch.setattr(_session, "PING_EVERY", 2.0)  # (10 s and 5 s: the same, slower)
    monkeypatch.setattr(_session, "PING_TIMEOUT", 1.0)
    with Serve() as server:
        # Task 0 waits in a round that task 1 never comes to; task 1 makes a key-value call.
        clients = [
            pr.Client(
                pr.Settings(address=server.address, timeout=30, **settings),
                pr.detect_topology({"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": str(task)}, address=server.address),
            )
            for task, settings in enumerate(({"connect_timeout": 60, "progress_interval": 1}, {"connect_timeout": 3}))
        ]
        with bound(clients) as pools:
            server.proc.send_signal(signal.SIGSTOP)
            try:
                waited = pools[0].submit(_timed, lambda: clients[0].rendezvous(pr.current_binding(), "r", timeout=2))
                put = pools[1].submit(_timed, lambda: clients[1].set("k", b"v"))
                name, took, _ = put.result(timeout=90)
                assert name == "CoordinatorUnavailableError" and took < 12, (name, took)
                name, took, _ = waited.result(timeout=90)
                assert name == "CoordinatorUnavailableError" and took < 15, (name, took)
            finally:
                server.proc.send_signal(signal.SIGCONT)
        server.stop()


def test_a_frozen_coordinator_fails_rounds_through_a_host_relay_within_the_budget(monkeypatch):
    """As above, with host fan-in: the relay answers its pings itself, so a try through it
    that ended when the relay gave up on the coordinator counted as one that got through,
    and a round without a timeout waited for ever. (The relay also spent its retry budget
    twice, sending each process's call again after the combined one found the coordinator
    unreachable.)"""
    from test_cli import Serve

    from pjrt_rendezvous.client import _session

    monkeypatch.setattr(_session, "PING_EVERY", 2.0)
    monkeypatch.setattr(_session, "PING_TIMEOUT", 1.0)
    with Serve() as server:
        clients = []
        for task in range(2):  # two processes of one host: the first one's relay carries both
            env = {"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": str(task),
                   "PJRT_RENDEZVOUS_LOCAL_RANK": str(task), "PJRT_RENDEZVOUS_LOCAL_WORLD_SIZE": "2"}
            # (a budget longer than the 5 s a failed relay is avoided: it is tried again within it)
            settings = pr.Settings(address=server.address, timeout=None, connect_timeout=10, fan_in="host")
            clients.append(pr.Client(settings, pr.detect_topology(env, address=server.address)))
        with bound(clients) as pools:
            assert meet(pools, clients, "through the relay") == [[b"x", b"x"]] * 2
            assert clients[1]._relay_session is not None
            server.proc.send_signal(signal.SIGSTOP)
            try:  # (task 0 never comes to this round)
                name, took, message = pools[1].submit(_timed, lambda: clients[1].rendezvous(pr.current_binding(), "r", b"x")).result(timeout=120)
                assert name == "CoordinatorUnavailableError" and took < 75, (name, took)
                assert message.count("Is `pjrt-rendezvous serve` (or the process embedding") == 1, message  # (said once)
            finally:
                server.proc.send_signal(signal.SIGCONT)
        server.stop()


def test_the_main_threads_round_on_its_stand_in_ends_as_unavailable_with_a_frozen_coordinator(monkeypatch):
    """The main thread of a process with a bound sibling (its rounds run on the stand-in
    thread) in a round while ``serve`` is stopped for good: it gets what its sibling gets,
    the coordinator unavailable. (Its wait for the stand-in ran out just before the stand-in's
    call was cut off, and it raised a RendezvousTimeout blaming an earlier call of the main
    thread that was interrupted, when none was.)"""
    from test_cli import Serve

    from pjrt_rendezvous.client import _client

    monkeypatch.setattr(_client, "_TRANSPORT_GRACE", 3.0)  # (10 s: the same, slower)
    assert threading.current_thread() is threading.main_thread()
    with Serve() as server:
        topology = pr.detect_topology(
            {"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": "0", "PJRT_RENDEZVOUS_CORES_PER_CHIP": "2"},
            address=server.address,
        )
        client = pr.Client(pr.Settings(address=server.address, timeout=2, connect_timeout=60), topology)
        binding = client.bind_thread(0)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sibling = pool.submit(client.bind_thread, 1).result()
            server.proc.send_signal(signal.SIGSTOP)
            try:  # (task 1 never comes to this round)
                theirs = pool.submit(_timed, lambda: client.rendezvous(sibling, "r", b"1"))
                name, took, message = _timed(lambda: client.rendezvous(binding, "r", b"0"))
                assert name == "CoordinatorUnavailableError" and took < 10, (name, took, message)
                assert "no answer to Rendezvous 3 s past its deadline" in message, message
                assert re.search(r"\(the call was round 0 of all ordinals, tag 'r', sent [\d.]+ s before\)$", message), message
                assert theirs.result(timeout=30)[0] == "CoordinatorUnavailableError"
            finally:
                server.proc.send_signal(signal.SIGCONT)
            pool.submit(client.unbind_thread).result()
        client.unbind_thread()
        client.close(leave=False)
        server.stop()


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_a_round_through_a_host_relay_to_a_frozen_coordinator_ends_as_unavailable(transport):
    """A round with a timeout through the host relay while ``serve`` is stopped for good:
    unanswered 10 s past its deadline (the coordinator answers a timed-out round at the
    deadline, naming who is missing), it ends as the coordinator being unavailable. (It
    ended as a RendezvousTimeout: on gRPC 'no answer to Rendezvous within 15 s', on the
    session port 'within 0 s', from a resend made after the deadline.)"""
    from test_cli import Serve

    with Serve() as server:
        clients = []
        for task in range(2):  # two processes of one host: the first one's relay carries both
            env = {"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": str(task),
                   "PJRT_RENDEZVOUS_LOCAL_RANK": str(task), "PJRT_RENDEZVOUS_LOCAL_WORLD_SIZE": "2"}
            settings = pr.Settings(address=server.address, timeout=2, connect_timeout=10, fan_in="host", transport=transport)
            clients.append(pr.Client(settings, pr.detect_topology(env, address=server.address)))
        with bound(clients) as pools:
            assert meet(pools, clients, "through the relay") == [[b"x", b"x"]] * 2
            server.proc.send_signal(signal.SIGSTOP)
            try:  # (task 0 never comes to this round)
                name, took, message = pools[1].submit(_timed, lambda: clients[1].rendezvous(pr.current_binding(), "r", b"x")).result(timeout=120)
                assert name == "CoordinatorUnavailableError" and took < 20, (name, took, message)
                assert "Rendezvous" in message and message.count("Is `pjrt-rendezvous serve` (or the process embedding") == 1, message
            finally:
                server.proc.send_signal(signal.SIGCONT)
        server.stop()


def test_a_coordinator_restarted_with_a_shorter_heartbeat_timeout_keeps_its_processes(tmp_path):
    """Restarted from its state file with a heartbeat timeout of 2 s instead of 60: the
    restored processes, heartbeating every 5 s until an answer gives them the new timeout,
    are not declared dead for that first gap, and then heartbeat every 2/3 s. (Clients kept
    the interval of their first registration, and the restart declared everyone dead.)"""
    state = tmp_path / "state.json"
    first = Coordinator(port=0, heartbeat_timeout=60.0, state_file=state).start()
    port = first.port
    clients = [pair_client(first.address, task) for task in range(2)]
    with bound(clients):
        first.stop(grace=0)
        second = Coordinator(port=port, heartbeat_timeout=2.0, state_file=state).start()
        try:
            time.sleep(9.0)  # past the old interval, and then many of the new timeouts
            status = clients[0].status()
            assert all(p.alive for p in status.jobs[0].participants), status
            assert not clients[0].events and not clients[1].events
            # (the new timeout taken from the answers; heartbeats within a third of it)
            assert [c._heartbeat_timeout for c in clients] == [2.0, 2.0]
            assert max(p.last_seen_age for p in clients[0].status().jobs[0].participants) < 2.0, status
        finally:
            second.stop(grace=0)


def test_a_process_declared_dead_stops_heartbeating():
    """Its heartbeat held up past the timeout (a stalled host), the process is declared dead
    and its next heartbeat refused (ABORTED): nothing is left to keep alive, so its
    heartbeats end there, where they went on being refused every third of the timeout."""
    with Coordinator(port=0, heartbeat_timeout=1.0) as coordinator:
        client = pair_client(coordinator.address, 0)
        sent, refused = [], []
        call = client._call

        def counted(method, request, *args, **kwargs):
            if method != "Heartbeat":
                return call(method, request, *args, **kwargs)
            sent.append(method)
            if len(sent) == 2:
                time.sleep(2.0)  # (held up: silent past the timeout)
            try:
                return call(method, request, *args, **kwargs)
            except pr.RendezvousError as exc:
                refused.append(exc.code)
                raise

        client._call = counted
        with bound((client,)):
            process = coordinator.core.jobs["default"].processes[client.incarnation]
            deadline = time.monotonic() + 20
            while not refused:
                assert time.monotonic() < deadline, (sent, refused)
                time.sleep(0.05)
            assert not process.alive and refused == ["ABORTED"], (process, refused)
            heartbeats = len(sent)
            time.sleep(2.0)  # (six heartbeat intervals)
            assert len(sent) == heartbeats and refused == ["ABORTED"], (sent, refused)


def test_a_job_killed_while_the_coordinator_restarted_is_relaunched_afresh(tmp_path):
    """A slice's maintenance: the coordinator (with its state file) and every process of a
    formed job go down together, and the job is launched again at once. Its processes,
    restored alive but never heard from again, must not take the new ones into the old run
    (each new process took its task over in turn, a new generation each, voiding the rounds
    of those before it: the first relaunch failed until the old ones were declared dead, a
    heartbeat timeout later, 60 s here)."""
    state = tmp_path / "state.json"
    first = Coordinator(port=0, state_file=state).start()
    port = first.port
    old = [start(first.address, "hang", task, processes=2) for task in range(2)]
    watcher = observer(first.address)
    try:
        assert watcher.get("ready/0", timeout=60) == b"" and watcher.get("ready/1", timeout=60) == b""
    finally:
        watcher.close()
    first.stop(grace=0)
    for process in old:
        process.kill()
        process.wait(10)
    second = Coordinator(port=port, state_file=state).start()  # (heartbeat timeout 60 s)
    try:
        started = time.monotonic()
        new = [start(second.address, "full_and_subsets", task, processes=2) for task in range(2)]
        records = [json.loads(p.communicate(timeout=60)[0]) for p in new]
        assert time.monotonic() - started < 30
        assert [r.get("error") for r in records] == [None, None], records
        assert [r["everyone"] for r in records] == [["p0", "p1"]] * 2
        assert second.core.jobs["default"].generation == 2  # (one step: afresh; each takeover was one)
    finally:
        second.stop(grace=0)


def test_an_event_while_a_watch_stream_is_down_is_not_missed():
    """An idle process's Watch stream (gRPC, here through a proxy) is cut and cannot
    reconnect for a while; meanwhile its peer dies. The stream opened again resumes where
    the last one ended, so the death is reported, not lost (a new stream started from the
    moment of its call). Heartbeats go to the session port, past the proxy."""
    from _proxy import Proxy

    with Coordinator(port=0, heartbeat_timeout=2.0, session_port=0) as coordinator, Proxy(coordinator.address) as proxy:
        idle, peer = pair_client(proxy.address, 0), pair_client(coordinator.address, 1)
        with bound((idle, peer)):
            for client in (idle, peer):  # (the peer's too: one opening as it stops, it closes, and dies of that)
                until_watching(coordinator, client.incarnation)
            assert proxy.drop(refuse_for=5.0) > 0
            peer._stopped.set()  # no more heartbeats: declared dead within the refusal
            deadline = time.monotonic() + 20
            while not idle.events and time.monotonic() < deadline:
                time.sleep(0.1)
            assert [e.kind for e in idle.events] == [pb.WatchEvent.PROCESS_DEAD], idle.events
            # (of no heartbeat, or of its connection closed: its Watch stream, ended by an
            # event it got as it stopped, was not opened again)
            assert re.search(r"^ordinal 1 .* died: (no heartbeat|its connection closed)", idle.events[0].message), idle.events


def test_a_live_process_whose_watch_connection_breaks_for_longer_than_the_grace_is_not_declared_dead():
    """Its Watch stream's connection (gRPC, through a proxy) is cut and cannot reconnect for
    longer than DISCONNECTED_GRACE; its heartbeats (to the session port, past the proxy) say
    it lives: it is not declared dead, and once the proxy lets it, it watches again."""
    from _proxy import Proxy

    with Coordinator(port=0, heartbeat_timeout=60, session_port=0) as coordinator, Proxy(coordinator.address) as proxy:
        idle, peer = pair_client(proxy.address, 0), pair_client(coordinator.address, 1)
        with bound((idle, peer)):
            until_watching(coordinator, idle.incarnation)  # (else the cut would not cut it)
            process = coordinator.core.jobs["default"].processes[idle.incarnation]
            assert process.heartbeat_interval == idle.settings.heartbeat_interval == 5.0  # (told as it registered)
            assert proxy.drop(refuse_for=DISCONNECTED_GRACE + 3) > 0
            time.sleep(DISCONNECTED_GRACE + 2)
            assert process.alive and not peer.events, process
            deadline = time.monotonic() + 20
            while proxy.open_connections < 1:  # (its gRPC channel: the Watch stream)
                assert time.monotonic() < deadline, "the idle process did not watch again"
                time.sleep(0.1)
            assert process.alive and process.disconnected is None


def test_a_watch_stream_opened_again_resumes_after_its_last_event():
    """A process's Watch stream (through a proxy) is cut after an event came (its peer left)
    and opened again: it resumes after that event, which the process heard once."""
    from _proxy import Proxy

    with Coordinator(port=0, heartbeat_timeout=60, session_port=0) as coordinator, Proxy(coordinator.address) as proxy:
        watcher, peer = pair_client(proxy.address, 0), pair_client(coordinator.address, 1)
        with bound((watcher, peer)):
            until_watching(coordinator, watcher.incarnation)
            peer.close()
            deadline = time.monotonic() + 20
            while not watcher.events:
                assert time.monotonic() < deadline, "the watcher did not hear its peer leave"
                time.sleep(0.05)
            reopened = watch_opened(watcher)  # (set by the next stream's first message)
            assert proxy.drop() > 0
            assert reopened.wait(20), "the watcher did not watch again"
            time.sleep(0.5)  # (what the new stream sends after its marker)
            assert [e.kind for e in watcher.events] == [pb.WatchEvent.PROCESS_LEFT], watcher.events


def test_a_process_counts_as_disconnected_only_when_its_last_watch_stream_ends():
    """A Watch stream opened again may start before the broken one is seen to end: the end
    of one of two streams is no close. Closed without a Leave, the process is (alive, and
    declared dead DISCONNECTED_GRACE later unless heard from)."""
    from pjrt_rendezvous.protos.v1 import coordinator_pb2_grpc as pb_grpc

    def until(condition, what: str) -> None:
        deadline = time.monotonic() + 20
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    with Coordinator(port=0, heartbeat_timeout=60) as coordinator:
        client = pair_client(coordinator.address, 0)
        marked = watch_opened(client)  # (set when its Watch stream has brought it its marker)
        watching = coordinator._running._servicer._watching  # (job, incarnation) -> its streams open
        with bound((client,)), grpc.insecure_channel(coordinator.address) as channel:
            process = coordinator.core.jobs["default"].processes[client.incarnation]
            until(marked.is_set, "its watch stream did not open")
            # (no heartbeat clears a mark from here on; its watch, past its marker, goes on: it
            # closed its stream at the marker when it came after this)
            client._stopped.set()
            extra = pb_grpc.CoordinatorStub(channel).Watch(pb.WatchRequest(job="default", incarnation=client.incarnation))
            next(extra)  # (its marker: the stream is open)
            assert watching[("default", client.incarnation)] == 2
            extra.cancel()
            until(lambda: watching[("default", client.incarnation)] == 1, "the cancelled stream did not end")
            assert process.disconnected is None
        until(lambda: process.disconnected is not None, "the closed client's process was not marked")  # (leave=False)
        assert process.alive


def test_a_watch_stream_of_a_job_dropped_at_max_jobs_ends_at_once_saying_so():
    """A job dropped to make room (max_jobs) takes its events with it: a stream still
    watching it (its process left) ends then, NOT_FOUND naming the job, instead of waiting
    for events of a job that is gone and ending at the coordinator's stop as UNKNOWN."""
    from pjrt_rendezvous.coordinator._core import Limits
    from pjrt_rendezvous.protos.v1 import coordinator_pb2_grpc as pb_grpc

    with Coordinator(port=0, heartbeat_timeout=None, limits=Limits(max_jobs=1)) as coordinator, \
            grpc.insecure_channel(coordinator.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        incarnation = "a" * 32
        stub.Register(pb.RegisterRequest(job="A", incarnation=incarnation, host="h", pid=1, task_id=0, num_tasks=1,
                                         devices_per_task=1, threads=[pb.ThreadSpec(thread_index=0)]), timeout=10)
        stream = stub.Watch(pb.WatchRequest(job="A", incarnation=incarnation), timeout=30)
        next(stream)  # (its marker: the stream is open)
        stub.Leave(pb.LeaveRequest(job="A", incarnation=incarnation), timeout=10)
        assert next(stream).kind == pb.WatchEvent.Kind.PROCESS_LEFT
        stub.KvSet(pb.KvSetRequest(job="B", entries=[pb.KvEntry(key="k", value=b"v")]), timeout=10)  # drops A
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as ended:
            next(stream)
        assert time.monotonic() - started < 10
        assert ended.value.code() is grpc.StatusCode.NOT_FOUND and "job 'A' is not known" in ended.value.details()


def test_serve_logs_once_the_calls_of_a_dead_process_and_for_an_unknown_job(caplog):
    """Refused without a line in serve's log, a process declared dead that calls again (it was
    paused) and calls for a job a restart without state file forgot left the operator to
    guess from the clients' logs: each is logged once (the caller is told every time)."""
    from pjrt_rendezvous.protos.v1 import coordinator_pb2_grpc as pb_grpc

    caplog.set_level(logging.WARNING, logger="pjrt_rendezvous.coordinator")
    with Coordinator(port=0, heartbeat_timeout=1.0) as coordinator:
        client = pair_client(coordinator.address, 0)
        with bound((client,)) as (pool,):
            process = coordinator.core.jobs["default"].processes[client.incarnation]
            client._stopped.set()  # its heartbeats stop: declared dead
            deadline = time.monotonic() + 10
            while process.alive:
                assert time.monotonic() < deadline, "not declared dead"
                time.sleep(0.05)
            for _ in range(2):
                with pytest.raises(pr.ParticipantFailedError, match="was declared dead"):
                    pool.submit(lambda: client.rendezvous(pr.current_binding(), "t", b"")).result()
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Heartbeat(pb.HeartbeatRequest(job="forgotten", incarnation="x" * 32))
                assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError):
                stub.Status(pb.StatusRequest(job="typo"))
    warned = [(r.event, r.getMessage()) for r in caplog.records if getattr(r, "event", "") in ("dead_process_called", "unknown_job")]
    assert [event for event, _ in warned] == ["dead_process_called", "unknown_job"], warned
    assert "refused calls from" in warned[0][1] and "which was declared dead earlier (" in warned[0][1], warned
    assert warned[1][1] == (
        "refused calls from processes of job 'forgotten', which this coordinator does not know: it has no "
        "--state-file, so a restart forgot its jobs, whose processes must start again"
    ), warned
    # (an operator's status of a job it mistyped is no process's call: not logged)


def test_serve_logs_once_a_job_refused_at_max_jobs(caplog):
    """A key-value job (a torch Store's) refused at --max-jobs was told only to its client: it
    is logged once per job name; a registration refused so keeps its one line of its own."""
    from pjrt_rendezvous.coordinator import Limits
    from pjrt_rendezvous.protos.v1 import coordinator_pb2_grpc as pb_grpc

    caplog.set_level(logging.WARNING, logger="pjrt_rendezvous.coordinator")
    with Coordinator(port=0, limits=Limits(max_jobs=1)) as coordinator:
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            stub.KvSet(pb.KvSetRequest(job="first", entries=[pb.KvEntry(key="k", value=b"v")]), timeout=10)
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.KvSet(pb.KvSetRequest(job="second", entries=[pb.KvEntry(key="k", value=b"v")]), timeout=10)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        client = pair_client(coordinator.address, 0)  # (job "default": refused too)
        with pytest.raises(pr.LimitExceededError, match="max_jobs=1"):
            client.bind_thread(0)
        client.close()
    said = [(r.event, r.getMessage()) for r in caplog.records if getattr(r, "event", "") in ("job_refused", "registration_refused")]
    assert [event for event, _ in said] == ["job_refused", "registration_refused"], said
    assert said[0][1].startswith(
        "refused to create a job: this coordinator already serves 1 job, the limit (max_jobs=1), and none can make room"
    ) and "job 'second' cannot be created" in said[0][1], said


def test_a_call_that_outlives_its_coordinator_names_what_failed_first(tmp_path, monkeypatch):
    """The coordinator's disk is full: it answers UNAVAILABLE ("cannot write its state
    file"), then goes away (serve stops). The client's final error named only the last
    attempt's refused connection, and blamed the network; it names the first failure too."""
    from pjrt_rendezvous.coordinator import _state

    hit = threading.Event()

    def full(fd):
        hit.set()
        raise OSError(28, "No space left on device")

    with Coordinator(port=0, state_file=tmp_path / "state.json") as coordinator:
        topology = pr.detect_topology({}, address=coordinator.address)
        client = pr.Client(pr.Settings(address=coordinator.address, connect_timeout=3), topology)
        client.set("a", b"1")
        monkeypatch.setattr(_state.os, "fsync", full)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            failing = pool.submit(client.set, "b", b"2")
            assert hit.wait(10)
            time.sleep(0.5)  # (its refusal on the way back)
            coordinator.stop()
            with pytest.raises(pr.CoordinatorUnavailableError) as failed:
                failing.result(30)
    client.close()
    assert "(its first failed attempt: the coordinator cannot write its state file" in str(failed.value), failed.value
    assert "No space left on device" in str(failed.value)


def test_an_event_is_streamed_only_once_it_is_on_disk(tmp_path, monkeypatch):
    """With a state file, a Watch stream sends an event (here a peer leaving) only once the
    state file holds it: a crash in between cannot take back an event a process acted on,
    nor leave a resuming stream's index past the end."""
    from test_state import slow_disk

    writing, release = slow_disk(monkeypatch, "rewrite", b"PROCESS_LEFT")  # the disk is slow for this one
    with Coordinator(port=0, state_file=tmp_path / "state.json") as coordinator:
        idle, peer = pair_client(coordinator.address, 0), pair_client(coordinator.address, 1)
        with bound((idle, peer)) as pools:
            until_watching(coordinator, idle.incarnation)
            leaving = pools[1].submit(peer.close)  # (its Leave waits for the write too)
            assert writing.wait(10)
            time.sleep(1.0)
            assert not idle.events  # not before it is on disk
            release.set()
            leaving.result(timeout=20)
            deadline = time.monotonic() + 10
            while not idle.events and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [e.kind for e in idle.events] == [pb.WatchEvent.PROCESS_LEFT], idle.events


def test_a_process_that_registers_again_after_a_coordinator_restart_watches_again():
    """A coordinator restarted without a state file forgets the job: the clients' Watch
    streams are refused (NOT_FOUND) until the processes register again, as the errors tell
    them to; then an idle process hears of its peer's death again. (Its Watch thread ended
    for good at the first refusal.)"""
    first = Coordinator(port=0, heartbeat_timeout=2.0).start()
    port = first.port
    idle, peer = pair_client(first.address, 0), pair_client(first.address, 1)
    with bound((idle, peer)) as pools:
        first.stop(grace=0)
        second = Coordinator(port=port, heartbeat_timeout=2.0).start()
        try:
            time.sleep(3.0)  # the Watch streams are refused meanwhile: the job is unknown
            bind_again(pools, (idle, peer))  # the documented recovery
            peer._stopped.set()  # the peer goes silent (no more heartbeats): it dies
            deadline = time.monotonic() + 20
            while not any(e.kind == pb.WatchEvent.PROCESS_DEAD for e in idle.events) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert [e.kind for e in idle.events] == [pb.WatchEvent.PROCESS_DEAD], idle.events
        finally:
            second.stop(grace=0)


def test_processes_registering_again_with_a_coordinator_that_lost_its_state_meet_in_its_generation():
    """The job reached generation 2 (a restart), then the coordinator restarted without a
    state file: the job is new to it (generation 1). The processes register again, as they
    are told to, take its generation (each thread's first call says the job moved), and
    meet. (Their rounds named generation 2 and were refused as void for ever.)"""
    first = Coordinator(port=0).start()
    port = first.port
    crashed = pair_client(first.address, 1)
    with bound([crashed]):
        pass  # (registered; the crash leaves it registered: close(leave=False))
    clients = (pair_client(first.address, 0), pair_client(first.address, 1))
    with bound(clients) as pools:  # task 1's replacement: the job moves to generation 2
        deadline = time.monotonic() + 30
        while clients[0].generation != 2:  # (task 0 registered before it: it hears of it by its Watch)
            assert time.monotonic() < deadline, clients[0].generation
            time.sleep(0.01)
        assert clients[1].generation == 2
        first.stop(grace=0)
        second = Coordinator(port=port).start()  # without a state file: the job is forgotten
        try:
            bind_again(pools, clients)  # as the errors say to
            assert [c.generation for c in clients] == [1, 1]
            for pool, c in zip(pools, clients):  # each thread told once that the job moved
                with pytest.raises(pr.ParticipantFailedError, match="moved from generation 2 to 1"):
                    pool.submit(lambda c=c: c.rendezvous(pr.current_binding(), "again", b"x")).result(timeout=30)
            assert meet(pools, clients, "again") == [[b"x", b"x"]] * 2
        finally:
            second.stop(grace=0)


def test_a_survivor_meets_a_new_process_after_a_restart_that_lost_the_state_at_the_same_generation():
    """Generation 1 all along: the coordinator restarts without a state file (with worker 0,
    say) and the job is new to it at generation 1 again. Task 0 survives and registers again;
    task 1 is a new process. They meet (the survivor's round numbers went on from before, the
    new process's from 0: every round failed as calls waiting on each other, for good)."""
    first = Coordinator(port=0).start()
    port = first.port
    survivor = pair_client(first.address, 0)
    old = pair_client(first.address, 1)
    with bound([survivor, old]) as pools:
        assert meet(pools, [survivor, old], "before") == [[b"x", b"x"]] * 2
        assert meet(pools, [survivor, old], "before") == [[b"x", b"x"]] * 2
        first.stop(grace=0)
        second = Coordinator(port=port).start()  # without a state file: the job is forgotten
        try:
            pools[0].submit(survivor.unbind_thread).result()
            pools[0].submit(survivor.bind_thread, 0).result()  # registering again, as the errors say to
            fresh = pair_client(second.address, 1)
            with bound([fresh]) as fresh_pools:
                assert survivor.generation == fresh.generation == 1
                both = [pools[0], fresh_pools[0]]
                assert meet(both, [survivor, fresh], "after") == [[b"x", b"x"]] * 2
        finally:
            second.stop(grace=0)


def test_a_round_given_up_in_an_outage_fails_for_the_peers_that_waited_it_out(tmp_path):
    """The coordinator is down while both processes call round 0. Task 1 gives up after its
    connect_timeout (2 s) and goes on to round 1; task 0, with a longer budget, resends
    round 0 to the coordinator once it is back. Told of the give-up before task 1's next
    round, the coordinator fails round 0 for task 0, saying who gave up and why, and both
    meet in round 1. (Task 0 waited in round 0 for task 1, which waited in round 1 for task
    0: both failed as calls waiting on each other, an error that blames the order of the
    program's calls, and task 1 failed twice.)"""
    state = tmp_path / "state.json"
    first = Coordinator(port=0, state_file=state).start()
    port = first.port
    topologies = [
        pr.detect_topology({"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": str(task)}, address=first.address)
        for task in range(2)
    ]
    clients = [
        pr.Client(pr.Settings(address=first.address, timeout=30, connect_timeout=budget), topology)
        for budget, topology in zip((60, 2), topologies)
    ]
    with bound(clients) as pools:
        assert meet(pools, clients, "before") == [[b"x", b"x"]] * 2
        first.stop(grace=0)
        waiting = pools[0].submit(_timed, lambda: clients[0].rendezvous(pr.current_binding(), "r", b"x"))
        name, _, message = pools[1].submit(_timed, lambda: clients[1].rendezvous(pr.current_binding(), "r", b"x")).result(timeout=60)
        assert name == "CoordinatorUnavailableError", message
        second = Coordinator(port=port, state_file=state).start()
        try:
            nxt = pools[1].submit(lambda: clients[1].rendezvous(pr.current_binding(), "next", b"y"))
            name, _, message = waiting.result(timeout=60)
            assert name == "ParticipantFailedError", message
            assert "rendezvous 'r' on all ordinals (round 1) cannot complete: ordinal 1 on" in message, message
            assert "gave up on it and went on to its next round: no answer within connect_timeout (2 s) or its timeout" in message
            mine = pools[0].submit(lambda: clients[0].rendezvous(pr.current_binding(), "next", b"x")).result(timeout=30)
            assert mine == nxt.result(timeout=30) == [b"x", b"y"]
        finally:
            second.stop(grace=0)


def test_a_siblings_round_waits_while_its_process_tells_of_a_given_up_round(tmp_path, monkeypatch):
    """As above with two threads a process: task 1's thread 0 makes a call of another group
    first, which tells the coordinator of the given-up round (slowly here), and its thread 1
    meanwhile calls the next round of all ordinals. That round waits for the telling (it
    reached the coordinator first, and the given-up round and it failed as waiting on each
    other); so every thread meets in it."""
    from pjrt_rendezvous.client import _client

    state = tmp_path / "state.json"
    first = Coordinator(port=0, state_file=state).start()
    port = first.port
    clients = [
        pr.Client(
            pr.Settings(address=first.address, timeout=30, connect_timeout=budget),
            pr.detect_topology(simulated_env(address=first.address, accelerator="v3-8", task=task, processes=2, hosts=2, threads=2)),
        )
        for task, budget in ((0, 60), (1, 2))
    ]
    pools = {(c, i): concurrent.futures.ThreadPoolExecutor(1) for c in range(2) for i in range(2)}

    def call(c: int, i: int, tag: str, **kwargs):
        return pools[c, i].submit(_timed, lambda: clients[c].rendezvous(pr.current_binding(), tag, tag.encode(), **kwargs))

    try:
        for (c, i), pool in pools.items():
            pool.submit(clients[c].bind_thread, i).result()
        assert {f.result(timeout=30)[0] for f in [call(c, i, "warm") for c, i in pools]} == {"answered"}
        first.stop(grace=0)
        waiting = [call(0, i, "r") for i in range(2)]
        assert [f.result(timeout=60)[0] for f in [call(1, i, "r") for i in range(2)]] == ["CoordinatorUnavailableError"] * 2
        second = Coordinator(port=port, state_file=state).start()
        try:
            real = _client.Client._call

            def slowly(self, method, *args, **kwargs):  # (a coordinator busy as it comes back)
                if method == "GiveUpRound":
                    time.sleep(1.0)
                return real(self, method, *args, **kwargs)

            monkeypatch.setattr(_client.Client, "_call", slowly)
            solo = call(1, 0, "solo", replicas=[2])
            time.sleep(0.3)
            nxt = [call(1, 1, "next")]
            for name, _, message in (w.result(timeout=60) for w in waiting):
                assert name == "ParticipantFailedError" and "ordinals 2-3 on" in message and "gave up on it" in message, message
            assert solo.result(timeout=30)[0] == "answered"
            nxt += [call(c, i, "next") for c, i in ((0, 0), (0, 1), (1, 0))]
            assert [n.result(timeout=30)[0] for n in nxt] == ["answered"] * 4
        finally:
            second.stop(grace=0)
    finally:
        for (c, i), pool in pools.items():
            pool.submit(clients[c].unbind_thread).result()
            pool.shutdown()
        for client in clients:
            client.close(leave=False)


def test_a_round_given_up_before_a_restart_that_lost_the_state_spoils_no_round_of_the_new_job():
    """Task 1 gave up round 1 in the outage; the coordinator came back without its state, so
    the job is new to it, at generation 1 again, and the processes' round numbers restart.
    The given-up round is of the old job: told, it failed the new job's round 1."""
    first = Coordinator(port=0).start()
    port = first.port
    clients = [
        pr.Client(
            pr.Settings(address=first.address, timeout=30, connect_timeout=2),
            pr.detect_topology({"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": str(task)}, address=first.address),
        )
        for task in range(2)
    ]
    with bound(clients) as pools:
        assert meet(pools, clients, "before") == [[b"x", b"x"]] * 2
        first.stop(grace=0)
        name, _, _ = pools[1].submit(_timed, lambda: clients[1].rendezvous(pr.current_binding(), "r", b"x")).result(timeout=60)
        assert name == "CoordinatorUnavailableError"
        second = Coordinator(port=port).start()  # without a state file: the job is forgotten
        try:
            bind_again(pools, clients)  # as the errors say to
            assert [c.generation for c in clients] == [1, 1]
            for number in range(3):
                assert meet(pools, clients, f"after {number}") == [[b"x", b"x"]] * 2, number
        finally:
            second.stop(grace=0)


def test_a_get_waiting_through_a_restart_that_lost_the_keys_is_refused_at_once():
    """Restarted without its state file, the coordinator has none of the keys a waiting get
    was waiting beside: its resend is refused at once, naming why (it waited out its
    timeout, then said only that the key was still not set, as if nothing had happened),
    also when it is its client's first call (a rank's first blocking get under torch); the
    client's next calls use the new, empty store. (`serve` killed and started again: an
    embedded coordinator's stop fails the wait instead, see above.)"""
    from test_cli import Serve

    first = Serve("--session-port", "0")
    port = first.port
    writer, client = observer(first.address), observer(first.address)
    writer.set("before", b"1")
    waiting = concurrent.futures.ThreadPoolExecutor(1)
    try:
        got = waiting.submit(client.get, "never", timeout=60)  # (its first call)
        deadline = time.monotonic() + 30
        while client not in _store_ids:  # its first call learnt the store: the wait names it, sent before or after the restart
            assert time.monotonic() < deadline and not got.done()
            time.sleep(0.01)
        first.proc.kill()
        first.proc.wait(10)
        with Serve("--port", str(port), "--session-port", "0", port_flag=False):
            started = time.monotonic()
            with pytest.raises(pr.MismatchError, match="the keys of job 'default' are not the ones this client saw: the coordinator restarted without its state file"):
                got.result(timeout=30)
            assert time.monotonic() - started < 20
            assert client.get("before", wait=False) is None  # the new store, at the next call
            client.set("after", b"2")
            assert client.get("after") == b"2"
    finally:
        waiting.shutdown()
        writer.close()
        client.close()


def test_a_get_that_times_out_after_a_resend_says_how_long_the_call_waited(tmp_path):
    """A waiting get resent after a coordinator restart (with its state file) times out on the
    new coordinator, which counts only its own wait: the error adds the call's whole wait (it
    said "still not set after 2.1 s" for a get of 5 s)."""
    state = str(tmp_path / "state")
    first = Coordinator(port=0, state_file=state).start()
    port = first.address.rsplit(":", 1)[1]
    client = observer(first.address)
    client.set("other", b"1")  # (the store is known: the resend is not refused as a new store)
    waiting = concurrent.futures.ThreadPoolExecutor(1)
    try:
        started = time.monotonic()
        got = waiting.submit(client.get, "never", timeout=5)
        time.sleep(1.5)
        first.stop(grace=0)
        time.sleep(0.5)
        second = Coordinator(port=int(port), state_file=state).start()
        try:
            with pytest.raises(pr.RendezvousTimeout) as raised:
                got.result(timeout=30)
            waited = time.monotonic() - started
            said = float(re.search(r"still not set after ([0-9.]+) s", str(raised.value))[1])
            total = float(re.search(r"the call waited ([0-9.]+) s in all: it was sent again", str(raised.value))[1])
            assert said < 4 and 4.5 <= total <= waited + 0.1, str(raised.value)
        finally:
            second.stop(grace=0)
    finally:
        waiting.shutdown()
        client.close()


def test_an_embedded_coordinator_watches_liveness_as_serve_does():
    """The embedded form declares silent processes dead after serve's default 60 s too;
    heartbeat_timeout=None turns the watch off."""
    with Coordinator(port=0) as coordinator:
        assert coordinator.core.heartbeat_timeout == 60.0
    with Coordinator(port=0, heartbeat_timeout=None) as coordinator:
        assert coordinator.core.heartbeat_timeout is None


def test_only_a_coordinator_of_this_process_stopped_for_good_is_given_up_on_at_once(tmp_path):
    """A client gives up soon on the address of a coordinator embedded in this process
    and stopped without a state file, and on no other: not on another port or host, nor
    once a coordinator is started on that port again, nor on one with a state file (a
    restart resumes it); nor does a client made after the stop (a server that took the port
    again is another coordinator)."""
    from pjrt_rendezvous.client._client import _stopped_here
    from pjrt_rendezvous.client._errors import STOPPED_HERE

    for host, dialled in (("0.0.0.0", "127.0.0.1"), ("0.0.0.0", "localhost"), ("127.0.0.1", "localhost")):
        made = time.monotonic()
        coordinator = Coordinator(host=host, port=0).start()
        port = coordinator.port
        assert _stopped_here(f"{dialled}:{port}", made) is None
        coordinator.stop()
        assert "Coordinator.stop() was called" in _stopped_here(f"{dialled}:{port}", made)
        assert _stopped_here(f"{dialled}:{port}", time.monotonic()) is None
        assert _stopped_here(f"192.0.2.1:{port}", made) is None  # (TEST-NET-1: not this host)
        assert _stopped_here(f"{dialled}:{port % 65535 + 1}", made) is None
        coordinator = Coordinator(host=host, port=port).start()
        assert _stopped_here(f"{dialled}:{port}", made) is None
        coordinator.stop(None)
        assert port in STOPPED_HERE
    made = time.monotonic()
    coordinator = Coordinator(port=0, state_file=tmp_path / "state").start()
    port = coordinator.port
    coordinator.stop()
    assert _stopped_here(f"127.0.0.1:{port}", made) is None


_PAUSED_CHILD = """
import sys, threading, time
import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client import _client
_client._TRANSPORT_GRACE = 1.0  # (the cut-off: 1 s past the round's deadline, not 10)
address = sys.argv[1]
client = pr.Client(pr.Settings(address=address, timeout=30), pr.detect_topology(
    {"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": "1"}, address=address))
binding = client.bind_thread(0)
threading.Thread(target=lambda: client.get("never set", timeout=60), daemon=True).start()  # reads the session first
time.sleep(0.5)
print("calling", flush=True)
try:
    print("answered", client.rendezvous(binding, "r", b"1", timeout=5), flush=True)
except pr.RendezvousError as exc:
    print(type(exc).__name__, exc, flush=True)
"""


def test_a_process_stopped_while_its_answer_came_takes_it_when_it_runs_again():
    """A process stopped (SIGSTOP) while its round completed, continued past the call's
    cut-off, takes the answer that came meanwhile (it was told that the coordinator was
    frozen: a caller parked behind another's read gave up before the reader ran again)."""
    with Coordinator(port=0) as coordinator:
        child = subprocess.Popen([sys.executable, "-c", _PAUSED_CHILD, coordinator.address], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "calling"
            cut_off = time.monotonic() + 5 + 1  # (the child's: its timeout, then the transport's grace)
            client = pair_client(coordinator.address, 0)
            with bound([client]) as pools:
                from test_cli import wait_until

                wait_until(lambda: client.status().jobs[0].pending_rounds, what="the child's round")
                child.send_signal(signal.SIGSTOP)
                try:
                    assert pools[0].submit(lambda: client.rendezvous(pr.current_binding(), "r", b"0", timeout=10)).result(15) == [b"0", b"1"]
                    time.sleep(max(0.0, cut_off + 3 - time.monotonic()))  # well past the child's cut-off
                finally:
                    child.send_signal(signal.SIGCONT)
                out, _ = child.communicate(timeout=60)
        finally:
            child.kill()
            child.wait()
    assert out.strip() == "answered [b'0', b'1']", out


def test_a_client_closed_with_a_reason_tells_its_own_calls_and_its_peers():
    """close(why=) (xla.spawn's child stopped by SIGTERM says why) ends the calls its
    threads make with that reason, not "call init() again", and its Leave carries it to the
    peers' failed rounds and the coordinator's log (they said "its client closed", blaming a
    healthy process that spawn stopped)."""
    from test_cli import wait_until

    with Coordinator(port=0) as coordinator:
        clients = [pair_client(coordinator.address, task) for task in range(2)]
        with bound(clients) as pools:
            waiting = pools[0].submit(lambda: clients[0].rendezvous(pr.current_binding(), "r", timeout=30))
            getter = concurrent.futures.ThreadPoolExecutor(1)
            getting = getter.submit(clients[1].get, "never set", timeout=30)
            wait_until(lambda: clients[0].status().jobs[0].pending_rounds, what="the round")
            time.sleep(0.3)  # (the get waits too)
            clients[1].close(why="stopped by its test")
            with pytest.raises(pr.UsageError, match=r"^this client was closed: stopped by its test$"):
                getting.result(10)
            getter.shutdown()
            # A later call of a thread it bound is told the same, not to bind again.
            with pytest.raises(pr.UsageError, match=r"through a client that was closed: stopped by its test$"):
                pools[1].submit(lambda: pr.rendezvous("next")).result(10)
            with pytest.raises(pr.ParticipantFailedError, match=r"a member left \(ordinal 1 on \S+ pid \d+: stopped by its test\)"):
                waiting.result(10)
