"""The state file: round trips, corruption detection, and a coordinator killed mid-job."""

from __future__ import annotations

import json
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client._demo import simulated_env
from pjrt_rendezvous.coordinator import Core, StateFileError
from pjrt_rendezvous.coordinator import _state
from pjrt_rendezvous.coordinator._core import Contribution, Registration, ThreadRequest

WORKER = pathlib.Path(__file__).with_name("pod_worker.py")


def populated_core() -> Core:
    core = Core()
    for task in range(2):
        core.register(
            0.0,
            Registration(
                job="j", incarnation=f"inc{task}", host=f"h{task}", pid=100 + task, task_id=task,
                num_tasks=2, devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),),
            ),
        )
    for task in range(2):
        key = core.arrive(
            1.0, job="j", incarnation=f"inc{task}", replicas=[], round_number=0,
            contributions=[Contribution(ordinal=task, tag="t", payload=bytes([task, 255]))], deadline=None,
        )
    core.kv_set("j", [("k", b"\x00\x01")])
    core.kv_add("j", "n", 3, request_id="r1")
    return core, key


def test_snapshot_round_trip_keeps_ranks_rounds_and_keys():
    """A restored core has the same rank table, finished rounds, keys and applied request ids."""
    core, key = populated_core()
    restored = _state.restore(_state.decode(_state.encode(_state.snapshot(core))), now=50.0)
    assert restored.world("j") == core.world("j")
    assert restored.outcome("j", key).result == [b"\x00\xff", b"\x01\xff"]
    assert restored.kv_get("j", ["k", "n"]) == [b"\x00\x01", b"3"]
    assert restored.kv_add("j", "n", 3, request_id="r1") == 3  # a retried add is not applied twice
    # A resend of the finished round gets its result; the next round starts at number 1.
    again = restored.arrive(
        51.0, job="j", incarnation="inc0", replicas=[], round_number=0,
        contributions=[Contribution(ordinal=0, tag="t", payload=b"\x00\xff")], deadline=None,
    )
    assert restored.outcome("j", again).result == [b"\x00\xff", b"\x01\xff"]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d[: len(d) // 2], "corrupt or truncated"),
        (lambda d: d.replace(b'\\"n\\"', b'\\"m\\"', 1), "checksum does not match"),
        (lambda d: b'{"hello": 1}', "not a pjrt-rendezvous state file"),
        (lambda d: b"", "corrupt or truncated"),
    ],
)
def test_damaged_state_is_detected_never_half_loaded(damage, message):
    """Torn, edited, empty or foreign files raise StateFileError saying what is wrong and what to do."""
    core, _ = populated_core()
    data = damage(_state.encode(_state.snapshot(core)))
    with pytest.raises(StateFileError, match=message) as info:
        _state.decode(data, path="/var/lib/x/state.json")
    assert "move /var/lib/x/state.json away" in str(info.value)


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
