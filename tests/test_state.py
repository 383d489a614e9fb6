"""The state file: round trips, corruption detection, and a coordinator killed mid-job."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import logging
import os
import pathlib
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client._demo import simulated_env
from pjrt_rendezvous.coordinator import Core, StateFileError
from pjrt_rendezvous.coordinator import _state
from pjrt_rendezvous.coordinator._core import Code, Contribution, CoreError, Registration, ThreadRequest
from pjrt_rendezvous.coordinator._server import ServerOptions, start_server

WORKER = pathlib.Path(__file__).with_name("pod_worker.py")


def populated_core() -> Core:
    core = Core()
    for task in range(2):
        core.register(
            0.0,
            Registration(
                job="j", incarnation=f"inc{task}", host=f"h{task}", pid=100 + task, task_id=task,
                num_tasks=2, devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),),
                client_version=f"0.{task}.0",
            ),
        )
    for task in range(2):
        key = core.arrive(
            1.0, job="j", incarnation=f"inc{task}", replicas=[], round_number=0,
            contributions=[Contribution(ordinal=task, tag="t", payload=bytes([task, 255]))], deadline=None,
        ).key
    core.kv_set("j", [("k", b"\x00\x01")])
    core.kv_add("j", "n", 3, request_id="r1")
    return core, key


def test_snapshot_round_trip_keeps_ranks_rounds_and_keys():
    """A restored core has the same rank table (with each process's client version), finished
    rounds, keys and applied request ids."""
    core, key = populated_core()
    restored = _state.restore(_state.decode(_state.encode(_state.snapshot(core))), now=50.0)
    assert restored.world("j") == core.world("j")
    (view,) = restored.status(50.0, "j")
    assert [p.client_version for p in view.participants] == ["0.0.0", "0.1.0"]
    assert restored.outcome("j", key).result == [b"\x00\xff", b"\x01\xff"]
    assert restored.kv_get("j", ["k", "n"]) == [b"\x00\x01", b"3"]
    assert restored.kv_add("j", "n", 3, request_id="r1") == 3  # a retried add is not applied twice
    # A resend of the finished round gets its result; the next round starts at number 1.
    again = restored.arrive(
        51.0, job="j", incarnation="inc0", replicas=[], round_number=0,
        contributions=[Contribution(ordinal=0, tag="t", payload=b"\x00\xff")], deadline=None,
    ).key
    assert restored.outcome("j", again).result == [b"\x00\xff", b"\x01\xff"]


def test_a_dead_process_keeps_how_long_ago_it_was_seen_across_a_restore():
    """A process dead for an hour was shown as seen at the restore ("last seen 2.0 s ago");
    it keeps its age (at least: the coordinator's own downtime is not known). Live ones
    count as seen at the restore, which is their grace."""
    core, _ = populated_core()  # (both last seen at 1.0)
    core.declare_dead("j", "inc1", "silent")
    restored = _state.restore(_state.decode(_state.encode(_state.snapshot(core, 3601.0))), now=50.0)
    # (a live one not heard from since was "last seen 2.0 s ago", as if it had called since)
    assert restored.describe_missing(restored.jobs["j"], [0, 1], 52.0) == (
        "0 on h0 (pid 100, not heard from since the coordinator restarted 2.0 s ago); "
        "1 on h1 (dead) (pid 101, last seen 3602.0 s ago)"
    )
    assert [p.unheard_since_restart for p in restored.status(52.0, "j")[0].participants] == [True, False]  # (status says it too)
    restored.touch("j", "inc0", 53.0)  # (a heartbeat)
    assert restored.describe_missing(restored.jobs["j"], [0], 54.0) == "0 on h0 (pid 100, last seen 1.0 s ago)"
    assert not restored.status(54.0, "j")[0].participants[0].unheard_since_restart


def test_a_host_s_restored_processes_heard_and_unheard_since_are_told_apart():
    """Two live processes of one host restored, one heard from since: "not heard from since
    the coordinator restarted" was said of both (one group per host)."""
    core = Core()
    for task in range(2):
        core.register(0.0, Registration(job="j", incarnation=f"i{task}", host="h", pid=100 + task, task_id=task, num_tasks=2,
                                        devices_per_task=1, local_rank=task, threads=(ThreadRequest(thread_index=0),)))
    restored = _state.restore(_state.snapshot(core), now=100.0)
    restored.touch("j", "i0", 101.0)
    assert restored.describe_missing(restored.jobs["j"], [0, 1], 103.0) == (
        "0 on h (pid 100, last seen 2.0 s ago); 1 on h (pid 101, not heard from since the coordinator restarted 3.0 s ago)"
    )


def _relaunched(restored: Core, task: int, now: float):
    return restored.register(now, Registration(
        job="j", incarnation=f"new{task}", host=f"h{task}", pid=200 + task, task_id=task, num_tasks=2,
        devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),),
    ))


def test_a_job_relaunched_after_a_restore_that_heard_none_of_it_starts_afresh():
    """Restored alive, never heard from again (killed as the coordinator restarted): the
    relaunch's first process starts the job afresh, saying what became of the last run (it
    took its task over, a new generation, and so did each next one, voiding what the ones
    before it had started)."""
    core, _ = populated_core()
    restored = _state.restore(_state.snapshot(core), now=100.0)
    generation = restored.jobs["j"].generation
    _relaunched(restored, 0, 102.0)
    job = restored.jobs["j"]
    assert job.generation == generation + 1 and set(job.processes) == {"new0"}
    assert job.last_run == {1: "h1 pid 101, which was not heard from since the coordinator restarted"}  # (not yet relaunched)
    # (Not declared dead, as processes whose connections closed are: not heard from since a
    # restart, one may live on, its call slower to come than the relaunched task's.)
    assert not [e for e in job.events if e.kind == "PROCESS_DEAD" and e.generation == generation]
    _relaunched(restored, 1, 102.5)  # joins the new run
    assert job.generation == generation + 1 and set(job.processes) == {"new0", "new1"} and job.formed
    # Were one of the old ones alive after all, its calls are told why they are refused.
    with pytest.raises(CoreError, match=re.escape(
        "process incarnation 'inc1' of job 'j' was dropped: job 'j' started afresh (every process of the last run is "
        "gone) as this process (h1 pid 101) was not heard from since the coordinator restarted; it takes no part any more"
    ) + "$"):
        restored.touch("j", "inc1", 103.0)


def test_the_launch_a_process_said_is_kept_in_the_state_file():
    """(A restart must not make a slower process of a launch start the job afresh.)"""
    core = Core()
    core.register(0.0, Registration(job="j", incarnation="a", host="h", pid=1, task_id=0, num_tasks=2, devices_per_task=1,
                                    local_rank=0, threads=(ThreadRequest(thread_index=0),), launch="spawn-1"))
    restored = _state.restore(_state.decode(_state.encode(_state.snapshot(core))), now=100.0)
    assert restored.jobs["j"].processes["a"].launch == "spawn-1"


def test_a_new_task_of_an_unformed_run_joins_it_after_a_restore_that_heard_none_of_it():
    """An unformed run restored with one live task not heard from yet (it is heard from again within
    seconds): a task registering for the first time joins that run (it dropped the live
    task, and the run then waited for its ordinals until its timeout)."""
    core = Core()
    core.register(0.0, Registration(job="j", incarnation="live0", host="h0", pid=1, task_id=0, num_tasks=3,
                                    devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),)))
    restored = _state.restore(_state.snapshot(core), now=100.0)
    restored.register(101.0, Registration(job="j", incarnation="new1", host="h1", pid=2, task_id=1, num_tasks=3,
                                          devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),),
                                          process_age=0.5))  # (started after the restart)
    assert set(restored.jobs["j"].processes) == {"live0", "new1"}
    restored.touch("j", "live0", 102.0)


def test_a_task_restarted_after_a_restore_that_heard_its_peers_takes_its_task_over():
    """One process heard from since the restore: the run lives, and a new process of the
    other task takes that task over, saying its old one was not heard from since the
    restart (it said "last heard from 0.0 s before", counted from the restore)."""
    core, _ = populated_core()
    restored = _state.restore(_state.snapshot(core), now=100.0)
    generation = restored.jobs["j"].generation
    restored.touch("j", "inc1", 101.0)
    _relaunched(restored, 0, 103.0)
    job = restored.jobs["j"]
    assert job.generation == generation + 1 and set(job.processes) == {"inc1", "new0"}
    assert job.replaced["inc0"] == (
        "task 0 (ordinal 0) restarted: h0 pid 200 replaces h0 pid 100, which was not heard from since the "
        "coordinator restarted from its state file 3.0 s before"
    )


def test_a_lifted_world_size_holds_for_the_run_under_way_only():
    """A job declared by --world-size, restored without it: a process of its live run that
    declares another size is refused, naming where the size came from; once that run is gone,
    a new one may have another size; a declared job that never ran is free at once."""
    core = Core()
    core.declare_job("j", 2)
    core.declare_job("idle", 8)
    core.register(0.0, Registration(job="j", incarnation="i0", host="h0", pid=1, task_id=0, num_tasks=2,
                                    devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),)))
    restored = _state.restore(_state.snapshot(core), now=10.0)
    assert sorted(restored.undeclare_jobs(None)) == ["idle", "j"]
    assert restored.jobs["idle"].world_size is None
    restored.touch("j", "i0", 11.0)  # (its run lives)
    with pytest.raises(CoreError, match=r"has world size 2 \(fixed by the coordinator's --world-size before the coordinator restarted\)"):
        restored.register(12.0, Registration(job="j", incarnation="i1", host="h1", pid=2, task_id=1, num_tasks=3,
                                             devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),)))
    restored.leave("j", "i0")
    restored.register(14.0, Registration(job="j", incarnation="i2", host="h1", pid=3, task_id=0, num_tasks=3,
                                         devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),)))
    assert restored.jobs["j"].world_size == 3
    assert restored.undeclare_jobs(None) == []


def test_an_ended_replica_stays_ended_across_a_restart():
    core = Core()
    for task in range(2):
        core.register(0.0, Registration(
            job="j", incarnation=f"inc-{task}", host="h", pid=task, task_id=task, num_tasks=2,
            devices_per_task=2, local_rank=task, threads=(ThreadRequest(thread_index=0), ThreadRequest(thread_index=1)),
        ))
    core.end_replicas("j", "inc-0", [1], "returned", now=1.0)
    restored = _state.restore(json.loads(json.dumps(_state.snapshot(core))), now=2.0)
    rnd = restored.arrive(3.0, job="j", incarnation="inc-1", replicas=[1, 2], round_number=0,
                          contributions=[Contribution(ordinal=2, tag="t", payload=b"")], deadline=None)
    assert "a member ended (ordinal 1 on h pid 0: its replica returned)" in rnd.error.message


def test_a_call_that_comes_to_a_failed_round_after_a_restart_is_told_it_came_late():
    """A failed round keeps who had called (not what they sent): after a restore, a member
    that comes late is told so, as before it, and one resending gets the round's error."""
    core = Core()
    for task in range(2):
        core.register(0.0, Registration(
            job="j", incarnation=f"inc-{task}", host="h", pid=task, task_id=task, num_tasks=2,
            devices_per_task=1, local_rank=task, threads=(ThreadRequest(thread_index=0),),
        ))
    core.arrive(1.0, job="j", incarnation="inc-0", replicas=[], round_number=0,
                contributions=[Contribution(ordinal=0, tag="t", payload=b"x")], deadline=2.0)
    core.expire(3.0)
    restored = _state.restore(json.loads(json.dumps(_state.snapshot(core))), now=4.0)

    def arrive(ordinal: int):
        return restored.arrive(5.0, job="j", incarnation=f"inc-{ordinal}", replicas=[], round_number=0,
                               contributions=[Contribution(ordinal=ordinal, tag="late", payload=b"")], deadline=None)

    assert "timed out" in arrive(0).error.message  # (a resend)
    with pytest.raises(CoreError, match=r"^ordinal 1 called rendezvous\('late'\) as round 0 of all ordinals, which had failed before it came \(its peers called rendezvous\('t'\)"):
        arrive(1)


def test_a_replaced_incarnation_stays_refused_after_a_restart():
    """The incarnation a restart replaced is kept: after the coordinator restarts from its
    state, it still cannot register again and take the task back."""
    core, _ = populated_core()
    again = Registration(
        job="j", incarnation="inc1-again", host="h1", pid=999, task_id=1,
        num_tasks=2, devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),),
    )
    core.register(2.0, again)
    restored = _state.restore(_state.decode(_state.encode(_state.snapshot(core))), now=50.0)
    with pytest.raises(CoreError, match="'inc1' of job 'j' was replaced: task 1 .* restarted: h1 pid 999"):
        restored.register(51.0, dataclasses.replace(again, incarnation="inc1", pid=101))
    assert restored.jobs["j"].members[1].incarnation == "inc1-again"


def test_a_state_file_keeps_a_job_s_latest_request_ids():
    """The core keeps 100,000 request ids a job for retried key-value changes; the state file
    keeps the latest REQUESTS_SAVED (all of them made every rewrite slow). A resend of a recent
    change across the restart is answered, not applied again."""
    core = Core()
    for n in range(_state.REQUESTS_SAVED + 500):
        core.kv_add("j", "n", 1, request_id=f"r{n}")
    restored = _state.restore(_state.decode(_state.encode(_state.snapshot(core))), now=1.0)
    kept = restored.jobs["j"].request_results
    assert len(kept) == _state.REQUESTS_SAVED and next(iter(kept)).endswith("\0r500")
    last = _state.REQUESTS_SAVED + 499
    assert restored.kv_add("j", "n", 1, request_id=f"r{last}") == last + 1  # its first answer
    assert restored.kv_get("j", ["n"]) == [str(last + 1).encode()]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d[: len(d) // 2], "corrupt or truncated"),
        (lambda d: d.replace(b'\\"n\\"', b'\\"m\\"', 1), "checksum does not match"),
        (lambda d: b'{"hello": 1}', "not a pjrt-rendezvous state file"),
        (lambda d: b"", "is empty, not written by a coordinator"),
        (lambda d: d.replace(b'"version": 2', b'"version": 3', 1), "has state format version 3, this coordinator reads 1 and 2"),
    ],
)
def test_damaged_state_is_detected_never_half_loaded(damage, message):
    """Torn, edited, empty or foreign files raise StateFileError saying what is wrong and what to do."""
    core, _ = populated_core()
    data = damage(_state.encode(_state.snapshot(core)))
    with pytest.raises(StateFileError, match=message) as info:
        _state.decode(data, path="/var/lib/x/state.json")
    assert "move /var/lib/x/state.json away" in str(info.value)


def test_a_version_1_file_is_read_and_its_jobs_get_store_ids():
    """Files from before key-value store ids (version 1, without them) still load; version 2
    files (which a version 1 coordinator refuses by their version, not on a journal line it
    cannot read) keep the ids."""
    core, _ = populated_core()
    body = _state.snapshot(core)
    assert _state.restore(_state.decode(_state.encode(body)), now=0.0).store_id("j") == core.store_id("j")
    old = {**body, "jobs": [{k: v for k, v in job.items() if k != "store_id"} for job in body["jobs"]]}
    del old["state_id"]
    data = _state.encode(old).replace(b'"version": 2', b'"version": 1', 1)
    restored = _state.restore(_state.decode(data), now=0.0)
    assert restored.jobs["j"].kv == core.jobs["j"].kv and restored.store_id("j") not in ("", core.store_id("j"))


def test_a_well_formed_file_with_a_wrong_shape_is_refused_as_invalid(tmp_path):
    """A hand-edited file whose checksum was fixed up, with a list where a mapping belongs."""
    core, _ = populated_core()
    body = _state.snapshot(core)
    body["jobs"][0]["tasks"] = []
    path = tmp_path / "state.json"
    path.write_bytes(_state.encode(body))
    with pytest.raises(StateFileError, match="does not hold a valid coordinator state"):
        _state.load(path, now=0.0, limits=None, heartbeat_timeout=None)


def test_serve_refuses_a_corrupt_state_file(tmp_path):
    """`serve --state-file` with a corrupt file exits 1 with the reason instead of starting empty."""
    path = tmp_path / "state.json"
    path.write_text('{"format": "pjrt-rendezvous-state", "version": 1, "sha256": "0", "body": "{}"}')
    out = subprocess.run(
        [sys.executable, "-m", "pjrt_rendezvous.coordinator", "serve", "--port", "0", "--state-file", str(path)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1
    assert "checksum does not match" in out.stderr


def start_coordinator(port, state_file):
    server = subprocess.Popen(
        [sys.executable, "-m", "pjrt_rendezvous.coordinator", "serve", "--port", str(port),
         "--session-port", "0", "--state-file", str(state_file), "--heartbeat-timeout", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = server.stdout.readline()
    match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
    assert match, (line, server.stderr.read() if server.poll() is not None else "")
    return server, int(match.group(1))


# -- one coordinator per state file; a link followed; errors naming --state-file ---------------


def serve_once(state_file, *prefix: str) -> subprocess.CompletedProcess:
    """``serve --state-file state_file``, expected to refuse to start: its output once it exits
    (TimeoutExpired if it serves instead)."""
    return subprocess.run(
        [*prefix, sys.executable, "-m", "pjrt_rendezvous.coordinator", "serve", "--port", "0",
         "--session-port", "off", "--state-file", str(state_file)],
        capture_output=True, text=True, timeout=20, check=False,
    )


def test_a_second_coordinator_on_a_state_file_in_use_refuses_to_start(tmp_path):
    """A second `serve` on the state file of a running one exits 1 naming the file and the
    pid holding it (both started, and the keys one acknowledged were lost to the other's
    rewrite); so does taking its files in this process. Once the first is killed, its lock
    is gone with it: a new coordinator starts and finds the first one's key."""
    state_file = tmp_path / "state.json"
    server, port = start_coordinator(0, state_file)
    address = f"127.0.0.1:{port}"
    client = pr.Client(pr.Settings(address=address, connect_timeout=30), pr.detect_topology({}, address=address))
    try:
        client.set("first", b"1")
        second = serve_once(state_file)
        assert second.returncode == 1, second
        assert f"the state file {state_file} (--state-file) is in use by another coordinator (pid {server.pid} on" in second.stderr
        assert "listening" not in second.stdout
        with pytest.raises(StateFileError, match=f"in use by another coordinator \\(pid {server.pid} on"):
            _state.Files(state_file)
        client.close()
        server.send_signal(signal.SIGKILL)  # no stop, no unlock: the kernel lets go
        server.wait(10)
        server, port = start_coordinator(0, state_file)
        address = f"127.0.0.1:{port}"
        client = pr.Client(pr.Settings(address=address, connect_timeout=30), pr.detect_topology({}, address=address))
        assert client.get("first", wait=False) == b"1"
    finally:
        client.close()
        server.terminate()
        server.wait(10)


def test_an_embedded_coordinator_gets_the_same_lock(tmp_path, monkeypatch):
    """Coordinator(state_file=) refuses a state file a `serve` holds, and one another
    Coordinator of this process holds; a stop lets go of it before it returns (its writer's
    thread, slow here, is waited for), so a restart at once is not refused; nor is a start
    again after one that failed (its port taken)."""
    from pjrt_rendezvous.coordinator import Coordinator

    state_file = tmp_path / "state.json"
    server, _ = start_coordinator(0, state_file)
    try:
        with pytest.raises(StateFileError, match=f"in use by another coordinator \\(pid {server.pid} on"):
            Coordinator(port=0, state_file=state_file).start()
    finally:
        server.terminate()
        server.wait(10)
    with Coordinator(port=0, state_file=state_file) as first:
        with pytest.raises(StateFileError, match=f"in use by another coordinator \\(pid {os.getpid()} on .*: this process, another"):
            Coordinator(port=0, state_file=state_file).start()
        with pytest.raises(OSError, match="cannot listen"):
            Coordinator(port=first.port, state_file=tmp_path / "other.json").start()
    with Coordinator(port=0, state_file=tmp_path / "other.json"):  # its lock went with the failed start
        pass
    real_close = _state.Files.close
    monkeypatch.setattr(_state.Files, "close", lambda files: (time.sleep(0.3), real_close(files)))  # a slow writer thread
    for _ in range(2):
        with Coordinator(port=0, state_file=state_file) as coordinator:
            assert coordinator.core is not None


_FORK_SCENARIO = """
import multiprocessing, sys, time
from pjrt_rendezvous.coordinator import Coordinator

with Coordinator(port=0, state_file=sys.argv[1]):
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    child.start()
try:
    with Coordinator(port=0, state_file=sys.argv[1]) as again:
        assert again.core is not None
    print("ok")
finally:
    child.kill()
    child.join(10)
"""


def test_a_lock_a_child_forked_just_before_still_holds_is_waited_for(tmp_path, monkeypatch):
    """A child forked while a coordinator ran holds a copy of its lock until its at-fork
    handler closes it, on a loaded machine some time after the fork: a coordinator started
    again in the parent meanwhile was refused as "in use by ... this process, another
    Coordinator in it" (once in CI). It waits for the copy to go, up to _CHILD_LETS_GO; past
    that it names the fork. (The copy: a duplicate of the lock's descriptor, as fork makes.)"""
    from pjrt_rendezvous.coordinator import Coordinator

    state_file = tmp_path / "state.json"

    def stopped_with_a_copy_held() -> int:
        with Coordinator(port=0, state_file=state_file):
            lock = os.stat(_state.lock_path(state_file.resolve()))
            (fd,) = [fd for fd, held in _state._held.items() if held == (lock.st_dev, lock.st_ino)]
            return os.dup(fd)

    copy = stopped_with_a_copy_held()
    threading.Timer(0.5, os.close, (copy,)).start()  # (the child's handler, late)
    started = time.monotonic()
    with Coordinator(port=0, state_file=state_file) as again:
        assert again.core is not None and time.monotonic() - started >= 0.4
    # A lock known by its file, not its path: one reached by another path (a bind mount;
    # here a hard link) and held here is another Coordinator's, refused at once.
    other = tmp_path / "other"
    other.mkdir()
    with Coordinator(port=0, state_file=state_file):
        os.link(_state.lock_path(state_file), other / "state.json.lock")
        started = time.monotonic()
        with pytest.raises(StateFileError, match=r": this process, another Coordinator in it\)"):
            Coordinator(port=0, state_file=other / "state.json").start()
        assert time.monotonic() - started < 1
    monkeypatch.setattr(_state, "_CHILD_LETS_GO", 0.3)
    copy = stopped_with_a_copy_held()
    try:
        with pytest.raises(StateFileError, match=r": this process, whose lock a process forked from it still held after 0.3 s\)"):
            Coordinator(port=0, state_file=state_file).start()
    finally:
        os.close(copy)


def test_a_forked_child_does_not_keep_the_state_file_locked(tmp_path):
    """An flock belongs to the open file, which a forked child shares: a child outliving its
    parent's coordinator kept its state file locked (a restart was refused as "in use").
    The child closes its copy at the fork. (Forked from a fresh interpreter: once, after the
    rest of the suite in one process, the lock was still held, with gRPC saying "other threads
    are currently calling into gRPC, skipping fork() handlers"; not reproduced since.)"""
    run = subprocess.run(
        [sys.executable, "-c", _FORK_SCENARIO, str(tmp_path / "state.json")], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_a_state_file_given_as_a_link_is_written_through_to_its_target(tmp_path):
    """A --state-file that is a link to a volume's file stays a link: the rewrites replace
    the file it points at (they replaced the link by a regular file, and the volume kept
    the old state); journal and lock are beside the target."""
    from pjrt_rendezvous.coordinator import Coordinator

    volume, folder = tmp_path / "volume", tmp_path / "etc"
    volume.mkdir()
    folder.mkdir()
    target, link = volume / "state.json", folder / "state.json"
    link.symlink_to(target)
    for value in (b"1", b"2"):  # each start rewrites the state file; the first creates the target
        with Coordinator(port=0, state_file=link) as coordinator:
            client = pr.Client(pr.Settings(address=coordinator.address), pr.detect_topology({}, address=coordinator.address))
            client.set("k", value)
            client.close()
        assert link.is_symlink() and os.readlink(link) == str(target)
        loaded = _state.load(target, now=0.0, limits=None, heartbeat_timeout=None)
        assert loaded.jobs["default"].kv["k"] == value
    assert sorted(p.name for p in folder.iterdir()) == ["state.json"]
    assert sorted(p.name for p in volume.iterdir()) == ["state.json", "state.json.journal", "state.json.lock"]


def unprivileged() -> tuple[str, ...]:
    """A command prefix under which permissions apply (root's bypass them)."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: file permissions cannot be tested")
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--")


def test_state_file_errors_name_the_option_the_path_and_what_to_do(tmp_path):
    """An unreadable state file or journal, and a folder the coordinator cannot write in
    (with or without a lock file in it already): serve exits 1 with a message naming
    --state-file and the state file, and what to do (they said "[Errno 21] Is a directory:
    'x'", or named the temporary file of a rewrite), a lock file of another user (said to
    be the folder's fault), a link to a damaged file (named by its target, without the link).
    A folder given as the state file is a setting refused: exit 2 (the unit does not restart
    on it)."""
    (tmp_path / "folder").mkdir()
    out = serve_once(tmp_path / "folder")
    assert out.returncode == 2 and "(--state-file) is a folder; give the path of a file, such as" in out.stderr, out.stderr
    cases = []
    path = tmp_path / "unreadable" / "state.json"
    path.parent.mkdir()
    path.write_bytes(_state.encode(_state.snapshot(populated_core()[0])))
    path.chmod(0o200)
    cases.append((path, f"cannot read the state file {path} (--state-file): Permission denied; make it readable"))
    other = tmp_path / "journal" / "state.json"
    other.parent.mkdir()
    shutil.copyfile(path, other)
    journal = _state.journal_path(other)
    journal.write_bytes(b"")
    journal.chmod(0o200)
    cases.append((other, f"cannot read {journal}, the journal of the state file {other} (--state-file): Permission denied"))
    for name, lock in (("read-only", False), ("read-only-but-the-lock", True)):
        folder = tmp_path / name
        folder.mkdir()
        if lock:  # the lock file is there already: the first write fails, on the temporary file
            (folder / "state.json.lock").write_bytes(b"")
        folder.chmod(0o555)
        message = f"state file {folder / 'state.json'} (--state-file): Permission denied; the coordinator's user must"
        cases.append((folder / "state.json", f"{message} be able to create and replace files in {folder}"))
    theirs = tmp_path / "theirs" / "state.json"  # a lock file made by a `sudo serve` before
    theirs.parent.mkdir()
    _state.lock_path(theirs).write_bytes(b"")
    _state.lock_path(theirs).chmod(0o600)
    os.chown(_state.lock_path(theirs), 12345, 12345) if os.geteuid() == 0 else None
    cases.append((theirs, f"cannot open {_state.lock_path(theirs)}, the lock of the state file {theirs} (--state-file): "
                          "Permission denied; it belongs to uid "))
    volume = tmp_path / "volume"  # a link to a damaged file: named as given
    volume.mkdir()
    (volume / "state.json").write_bytes(b'{"format": "pjrt-rendez')
    (tmp_path / "link.json").symlink_to(volume / "state.json")
    cases.append((tmp_path / "link.json", f"{tmp_path / 'link.json'} is corrupt or truncated"))
    try:
        for state_file, message in cases:
            out = serve_once(state_file, *unprivileged())
            assert out.returncode == 1 and message in out.stderr, (state_file, out.stderr)
            assert ".state.json." not in out.stderr and "Traceback" not in out.stderr
    finally:
        for name in ("read-only", "read-only-but-the-lock"):
            (tmp_path / name).chmod(0o755)


def test_coordinator_killed_mid_job_restarts_from_its_state_file(tmp_path):
    """SIGKILL the coordinator mid-job, restart it on the same port from its state file: the job
    finishes with the same ordinals, every round right, none lost or doubled, every add counted once."""
    state_file = tmp_path / "state.json"
    server, port = start_coordinator(0, state_file)
    address = f"127.0.0.1:{port}"
    watcher = pr.Client(pr.Settings(address=address, connect_timeout=60), pr.detect_topology({}, address=address))
    children = []
    try:
        for task in range(2):
            env = simulated_env(address=address, accelerator="v3-8", task=task, processes=2, hosts=2, threads=None)
            env.update(STEADY_ROUNDS="40", PJRT_RENDEZVOUS_CONNECT_TIMEOUT="60")
            children.append(
                subprocess.Popen([sys.executable, str(WORKER), "steady"], env=env, stdout=subprocess.PIPE, text=True)
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            jobs = watcher.status("").jobs
            if jobs and jobs[0].rounds_completed >= 10:
                break
            time.sleep(0.05)
        before = {p.ordinal: (p.host, p.pid) for p in watcher.status().jobs[0].participants}
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        time.sleep(0.5)  # clients now retry against a dead port
        server, _ = start_coordinator(port, state_file)
        records = []
        for child in children:
            out, _ = child.communicate(timeout=120)
            records += [json.loads(line) for line in out.splitlines()]
        (job,) = watcher.status().jobs
        after = {p.ordinal: (p.host, p.pid) for p in job.participants}
        adds = watcher.get("adds", wait=False)
    finally:
        for child in children:
            child.kill()
        server.terminate()
        server.wait(10)
        watcher.close()
    assert [r.get("error") for r in records] == [None] * 4, records
    assert all(r["wrong"] == [] and r["rounds"] == 40 for r in records)
    assert sorted(r["ordinal"] for r in records) == [0, 1, 2, 3]
    assert all(r["ordinal_after"] == r["ordinal"] for r in records)
    assert after == before
    assert job.rounds_completed == 40
    assert adds == b"160"


def test_a_job_name_reused_run_after_run_keeps_a_state_file_of_one_runs_size(monkeypatch):
    """Old generations' rounds and all but the latest events are forgotten: the state file of
    a job run 40 times is no bigger than after 4 runs, and loads back with the same events
    (counted from the first) and rounds; an older file holding every generation loads without
    the forgotten ones."""
    from pjrt_rendezvous.coordinator import _core

    monkeypatch.setattr(_core, "_EVENTS_KEPT", 5)
    core = Core(heartbeat_timeout=60)
    sizes = {}
    for run in range(1, 41):
        core.register(0.0, Registration(job="j", incarnation=f"run-{run}", host="h", pid=run, task_id=0, num_tasks=1,
                                        devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),)))
        for number in range(2):
            core.arrive(1.0, job="j", incarnation=f"run-{run}", replicas=[], round_number=number,
                        contributions=[Contribution(0, "t", b"x" * 10_000)], deadline=None, generation=run)
        core.leave("j", f"run-{run}")
        sizes[run] = len(_state.encode(_state.snapshot(core)))
    assert sizes[40] < sizes[4] + 400  # (longer numbers in it), not 10 times
    assert sizes[4] < 10_000  # (the finished runs' payloads are gone: Core._drop_payloads)
    body = _state.snapshot(core)
    restored = _state.restore(_state.decode(_state.encode(body)), now=5.0, heartbeat_timeout=60)
    assert _state.snapshot(restored) == body
    log = restored.jobs["j"].events
    assert (len(log), log.dropped) == (40, 35)
    assert [e.message for e in restored.events("j", 38)[1]] == [e.message for e in core.events("j", 38)[1]]

    older = json.loads(json.dumps(body))  # as written before: every generation, no count of dropped events
    older["jobs"][0]["groups"] += [dict(g, generation=1) for g in older["jobs"][0]["groups"]]
    del older["jobs"][0]["events_dropped"]
    restored = _state.restore(older, now=5.0)
    assert {key[0] for key in restored.jobs["j"].groups} == {39, 40}
    assert len(restored.jobs["j"].events) == 5


# -- the journal: finished rounds and key-value changes appended, not the whole state rewritten ---


def slow_disk(monkeypatch, write: str, marker: bytes):
    """Makes the state file's ``write`` ("append" or "rewrite") of data holding ``marker``
    wait until released; returns (set once such a write began, the release)."""
    writing, release = threading.Event(), threading.Event()
    real = getattr(_state.Files, write)

    def slow(files, data: bytes) -> None:
        if marker in data:
            writing.set()
            release.wait(20)
        real(files, data)

    monkeypatch.setattr(_state.Files, write, slow)
    return writing, release


def journaled_core(path: pathlib.Path):
    """A core of two processes with a state writer on ``path`` (nothing written yet)."""
    from pjrt_rendezvous.coordinator._server import _StateWriter

    core, _ = populated_core()
    writer = _StateWriter(core, _state.Files(path))
    return core, writer


def play(core: Core, first: int, last: int) -> None:
    """Rounds ``first``..``last`` of both processes (payload: the round number and ordinal)."""
    for number in range(first, last + 1):
        for task in range(2):
            core.arrive(
                2.0, job="j", incarnation=f"inc{task}", replicas=[], round_number=number,
                contributions=[Contribution(ordinal=task, tag="t", payload=b"%d/%d" % (number, task))], deadline=None,
            )


def test_the_world_is_told_only_once_its_last_registration_is_on_disk(tmp_path, monkeypatch):
    """WaitWorld, woken by the Register that completes the world, answers only once that
    registration is written (it answered before: killed just then, the coordinator came
    back without the process its peers were told of, and the process's relaunch joined the
    same generation unnoticed)."""
    import concurrent.futures

    from pjrt_rendezvous.coordinator import Coordinator

    gate = threading.Event()
    gate.set()
    rewrite = _state.Files.rewrite
    monkeypatch.setattr(_state.Files, "rewrite", lambda files, data: (gate.wait(30), rewrite(files, data)))
    with Coordinator(port=0, state_file=tmp_path / "state") as coordinator:
        clients = [
            pr.Client(
                pr.Settings(address=coordinator.address, timeout=30),
                pr.detect_topology({"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": str(task)}, address=coordinator.address),
            )
            for task in range(2)
        ]
        pools = [concurrent.futures.ThreadPoolExecutor(1) for _ in clients]  # a thread per process
        pools[0].submit(clients[0].bind_thread, 0).result()
        gate.clear()  # the disk stalls
        world = pools[0].submit(clients[0].wait_world)
        registered = pools[1].submit(clients[1].bind_thread, 0)
        deadline = time.monotonic() + 30
        while len(coordinator.core.jobs["default"].members) < 2:  # the world is complete in memory
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(concurrent.futures.TimeoutError):
            world.result(timeout=1.0)
        assert not registered.done()
        gate.set()
        assert len(world.result(timeout=30)) == 2 and registered.result(timeout=30).ordinal == 1
        for pool, c in zip(pools, clients):
            pool.submit(c.unbind_thread).result()
            pool.shutdown()
            c.close()


def test_the_world_told_is_the_one_complete_before_the_wait_for_the_disk():
    """A process restarted in place (its first thread bound, the world incomplete again)
    while WaitWorld waits for the disk: it answers the table it built, complete (it built
    it after the wait, and failed with TypeError on an incomplete world)."""
    from pjrt_rendezvous.coordinator._servicer import Servicer, _process_id
    from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

    def registration(task: int, incarnation: str, thread: int) -> Registration:
        return Registration(job="j", incarnation=incarnation, host=f"h{task}", pid=1, task_id=task, num_tasks=2,
                            devices_per_task=2, local_rank=task, threads=(ThreadRequest(thread_index=thread),))

    async def main():
        core = Core(heartbeat_timeout=60)
        servicer = Servicer(core, persist=lambda: asyncio.sleep(0.05))  # a slow disk
        for task, thread in ((0, 0), (0, 1), (1, 0)):
            core.register(0.0, registration(task, f"inc{task}", thread))
        world = asyncio.ensure_future(servicer.WaitWorld(pb.WaitWorldRequest(job="j"), None))
        await asyncio.sleep(0.01)
        core.register(0.0, registration(1, "inc1", 1))  # complete
        servicer._wake()
        await asyncio.sleep(0.01)  # WaitWorld waits for the disk
        core.register(1.0, registration(0, "again0", 0))  # task 0 restarted in place
        servicer._wake()
        assert not core.world_complete("j")
        told = pb.WaitWorldResponse.FromString(await world)
        assert told.world_size == 4 and [p.incarnation for p in told.processes] == [_process_id("inc0"), _process_id("inc1")]

    asyncio.run(main())


def test_finished_rounds_go_to_the_journal_and_come_back_after_a_crash(tmp_path):
    """After the first write, a round only appends a line to the journal (the state file is
    not rewritten); loading replays the lines: the same rounds, counters and next round."""
    path = tmp_path / "state.json"
    core, writer = journaled_core(path)

    async def main():
        await writer.flush()
        state = path.read_bytes()
        for number in range(1, 31):
            play(core, number, number)
            await writer.flush()
        assert path.read_bytes() == state
        writer.close()

    asyncio.run(main())
    assert len(_state.journal_path(path).read_bytes().splitlines()) == 30
    restored = _state.load(path, now=60.0, limits=None, heartbeat_timeout=None)
    assert _state.snapshot(restored) == _state.snapshot(core)
    assert restored.jobs["j"].rounds_completed == 31
    key = restored.arrive(
        61.0, job="j", incarnation="inc0", replicas=[], round_number=30,
        contributions=[Contribution(ordinal=0, tag="t", payload=b"30/0")], deadline=None,
    ).key
    assert restored.outcome("j", key).result == [b"30/0", b"30/1"]  # a resend gets the stored result


def test_key_value_changes_go_to_the_journal_in_order_and_come_back(tmp_path):
    """Sets, deletes, request-id changes and a job created by a key-value call are appended
    to the journal, not rewritten into the state file; replayed in order they give the same
    keys, and a retried request gets its first result."""
    path = tmp_path / "state.json"
    core, writer = journaled_core(path)

    async def main():
        await writer.flush()
        state = path.read_bytes()
        core.kv_set("j", [("a", b"1"), ("b", b"")])
        await writer.flush()
        assert core.kv_delete("j", "a") and not core.kv_delete("j", "missing")
        core.kv_set("j", [("a", b"again")])  # set, deleted and set again: set
        assert core.kv_delete("j", "b")
        assert core.kv_add("j", "n", 5, request_id="add") == 8
        await writer.flush()
        core.kv_append("j", "log", b"x", request_id="append")
        assert core.kv_compare_set("j", "cas", b"", b"v", request_id="cas") == b"v"
        core.kv_set("created-by-a-set", [("k", b"\x00\xff")])
        play(core, 1, 1)
        await writer.flush()
        assert path.read_bytes() == state
        writer.close()

    asyncio.run(main())
    assert len(_state.journal_path(path).read_bytes().splitlines()) == 3
    restored = _state.load(path, now=0.0, limits=None, heartbeat_timeout=None)
    assert _state.snapshot(restored) == _state.snapshot(core)
    assert restored.jobs["j"].kv == {"k": b"\x00\x01", "n": b"8", "a": b"again", "log": b"x", "cas": b"v"}
    assert restored.jobs["created-by-a-set"].kv == {"k": b"\x00\xff"}
    for name in ("j", "created-by-a-set"):  # the same stores: their clients are not refused
        assert restored.store_id(name) == core.store_id(name) != ""
    assert restored.kv_add("j", "n", 5, request_id="add") == 8  # the retry is not applied again
    assert restored.kv_compare_set("j", "cas", b"", b"w", request_id="cas") == b"v"


def test_a_restore_with_a_shorter_heartbeat_timeout_judges_nobody_until_the_old_one_could_pass():
    """Restored with a heartbeat timeout of 3 s from a file of a 60 s coordinator (whose
    clients heartbeat every 5 s until told otherwise), and restored again 2 s later from the
    file the first restore wrote: nobody is declared dead within min(60 s, 15 s) of either
    restore, and after it the 3 s timeout applies. (The second restore read 3 s as the old
    timeout and declared everyone dead at 3 s.)"""
    core = Core(heartbeat_timeout=60.0)
    for task in range(2):
        core.register(0.0, Registration(job="j", incarnation=f"i{task}", host="h", pid=task, task_id=task, num_tasks=2,
                                        devices_per_task=1, local_rank=task, threads=(ThreadRequest(thread_index=0),)))
    first = _state.restore(_state.snapshot(core), now=100.0, heartbeat_timeout=3.0)
    second = _state.restore(_state.decode(_state.encode(_state.snapshot(first))), now=102.0, heartbeat_timeout=3.0)
    for restored, within in ((first, 114.0), (second, 116.0)):
        restored.check_liveness(within)
        assert all(p.alive for p in restored.jobs["j"].processes.values())
        restored.touch("j", "i0", within)  # i0 heartbeats; i1 stays silent
        restored.check_liveness(within + 2.0)  # past the window; i0 heard 2 s ago
        assert [p.alive for p in restored.jobs["j"].processes.values()] == [True, False]
    assert _state.snapshot(second)["heartbeat_timeout"] == 3.0  # all told by now


def test_a_process_not_heard_from_since_a_restore_is_given_the_heartbeat_timeout():
    """The restart closed every connection, but that says nothing of a process: one stalled
    across it (stopped, or a call holding the GIL for 25 s) cannot call again until it
    resumes, and was declared dead 15 s after the restart when judged as a process whose own
    connection closed (a trial's false death). It is given the heartbeat timeout from the
    restart, as a process silent with its connection open is."""
    core = Core(heartbeat_timeout=60.0)
    for task in range(3):
        core.register(0.0, Registration(job="j", incarnation=f"i{task}", host="h", pid=task, task_id=task, num_tasks=3,
                                        devices_per_task=1, local_rank=task, threads=(ThreadRequest(thread_index=0),),
                                        heartbeat_interval=5.0))
    restored = _state.restore(_state.decode(_state.encode(_state.snapshot(core))), now=100.0, heartbeat_timeout=60.0)
    restored.serving_from(101.0)
    for incarnation, when in (("i0", 102.0), ("i2", 103.0)):  # the others are back at once
        restored.touch("j", incarnation, when)
    for now in (120.0, 140.0, 160.0):  # (heartbeats of the others every 5 s, as a client sends them)
        for incarnation in ("i0", "i2"):
            restored.touch("j", incarnation, now)
        restored.check_liveness(now + 0.5)
        assert all(p.alive for p in restored.jobs["j"].processes.values()), now
    restored.check_liveness(161.5)
    assert [p.alive for p in restored.jobs["j"].processes.values()] == [True, False, True]
    assert restored.jobs["j"].processes["i1"].death == (
        "not heard from since the coordinator restarted from its state file 60.5 s ago (heartbeat timeout 60 s)"
    )


def test_a_restore_judges_nobody_until_its_longest_registered_heartbeat_interval_could_pass():
    """A process registered with heartbeat_interval=20 under a 60 s timeout heartbeats every
    20 s until an answer tells it a shorter timeout: restored with 10 s, it is not declared
    dead 15 s after the restore (three default intervals, as the window was) but only once
    three of its intervals (capped at the old timeout) have passed."""
    core = Core(heartbeat_timeout=60.0)
    for task, interval in ((0, 20.0), (1, 0.0)):  # (0.0: a file from before the interval was kept)
        core.register(0.0, Registration(job="j", incarnation=f"i{task}", host="h", pid=task, task_id=task, num_tasks=2,
                                        devices_per_task=1, local_rank=task, threads=(ThreadRequest(thread_index=0),),
                                        heartbeat_interval=interval))
    restored = _state.restore(_state.decode(_state.encode(_state.snapshot(core))), now=100.0, heartbeat_timeout=10.0)
    restored.touch("j", "i0", 101.0)  # its watch stream reconnected; its next heartbeat is due by 120
    restored.check_liveness(159.0)
    assert all(p.alive for p in restored.jobs["j"].processes.values())
    restored.touch("j", "i0", 159.0)
    restored.check_liveness(161.0)
    assert [p.alive for p in restored.jobs["j"].processes.values()] == [True, False]


def test_heartbeat_clocks_of_a_restore_start_when_serving_does(tmp_path, monkeypatch):
    """A restore that takes longer than the heartbeat timeout (a large state file read,
    replayed and written again before serving) declared every process dead as serving
    began ("no heartbeat for 12.7 s" of an 8 s timeout). The restore's window and the
    processes' silence now count from the start of serving."""
    core = Core(heartbeat_timeout=1.0)
    for task in range(2):
        core.register(0.0, Registration(job="j", incarnation=f"i{task}", host="h", pid=task, task_id=task, num_tasks=2,
                                        devices_per_task=1, local_rank=task, threads=(ThreadRequest(thread_index=0),)))
    restored = _state.restore(_state.snapshot(core), now=100.0, heartbeat_timeout=1.0)
    restored.touch("j", "i0", 100.5)  # heard during the start: its clock is its own
    restored.serving_from(130.0)
    restored.check_liveness(130.9)
    assert all(p.alive for p in restored.jobs["j"].processes.values())
    restored.check_liveness(131.5)  # past the window (min(the file's timeout, 15 s): 1 s from 130)
    assert [p.alive for p in restored.jobs["j"].processes.values()] == [False, False]
    # i1, silent since the restore, may have died while the coordinator was down: its
    # silence counts from the restart, and says so ("no heartbeat for 1.5 s" did not).
    assert restored.jobs["j"].processes["i1"].death == (
        "not heard from since the coordinator restarted from its state file 1.5 s ago (heartbeat timeout 1 s)"
    )
    assert restored.jobs["j"].processes["i0"].death.startswith("no heartbeat for 31.0 s")  # (heard during the start)

    # serve does it: a load as slow as 1.5 s of a 1 s timeout declares nobody dead at once.
    path = tmp_path / "state.json"
    _state.write_atomic(path, _state.encode(_state.snapshot(core)))
    real_load = _state.load

    def slow_load(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        time.sleep(1.5)
        return loaded

    monkeypatch.setattr(_state, "load", slow_load)

    async def main():
        server = await start_server(ServerOptions(port=0, state_file=path, heartbeat_timeout=1.0, session_port=None))
        try:
            await asyncio.sleep(0.3)  # a liveness pass or more
            return [p.alive for p in server.core.jobs["j"].processes.values()]
        finally:
            await server.stop(None)

    assert asyncio.run(main()) == [True, True]


def test_a_max_jobs_lowered_at_a_restart_is_warned_of_and_each_new_job_drops_the_finished_down_to_it(tmp_path, caplog):
    """Restarted with --max-jobs 2 over a state file of 5 jobs (an operator saving memory):
    the restore said nothing, and each new job dropped one finished job, so the limit never
    held again. The restore warns, and a new job drops every finished one down to it (a job
    with a live process stays)."""
    from pjrt_rendezvous.coordinator import Limits

    core = Core(Limits(max_jobs=6))
    for n in range(5):
        core.register(0.0, Registration(job=f"run-{n}", incarnation=f"i{n}", host="h", pid=n, task_id=0, num_tasks=1,
                                        devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),)))
        if n != 2:  # (run-2 lives on)
            core.leave(f"run-{n}", f"i{n}")
    path = tmp_path / "state.json"
    _state.write_atomic(path, _state.encode(_state.snapshot(core)))

    async def main():
        server = await start_server(ServerOptions(port=0, state_file=path, limits=Limits(max_jobs=2), session_port=None))
        try:
            server.core.register(1.0, Registration(job="new", incarnation="n", host="h", pid=9, task_id=0, num_tasks=1,
                                                   devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),)))
            return sorted(server.core.jobs)
        finally:
            await server.stop(None)

    with caplog.at_level(logging.WARNING, logger="pjrt_rendezvous.coordinator"):
        assert asyncio.run(main()) == ["new", "run-2"]
    (warned,) = [r.getMessage() for r in caplog.records if getattr(r, "event", "") == "over_max_jobs"]
    assert warned == (
        "restored 5 jobs, more than --max-jobs 2: each new job drops the finished ones down to it (a job is "
        "finished once every process of it is gone)"
    )


def test_a_write_out_of_open_files_is_tried_again_before_it_stops_serve(tmp_path, monkeypatch, caplog):
    """Out of open files (a peer opening connections and sending nothing can cause it), a
    rewrite's temporary file could not be made, and the write failed as a broken disk
    would: serve stopped. It is tried again for up to OUT_OF_FILES_WAIT, then fails."""
    import errno

    path = tmp_path / "state.json"
    real_mkstemp = _state.tempfile.mkstemp
    refusals = [2]  # the next mkstemps refused

    def mkstemp(**kwargs):
        if refusals[0]:
            refusals[0] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return real_mkstemp(**kwargs)

    monkeypatch.setattr(_state.tempfile, "mkstemp", mkstemp)
    files = _state.Files(path)
    snapshot = _state.encode(_state.snapshot(Core()))
    files.rewrite(snapshot)
    assert refusals == [0] and path.exists()
    assert "out of open files to write the state file" in caplog.text
    monkeypatch.setattr(_state, "OUT_OF_FILES_WAIT", 0.3)
    refusals[0] = 10**6
    with pytest.raises(OSError, match="Too many open files"):
        files.rewrite(snapshot)
    files.close()


def _stalling(path: pathlib.Path, monkeypatch, write: str):
    """A core with two registered processes of job "j", a servicer and a state writer at
    ``path``, and a gate: cleared, the writer's ``write`` (``append`` or ``rewrite``) waits
    for it (a slow disk)."""
    from pjrt_rendezvous.coordinator._server import _StateWriter
    from pjrt_rendezvous.coordinator._servicer import Servicer

    core = Core()
    for task in range(2):
        core.register(0.0, Registration(job="j", incarnation=f"i{task}", host="h", pid=task, task_id=task, num_tasks=2,
                                        devices_per_task=1, local_rank=task, threads=(ThreadRequest(thread_index=0),)))
    gate = threading.Event()
    gate.set()
    real = getattr(_state.Files, write)
    monkeypatch.setattr(_state.Files, write, lambda files, data: (gate.wait(30), real(files, data))[1])
    writer = _StateWriter(core, _state.Files(path))
    return core, writer, Servicer(core, clock=time.monotonic, persist=writer.flush), gate


def test_a_refusal_resting_on_another_call_s_change_waits_for_the_disk(tmp_path, monkeypatch):
    """Round 0 times out in memory while its journal line waits on a slow disk; a member
    calling late is refused as late. It was told at once, from what a crash would take back
    (restarted, the round was not finished, and its peers resent it); the refusal now waits
    for the write, on a session as over gRPC."""
    import grpc

    from pjrt_rendezvous.client._session import decode_answers, encode_answers
    from pjrt_rendezvous.client._wire import encode_rendezvous

    path = tmp_path / "state.json"
    core, writer, servicer, gate = _stalling(path, monkeypatch, "append")

    def call(call_id: int, ordinal: int, timeout: float):
        body = encode_rendezvous("j", f"i{ordinal}", [], 0, timeout, core.jobs["j"].generation, [(ordinal, "save", b"", "")])
        return asyncio.ensure_future(servicer._session_call((call_id, "Rendezvous", body, False)))

    async def main():
        await writer.flush()
        gate.clear()  # the disk stalls from here on
        first = call(1, 0, 0.2)
        await asyncio.sleep(0.5)  # round 0 timed out in memory; its line waits for the disk
        late = call(2, 1, 5.0)
        await asyncio.sleep(0.3)
        assert not late.done(), "the late member was told before the round's end was on disk"
        gate.set()
        answers = [decode_answers(encode_answers([await task], False)) for task in (first, late)]
        writer.close()
        return answers

    (first,), (late,) = asyncio.run(main())
    assert first[1] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], first
    assert late[1] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and "had failed before it came" in late[2], late
    restored = _state.load(path, now=0.0, limits=None, heartbeat_timeout=None)
    assert restored.jobs["j"].rounds_completed == core.jobs["j"].rounds_completed


def test_a_watch_s_first_message_waits_for_the_events_it_counts_to_be_on_disk(tmp_path, monkeypatch):
    """A Watch's first message names the index of the next event: it counted a death still
    being written, which a crash would take back (the client's next Watch then skipped the
    next new event, or got them all again). It now waits for the write."""
    from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

    path = tmp_path / "state.json"
    core, writer, servicer, gate = _stalling(path, monkeypatch, "rewrite")

    async def main():
        await writer.flush()
        gate.clear()  # the disk stalls from here on
        core.declare_dead("j", "i1", "killed")  # an event, not on disk yet
        stream = servicer.Watch(pb.WatchRequest(job="j", incarnation="i0"), None)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.3)
        assert not first.done(), "the Watch counted an event that was not on disk"
        gate.set()
        marker = await first
        await stream.aclose()
        writer.close()
        return marker.index

    assert asyncio.run(main()) == len(core.events("j", 0)[1])
    restored = _state.load(path, now=0.0, limits=None, heartbeat_timeout=None)
    assert restored.events("j", 0) == core.events("j", 0)


def test_a_give_up_answered_not_failed_waits_for_the_round_s_end_on_disk(tmp_path, monkeypatch):
    """A process that gave up on round 0 tells the coordinator, which answers failed=False
    when the round finished meanwhile, and the process forgets the round. It answered at
    once, from a finish still being written: killed then, the coordinator came back with
    round 0 pending, its peers resent it and waited there for ordinals that had gone on to
    round 1, which the give-up exists to prevent. The answer now waits for the write."""
    from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

    path = tmp_path / "state.json"
    core, writer, servicer, gate = _stalling(path, monkeypatch, "append")

    async def main():
        await writer.flush()
        gate.clear()  # the disk stalls from here on
        for task in range(2):  # round 0 finishes in memory; its journal line waits for the disk
            core.arrive(1.0, job="j", incarnation=f"i{task}", replicas=[], round_number=0,
                        contributions=[Contribution(ordinal=task, tag="t", payload=b"")], deadline=None)
        request = pb.GiveUpRoundRequest(job="j", incarnation="i0", generation=core.jobs["j"].generation,
                                        round=0, ordinals=[0], tag="t", reason="out of reach")
        told = asyncio.ensure_future(servicer.GiveUpRound(request, None))
        await asyncio.sleep(0.3)
        early = told.done()
        on_disk = _state.load(path, now=0.0, limits=None, heartbeat_timeout=None).jobs["j"].rounds_completed
        gate.set()
        answer = await told
        writer.close()
        return early, on_disk, answer.failed

    early, on_disk, failed = asyncio.run(main())
    assert not early, f"told failed=False while the round's end was not on disk (rounds on disk: {on_disk})"
    assert failed is False
    restored = _state.load(path, now=0.0, limits=None, heartbeat_timeout=None)
    assert restored.jobs["j"].rounds_completed == core.jobs["j"].rounds_completed == 1


def test_a_watch_refused_for_a_death_waits_for_the_death_to_be_on_disk(tmp_path, monkeypatch):
    """A Watch of a process declared dead is refused (ABORTED), and its client stops watching
    for good. It was refused at once, from a death still being written: killed then, the
    coordinator came back with the process alive, which no longer heard of any event. The
    refusal now waits for the write, as every other call's does."""
    from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

    class Aborted(Exception):
        pass

    class Context:
        async def abort(self, code, message):
            raise Aborted(code, message)

    path = tmp_path / "state.json"
    core, writer, servicer, gate = _stalling(path, monkeypatch, "rewrite")

    async def main():
        await writer.flush()
        gate.clear()  # the disk stalls from here on
        core.declare_dead("j", "i1", "silent")  # not on disk yet
        stream = servicer.Watch(pb.WatchRequest(job="j", incarnation="i1"), Context())
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.3)
        early = first.done()
        alive_on_disk = _state.load(path, now=0.0, limits=None, heartbeat_timeout=None).jobs["j"].processes["i1"].alive
        gate.set()
        with pytest.raises(Aborted) as refused:
            await first
        writer.close()
        return early, alive_on_disk, refused.value.args

    early, alive_on_disk, (code, message) = asyncio.run(main())
    assert not early, f"the Watch was refused for a death not on disk (alive on disk: {alive_on_disk})"
    assert code.name == "ABORTED" and "declared dead" in message, (code, message)


def test_temporary_files_a_crash_left_are_removed_at_the_next_start(tmp_path, monkeypatch):
    """A rewrite killed before its rename (kill -9, out of memory) leaves a temporary file as
    large as the state; they piled up until no rewrite fitted on the volume. The next start
    removes them, and nothing else."""
    path = tmp_path / "state.json"
    made = []  # the names write_atomic gives its temporary files
    real_mkstemp = _state.tempfile.mkstemp

    def mkstemp(**kwargs):
        fd, name = real_mkstemp(**kwargs)
        made.append(pathlib.Path(name).name)
        return fd, name

    monkeypatch.setattr(_state.tempfile, "mkstemp", mkstemp)
    files = _state.Files(path)
    files.rewrite(_state.encode(_state.snapshot(Core())))
    files.close()
    assert [m[: m.index("-") + 1] for m in made] == [".state.json.tmp-", ".state.json.journal.tmp-"], made
    left = [tmp_path / ".state.json.tmp-k1ll3d", tmp_path / ".state.json.journal.tmp-0oMkill"]
    kept = [tmp_path / ".state.json.other", tmp_path / "state.json.tmp-x", tmp_path / ".other.json.tmp-y"]
    for leftover in left + kept:
        leftover.write_bytes(b"{")
    _state.Files(path).close()
    assert [p.exists() for p in left + kept] == [False, False, True, True, True]


def test_a_journal_left_without_its_state_file_is_not_replayed_onto_a_new_one(tmp_path, monkeypatch, caplog):
    """A state file moved away (as its error says to, when it is corrupt) leaves its journal
    behind. The next coordinator starts empty, and its first write replaces the state file,
    then the journal: killed between the two, it came back replaying the old run's lines onto
    the new, empty state (keys of the old run back, or a refusal to start naming a job it
    never had). A journal without its state file belongs to nothing: it is moved aside at the start."""
    path = tmp_path / "state.json"
    core = Core()
    from pjrt_rendezvous.coordinator._server import _StateWriter

    writer = _StateWriter(core, _state.Files(path))

    async def first_run():
        await writer.flush()
        core.kv_set("store", [("old", b"1")])
        await writer.flush()  # (journaled)
        writer.close()

    asyncio.run(first_run())
    assert _state.journal_path(path).stat().st_size > 0
    path.unlink()  # moved away; its journal stays
    real = _state.write_atomic

    def killed_before_the_journal(target, data):
        if target == _state.journal_path(path):
            raise KeyboardInterrupt("killed between the state file and its journal")
        real(target, data)

    with caplog.at_level(logging.WARNING, logger="pjrt_rendezvous.coordinator"):
        files = _state.Files(path)
    monkeypatch.setattr(_state, "write_atomic", killed_before_the_journal)
    with pytest.raises(KeyboardInterrupt):
        files.rewrite(_state.encode(_state.snapshot(Core())))
    files.close()
    restored = _state.load(path, now=0.0, limits=None, heartbeat_timeout=None)
    assert restored.jobs == {}, f"the old run's keys came back: {restored.jobs}"
    assert "without its state file" in caplog.text, caplog.text
    assert (tmp_path / "state.json.journal.orphaned").stat().st_size > 0  # kept aside, not removed


def test_a_journal_whose_close_failed_is_not_closed_again(tmp_path, monkeypatch):
    """close(2) of the journal failing (EIO, on NFS) still frees its descriptor, but Files kept
    the number: every later rewrite closed it again and failed (EBADF), or closed whatever
    file had been given that number since (a client's connection). The rewrite that met the
    error fails; the next ones work."""
    import errno

    path = tmp_path / "state.json"
    files = _state.Files(path)
    files.rewrite(_state.encode(_state.snapshot(Core())))
    files.append(_state.journal_entry(1, [], {}))
    journal_fd = files._journal
    real_close = os.close

    def close(fd):
        real_close(fd)
        if fd == journal_fd:
            raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as patch:
        patch.setattr(_state.os, "close", close)
        with pytest.raises(OSError, match="Input/output error"):
            files.rewrite(_state.encode(_state.snapshot(Core())))
    files.rewrite(_state.encode(_state.snapshot(Core())))
    files.close()


@pytest.mark.parametrize("removed", ["journal", "state file"])
def test_a_state_file_or_journal_removed_while_it_runs_is_written_again_whole(tmp_path, caplog, removed):
    """The journal or the state file removed under a running coordinator (by hand, or a
    cleaner of old files in /tmp): the journal's appends went on into the removed file (or
    beside no state file), so what was acknowledged before and after was lost at the next
    restart. The next write finds it gone and writes the whole state again."""
    from pjrt_rendezvous.coordinator._server import _StateWriter

    path = tmp_path / "state.json"
    core = Core()
    writer = _StateWriter(core, _state.Files(path))

    async def run():
        await writer.flush()
        core.kv_set("store", [("before", b"1")])
        await writer.flush()  # (journaled)
        (_state.journal_path(path) if removed == "journal" else path).unlink()
        core.kv_set("store", [("after", b"2")])
        await writer.flush()
        core.kv_set("store", [("later", b"3")])
        await writer.flush()
        writer.close()

    with caplog.at_level(logging.WARNING, logger="pjrt_rendezvous.coordinator"):
        asyncio.run(run())
    assert "was removed while the coordinator ran: writing the whole state again" in caplog.text, caplog.text
    assert path.exists() and _state.journal_path(path).exists()
    restored = _state.load(path, now=0.0, limits=None, heartbeat_timeout=None)
    assert restored.kv_get("store", ["before", "after", "later"]) == [b"1", b"2", b"3"]


def test_a_folder_that_cannot_be_synced_does_not_fail_the_writes(tmp_path, monkeypatch):
    """Some file systems (network, FUSE) refuse fsync on a folder with EINVAL: every rewrite
    failed there, so a coordinator could not keep a state file at all. Like PostgreSQL and
    SQLite, the folder's sync is skipped there; a file's own fsync failing still fails."""
    path = tmp_path / "state.json"
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    core = Core()
    core.kv_set("store", [("k", b"v")])
    files = _state.Files(path)
    files.rewrite(_state.encode(_state.snapshot(core)))
    files.close()
    restored = _state.load(path, now=0.0, limits=None, heartbeat_timeout=None)
    assert restored.kv_get("store", ["k"]) == [b"v"]

    def broken(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken)
    files = _state.Files(path)
    with pytest.raises(OSError, match="Input/output error"):
        files.rewrite(_state.encode(_state.snapshot(core)))
    files.close()
    # (and the failed write's temporary file is gone: a disk full kept the space it took)
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name], list(tmp_path.iterdir())


def test_an_append_journals_what_it_appends_not_the_whole_value(tmp_path, monkeypatch):
    """Each append to a large value adds a line of its own bytes to the journal (it wrote
    the whole value each time: ten 1-byte appends to 1 MB wrote over 10 MB), and the
    replayed appends give the value back, in order."""
    path = tmp_path / "state.json"
    core, writer = journaled_core(path)
    written = []
    for name in ("append", "rewrite"):
        real = getattr(_state.Files, name)
        monkeypatch.setattr(_state.Files, name, lambda files, data, real=real: (written.append(len(data)), real(files, data))[1])

    async def main():
        core.kv_set("j", [("log", b"x" * 1_000_000)])
        await writer.flush()  # (written whole: the job is new)
        written.clear()
        for k in range(10):
            core.kv_append("j", "log", b"%d" % k, request_id=f"a{k}")
            await writer.flush()
        writer.close()

    asyncio.run(main())
    assert len(written) == 10 and sum(written) < 10_000, written
    restored = _state.load(path, now=0.0, limits=None, heartbeat_timeout=None)
    assert restored.jobs["j"].kv["log"] == b"x" * 1_000_000 + b"0123456789"
    assert _state.snapshot(restored) == _state.snapshot(core)


def test_a_journal_cut_short_loses_only_its_last_unacknowledged_line(tmp_path, caplog):
    """A crash in the middle of an append leaves a partial last line: ignored (its callers
    were never answered), and logged (a line without its end was dropped in silence). A
    damaged line before the last is reported, never skipped."""
    path = tmp_path / "state.json"
    core, writer = journaled_core(path)

    async def main():
        await writer.flush()
        for number in range(1, 4):
            play(core, number, number)
            await writer.flush()
        writer.close()

    asyncio.run(main())
    journal = _state.journal_path(path)
    lines = journal.read_bytes().splitlines(keepends=True)
    journal.write_bytes(b"".join(lines) + lines[-1][:40])  # a torn fourth append
    with caplog.at_level(logging.WARNING, logger="pjrt_rendezvous.coordinator"):
        assert _state.snapshot(_state.load(path, now=0.0, limits=None, heartbeat_timeout=None)) == _state.snapshot(core)
    assert any("it has no end (a write cut short)" in r.getMessage() for r in caplog.records), caplog.text
    journal.write_bytes(lines[0] + lines[1] + lines[2].replace(b'"t"', b'"u"'))  # the last, damaged
    restored = _state.load(path, now=0.0, limits=None, heartbeat_timeout=None)
    assert restored.jobs["j"].rounds_completed == core.jobs["j"].rounds_completed - 1
    journal.write_bytes(lines[0] + lines[1].replace(b'"t"', b'"u"') + lines[2])
    with pytest.raises(StateFileError, match="corrupt at line 2"):
        _state.load(path, now=0.0, limits=None, heartbeat_timeout=None)


def test_journal_lines_older_than_the_state_file_are_skipped(tmp_path):
    """A crash between rewriting the state file and emptying the journal leaves older lines
    behind: their version is not newer than the state file's, so they are not replayed."""
    path = tmp_path / "state.json"
    core, writer = journaled_core(path)

    async def main():
        await writer.flush()
        writer.close()

    asyncio.run(main())
    from pjrt_rendezvous.coordinator._core import Round

    old = Round(generation=1, group=(0,), number=7, started=0.0, members=frozenset({0}), size=1, tag="t", result=[b"old"])
    _state.journal_path(path).write_bytes(_state.journal_entry(core.version, [("round", "j", old)], {"j": 99}))
    restored = _state.load(path, now=0.0, limits=None, heartbeat_timeout=None)
    assert _state.snapshot(restored) == _state.snapshot(core)


def test_other_changes_and_a_long_journal_rewrite_the_state(tmp_path, monkeypatch):
    """A change to the ranks (here a job declared) rewrites the state file and empties the
    journal; so does the next write once the journal has grown past JOURNAL_LIMIT; a failed
    append makes the next write whole. The state loads the same every time."""
    path = tmp_path / "state.json"
    core, writer = journaled_core(path)
    journal = _state.journal_path(path)

    def loaded():
        return _state.snapshot(_state.load(path, now=0.0, limits=None, heartbeat_timeout=None))

    async def main():
        await writer.flush()
        play(core, 1, 1)
        await writer.flush()
        assert journal.stat().st_size > 0
        core.declare_job("other", 4)
        play(core, 2, 2)
        await writer.flush()
        assert journal.stat().st_size == 0 and loaded() == _state.snapshot(core)
        monkeypatch.setattr(_state, "JOURNAL_LIMIT", 1000)
        for number in range(3, 30):
            play(core, number, number)
            await writer.flush()
            assert journal.stat().st_size < 1000 + 400
        assert loaded() == _state.snapshot(core)
        def fail(fd):
            raise OSError(28, "No space left on device")

        with monkeypatch.context() as patch:
            patch.setattr(_state.os, "fsync", fail)  # the next append fails
            play(core, 30, 30)
            with pytest.raises(CoreError, match="cannot write its state file .*No space") as failed:
                await writer.flush()
            assert failed.value.code is Code.UNAVAILABLE and writer.failed.is_set()
        play(core, 31, 31)
        state = path.read_bytes()
        await writer.flush()
        assert path.read_bytes() != state and loaded() == _state.snapshot(core)
        writer.close()

    asyncio.run(main())
