"""End to end over real gRPC on loopback: a real coordinator, real processes x threads."""

from __future__ import annotations

import concurrent.futures
import io
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client._demo import run_demo, simulated_env
from pjrt_rendezvous.coordinator import Coordinator
from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

WORKER = pathlib.Path(__file__).with_name("pod_worker.py")


@pytest.fixture
def coordinator():
    with Coordinator(port=0) as c:
        yield c


def run_pod(address, scenario, *, processes, hosts=1, accelerator="v3-8", threads=None, timeout=60, env_patch=None):
    """Runs ``processes`` simulated TPU processes; returns their JSON records sorted by ordinal."""
    children = []
    for task in range(processes):
        env = simulated_env(
            address=address, accelerator=accelerator, task=task, processes=processes, hosts=hosts, threads=threads
        )
        env.update((env_patch or {}).get(task, {}))
        children.append(
            subprocess.Popen([sys.executable, str(WORKER), scenario], env=env, stdout=subprocess.PIPE, text=True)
        )
    records = []
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            out, _ = child.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for c in children:
                c.kill()
            pytest.fail(f"simulated pod hung in scenario {scenario!r}")
        assert child.returncode == 0
        records += [json.loads(line) for line in out.splitlines()]
    return sorted(records, key=lambda r: r.get("ordinal", -1))


def test_demo_simulates_a_v3_8():
    """The README's main job: 4 processes x 2 threads get ordinals 0-7 and correct rounds."""
    out = io.StringIO()
    assert run_demo(processes=4, out=out) == 0, out.getvalue()
    text = out.getvalue()
    assert "8 ordinals, world size 8" in text and text.rstrip().endswith("ok")
    assert len(re.findall(r"^\d+ +\d+ +\d+ +\d+ +sim-host-0 .* ok$", text, re.M)) == 8


def test_demo_runs_on_the_python_path_alone():
    """Built without a C compiler (or with PJRT_RENDEZVOUS_NATIVE=0), the package decodes and
    encodes its messages in Python: the README's main job works on that path alone."""
    probe = "from pjrt_rendezvous.client import _session, _wire; assert _session._native is _wire._native is None"
    for off in ("false", " Off"):  # (read as on once)
        subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, PJRT_RENDEZVOUS_NATIVE=off), check=True, timeout=60)
    unknown = subprocess.run(  # neither on nor off: said, not taken as on in silence
        [sys.executable, "-c", "import pjrt_rendezvous.client"],
        env=dict(os.environ, PJRT_RENDEZVOUS_NATIVE="disabled"), capture_output=True, text=True, timeout=60,
    )
    assert "PJRT_RENDEZVOUS_NATIVE='disabled' is neither on" in unknown.stderr, unknown.stderr
    env = dict(os.environ, PJRT_RENDEZVOUS_NATIVE="0")
    subprocess.run([sys.executable, "-c", probe], env=env, check=True, timeout=60)
    demo = subprocess.run(
        [sys.executable, "-m", "pjrt_rendezvous.coordinator", "demo"], env=env, capture_output=True, text=True, timeout=120
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert demo.stdout.rstrip().endswith("ok")


def test_multi_host_v3_32_full_world_subsets_and_repeated_tags(coordinator):
    """16 processes x 2 threads on 4 simulated hosts: ordinals from the TPU variables, results in ordinal order."""
    records = run_pod(coordinator.address, "full_and_subsets", processes=16, hosts=4, accelerator="v3-32", timeout=120)
    assert [r.get("error") for r in records] == [None] * 32
    assert [r["ordinal"] for r in records] == list(range(32))
    for r in records:
        task, thread = divmod(r["ordinal"], 2)
        assert r["local_ordinal"] == (task % 4) * 2 + thread
        assert r["everyone"] == [f"p{o}" for o in range(32)]
        assert r["again"] == [[f"r{o}-{k}" for o in range(32)] for k in range(3)]
        if r["ordinal"] < 3:
            assert r["first"] == ["f0", "f1", "f2"]
        base = r["ordinal"] - r["ordinal"] % 2
        assert r["pair"] == [f"x{base}", f"x{base + 1}"]
    status = pr.Client(pr.Settings(address=coordinator.address), pr.detect_topology({})).status()
    (job,) = status.jobs
    assert (job.world_size, job.registered, len(job.pending_rounds)) == (32, 32, 0)
    assert {p.host for p in job.participants} == {f"sim-host-{h}" for h in range(4)}
    # 4 full-world rounds + 1 'firsts' + 16 pairs
    assert job.rounds_completed == 4 + 1 + 16


def test_timeout_names_missing_ordinals_with_host(coordinator):
    """When one process never arrives, every other thread times out with its ordinals, host and last-seen time."""
    records = run_pod(coordinator.address, "timeout_missing", processes=3, hosts=3, threads=2)
    errors = [r for r in records if "error" in r]
    assert len(errors) == 4
    for e in errors:
        assert e["error"] == "RendezvousTimeout" and e["code"] == "DEADLINE_EXCEEDED"
        assert re.search(r"missing ordinals 2-3 on sim-host-1 \(pid \d+, last seen", e["message"]), e["message"]


def test_tag_mismatch_fails_every_member_promptly(coordinator):
    """One ordinal bringing another tag fails the round for all, naming who brought which tag
    (at once: not at the round's 30 s timeout)."""
    records = run_pod(coordinator.address, "tag_mismatch", processes=2, threads=2)
    assert {r["error"] for r in records} == {"MismatchError"}, records
    for r in records:  # the round fails at the first arrival of the other tag
        # (the 'save' side is placed too when no side is larger: ordinal 2 alone, if 0-1 had not come)
        assert re.search(r"ordinals? [0-9, -]+ (\(\S+ pid \d+\) )?called rendezvous\('save'\)", r["message"]), r["message"]
        assert re.search(r"ordinal 3 \(\S+ pid \d+\) called rendezvous\('step'\)", r["message"]), r["message"]  # (the odd one out placed)


def test_a_slower_process_that_comes_after_the_others_left_is_told_what_became_of_them(coordinator):
    """The mismatch fails the round within task 1, which exits before task 0 (started with
    it, slower) registers: task 0 starts a new run (a relaunch of task 1 would join it), and
    its timeout says that task 1's process of the last run left."""
    alone = {"POD_WORKER_NO_WORLD_WAIT": "1", "POD_WORKER_TIMEOUT": "2"}
    records = run_pod(coordinator.address, "tag_mismatch", processes=2, threads=2,
                      env_patch={0: {**alone, "POD_WORKER_AFTER_OTHERS_LEFT": "1"}, 1: alone})
    assert [r["error"] for r in records] == ["RendezvousTimeout"] * 2 + ["MismatchError"] * 2, records
    for r in records[:2]:
        assert re.search(r"missing ordinals 2-3 not registered since the job started afresh \(the last run's was "
                         r"sim-host-0 pid \d+, which left\)", r["message"]), r["message"]


def test_caller_outside_replicas_fails_the_round_for_its_members(coordinator):
    """Ordinal 3 calling on replicas [0, 1] while ordinal 0 waits there gets INVALID_ARGUMENT
    and releases 0 at once, and 1 when it comes, with the same error."""
    records = run_pod(coordinator.address, "not_in_replicas", processes=2, threads=2)
    errors = [r for r in records if "error" in r]
    assert len(errors) == 3, records  # ordinals 0, 1 and 3; ordinal 2 took no part
    for e in errors:
        assert e["error"] == "InvalidArgumentError"
        assert "ordinal 3 called rendezvous('sub') with replicas [0-1] but is not among them" in e["message"]


def test_key_value_waiting_get_is_released_by_a_later_set(coordinator):
    """A blocking get in one process returns once another process sets the key; add counts every thread once."""
    records = run_pod(coordinator.address, "kv_wait", processes=2, threads=2)
    assert [r.get("error") for r in records] == [None] * 4
    assert sorted(r["total"] for r in records) == [1, 2, 3, 4]
    first = records[0]
    assert first["value"] == "from 3" and first["waited"] >= 0.4


def test_duplicate_ordinal_is_refused(coordinator):
    """Two processes claiming the same task get ALREADY_EXISTS naming both."""
    records = run_pod(
        coordinator.address,
        "full_and_subsets",
        processes=2,
        threads=1,
        timeout=60,
        env_patch={
            # (long enough for both to start: a claim after the owner left is a relaunch of its task)
            0: {"PJRT_RENDEZVOUS_TIMEOUT": "10"},
            1: {"PJRT_RENDEZVOUS_TASK_ID": "0", "PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TIMEOUT": "10"},
        },
    )
    duplicate = [r for r in records if r.get("error") == "DuplicateOrdinalError"]
    assert len(duplicate) == 1, records
    assert "already registered by sim-host-0 pid" in duplicate[0]["message"]
    assert "two processes share one task id" in duplicate[0]["message"]
    # The rightful owner is not disturbed; its round then times out naming the absent task.
    (stuck,) = [r for r in records if r.get("error") == "RendezvousTimeout"]
    assert "missing ordinal 1 never registered" in stuck["message"]


def test_world_of_one_needs_no_coordinator():
    """A single process off TPU is a world of one: rendezvous returns [payload] with no server,
    and refuses what a bound thread's call refuses (a script must not break only when it
    runs on more than one chip)."""
    code = textwrap.dedent(
        """
        import pjrt_rendezvous.client as pr
        assert pr.get_world_size() == 1 and pr.get_ordinal() == 0 and pr.is_master_ordinal()
        refused = [
            ((None, b"x"), TypeError, "tag must be str"),
            ((123,), TypeError, "tag must be str"),
            (("\\udcff",), pr.UsageError, "not valid text"),
            (("t", "text"), TypeError, "payload must be bytes"),
            (("t", b"", [0, "1"]), TypeError, "replicas must be ints"),
            (("t", b"", [True]), TypeError, "replicas must be ints"),
            (("t", b"", {0: 1}), TypeError, "replicas must be a sequence of ints, got dict"),
            (("t", b"", [0, 0]), pr.InvalidArgumentError, "replicas listing ordinal 0 more than once"),
            (("t", b"", [1, 0]), pr.InvalidArgumentError, "replicas [1] are out of range [0, 1) for a world of one"),
        ]
        for args, error, words in refused:
            try:
                pr.rendezvous(*args)
            except error as exc:
                assert words in str(exc), (args, exc)
            else:
                raise AssertionError(f"rendezvous{args!r} was not refused")
        class Index:  # an int as numpy's are: replicas=list(np.arange(n)) is taken
            def __index__(self):
                return 0
        assert pr.rendezvous("t", b"i", [Index()]) == [b"i"]
        try:
            import numpy
        except ImportError:
            pass
        else:
            assert pr.rendezvous("t", b"n", numpy.arange(1)) == [b"n"]
        print(pr.rendezvous("t", b"solo"))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "PJRT_", "CLOUD_TPU"))}
    env["PJRT_RENDEZVOUS_ADDRESS"] = "127.0.0.1:1"  # nothing listens: it must not be asked
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[b'solo']"


def test_unbound_thread_gets_a_clear_error(coordinator):
    """Outside a bound thread, in a world larger than one, the xm-style calls say how to bind."""
    topology = pr.detect_topology(
        {"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": "0", "PJRT_RENDEZVOUS_ADDRESS": coordinator.address}
    )
    pr.shutdown()
    pr.init(topology=topology)
    try:
        with pytest.raises(pr.UsageError, match="bind_thread"):
            pr.get_ordinal()
        with pytest.raises(pr.UsageError, match=r"^rendezvous\(\) needs a bound thread"):
            pr.rendezvous("t", b"")
        with pytest.raises(pr.UsageError, match=r"^barrier\(\) needs a bound thread"):  # (named as called)
            pr.barrier("t")
        for local in (True, False):  # (it named get_local_ordinal() and get_ordinal())
            with pytest.raises(pr.UsageError, match=r"^is_master_ordinal\(\) needs a bound thread"):
                pr.is_master_ordinal(local)
    finally:
        pr.shutdown()


def test_threads_of_one_process_share_one_rpc_per_round(coordinator):
    """Two threads of a process arriving at a round produce one Rendezvous RPC carrying both ordinals."""
    calls = []
    topology = pr.detect_topology({"PJRT_RENDEZVOUS_CORES_PER_CHIP": "2"}, address=coordinator.address)
    client = pr.Client(pr.Settings(address=coordinator.address, timeout=30, batch_window=30), topology)  # (siblings far apart on a loaded machine: still one call)
    original = client._send_round

    def counting(replicas, group, round_number, batch):
        calls.append(sorted(batch.contributions))
        return original(replicas, group, round_number, batch)

    client._send_round = counting  # observation only: the real RPC still goes out
    results = {}

    bound = threading.Barrier(2)

    def thread_main(index):
        binding = client.bind_thread(index)
        bound.wait()  # as spawn does: every thread bound before user code runs
        try:
            for k in range(5):
                results[(index, k)] = client.rendezvous(binding, f"step{k}", b"%d" % index)
        finally:
            client.unbind_thread()

    threads = [threading.Thread(target=thread_main, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    client.close()
    assert all(results[(i, k)] == [b"0", b"1"] for i in range(2) for k in range(5))
    assert calls == [[0, 1]] * 5


def test_a_thread_whose_sibling_is_in_another_round_arrives_at_once(coordinator):
    """The first thread at a full-world round waits for its sibling only until the sibling
    enters a subset round instead: then it sends its own arrival at once, so the coordinator
    knows who is really missing (not after the 30 s batch window)."""
    clients, calls = [], []
    for task in range(2):
        env = simulated_env(address=coordinator.address, accelerator="v3-8", task=task, processes=2, hosts=1, threads=2)
        client = pr.Client(pr.Settings(address=coordinator.address, timeout=20, batch_window=30),
                           pr.detect_topology(env, address=coordinator.address))
        original = client._send_round

        def counting(replicas, group, round_number, batch, original=original, task=task):
            calls.append((task, list(group), sorted(batch.contributions)))
            return original(replicas, group, round_number, batch)

        client._send_round = counting  # observation only: the real RPC still goes out
        clients.append(client)
    results, seen = {}, []
    bound = threading.Barrier(4)

    def thread_main(client, index):
        binding = client.bind_thread(index)
        bound.wait(30)
        try:
            if binding.ordinal == 1:  # once its sibling waits in the full-world round
                time.sleep(0.3)
            if binding.ordinal == 3:  # while ordinal 1 waits for it in their pair round
                time.sleep(1.5)
                (job,) = client.status().jobs
                seen.extend((list(r.replicas), list(r.arrived)) for r in job.pending_rounds)
            if index == 1:
                results[(binding.ordinal, "pair")] = client.rendezvous(binding, "pair", b"p", [1, 3])
            results[(binding.ordinal, "all")] = client.rendezvous(binding, "all", b"%d" % binding.ordinal)
        finally:
            client.unbind_thread()

    threads = [threading.Thread(target=thread_main, args=(c, i)) for c in clients for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for client in clients:
        client.close()
    assert results == {
        (1, "pair"): [b"p", b"p"], (3, "pair"): [b"p", b"p"], **{(o, "all"): [b"0", b"1", b"2", b"3"] for o in range(4)}
    }
    # Ordinal 2 still waits (for up to the batch window) for its sibling 3, which is in no round.
    assert sorted(seen) == [([], [0]), ([1, 3], [1])]
    assert (0, [], [0]) in calls and (0, [], [1]) in calls


def test_serve_cli_health_reflection_and_status():
    """`pjrt-rendezvous serve --port 0` prints its port, answers health and reflection, and `status` reads it."""
    server = subprocess.Popen(
        [sys.executable, "-m", "pjrt_rendezvous.coordinator", "serve", "--port", "0", "--world-size", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert match, line
        address = f"127.0.0.1:{match.group(1)}"
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(service="pjrt_rendezvous.v1.Coordinator"), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = {s.name for r in responses for s in r.list_services_response.service}
            assert "pjrt_rendezvous.v1.Coordinator" in names and "grpc.health.v1.Health" in names
        status = subprocess.run(
            [sys.executable, "-m", "pjrt_rendezvous.coordinator", "status", "--address", address],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert status.returncode == 0, status.stderr
        assert "job 'default': 0/4 ordinals registered" in status.stdout
        as_json = subprocess.run(
            [sys.executable, "-m", "pjrt_rendezvous.coordinator", "status", "--address", address, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert json.loads(as_json.stdout)["jobs"][0]["worldSize"] == 4
    finally:
        server.terminate()
        server.wait(10)
    assert server.returncode == 0


def test_status_shows_a_stuck_round(coordinator):
    """While a round waits, status names its tag, who arrived and who is missing (with host)."""
    topology = pr.detect_topology(
        {"PJRT_RENDEZVOUS_NUM_TASKS": "2", "TPU_WORKER_HOSTNAMES": "h0,h1", "TPU_WORKER_ID": "0"},
        address=coordinator.address,
    )
    client = pr.Client(pr.Settings(address=coordinator.address, timeout=30), topology)
    done = threading.Event()

    def waiter():
        binding = client.bind_thread(0)
        try:
            client.rendezvous(binding, "stuck", b"", timeout=5)  # (pending long enough to be seen on a loaded machine)
        except pr.RendezvousTimeout:
            done.set()

    t = threading.Thread(target=waiter)
    t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        jobs = client.status("").jobs  # every job: 'default' exists only once the thread registered
        if jobs and jobs[0].pending_rounds:
            job = jobs[0]
            break
        time.sleep(0.05)
    (r,) = job.pending_rounds
    assert [(g.tag, list(g.ordinals)) for g in r.tags] == [("stuck", [0])]
    assert list(r.missing) == [1] and r.missing_summary == "1 never registered"
    t.join(20)
    assert done.is_set()
    client.close()


def test_wait_world_returns_every_ordinal_with_its_process(coordinator):
    """The rank table travels grouped by process; the client expands it to one Participant per
    ordinal, in ordinal order, with each process's host, pid and incarnation (its digest:
    the incarnation itself proves the process's calls)."""
    from pjrt_rendezvous.coordinator._servicer import _process_id

    from test_cli import bound_thread, simulated_process

    clients = [simulated_process(coordinator.address, task, processes=2, threads=2) for task in range(2)]
    workers = [bound_thread(c, i) for c in clients for i in range(2)]
    table = clients[1].wait_world(timeout=30)
    assert [p.ordinal for p in table] == [0, 1, 2, 3]
    assert [(p.task_id, p.thread_index, p.local_ordinal) for p in table] == [(0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)]
    assert [p.host for p in table] == ["sim-host-0", "sim-host-0", "sim-host-1", "sim-host-1"]
    assert {p.incarnation for p in table[:2]} == {_process_id(clients[0].incarnation)}
    assert {p.incarnation for p in table[2:]} == {_process_id(clients[1].incarnation)}
    assert all(p.pid == os.getpid() and p.alive for p in table)
    for c in clients:
        c.close()
    for thread, errors in workers:
        thread.join(30)
        assert not errors, errors


def test_wait_world_before_any_process_registered_waits_for_the_job(coordinator, caplog):
    """A wait for the world made before the job exists (the first process to ask, or a
    launcher watching) waits for its processes to register; it failed at once with "job ...
    is not known". One that times out says the job is not known, naming the known jobs.
    While it waits, it says every progress_interval how far the world is (it said nothing)."""
    from test_cli import bound_thread, simulated_process

    settings = pr.Settings(address=coordinator.address, job="later", progress_interval=0.2)
    observer = pr.Client(settings, pr.detect_topology({}, address=coordinator.address))
    with pytest.raises(pr.RendezvousTimeout, match=r"after 0\.\d+ s, job 'later' is not known"):
        observer.wait_world(timeout=0.1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(observer.wait_world, timeout=30)
        deadline = time.monotonic() + 20
        while "for the world of job 'later': the coordinator has no such job yet: no process registered in it" not in caplog.text:
            assert time.monotonic() < deadline and not waiting.done(), caplog.text
            time.sleep(0.05)
        clients = [simulated_process(coordinator.address, task, processes=2, threads=2, job="later") for task in range(2)]
        workers = [bound_thread(clients[0], i) for i in range(2)]
        deadline = time.monotonic() + 30
        while "for the world of job 'later': 2 of 4 ordinals registered" not in caplog.text:
            assert time.monotonic() < deadline and not waiting.done(), caplog.text
            time.sleep(0.05)
        workers += [bound_thread(clients[1], i) for i in range(2)]
        assert [p.ordinal for p in waiting.result(timeout=30)] == [0, 1, 2, 3]
    with pytest.raises(pr.InvalidArgumentError, match="holds a control character"):
        pr.Client(pr.Settings(address=coordinator.address), pr.detect_topology({}, address=coordinator.address))._call(
            "WaitWorld", pb.WaitWorldRequest(job="a\x00b", timeout=1)
        )
    for client in clients:
        client.close()
    observer.close()
    for thread, errors in workers:
        thread.join(30)
        assert not errors, errors


def test_wait_world_still_waiting_lines_name_the_missing_ordinals(coordinator, caplog):
    """A wait for a world missing a process and a thread says, every progress_interval,
    which ordinals are missing and where, as its timeout does: it said only "5 of 8 ordinals
    registered", and who was missing took `pjrt-rendezvous status` on the coordinator's host."""
    from test_cli import bound_thread, simulated_process

    clients = [simulated_process(coordinator.address, task, processes=4, threads=2, progress_interval=0.2) for task in range(3)]
    workers = [bound_thread(c, i) for c in clients[:2] for i in range(2)]
    workers.append(bound_thread(clients[2], 0))  # ordinal 5 (its thread 1) and task 3 (6-7) never come
    caplog.set_level(logging.WARNING, logger="pjrt_rendezvous.client")
    with pytest.raises(pr.RendezvousTimeout) as timeout:
        clients[0].wait_world(timeout=1.0)
    assert re.search(r"missing ordinals 5-7 \(5 on sim-host-2 \(pid \d+, last seen", str(timeout.value)), timeout.value
    lines = [r.getMessage() for r in caplog.records if "for the world of job" in r.getMessage() and " of 8 ordinals" in r.getMessage()]
    assert lines, caplog.text
    assert re.search(r"5 of 8 ordinals registered; missing ordinals 5-7 \(5 on sim-host-2 \(pid \d+, last seen", lines[0]), lines[0]
    assert lines[0].endswith("; 6-7 never registered)"), lines[0]
    for client in clients:
        client.close()
    for thread, errors in workers:
        thread.join(30)
        assert not errors, errors


def test_contributions_as_messages_and_as_lists_meet_in_one_round(coordinator):
    """An older client's Contribution messages and our lists are the same to the coordinator;
    malformed lists are refused with what is wrong."""
    topology = lambda task: pr.detect_topology(  # noqa: E731
        {"PJRT_RENDEZVOUS_NUM_TASKS": "2", "PJRT_RENDEZVOUS_TASK_ID": str(task)}, address=coordinator.address
    )
    clients = [pr.Client(pr.Settings(address=coordinator.address, timeout=30), topology(task)) for task in range(2)]
    results = {}

    def ours() -> None:
        with clients[1].bind_thread(0) as binding:
            results["lists"] = clients[1].rendezvous(binding, "mixed", b"b")

    with clients[0].bind_thread(0):
        thread = threading.Thread(target=ours)
        thread.start()
        older = pb.RendezvousRequest(
            job=clients[0].settings.job, incarnation=clients[0].incarnation, round=0, timeout=30,
            contributions=[pb.Contribution(ordinal=0, tag="mixed", payload=b"a")],
        )
        results["messages"] = clients[0]._call("Rendezvous", older, time.monotonic() + 30, waits=True)
        thread.join(30)
        malformed = pb.RendezvousRequest(
            job=clients[0].settings.job, incarnation=clients[0].incarnation, round=1, ordinals=[0], tags=["x", "y"]
        )
        with pytest.raises(pr.RendezvousError, match=r"malformed rendezvous request: 2 tags for 1 ordinals"):
            clients[0]._call("Rendezvous", malformed)
    for client in clients:
        client.close()
    assert results == {"messages": [b"a", b"b"], "lists": [b"a", b"b"]}


def test_waits_on_one_key_keep_their_own_deadlines(coordinator):
    """Waiters on one key share one timer, at the earliest deadline: a get that times out
    does not end a sibling's longer wait, and a later, shorter get still times out on time."""
    topology = pr.detect_topology({}, address=coordinator.address)
    client = pr.Client(pr.Settings(address=coordinator.address, timeout=30), topology)
    try:
        with client.bind_thread(0):  # registers the process (and unbinds this thread after)
            got: list = []
            patient = threading.Thread(target=lambda: got.append(client.get("late", timeout=30)))
            patient.start()
            time.sleep(0.2)  # the patient get waits first, with the later deadline
            for timeout in (0.5, 0.3):
                started = time.monotonic()
                with pytest.raises(pr.RendezvousTimeout, match="late"):
                    client.get("late", timeout=timeout)
                assert timeout <= time.monotonic() - started < timeout + 5
            assert patient.is_alive() and not got
            client.set("late", b"now")
            patient.join(10)
            assert got == [b"now"]
    finally:
        client.close()
