"""The ``pjrt-rendezvous`` command against real coordinators: ``status``, ``health``,
``serve`` settings from variables, and the event log lines."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import queue
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client._demo import simulated_env
from pjrt_rendezvous.client._version import VERSION, build
from pjrt_rendezvous.coordinator import _cli
from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb
from pjrt_rendezvous.protos.v1 import coordinator_pb2_grpc as pb_grpc

CLI = [sys.executable, "-m", "pjrt_rendezvous.coordinator"]


def clean_env(**extra) -> dict[str, str]:
    """This environment without any PJRT_RENDEZVOUS_* setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PJRT_RENDEZVOUS_")}
    env.update(extra)
    return env


# Runs argv[2:] with the signals numbered in argv[1] ignored, and SIGHUP and SIGINT otherwise
# at their default (as inherited across exec: whatever started the tests may ignore them).
_WITH_SIGNALS = """
import os, signal, sys
ignored = {int(n) for n in sys.argv[1].split(",") if n}
for sig in (signal.SIGHUP, signal.SIGINT):
    signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
os.execv(sys.argv[2], sys.argv[2:])
"""


class Serve:
    """A real ``pjrt-rendezvous serve`` process on a free loopback port; stderr is collected."""

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, port_flag: bool = True, program: list[str] = CLI,
        ignoring: tuple[signal.Signals, ...] | None = None,
    ) -> None:
        command = [*program, "serve", *(["--port", "0"] if port_flag else []), *args]
        if ignoring is not None:  # started with these ignored (SIGHUP and SIGINT otherwise at their default)
            command = [sys.executable, "-c", _WITH_SIGNALS, ",".join(str(int(sig)) for sig in ignoring), *command]
        self.proc = subprocess.Popen(
            command, env=clean_env(**(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self._terminated = False
        self.lines: list[str] = []  # stderr
        self.stdout_lines: list[str] = []  # every line, complete once stop() returns
        self._stdout: queue.Queue[str] = queue.Queue()

        def stdout_line(line: str) -> None:
            self.stdout_lines.append(line)
            self._stdout.put(line)

        self._readers = [
            threading.Thread(target=self._drain, args=(self.proc.stderr, self.lines.append), daemon=True),
            threading.Thread(target=self._drain, args=(self.proc.stdout, stdout_line), daemon=True),
        ]
        for reader in self._readers:
            reader.start()
        try:
            self.port = self._announced_port("grpc", r"listening on \S+:(\d+)$")
            self.address = f"127.0.0.1:{self.port}"
            self.session_port = None
            tls = "--tls-cert" in args or "PJRT_RENDEZVOUS_SERVER_TLS_CERT" in (env or {})
            if not tls and dict(zip(args, args[1:])).get("--session-port") != "off":  # none with TLS
                self.session_port = self._announced_port("session", r"session port \S+:(\d+)$")
            self.metrics_port = None
            if "--metrics-port" in args or "PJRT_RENDEZVOUS_METRICS_PORT" in (env or {}):
                self.metrics_port = self._announced_port("metrics", r":(\d+)/metrics$")
        except BaseException:
            self.__exit__()  # no orphan server when the start fails
            raise

    def _announced_port(self, service: str, text_pattern: str) -> int:
        """The port the next stdout line announces: a JSON line under --log-format json, else text."""
        line = self.read_stdout_line()
        if line.startswith("{"):
            record = json.loads(line)
            assert (record.get("event"), record.get("service")) == ("address", service), line
            return int(record["port"])
        match = re.search(text_pattern, line)
        assert match, f"serve did not announce its {service} port: {line!r} {self.stderr()}"
        return int(match.group(1))

    def read_stdout_line(self, timeout: float = 30) -> str:
        try:
            return self._stdout.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"serve printed nothing in {timeout} s; stderr: {self.stderr()}") from None

    @staticmethod
    def _drain(stream, sink) -> None:
        for line in stream:
            sink(line.rstrip("\n"))

    def stderr(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, pattern: str, timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if re.search(pattern, line):
                    return line
            time.sleep(0.05)
        raise AssertionError(f"no log line matching {pattern!r} in {timeout} s:\n{self.stderr()}")

    def terminate(self) -> None:
        """Sends SIGTERM once (a second one could hit the exiting process's default handler)."""
        if not self._terminated and self.proc.poll() is None:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        self.terminate()
        try:
            code = self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        for reader in self._readers:
            reader.join(5)
        return code

    def __enter__(self) -> "Serve":
        return self

    def __exit__(self, *exc_info) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env=clean_env(**(env or {})), capture_output=True, text=True, timeout=timeout)


def simulated_process(address: str, task: int, *, processes: int, threads: int = 2, **settings) -> pr.Client:
    """A client for simulated TPU process ``task``, one per host ``sim-host-<task>``."""
    env = simulated_env(address=address, accelerator="v3-8", task=task, processes=processes, hosts=processes, threads=threads)
    topology = pr.detect_topology(env, address=address)
    return pr.Client(pr.Settings(address=address, timeout=60, connect_timeout=5, **settings), topology)


def in_thread(fn, *args) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    return thread


def bound_thread(client: pr.Client, index: int, body=None) -> tuple[threading.Thread, list]:
    """Binds a new thread to device ``index`` of ``client`` and runs ``body(binding)`` there
    (or just stays bound until the client closes); returns the thread and its errors."""
    errors: list[BaseException] = []
    registered = threading.Event()

    def main():
        try:
            binding = client.bind_thread(index)
        except BaseException as exc:
            errors.append(exc)
            registered.set()
            return
        registered.set()
        try:
            if body is not None:
                body(binding)
            else:
                client._stopped.wait()
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.unbind_thread()

    thread = in_thread(main)
    assert registered.wait(30), "bind_thread did not return"
    assert not errors or body is not None, errors
    return thread, errors


def free_port() -> int:
    """A loopback port nothing listens on (just now)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(predicate, timeout: float = 20, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# -- status ---------------------------------------------------------------------------------


def test_status_table_and_json_show_a_stuck_round():
    """A round stuck on a silent process and a refused one: `status` names the tag, 4/8
    arrived, the missing ordinals as ranges with their host and pid, the refused task and
    why (the table said "not registered" only, and serve logged nothing), and `--json` the
    same."""
    with Serve("--world-size", "8") as server:
        clients = [simulated_process(server.address, task, processes=4) for task in range(3)]
        refused = simulated_process(server.address, 3, processes=5)  # a world of 10, not 8
        for thread in (0, 1):
            with pytest.raises(pr.MismatchError):
                refused.bind_thread(thread)
        refused.close()
        server.wait_for_line(r"refused the registration of task 3 \(sim-host-3 pid \d+\) in job 'default': .*world size 8")

        def step(binding):
            binding.client.rendezvous(binding, "step", b"", timeout=60)

        threads = [bound_thread(clients[task], thread, step)[0] for task in (0, 1) for thread in (0, 1)]
        threads += [bound_thread(clients[2], thread)[0] for thread in (0, 1)]  # registered, silent
        wait_until(
            lambda: [r for j in clients[2].status().jobs for r in j.pending_rounds if len(r.arrived) == 4],
            what="four arrivals",
        )

        table = run_cli("status", "--address", server.address)
        assert table.returncode == 0, table.stderr
        text = table.stdout
        pid = os.getpid()
        assert "job 'default': 6/8 ordinals registered, generation 1, 0 rounds completed" in text, text
        assert "not registered: ordinals 6-7" in text
        host_rows = [line.split() for line in text.splitlines() if line.strip().startswith("sim-host-")]
        assert [row[:4] for row in host_rows] == [
            ["sim-host-0", "1", str(pid), "0-1"],
            ["sim-host-1", "1", str(pid), "2-3"],
            ["sim-host-2", "1", str(pid), "4-5"],
        ], text
        assert all(row[-2:] == ["s", "ago"] for row in host_rows)
        (round_row,) = [line for line in text.splitlines() if "'step'" in line]
        assert re.match(r"^\s+0\s+all\s+'step'\s+4/8\s+\d+\.\d s\s+4-5 on sim-host-2 \(pid \d+, last seen \d+\.\d s ago\)$", round_row), text
        assert re.search(r"^\s+HOST\s+PROCESSES\s+PIDS\s+ORDINALS\s+LAST SEEN$", text, re.M), text
        assert re.search(r"^\s+6-7 refused \(below\)$", text, re.M), text
        assert re.search(r"^\s+REFUSED TASK\s+ORDINALS\s+WHY \(its latest registration\)$", text, re.M), text
        assert re.search(r"^\s+3\s+6-7\s+sim-host-3 pid \d+ was refused: .*world size 8", text, re.M), text

        as_json = run_cli("status", "--address", server.address, "--json")
        assert as_json.returncode == 0, as_json.stderr
        (job,) = json.loads(as_json.stdout)["jobs"]
        assert (job["worldSize"], job["registered"], job["generation"], job["notRegistered"]) == (8, 6, 1, [6, 7])
        assert [h["host"] for h in job["hosts"]] == ["sim-host-0", "sim-host-1", "sim-host-2"]
        assert [(h["ordinals"], h["ranges"]) for h in job["hosts"]] == [([0, 1], "0-1"), ([2, 3], "2-3"), ([4, 5], "4-5")]
        (pending,) = job["pendingRounds"]
        assert pending["round"] == 0 and pending["expected"] == 8 and pending["arrived"] == [0, 1, 2, 3]
        assert pending["tags"] == [{"tag": "step", "ordinals": [0, 1, 2, 3]}]
        assert [(m["host"], m["ordinals"]) for m in pending["missingByHost"]] == [("sim-host-2", [4, 5]), (None, [6, 7])]
        assert pending["missingByHost"][0]["pids"] == [pid] and pending["missingByHost"][0]["lastSeenAge"] >= 0
        assert all(h["lastSeenAge"] >= 0 for h in job["hosts"])
        assert "4-5 on sim-host-2" in pending["missingSummary"] and "6-7 not registered (sim-host-3 pid" in pending["missingSummary"]
        ((refusal),) = job["refused"]
        assert refusal["taskId"] == 3 and refusal["ordinals"] == [6, 7] and "world size 8" in refusal["reason"], refusal
        assert isinstance(job["participants"][0]["pid"], int)

        for client in clients:
            client.close()  # the waiting calls end
        for thread in threads:
            thread.join(30)
        assert server.stop() == 0
    # (once for the process: each of its threads is refused, and each was a warning)
    assert sum("WARNING" in line and "refused the registration of task 3" in line for line in server.lines) == 1, server.stderr()


def test_status_names_the_process_of_a_missing_ordinal_whose_thread_is_not_bound():
    """A round waits for ordinal 3, whose process (task 1) registered its thread 0 but not yet
    thread 1: the error, the serve log and the round's missingSummary say "3 on sim-host-1",
    but the status table said "3 not registered" and its JSON ``host`` null, as for a task
    nobody started: the operator could not tell which process to look at. Now the table
    names its host, pid and last-seen age as for any other missing ordinal."""
    with Serve("--world-size", "4") as server:
        clients = [simulated_process(server.address, task, processes=2) for task in range(2)]

        def step(binding):
            binding.client.rendezvous(binding, "step", b"", timeout=60)

        threads = [bound_thread(clients[0], thread, step)[0] for thread in (0, 1)]
        threads.append(bound_thread(clients[1], 0, step)[0])  # its thread 1 never binds
        wait_until(
            lambda: [r for j in clients[0].status().jobs for r in j.pending_rounds if len(r.arrived) == 3],
            what="three arrivals",
        )
        (pending,) = clients[0].status().jobs[0].pending_rounds
        assert re.match(r"3 on sim-host-1 \(pid \d+, last seen", pending.missing_summary), pending.missing_summary

        table = run_cli("status", "--address", server.address)
        assert table.returncode == 0, table.stderr
        text = table.stdout
        assert re.search(r"not registered: ordinal 3 \(3 on sim-host-1 \(pid \d+, last seen ", text), text  # (a thread not bound yet)
        (round_row,) = [line for line in text.splitlines() if "'step'" in line]
        assert re.search(r"3/4\s+\d+\.\d s\s+3 on sim-host-1 \(pid %d, last seen \d+\.\d s ago\)$" % os.getpid(), round_row), text

        as_json = run_cli("status", "--address", server.address, "--json")
        assert as_json.returncode == 0, as_json.stderr
        (missing,) = json.loads(as_json.stdout)["jobs"][0]["pendingRounds"][0]["missingByHost"]
        assert (missing["host"], missing["ordinals"], missing["pids"]) == ("sim-host-1", [3], [os.getpid()]), missing
        assert missing["lastSeenAge"] >= 0

        for client in clients:
            client.close()  # the waiting calls end
        for thread in threads:
            thread.join(30)
        assert server.stop() == 0


def test_status_of_an_unknown_job_or_an_absent_coordinator_fails_with_a_message():
    """`status --job nope` exits 1 naming the known jobs; an address nobody listens on exits 1."""
    with Serve("--world-size", "2") as server:
        missing = run_cli("status", "--address", server.address, "--job", "nope")
        assert missing.returncode == 1 and "job 'nope' is not known" in missing.stderr and "'default'" in missing.stderr
        server.stop()
    gone = run_cli("status", "--address", server.address, timeout=60)
    assert gone.returncode == 1 and "pjrt-rendezvous status:" in gone.stderr


def test_status_names_a_forgotten_job_whose_processes_still_call():
    """A coordinator restarted without a state file forgets its job while the job's processes
    go on calling it, each call refused: status said "no jobs" (one serve log line told of
    them). It names the job, how many of its processes call and when the last did, in the
    table, in --json and for `status --job`; once a new process makes the job again, the old
    ones are shown in its section as processes not registered in it that still call."""
    ports = [str(free_port()), str(free_port())]
    flags = ("--port", ports[0], "--session-port", ports[1], "--heartbeat-timeout", "3")
    with Serve(*flags, port_flag=False) as first:
        clients = [simulated_process(first.address, t, processes=2, threads=1) for t in range(2)]
        threads = [bound_thread(c, 0)[0] for c in clients]
        first.wait_for_line("world formed")
        first.proc.kill()  # (no drain: as a crash)
        first.proc.wait(10)
    try:
        with Serve(*flags, port_flag=False) as second:
            heard = wait_until(
                lambda: (r := run_cli("status", "--address", second.address)).returncode == 0
                and "2 processes" in r.stdout and r.stdout,
                timeout=30, what="both processes' refused heartbeats",
            )
            assert heard.startswith(f"coordinator {second.address} (pjrt-rendezvous "), heard
            assert re.search(
                r": no jobs\n\njobs this coordinator does not know, whose processes still call it \(refused: it has "
                r"no --state-file, so a restart forgot its jobs, whose processes must start again\):\n"
                r"  job 'default': 2 processes, the last heard from \d+\.\d s ago\n$", heard,
            ), heard
            as_json = json.loads(run_cli("status", "--address", second.address, "--json").stdout)
            (unknown,) = as_json["unknownProcesses"]
            assert (unknown["job"], unknown["jobKnown"], unknown["processes"]) == ("default", False, 2), unknown
            assert 0 <= unknown["lastCallAge"] < 10
            one = run_cli("status", "--address", second.address, "--job", "default")
            assert one.returncode == 1 and "job 'default' is not known" in one.stderr, one.stderr
            assert re.search(r"; 2 processes of it heartbeat this coordinator, the last \d+\.\d+ s ago$", one.stderr.strip())

            fresh = simulated_process(second.address, 0, processes=2, threads=1)
            threads.append(bound_thread(fresh, 0)[0])  # (its registration makes the job again)
            after = json.loads(run_cli("status", "--address", second.address, "--json").stdout)
            assert [j["job"] for j in after["jobs"]] == ["default"], after
            # The old processes call on, strangers to the job made again: shown in its section.
            (unknown,) = after["unknownProcesses"]
            assert (unknown["job"], unknown["jobKnown"], unknown["processes"]) == ("default", True, 2), unknown
            table = run_cli("status", "--address", second.address).stdout
            assert re.search(
                r"\n  not registered in it, yet calling: 2 processes, the last heard from \d+\.\d s ago \(refused: it has "
                r"no --state-file, so a restart forgot them, or their job was dropped at --max-jobs \(made again since\): "
                r"they must register again\)\n",
                table,
            ), table
            assert "jobs this coordinator does not know" not in table
            fresh.close()
            second.stop()
    finally:
        for c in clients:
            c.close()
        for t in threads:
            t.join(10)


def test_status_finds_the_coordinator_where_serve_s_variables_put_it():
    """Next to a serve configuration (the image sets PJRT_RENDEZVOUS_HOST=0.0.0.0 and
    _PORT), `status` without --address dials that port on this machine, as `health` does."""
    with Serve("--world-size", "2") as server:
        found = run_cli("status", env={"PJRT_RENDEZVOUS_HOST": "0.0.0.0", "PJRT_RENDEZVOUS_PORT": str(server.port)})
        assert found.returncode == 0, found.stderr
        assert f"127.0.0.1:{server.port}" in found.stdout


def test_status_and_health_read_an_address_as_clients_do_and_need_no_known_tpu_layout():
    """An address without a port takes the default port (gRPC's own default is 443); a bad
    one is refused naming --address; a TPU type the client cannot lay out does not stop
    `status --address`."""
    with Serve("--world-size", "2") as server:
        unknown_tpu = run_cli("status", "--address", server.address, env={"TPU_ACCELERATOR_TYPE": "v9-8"})
        assert unknown_tpu.returncode == 0, unknown_tpu.stderr
        for command in ("health", "status"):
            default_port = run_cli(command, "--address", "nowhere.invalid", "--timeout", "2")
            assert default_port.returncode == 1 and "nowhere.invalid:7481" in default_port.stderr, default_port.stderr
            bad = run_cli(command, "--address", "127.0.0.1:99999")  # (2: a bad argument, not a coordinator down)
            assert bad.returncode == 2 and "--address has an invalid port" in bad.stderr, bad.stderr
        server.stop()


def test_status_without_address_finds_worker_0_where_the_client_cannot_lay_out_the_tpu(capsys):
    """`status` needs only the coordinator's address: on a TPU type the client cannot lay out
    (tpu7x-8) it still dials worker 0 of TPU_WORKER_HOSTNAMES, or of the metadata server's
    worker-network-endpoints, instead of failing on the topology."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    unroutable = "192.0.2.1"  # TEST-NET-1: nothing answers there
    env = clean_env(TPU_ACCELERATOR_TYPE="tpu7x-8", TPU_WORKER_HOSTNAMES=f"{unroutable},192.0.2.2")
    assert _cli.main(["status", "--timeout", "0.5"], env=env) == 1
    err = capsys.readouterr().err
    assert f"pjrt-rendezvous status: {unroutable}:7481: " in err and "accelerator" not in err, err

    class Metadata(BaseHTTPRequestHandler):
        answers = {"tpu-env": "ACCELERATOR_TYPE: 'tpu7x-8'\n", "worker-network-endpoints": f"w-0:1:{unroutable}"}

        def do_GET(self):  # noqa: N802 (http.server naming)
            body = self.answers.get(self.path.rsplit("/", 1)[-1])
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write((body or "").encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    thread = in_thread(server.serve_forever)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/attributes"
        assert _cli.main(["status", "--timeout", "0.5"], env=clean_env(PJRT_RENDEZVOUS_METADATA_URL=url)) == 1
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    err = capsys.readouterr().err
    assert f"pjrt-rendezvous status: {unroutable}:7481: " in err and "accelerator" not in err, err


def test_status_of_a_pod_larger_than_grpcs_default_message(capsys):
    """Two jobs of 65,536 ordinals: the status answer is over gRPC's default 4 MiB, which the
    command refused (RESOURCE_EXHAUSTED) where the library's own client takes any size."""
    from pjrt_rendezvous.coordinator import Coordinator
    from pjrt_rendezvous.coordinator._core import Registration, ThreadRequest

    def populate(core, done):
        for job in ("a", "b"):
            for task in range(16384):
                core.register(0.0, Registration(
                    job=job, incarnation=f"{job}-{task}", host=f"t1v-n-{task // 4}", pid=task, task_id=task,
                    num_tasks=16384, devices_per_task=4, local_rank=task % 4,
                    threads=tuple(ThreadRequest(thread_index=i, runtime_ordinal=None) for i in range(4)),
                ))
        core.take_wakeups()
        done.set()

    with Coordinator(port=0, heartbeat_timeout=None) as coordinator:
        done = threading.Event()
        coordinator._loop.call_soon_threadsafe(populate, coordinator.core, done)
        assert done.wait(120)
        assert _cli.main(["status", "--address", coordinator.address]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "job 'a'" in out and "job 'b'" in out and "t1v-n-4095" in out


def test_the_version_is_the_installed_distributions():
    """The package's version has one source, client/_version.py, which the build reads
    (pyproject.toml's dynamic version): what clients tell the coordinator, what the
    coordinator exports and `--version` prints is what pip installed."""
    from importlib import metadata

    assert metadata.version("pjrt-rendezvous") == VERSION
    done = run_cli("--version")
    assert done.returncode == 0 and done.stdout.split() == ["pjrt-rendezvous", build()], done
    assert build().startswith(f"{VERSION}+proto.") and len(build()) == len(VERSION) + 15


def test_a_client_of_another_version_is_logged_once_and_named_by_status(capsys, caplog):
    """Each process's client tells its package version at registration: status names the
    coordinator's and every process whose client is of another (an image and a training
    environment upgraded apart), and the coordinator logs such a process once per job and
    version (`version_mismatch`). A version that could forge a log line is refused."""
    import grpc

    from pjrt_rendezvous.coordinator import Coordinator

    ours = build()  # (the release and its protocol's digest)
    with Coordinator(port=0, heartbeat_timeout=None) as coordinator:
        client = simulated_process(coordinator.address, 0, processes=3, threads=1)
        bound_thread(client, 0)
        caplog.set_level("WARNING", logger="pjrt_rendezvous.coordinator")
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)

            def register(task: int, version: str):
                return stub.Register(pb.RegisterRequest(
                    job="default", incarnation=f"old-{task}", host="t1v-n-9", pid=100 + task, task_id=task,
                    num_tasks=3, devices_per_task=1, threads=[pb.ThreadSpec(thread_index=0)], client_version=version,
                ), timeout=10)

            register(1, "0.0.9")
            register(2, "0.0.9")
            with pytest.raises(grpc.RpcError) as refused:
                register(2, "0.0.9\n2026-12-03 INFO forged")
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
            assert "client version" in refused.value.details() and "control character" in refused.value.details()
        told = [r for r in caplog.records if getattr(r, "event", "") == "version_mismatch"]
        assert len(told) == 1 and told[0].getMessage() == (
            f"task 1 (t1v-n-9 pid 101) in job 'default' runs pjrt-rendezvous 0.0.9, this coordinator {ours}: "
            "upgrade both to one version (`pjrt-rendezvous status` names each process's)"
        ), [r.getMessage() for r in told]
        assert {p.client_version for j in client.status().jobs for p in j.participants} == {ours, "0.0.9"}
        assert _cli.main(["status", "--address", coordinator.address]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"coordinator {coordinator.address} (pjrt-rendezvous {ours}): 1 job\n"), out
        assert "  client version 0.0.9 (not the coordinator's): t1v-n-9 pid 101, t1v-n-9 pid 102\n" in out, out
        assert _cli.main(["status", "--address", coordinator.address, "--json"]) == 0
        as_json = json.loads(capsys.readouterr().out)
        assert as_json["coordinatorVersion"] == ours, as_json
        assert sorted(p["clientVersion"] for p in as_json["jobs"][0]["participants"]) == ["0.0.9", "0.0.9", ours]
        client.close()


def test_render_status_of_a_large_pod_stays_readable():
    """64 hosts of 8 processes of 8 threads, a strided round (every 8th ordinal) missing on
    every host, half a host not registered: a round's MISSING names 8 hosts and counts the
    rest, its GROUP and each host's ordinals are cut short (every line of the table was
    padded to a GROUP of 512 ordinals: 1,025 of 1,543 lines over 200 columns), and the
    unregistered ordinals say where they are."""
    participants = [
        pb.Participant(ordinal=o, task_id=o // 8, host=f"h{o // 64}", pid=1000 + o // 8, incarnation=f"i{o // 8}",
                       last_seen_age=1.0, alive=True)
        for o in range(4096 - 4)
    ]
    group = list(range(0, 4096 + 8, 8))  # (4096: of task 512, of no process yet)
    response = pb.StatusResponse(
        jobs=[
            pb.JobStatus(
                job="j", world_size=4096 + 8, registered=4092, generation=1, participants=participants, devices_per_task=8,
                pending_rounds=[
                    pb.PendingRound(replicas=group, round=3, tags=[pb.TagGroup(tag="t", ordinals=[0])], arrived=[0],
                                    missing=group[1:], waiting_seconds=30.0)
                ],
            )
        ]
    )
    lines = _cli.render_status(response, "x:1").splitlines()
    assert max(map(len, lines)) < 200, max(lines, key=len)
    assert len(lines) < 64 + 30, len(lines)  # (a line per host, a few per round)
    assert "  not registered: ordinals 4092-4103 (4092-4095 on h63 (pid 1511, last seen 1.0 s ago); 4096-4103 never registered)" in lines, lines[:4]
    (first,) = [line for line in lines if line.lstrip().startswith("3 ")]
    assert re.search(r"^  3\s+0, 8, 16, 24, 32, 40, .*, \.\.\. \(513 ordinals\)\s+'t'\s+1/513\s+30\.0 s\s+8, 16, 24", first), first
    # (the ordinal of no process is said, not counted as a host more)
    assert any(line.strip() == "and 448 ordinals on 56 hosts more (status --json lists them)" for line in lines), lines[-12:]
    assert any(line.strip() == "4096 never registered" for line in lines), lines[-12:]


def test_render_status_marks_dead_processes_and_groups_hosts_naturally():
    """Rendering alone: hosts sort as host-2 before host-10, a dead pid is marked and one that
    closed its client marked as left, both listed first, plural words agree."""
    participants = [
        pb.Participant(
            ordinal=o, task_id=o, host=f"host-{h}", pid=100 + o, incarnation=f"i{o}", last_seen_age=age, alive=alive, left=left,
            ended="returned" if o == 0 else "",
        )
        for o, h, age, alive, left in [(0, 10, 0.5, True, False), (1, 2, 75.0, False, False), (2, 10, 9.0, False, True)]
    ]
    response = pb.StatusResponse(
        jobs=[
            pb.JobStatus(
                job="j", world_size=3, registered=3, generation=3, rounds_completed=1, kv_keys=1,
                participants=participants,
                pending_rounds=[
                    pb.PendingRound(
                        replicas=[0, 1], round=7, tags=[pb.TagGroup(tag="a", ordinals=[0])], arrived=[0],
                        missing=[1], waiting_seconds=3725.0, missing_summary="1 on host-2 (dead)",
                    )
                ],
            )
        ]
    )
    text = _cli.render_status(response, "x:1")
    assert "1 round completed, 1 key, 1 pending round; of 3 processes, 1 left and 1 dead\n" in text, text
    rows = [line.split()[0] for line in text.splitlines() if line.strip().startswith("host-")]
    assert rows == ["host-2", "host-10"]
    assert _cli._natural("node-1²") == ["node-", 1, "²"]  # (a digit that is no decimal: int() raised)
    assert re.search(r"host-2\s+1 \(1 dead\)\s+101 \(dead\)\s+1\s+1 min 15 s ago", text), text
    # The departed first; last seen of its live process alone (one that left long ago is no news).
    # ... and its ordinals whose replicas ended while their process goes on.
    assert re.search(r"host-10\s+2 \(1 left\)\s+102 \(left\), 100\s+0, 2 \(ordinal 0 ended\)\s+0.5 s ago", text), text
    assert _cli._pids([1, 2, 3, 4, 5, 6], dead={6}, left={5}) == "6 (dead), 5 (left), 1, 2, +2 more"
    assert _cli._pids([1, 2, 3, 4], dead={4}, left={3}, closed={2}) == "4 (dead), 2 (connection closed), 3 (left), 1"
    assert _cli._processes_cell({"processes": 3, "dead": 1, "left": 1}) == "3 (1 dead, 1 left)"  # (was "3 (1 dead) (1 left)")
    assert _cli._pids([1, 2], unheard={2}) == "2 (not since the restart), 1"
    # (marked ones before the departed: an unheard pid is not hidden behind four that left)
    assert _cli._pids([1, 2, 3, 4, 5, 6], unheard={6}, left={2, 3, 4, 5}) == "6 (not since the restart), 2 (left), 3 (left), 4 (left), +2 more"
    # 8 hosts are shown whatever the lines of ordinals of no process before them
    hosts = [{"host": f"h{h}", "ordinals": [2 + h], "pids": [h], "deadPids": [], "leftPids": [], "closedPids": [],
              "unheardPids": [], "lastSeenAge": 1.0} for h in range(_cli._HOSTS_SHOWN)]
    where = _cli._where([{"host": None, "ordinals": [0, 1]}, *hosts], refused={0})
    assert where[:2] == ["0 refused (below)", "1 never registered"] and len(where) == 2 + _cli._HOSTS_SHOWN, where
    assert re.search(
        r"7\s+0-1\s+'a'\s+1/2\s+1 h 2 min\s+1 on host-2 \(pid 101 \(dead\), last seen 1 min 15 s ago\)", text
    ), text
    assert _cli.render_status(pb.StatusResponse(), "x:1") == "coordinator x:1: no jobs\n"
    # (status --job: the coordinator's jobs are not counted, "1 job" read as all it serves)
    assert _cli.render_status(response, "x:1", "j").startswith("coordinator x:1\n\njob ")


def test_render_status_names_many_finished_jobs_on_one_line():
    """A coordinator serving a job name per run keeps up to --max-jobs finished ones: past
    three, they are named on one line after the live jobs (each took some five lines, sorted
    by name among the live ones: 1,024 jobs, 5,000 lines); three or fewer stay in full."""
    def job(name, *, alive, pending=False):
        participant = pb.Participant(ordinal=0, task_id=0, host="h", pid=1, incarnation=name, alive=alive, left=not alive)
        rounds = [pb.PendingRound(round=0, arrived=[0], missing=[1])] if pending else []
        return pb.JobStatus(job=name, world_size=1, registered=1, generation=1, participants=[participant], pending_rounds=rounds)

    runs = [job(f"run-{i}", alive=False) for i in range(1, 26)]
    refused = job("refused", alive=False)  # (its next run's task refused: what the operator looks for)
    refused.refused.append(pb.RefusedTask(task_id=0, ordinals=[0], reason="h pid 2 was refused: ..."))
    jobs = [*runs, job("live", alive=True), job("failing", alive=False, pending=True), refused, pb.JobStatus(job="store", kv_keys=2)]
    text = _cli.render_status(pb.StatusResponse(jobs=jobs), "x:1")
    named = ", ".join(f"'run-{i}'" for i in range(1, 21))
    assert text.endswith(
        f"\n\n25 finished jobs (every process left or dead; `status --job NAME` shows one, --json all): {named} and 5 more\n"
    ), text
    assert [line.split()[1] for line in text.splitlines() if line.startswith("job ")] == ["'live':", "'failing':", "'refused':", "'store':"]
    few = _cli.render_status(pb.StatusResponse(jobs=[*runs[:3], jobs[-3]]), "x:1")
    assert "finished jobs" not in few and few.count("\njob 'run-") == 3, few
    # A finished job whose processes the coordinator does not know still call is shown whole
    calling = pb.UnknownProcesses(job="run-7", job_known=True, processes=2, last_call_age=1.0, reason="a restart")
    text = _cli.render_status(pb.StatusResponse(jobs=jobs, unknown_processes=[calling]), "x:1")
    assert "\njob 'run-7':" in text and "not registered in it, yet calling: " in text and "'run-7'" not in text.splitlines()[-1], text
    assert "24 finished jobs" in text.splitlines()[-1], text


def test_render_status_says_a_process_not_heard_from_since_a_restart():
    """Restored from the state file and silent since, a process's "last seen 4.1 s ago" was
    counted from the restart (it may have been gone long before), where the coordinator's own
    messages say so: status says so too; a connection closed is marked on its pid."""
    participants = [
        pb.Participant(ordinal=0, task_id=0, host="h0", pid=10, incarnation="a", last_seen_age=4.1, alive=True,
                       unheard_since_restart=True),
        pb.Participant(ordinal=1, task_id=1, host="h1", pid=11, incarnation="b", last_seen_age=2.0, alive=True,
                       disconnected_age=1.5),
        pb.Participant(ordinal=2, task_id=2, host="h2", pid=12, incarnation="c", last_seen_age=0.2, alive=True),
    ]
    response = pb.StatusResponse(jobs=[pb.JobStatus(
        job="j", world_size=3, registered=3, generation=1, participants=participants,
        pending_rounds=[pb.PendingRound(round=0, tags=[pb.TagGroup(tag="t", ordinals=[2])], arrived=[2], missing=[0, 1],
                                        waiting_seconds=5.0)],
    )])
    text = _cli.render_status(response, "x:1")
    assert re.search(r"h0\s+1\s+10\s+0\s+4.1 s ago \(not since the restart\)", text), text
    assert re.search(r"h2\s+1\s+12\s+2\s+0.2 s ago\n", text), text
    assert "0 on h0 (pid 10, not heard from since the coordinator restarted 4.1 s ago)" in text, text
    assert "1 on h1 (pid 11 (connection closed), last seen 2.0 s ago)" in text, text
    # A host of two processes, one unheard: its pid marked, not the host (its heard one was).
    participants.append(pb.Participant(ordinal=3, task_id=3, host="h0", pid=13, incarnation="d", last_seen_age=0.5,
                                       alive=True, ended="its thread raised"))
    response.jobs[0].world_size = response.jobs[0].registered = 4
    response.jobs[0].ClearField("participants")
    response.jobs[0].participants.extend(participants)
    text = _cli.render_status(response, "x:1")
    assert re.search(r"h0\s+2\s+10 \(not since the restart\), 13\s+0, 3 \(ordinal 3 ended\)\s+4.1 s ago\n", text), text
    job = _cli.status_json(response, "x:1")["jobs"][0]
    assert [h["unheardPids"] for h in job["hosts"]] == [[10], [], []] and job["participants"][0]["unheardSinceRestart"]


# -- health ---------------------------------------------------------------------------------


def test_health_exit_codes():
    """`health` exits 0 for a serving coordinator (found at PJRT_RENDEZVOUS_PORT by default),
    1 for an unknown service, and 1 once the coordinator is gone."""
    with Serve() as server:
        ok = run_cli("health", "--address", server.address)
        assert (ok.returncode, ok.stdout.strip()) == (0, f"{server.address}: SERVING"), ok.stderr
        local = run_cli("health", env={"PJRT_RENDEZVOUS_PORT": str(server.port)})
        assert local.returncode == 0, local.stderr
        coordinator = run_cli("health", "--address", server.address, "--service", "pjrt_rendezvous.v1.Coordinator")
        assert coordinator.returncode == 0, coordinator.stderr
        unknown = run_cli("health", "--address", server.address, "--service", "no.such.Service")
        assert unknown.returncode == 1 and "NOT_FOUND: the coordinator has no such service" in unknown.stderr
        assert server.stop() == 0
    started = time.monotonic()
    down = run_cli("health", "--address", server.address, "--timeout", "2")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr
    assert time.monotonic() - started < 30


def test_health_needs_no_token():
    """Against a coordinator that requires a token, health passes without one (probes carry none)."""
    with Serve(env={"PJRT_RENDEZVOUS_TOKEN": "sekrit-123"}) as server:
        assert run_cli("health", "--address", server.address).returncode == 0
        refused = run_cli("status", "--address", server.address)
        assert refused.returncode == 1 and "no token" in refused.stderr
        allowed = run_cli("status", "--address", server.address, env={"PJRT_RENDEZVOUS_TOKEN": "sekrit-123"})
        assert allowed.returncode == 0, allowed.stderr
        server.stop()


def test_health_wait_returns_once_the_coordinator_listens():
    """`health --wait` started before the coordinator exits 0 as soon as it serves."""
    port = free_port()
    waiting = subprocess.Popen(
        [*CLI, "health", "--wait", "--timeout", "60", "--address", f"127.0.0.1:{port}"],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        time.sleep(1.0)
        assert waiting.poll() is None  # still waiting: nothing listens yet
        with Serve("--port", str(port), "--session-port", "0", port_flag=False) as server:
            out, err = waiting.communicate(timeout=60)
            assert waiting.returncode == 0, err
            assert "SERVING" in out
            server.stop()
    finally:
        waiting.kill()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A self-signed certificate issued only for the name coordinator.test (not 127.0.0.1);
    also a key of no certificate (other.key) and a file that is no PEM (junk.pem)."""
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=coordinator.test",
         "-addext", "subjectAltName=DNS:coordinator.test", "-keyout", "server.key", "-out", "server.pem"],
        cwd=d, check=True, capture_output=True, timeout=60,
    )
    subprocess.run(
        ["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "other.key"],
        cwd=d, check=True, capture_output=True, timeout=60,
    )
    (d / "junk.pem").write_text("not a certificate\n")
    for command in (  # (-days 0: valid until the second it was made)
        ["req", "-new", "-key", "server.key", "-subj", "/CN=coordinator.test", "-out", "expired.csr"],
        ["x509", "-req", "-in", "expired.csr", "-signkey", "server.key", "-days", "0", "-out", "expired.pem"],
    ):
        subprocess.run(["openssl", *command], cwd=d, check=True, capture_output=True, timeout=60)
    time.sleep(1.1)  # (expired now)
    subprocess.run(
        ["openssl", "pkey", "-in", "server.key", "-aes256", "-passout", "pass:x", "-out", "encrypted.key"],
        cwd=d, check=True, capture_output=True, timeout=60,
    )
    return d


def test_health_with_tls_uses_the_client_variables(tls_files):
    """With TLS on (server files from PJRT_RENDEZVOUS_SERVER_TLS_*), health trusts the CA from
    PJRT_RENDEZVOUS_TLS_CA and checks the name from PJRT_RENDEZVOUS_TLS_SERVER_NAME."""
    server_env = {
        "PJRT_RENDEZVOUS_SERVER_TLS_CERT": str(tls_files / "server.pem"),
        "PJRT_RENDEZVOUS_SERVER_TLS_KEY": str(tls_files / "server.key"),
    }
    with Serve(env=server_env) as server:
        ca = {"PJRT_RENDEZVOUS_TLS_CA": str(tls_files / "server.pem")}
        plaintext = run_cli("health", "--address", server.address, "--timeout", "3")
        assert plaintext.returncode == 1
        assert re.search(r"[.?] If it serves TLS, this client needs PJRT_RENDEZVOUS_TLS_CA", plaintext.stderr), plaintext.stderr
        for command in ("status", "health --wait"):  # they wait out --timeout, then say why
            waited = run_cli(*command.split(), "--address", server.address, "--timeout", "2")
            assert waited.returncode == 1 and ": UNAVAILABLE: " in waited.stderr, (command, waited.stderr)
        for command in ("health", "status"):  # the certificate does not name 127.0.0.1: said at once
            started = time.monotonic()
            wrong_name = run_cli(command, "--address", server.address, "--timeout", "20", env=ca)
            assert wrong_name.returncode == 1 and time.monotonic() - started < 15, (command, wrong_name.stderr)
            assert "TLS certificate does not name the host this client dials" in wrong_name.stderr, wrong_name.stderr
        named = run_cli(
            "health", "--address", server.address, env={**ca, "PJRT_RENDEZVOUS_TLS_SERVER_NAME": "coordinator.test"}
        )
        assert named.returncode == 0, named.stderr
        flag = run_cli("health", "--address", server.address, "--tls-server-name", "coordinator.test", env=ca)
        assert flag.returncode == 0, flag.stderr
        status = run_cli(
            "status", "--address", server.address, env={**ca, "PJRT_RENDEZVOUS_TLS_SERVER_NAME": "coordinator.test"}
        )
        assert status.returncode == 0, status.stderr
        server.stop()


def test_status_and_health_wait_say_why_they_cannot_connect():
    """`status` and `health --wait` wait out --timeout for a coordinator that is starting,
    then report why they could not connect (as `health` without --wait does), not
    DEADLINE_EXCEEDED."""
    address = f"127.0.0.1:{free_port()}"
    for command in ("status", "health --wait", "health"):
        started = time.monotonic()
        out = run_cli(*command.split(), "--address", address, "--timeout", "2")
        assert out.returncode == 1 and "Connection refused" in out.stderr, (command, out.stderr)
        assert "DEADLINE_EXCEEDED" not in out.stderr, (command, out.stderr)
        # It did wait (until less than RETRY_EVERY, 0.2 s, was left: a CI run took 1.96 s in all)
        assert command == "health" or time.monotonic() - started > 1.5
    unknown = run_cli("status", "--address", "nowhere.invalid", "--timeout", "2")
    assert unknown.returncode == 1 and "DEADLINE_EXCEEDED" not in unknown.stderr, unknown.stderr
    assert "nowhere.invalid:7481: UNAVAILABLE: " in unknown.stderr, unknown.stderr


def test_status_and_health_say_what_no_answer_means():
    """Against a port that takes connections and never answers (a stopped or frozen
    coordinator), `status` and `health` end at --timeout saying so, not with gRPC's bare
    "Deadline Exceeded"."""
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(16)  # (connections complete in the backlog; nothing reads them)
        address = f"127.0.0.1:{frozen.getsockname()[1]}"
        for command in ("status", "health"):
            out = run_cli(command, "--address", address, "--timeout", "1.5")
            assert out.returncode == 1, (command, out.stderr)
            assert "No answer within 1.5 s (--timeout): the coordinator, or the network to it, is frozen" in out.stderr, out.stderr


def test_health_and_status_ignore_client_settings_they_do_not_use():
    """A container's probe runs in the coordinator's environment, which may hold client
    settings too: malformed ones that `health` and `status` do not use (timeouts, job,
    fan-in...) fail neither; `health` sends no token (health checks need none), so not even
    a token gRPC cannot carry fails it."""
    unused = {
        "PJRT_RENDEZVOUS_TIMEOUT": "0", "PJRT_RENDEZVOUS_CONNECT_TIMEOUT": "soon", "PJRT_RENDEZVOUS_BATCH_WINDOW": "x",
        "PJRT_RENDEZVOUS_FAN_IN": "on", "PJRT_RENDEZVOUS_TRANSPORT": "udp", "PJRT_RENDEZVOUS_HEARTBEAT_INTERVAL": "0",
        "PJRT_RENDEZVOUS_PROGRESS_INTERVAL": "x", "PJRT_RENDEZVOUS_JOB": " train",
    }
    with Serve() as server:
        for command in ("health", "status"):
            out = run_cli(command, "--address", server.address, env=unused)
            assert out.returncode == 0, (command, out.stderr)
        wrapped = run_cli("health", "--address", server.address, env={"PJRT_RENDEZVOUS_TOKEN": "abc\ndef"})
        assert wrapped.returncode == 0, wrapped.stderr
        server.stop()


def test_health_and_status_name_the_variable_that_gave_a_bad_address():
    """Without --address, a malformed PJRT_RENDEZVOUS_PORT (a Kubernetes service link's
    tcp://IP:PORT), port 0 (serve picks a free one) or a malformed PJRT_RENDEZVOUS_ADDRESS is
    refused naming that variable, not --address, which nobody gave."""
    link = {"PJRT_RENDEZVOUS_PORT": "tcp://10.0.0.1:7481"}
    for command in ("health", "status"):
        out = run_cli(command, env=link)
        assert out.returncode == 2 and "PJRT_RENDEZVOUS_PORT='tcp://10.0.0.1:7481': port must be an integer" in out.stderr, out.stderr
        assert "--address" not in out.stderr, out.stderr
        free = run_cli(command, env={"PJRT_RENDEZVOUS_PORT": "0"})
        assert free.returncode == 2 and "PJRT_RENDEZVOUS_PORT=0 makes serve pick a free port" in free.stderr, free.stderr
    address = run_cli("status", env={"PJRT_RENDEZVOUS_ADDRESS": "127.0.0.1:99999"})
    assert address.returncode == 2 and "PJRT_RENDEZVOUS_ADDRESS has an invalid port" in address.stderr, address.stderr


# -- serve settings -------------------------------------------------------------------------


def test_serve_takes_its_settings_from_variables_and_flags_win(tmp_path):
    """PJRT_RENDEZVOUS_WORLD_SIZE, _STATE_FILE, _HOST and _LOG_FORMAT configure serve; a flag
    given on the command line wins over its variable; a bad value is refused naming the variable."""
    state = tmp_path / "state"
    env = {
        "PJRT_RENDEZVOUS_HOST": "127.0.0.1",
        "PJRT_RENDEZVOUS_WORLD_SIZE": "4",
        "PJRT_RENDEZVOUS_STATE_FILE": str(state),
        "PJRT_RENDEZVOUS_LOG_FORMAT": "json",
        "PJRT_RENDEZVOUS_JOB": "",  # empty: unset
    }
    with Serve(env=env) as server:
        status = run_cli("status", "--address", server.address)
        assert "job 'default': 0/4 ordinals registered" in status.stdout, status.stderr
        assert state.exists()
        line = server.wait_for_line(r'"event": "listening"')
        assert json.loads(line)["port"] == server.port
        server.stop()
    with Serve("--world-size", "6", "--state-file", str(tmp_path / "other"), env=env) as server:
        assert "0/6 ordinals registered" in run_cli("status", "--address", server.address).stdout
        server.stop()
    bad = run_cli("serve", "--port", "0", env={"PJRT_RENDEZVOUS_HEARTBEAT_TIMEOUT": "soon"})
    assert bad.returncode == 2 and "PJRT_RENDEZVOUS_HEARTBEAT_TIMEOUT='soon'" in bad.stderr


def test_a_flag_wins_over_its_malformed_variable():
    """A flag on the command line wins: its variable is not read, so a malformed one (here a
    Kubernetes service link's PJRT_RENDEZVOUS_PORT=tcp://IP:PORT) does not stop serve; without
    the flag it is refused, naming the variable."""
    link = {"PJRT_RENDEZVOUS_PORT": "tcp://10.0.0.1:7481"}
    with Serve("--session-port", "0", env=link) as server:  # (Serve gives --port 0)
        assert run_cli("health", "--address", server.address).returncode == 0
        server.stop()
    refused = run_cli("serve", env=link, timeout=30)
    assert refused.returncode == 2 and "PJRT_RENDEZVOUS_PORT='tcp://10.0.0.1:7481'" in refused.stderr, refused.stderr
    assert "a Kubernetes service link? set enableServiceLinks: false" in refused.stderr, refused.stderr


def test_serve_refuses_a_token_grpc_cannot_send_naming_where_it_came_from(tmp_path):
    """gRPC sends the token in a header, printable ASCII alone: a token file `base64` wrapped
    onto two lines, a tab or a byte beyond ASCII would fail every call ("Invalid metadata").
    `serve` refuses them as it starts, naming the flag, the variable or the file; a file's
    last line break is no part of the token."""
    wrapped = tmp_path / "wrapped"
    wrapped.write_text("A" * 76 + "\n" + "B" * 12 + "\n")  # as `openssl rand -base64 64` writes it
    binary = tmp_path / "binary"
    binary.write_bytes(b"tok\x88en\n")
    cases = [
        ((("--token-file", str(wrapped)), {}), f"the file {wrapped} (--token-file)"),
        (((), {"PJRT_RENDEZVOUS_TOKEN_FILE": str(wrapped)}), f"the file {wrapped} (PJRT_RENDEZVOUS_TOKEN_FILE)"),
        (((), {"PJRT_RENDEZVOUS_TOKEN": "abc\tdef"}), "PJRT_RENDEZVOUS_TOKEN "),
        (((), {"PJRT_RENDEZVOUS_TOKEN": "pässwörd"}), "PJRT_RENDEZVOUS_TOKEN "),
        ((("--token-file", str(binary)), {}), f"the token file {binary} (--token-file)"),
    ]
    for (args, env), named in cases:
        out = run_cli("serve", "--port", "0", *args, env=env, timeout=30)
        assert out.returncode == 2 and named in out.stderr and "printable ASCII" in out.stderr, (args, env, out.stderr)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for args, env, named in [
        ((), {"PJRT_RENDEZVOUS_TOKEN": " "}, "the token from PJRT_RENDEZVOUS_TOKEN is empty"),
        (("--token-file", str(empty)), {}, f"the token from the file {empty} (--token-file) is empty"),
    ]:  # (the variable's said only "the token is empty")
        out = run_cli("serve", "--port", "0", *args, env=env, timeout=30)
        assert out.returncode == 2 and named in out.stderr, (args, env, out.stderr)
    with pytest.raises(pr.UsageError, match="the token from PJRT_RENDEZVOUS_TOKEN, .* is empty"):
        pr.Settings(address="127.0.0.1:1", token=" ")
    one_line = tmp_path / "token"
    one_line.write_text("sekrit-123\n")
    with Serve("--token-file", str(one_line)) as server:
        allowed = run_cli("status", "--address", server.address, env={"PJRT_RENDEZVOUS_TOKEN": "sekrit-123"})
        assert allowed.returncode == 0, allowed.stderr
        server.stop()


def test_a_comment_left_in_a_variable_s_value_is_named():
    """systemd's EnvironmentFile= keeps a comment after a value in the value (a shell drops
    it). A number then fails to parse, a token took the comment as part of the secret
    (`health` passed while every client was refused), a state file's path or a job name took
    it in (a state file named "c.state # file"; a job "train # fixed size" given the world
    size meant for "train"), a host failed to listen, exit 1, naming flags nobody gave.
    serve refuses each, saying so (exit 2, which the unit does not restart); health and
    status refuse the host and port; a client its job name and file paths."""
    hint = "a comment after the value? systemd's EnvironmentFile= keeps everything after '='"
    for variable, value in [
        ("PJRT_RENDEZVOUS_WORLD_SIZE", "32          # fix the default job's world size up front"),
        ("PJRT_RENDEZVOUS_TOKEN", "s3cret              # shared secret"),
        ("PJRT_RENDEZVOUS_STATE_FILE", "/var/lib/pjrt-rendezvous/c.state # file"),
        ("PJRT_RENDEZVOUS_JOB", "train # fixed size"),
        ("PJRT_RENDEZVOUS_HOST", "127.0.0.1 # where"),
    ]:
        out = run_cli("serve", "--port", "0", env={variable: value}, timeout=30)
        assert out.returncode == 2 and variable in out.stderr and hint in out.stderr, (variable, out.stderr)
    for command in ("health", "status"):
        out = run_cli(command, env={"PJRT_RENDEZVOUS_HOST": "127.0.0.1 # where", "PJRT_RENDEZVOUS_PORT": "7481"})
        assert out.returncode == 2 and "PJRT_RENDEZVOUS_HOST" in out.stderr and hint in out.stderr, (command, out.stderr)
    with pytest.raises(pr.UsageError, match="holds a blank followed by '#'"):
        pr.Settings(address="127.0.0.1:1", token="s3cret # shared secret")
    for variable, value in [("PJRT_RENDEZVOUS_JOB", "train # fixed size"), ("PJRT_RENDEZVOUS_TLS_CA", "/etc/ca.pem # ca")]:
        with pytest.raises(pr.UsageError, match=re.escape(f"{variable}={value!r} holds a blank followed by '#'")):
            pr.Settings.resolve({variable: value}, address="127.0.0.1:1")  # (clients read the same files)
    assert pr.Settings(address="127.0.0.1:1", token="a#b c").token == "a#b c"  # '#' alone is no comment


def test_a_quoted_value_is_named():
    """docker's --env-file keeps quotes in a value (PJRT_RENDEZVOUS_HEARTBEAT_TIMEOUT="60"):
    the refusal said only that '"60"' is not a number."""
    hint = "quotes around the value? docker's --env-file keeps them in it: write the value bare"
    for variable, value in [("PJRT_RENDEZVOUS_HEARTBEAT_TIMEOUT", '"60"'), ("PJRT_RENDEZVOUS_PORT", "'7481'")]:
        out = run_cli("serve", env={"PJRT_RENDEZVOUS_PORT": "0", variable: value}, timeout=30)
        assert out.returncode == 2 and variable in out.stderr and out.stderr.count(hint) == 1, (variable, out.stderr)
    for variable in ("PJRT_RENDEZVOUS_TIMEOUT", "PJRT_RENDEZVOUS_BATCH_WINDOW"):
        with pytest.raises(pr.UsageError, match=re.escape(hint)):
            pr.Settings.resolve({variable: '"60"'}, address="127.0.0.1:1")


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_serve_listens_on_a_bracketed_ipv6_host():
    """`--host [::1]` (an address's spelling) listens there on every port: gRPC, the session
    port and metrics, as does an embedded coordinator; brackets around anything else are
    refused up front."""
    from pjrt_rendezvous.coordinator import Coordinator

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    with Coordinator(host="[::1]", session_port=0, metrics_port=0) as embedded:
        assert embedded.address == f"[::1]:{embedded.port}" and embedded.session_port and embedded.metrics_port
    with Serve("--host", "[::1]", "--metrics-port", "0") as server:
        assert [line.split()[-1] for line in server.stdout_lines] == [
            f"[::1]:{server.port}", f"[::1]:{server.session_port}", f"http://[::1]:{server.metrics_port}/metrics",
        ]
        local = run_cli("health", env={"PJRT_RENDEZVOUS_HOST": "[::1]", "PJRT_RENDEZVOUS_PORT": str(server.port)})
        assert local.returncode == 0 and f"[::1]:{server.port}: SERVING" in local.stdout, local.stderr
        with socket.create_connection(("::1", server.metrics_port), timeout=10):
            pass
        assert server.stop() == 0
    unclosed = run_cli("serve", "--port", "0", "--host", "[::1", timeout=30)
    assert unclosed.returncode == 2 and "brackets are for an IPv6 address" in unclosed.stderr, unclosed.stderr


_DUAL_STACK_CHECK = """
import fcntl, json, socket, struct
# This is a network namespace of its own: its one interface, lo, is down until brought up.
with socket.socket() as s:
    flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0))[:18])[1]  # SIOCGIFFLAGS
    fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))  # SIOCSIFFLAGS, IFF_UP
from pjrt_rendezvous.coordinator import Coordinator
reached = {}
for host in ("::", "0.0.0.0"):
    with Coordinator(host=host, session_port=0, metrics_port=0) as coordinator:
        for what, port in (("grpc", coordinator.port), ("session", coordinator.session_port), ("metrics", coordinator.metrics_port)):
            for peer in ("127.0.0.1", "::1"):
                try:
                    socket.create_connection((peer, port), timeout=5).close()
                    reached[f"{host} {what} {peer}"] = True
                except OSError:
                    reached[f"{host} {what} {peer}"] = False
print(json.dumps(reached))
"""


@pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="no dual-stack IPv6")
def test_a_wildcard_host_listens_on_both_families_on_every_port():
    """`--host ::` (and 0.0.0.0) take IPv4 and IPv6 on the session and metrics ports as
    gRPC's port does (asyncio's IPv6 sockets took IPv6 alone: IPv4 clients fell back to
    gRPC, and Prometheus could not scrape over IPv4). Run in a network namespace of its own
    (`unshare -n`), where a wildcard is loopback alone."""
    try:
        out = subprocess.run(
            ["unshare", "-n", sys.executable, "-c", _DUAL_STACK_CHECK],
            env=clean_env(), capture_output=True, text=True, timeout=120,
        )
    except FileNotFoundError:
        pytest.skip("no unshare")
    if out.returncode != 0 and "unshare" in out.stderr:
        pytest.skip(f"cannot make a network namespace here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    reached = json.loads(out.stdout)
    assert len(reached) == 12 and all(reached.values()), reached


def test_serve_startup_errors_name_their_option(tmp_path, tls_files):
    """Each startup error names the option (or the variable) it is about: a metrics port in
    use, a TLS or token file that cannot be read, a key of another certificate, a client CA
    that is no PEM (not blamed on the port), an encrypted key, a key and certificate swapped, an
    expired certificate; a stray space in PJRT_RENDEZVOUS_HOST is none."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = run_cli("serve", "--port", "0", "--metrics-port", str(port), timeout=30)
    assert busy.returncode == 1, busy.stderr
    assert f"cannot listen on the metrics port 127.0.0.1:{port} (--metrics-host, --metrics-port)" in busy.stderr
    cert, key = str(tls_files / "server.pem"), str(tls_files / "server.key")
    missing = str(tmp_path / "nope.pem")
    cases = [
        (("--tls-cert", missing, "--tls-key", key), {}, f"cannot read {missing} (--tls-cert): No such file"),
        (("--tls-key", key), {"PJRT_RENDEZVOUS_SERVER_TLS_CERT": missing}, f"cannot read {missing} (PJRT_RENDEZVOUS_SERVER_TLS_CERT)"),
        (("--token-file", missing), {}, f"cannot read the token file {missing} (--token-file)"),
    ]
    for args, env, named in cases:
        out = run_cli("serve", "--port", "0", *args, env=env, timeout=30)
        assert out.returncode == 1 and named in out.stderr and "port is in use" not in out.stderr, (args, out.stderr)
    # Files that are there but no PEM pair are malformed settings, exit 2 (they failed when gRPC
    # listened, exit 1, which the unit restarts to fail again).
    other = str(tls_files / "other.key")
    for args, env, named in [
        (("--tls-cert", cert, "--tls-key", other), {},
         f"the TLS certificate {cert} (--tls-cert) and key {other} (--tls-key) are not a PEM certificate and its unencrypted private key: "),
        (("--tls-key", key, "--tls-ca", str(tls_files / "junk.pem")), {"PJRT_RENDEZVOUS_SERVER_TLS_CERT": cert},
         f"the client CA {tls_files / 'junk.pem'} (--tls-ca) holds no PEM certificate"),
        (("--tls-cert", cert, "--tls-key", str(tls_files / "encrypted.key")), {},
         f"the key is encrypted, which gRPC cannot use: decrypt it (openssl pkey -in {tls_files / 'encrypted.key'} -out NEW.key)"),
        (("--tls-cert", key, "--tls-key", cert), {}, "the certificate's file holds a private key (the two files swapped?)"),
        (("--tls-cert", str(tls_files / "expired.pem"), "--tls-key", key), {},
         f"the TLS certificate {tls_files / 'expired.pem'} (--tls-cert) is refused by every client: it expired on "),
    ]:
        out = run_cli("serve", "--port", "0", *args, env=env, timeout=30)
        assert out.returncode == 2 and named in out.stderr, (args, out.stderr)
    with Serve(env={"PJRT_RENDEZVOUS_HOST": "127.0.0.1 "}) as server:
        assert server.stdout_lines[0] == f"pjrt-rendezvous coordinator listening on 127.0.0.1:{server.port}"
        server.stop()
    # Not an error, but not silent: a session port named with TLS is none.
    with Serve("--tls-cert", cert, "--tls-key", key, "--session-port", "0") as server:
        server.wait_for_line(r"no session port with TLS \(it is plain TCP\): --session-port=0 is ignored")
        server.stop()


def test_serve_refuses_an_empty_host():
    """A blank host is refused as such (gRPC's "host must not be empty" was reported as a port
    in use); an empty variable is unset, as for every variable."""
    for args, env, named in [
        (("--host", ""), {}, "argument --host: the host to listen on is empty"),
        ((), {"PJRT_RENDEZVOUS_HOST": " "}, "PJRT_RENDEZVOUS_HOST=' ': the host to listen on is empty"),
    ]:
        out = run_cli("serve", "--port", "0", *args, env=env, timeout=30)
        assert out.returncode == 2 and named in out.stderr and "in use" not in out.stderr, out.stderr
    with Serve(env={"PJRT_RENDEZVOUS_HOST": ""}) as server:
        assert server.stdout_lines[0] == f"pjrt-rendezvous coordinator listening on 127.0.0.1:{server.port}"
        server.stop()


def test_serve_refuses_a_host_with_a_port_or_a_scheme_and_says_why_it_cannot_listen():
    """A host with a port, a scheme or an IPv4 address out of range is refused as malformed
    (exit 2); one that does not resolve, or is not this machine's, exits 1 with the system's
    reason (both said "the port is in use, or the host is not an address of this machine")."""
    for host in ("127.0.0.1:80", "http://127.0.0.1", "256.1.1.1", "worker 0"):
        out = run_cli("serve", "--port", "0", "--host", host, timeout=30)
        assert out.returncode == 2 and "without a port or a scheme" in out.stderr, (host, out.stderr)
    for host, reasons in (("bogus.invalid", ("not known", "name resolution")), ("192.0.2.1", ("Cannot assign",))):
        out = run_cli("serve", "--port", "0", "--session-port", "off", "--host", host, timeout=30)
        assert out.returncode == 1 and f"cannot listen on {host}:0 (--host, --port): " in out.stderr, out.stderr
        assert any(r in out.stderr for r in reasons) and "in use" not in out.stderr, out.stderr


def test_serve_setting_errors_name_what_set_them():
    """A metrics host without a metrics port is refused (it was ignored: no endpoint, no word),
    naming the variable when one set it; a bad session port names its words too."""
    for args, env, named in [
        (("--metrics-host", "127.0.0.1"), {}, "--metrics-host (where the metrics endpoint listens) needs --metrics-port"),
        ((), {"PJRT_RENDEZVOUS_METRICS_HOST": "127.0.0.1"}, "PJRT_RENDEZVOUS_METRICS_HOST (where the metrics endpoint listens)"),
    ]:
        out = run_cli("serve", "--port", "0", *args, env=env, timeout=30)
        assert out.returncode == 2 and named in out.stderr, out.stderr
    missing = run_cli("serve", "--port", "0", env={"PJRT_RENDEZVOUS_STATE_FILE": "/nonexistent/state"}, timeout=30)
    assert missing.returncode == 1 and "/nonexistent/state (PJRT_RENDEZVOUS_STATE_FILE) does not exist" in missing.stderr
    bad = run_cli("serve", "--port", "0", env={"PJRT_RENDEZVOUS_SESSION_PORT": "foo"}, timeout=30)
    assert bad.returncode == 2 and "PJRT_RENDEZVOUS_SESSION_PORT='foo': port must be an integer, got 'foo', auto or off" in bad.stderr


def test_serve_refuses_a_job_name_clients_refuse():
    """PJRT_RENDEZVOUS_JOB is shared with the clients, which refuse ' train': serve must not
    create a job no client can join."""
    spaced = run_cli("serve", "--port", "0", "--world-size", "2", env={"PJRT_RENDEZVOUS_JOB": " train"}, timeout=30)
    assert spaced.returncode == 2 and "PJRT_RENDEZVOUS_JOB=' train'" in spaced.stderr, spaced.stderr
    assert "spaces at an end" in spaced.stderr
    for job in ("train ", ""):
        flag = run_cli("serve", "--port", "0", "--job", job, timeout=30)
        assert flag.returncode == 2 and "argument --job" in flag.stderr, flag.stderr


def test_serve_refuses_a_declared_job_over_its_limits_as_a_setting():
    """A --world-size over --max-world-size, or a --job longer than --max-name-length (by
    flag or variable): exit 2, naming what set them (the core refused them once serving:
    exit 1, a restart loop under the unit, naming max_world_size)."""
    over = run_cli("serve", "--port", "0", "--world-size", "100000", timeout=30)
    assert over.returncode == 2 and "a world size of 100000 (--world-size) is over the largest this coordinator takes, 65536 (--max-world-size)" in over.stderr, over.stderr
    env = {"PJRT_RENDEZVOUS_MAX_WORLD_SIZE": "8", "PJRT_RENDEZVOUS_WORLD_SIZE": "16"}
    variables = run_cli("serve", "--port", "0", env=env, timeout=30)
    assert variables.returncode == 2 and "a world size of 16 (PJRT_RENDEZVOUS_WORLD_SIZE) is over" in variables.stderr, variables.stderr
    assert "8 (PJRT_RENDEZVOUS_MAX_WORLD_SIZE)" in variables.stderr, variables.stderr
    long = run_cli("serve", "--port", "0", "--world-size", "2", "--job", "j" * 300, timeout=30)
    assert long.returncode == 2 and "a job name of 300 characters (--job) is over the limit of 256 (--max-name-length)" in long.stderr, long.stderr


@pytest.mark.parametrize("json_by", ["flag", "variable"])
def test_a_bad_variable_under_json_logs_is_refused_in_a_json_line(json_by):
    """With the log format json (by flag or variable), the refusal of a malformed variable is
    one more JSON line like the log's, for the log collector; with an unknown format, text."""
    args, env = (("--log-format", "json"), {}) if json_by == "flag" else ((), {"PJRT_RENDEZVOUS_LOG_FORMAT": "json"})
    out = run_cli("serve", "--port", "0", *args, env={**env, "PJRT_RENDEZVOUS_GRACE": "x"}, timeout=30)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.splitlines()
    record = json.loads(line)
    assert (record["level"], record["event"]) == ("ERROR", "failed") and "PJRT_RENDEZVOUS_GRACE='x'" in record["message"]
    unknown = run_cli("serve", "--port", "0", env={"PJRT_RENDEZVOUS_LOG_FORMAT": "xml", "PJRT_RENDEZVOUS_GRACE": "x"}, timeout=30)
    assert unknown.returncode == 2 and unknown.stderr.startswith("pjrt-rendezvous: PJRT_RENDEZVOUS_GRACE='x'"), unknown.stderr


def test_every_serve_option_has_a_variable():
    """Each serve flag (but --help) is in SERVE_VARIABLES, so the deploy files can set any of them."""
    parser = _cli._parser({})
    serve = parser._subparsers._group_actions[0].choices["serve"]
    dests = {a.dest for a in serve._actions if a.dest != "help"}
    assert dests == set(_cli.SERVE_VARIABLES)
    assert all(v.startswith("PJRT_RENDEZVOUS_") for v in _cli.SERVE_VARIABLES.values())
    assert len(set(_cli.SERVE_VARIABLES.values())) == len(_cli.SERVE_VARIABLES)
    timed = [a for a in serve._actions if a.type is not None and a.type.__name__.endswith("seconds")]
    assert len(timed) == 3 and all(a.metavar == "SECONDS" for a in timed), [(a.dest, a.metavar) for a in timed]


@pytest.mark.parametrize("text, seconds", [("2.5", 2.5), ("none", None), ("inf", None), (" Forever ", None)])
def test_serve_reads_seconds_as_the_client_reads_its_timeouts(text, seconds):
    """One parser for both: the same words for no limit, the same refusals."""
    from pjrt_rendezvous.client._config import parse_seconds

    assert _cli._seconds(text) == seconds == parse_seconds(text)


@pytest.mark.parametrize("text", ["soon", "0", "-1", "nan", ""])
def test_serve_refuses_seconds_the_client_refuses(text):
    from pjrt_rendezvous.client._config import parse_seconds
    from pjrt_rendezvous.client._errors import UsageError

    with pytest.raises(argparse.ArgumentTypeError, match="seconds"):
        _cli._seconds(text)
    with pytest.raises(UsageError, match="seconds"):
        parse_seconds(text)


# -- logs -----------------------------------------------------------------------------------


def test_json_log_lines_for_each_significant_event():
    """`--log-format json`: registration, world formed, round late (with missing ordinals),
    process dead, round failed and process restarted each give one JSON line with their fields."""
    with Serve("--log-format", "json", "--late-after", "0.5", "--heartbeat-timeout", "3") as server:
        first = simulated_process(server.address, 0, processes=2, threads=1)
        second = simulated_process(server.address, 1, processes=2, threads=1)
        bound_thread(second, 0)

        def stuck(binding):
            first.rendezvous(binding, "ckpt", b"", timeout=30)

        waiter, outcome = bound_thread(first, 0, stuck)
        late = json.loads(server.wait_for_line(r'"event": "round_late"'))
        second.close(leave=False)  # its heartbeats stop, its connection closes: declared dead within 3 s
        dead = json.loads(server.wait_for_line(r'"event": "process_dead"'))
        failed = json.loads(server.wait_for_line(r'"event": "round_failed"'))
        waiter.join(30)
        replacement = simulated_process(server.address, 1, processes=2, threads=1)
        bound_thread(replacement, 0)
        restarted = json.loads(server.wait_for_line(r'"event": "process_restarted"'))
        server.wait_for_line(r'"event": "world_formed".*"generation": 2')
        for client in (first, replacement):
            client.close()
        assert server.stop() == 0

    events = [json.loads(line) for line in server.lines if line.startswith("{")]
    # grpc's C core may print its own lines; everything from our loggers is JSON.
    assert all(line.startswith("{") or re.match(r"^[IWEF]\d{4} ", line) for line in server.lines), server.stderr()
    registered = [e for e in events if e.get("event") == "registered"]
    first_two = sorted((e["task"], e["host"], e["ordinals"]) for e in registered[:2])
    assert first_two == [(0, "sim-host-0", "0"), (1, "sim-host-1", "1")]
    assert [e["registered"] for e in registered] == [1, 2, 2] and registered[2]["generation"] == 2
    assert [e["generation"] for e in events if e.get("event") == "world_formed"] == [1, 2]
    assert (late["level"], late["tag"], late["arrived"], late["expected"], late["missing"]) == ("WARNING", "ckpt", 1, 2, "1")
    assert (late["missing_hosts"], late["missing_hosts_count"]) == (["sim-host-1"], 1)
    assert re.search(r"missing ordinal 1 on sim-host-1 \(pid \d+, last seen", late["message"]), late["message"]
    assert (dead["ordinals"], dead["host"]) == ("1", "sim-host-1") and "died: " in dead["message"]
    task_1 = next(e for e in registered if e["task"] == 1)
    assert (dead["task"], dead["pid"]) == (1, task_1["pid"]), (dead, task_1)  # (were in the message only)
    assert (restarted["task"], restarted["pid"]) == (1, task_1["pid"]), restarted  # (the process replaced)
    assert failed["code"] == "ABORTED" and "a member died" in failed["message"]
    assert restarted["ordinals"] == "1" and "restarted" in restarted["message"]
    assert outcome and isinstance(outcome[0], pr.ParticipantFailedError)
    waits = [e["waited"] for e in events if e.get("event") == "round_late"]  # at 0.5 s, then as its wait doubles
    assert waits and all(wait >= 0.5 * 2**number for number, wait in enumerate(waits)), waits
    for e in events:
        assert {"time", "level", "logger", "message"} <= set(e)


def test_the_stopping_line_says_a_pending_round_is_resent_not_kept():
    """The state file keeps finished rounds; a pending one is made again from its members'
    resends (its age counted from then): the stopping line said it was "kept in the state
    file"."""
    from pjrt_rendezvous.coordinator import Core, _server
    from pjrt_rendezvous.coordinator._core import Contribution, Registration, ThreadRequest

    core = Core()
    core.register(time.monotonic(), Registration(job="j", incarnation="i", host="h", pid=1, task_id=0, num_tasks=2,
                                                 devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),)))
    core.arrive(time.monotonic(), job="j", incarnation="i", replicas=[], round_number=0,
                contributions=[Contribution(0, "t", b"")], deadline=None)
    said = _server._pending_at_stop(core, True)
    assert said.startswith("; 1 round pending, to be resent by its members to a coordinator restarted from the state "
                           "file: job 'j': rendezvous 't' on all ordinals (round 0), 1 of 2 arrived"), said


def test_text_log_lines_are_one_line_per_event():
    """The default text format writes one line per event, with time, level and the message."""
    with Serve("--world-size", "2") as server:
        clients = [simulated_process(server.address, t, processes=2, threads=1) for t in range(2)]
        for client in clients:
            bound_thread(client, 0)
        line = server.wait_for_line("world formed")
        assert re.match(
            r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO pjrt_rendezvous\.coordinator: world formed in job "
            r"'default': 2 ordinals, 2 processes on 2 hosts, generation 1$",
            line,
        ), line
        registered = [l for l in server.lines if " registered task " in l]
        assert len(registered) == 2 and "ordinal 1; 2 of 2 ordinals registered" in registered[1]
        for client in clients:
            client.close()
        assert server.stop() == 0
    assert any("stopping (SIGTERM): in-flight calls get" in l for l in server.lines)


def test_a_text_log_line_writes_control_characters_escaped():
    """A carriage return or an escape in a message (a tag, a reason, a peer's text) forged a
    log line on a terminal: the text format wrote only line feeds escaped."""
    import io
    import logging

    from pjrt_rendezvous.coordinator import _logging

    stream, first, as_json = io.StringIO(), io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    log = logging.getLogger("pjrt_rendezvous.coordinator")
    try:
        _logging.configure("INFO", "text", first)
        _logging.configure("INFO", "text", stream)  # (configured again: the first stream gets nothing more)
        log.warning("tag %r and %s", "t", "x\r\x1b[2Ky\nz\té")
        _logging.configure("INFO", "json", as_json)
        try:
            raise ValueError("the cause")
        except ValueError:
            log.exception("a failure", extra={"event": "test"})  # (a JSON line keeps the traceback)
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
    assert stream.getvalue().endswith("tag 't' and x\\r\\x1b[2Ky\\nz\\té\n"), stream.getvalue()
    assert first.getvalue() == "", first.getvalue()
    line = json.loads(as_json.getvalue())
    assert line["event"] == "test" and "Traceback" in line["exception"] and "ValueError: the cause" in line["exception"], line


@pytest.mark.parametrize("json_by", ["flag", "variable"])
def test_serve_under_json_logs_prints_json_lines_on_stdout_too(json_by):
    """Under `--log-format json` (or PJRT_RENDEZVOUS_LOG_FORMAT=json) every line serve prints on
    stdout (where it listens: gRPC, session port, metrics) is a JSON line shaped like the log's."""
    args, env = (("--log-format", "json"), {}) if json_by == "flag" else ((), {"PJRT_RENDEZVOUS_LOG_FORMAT": "json"})
    with Serve(*args, "--metrics-port", "0", env=env) as server:
        assert server.stop() == 0
    records = [json.loads(line) for line in server.stdout_lines]
    assert [r["service"] for r in records] == ["grpc", "session", "metrics"], server.stdout_lines
    for record in records:
        assert {"time", "level", "logger", "message"} <= set(record) and record["event"] == "address"
    assert [r["port"] for r in records] == [server.port, server.session_port, server.metrics_port]
    assert records[0]["address"] == f"127.0.0.1:{server.port}"
    assert records[0]["message"] == f"pjrt-rendezvous coordinator listening on 127.0.0.1:{server.port}"
    assert records[2]["url"] == f"http://127.0.0.1:{server.metrics_port}/metrics"


def test_serve_prints_text_lines_on_stdout_by_default():
    """The default text format keeps the plain lines scripts read (`listening on HOST:PORT`)."""
    with Serve("--metrics-port", "0") as server:
        assert server.stop() == 0
    assert server.stdout_lines == [
        f"pjrt-rendezvous coordinator listening on 127.0.0.1:{server.port}",
        f"pjrt-rendezvous session port 127.0.0.1:{server.session_port}",
        f"pjrt-rendezvous metrics on http://127.0.0.1:{server.metrics_port}/metrics",
    ]


def test_tune_collector_sets_startup_aside_and_still_collects_cycles():
    """What `serve` does once it listens: sets aside what startup allocated and collects
    cyclic garbage less often, still collecting it. In a child: the process changes for good."""
    code = """
import gc, sys
from pjrt_rendezvous.coordinator import _server
before = gc.get_freeze_count()  # (0; CPython 3.12.1's own startup froze some 375 objects)
assert gc.get_threshold() != _server.GC_THRESHOLDS
_server.tune_collector()
assert gc.get_freeze_count() > before + 1000, (before, gc.get_freeze_count())
assert gc.get_threshold() == _server.GC_THRESHOLDS, gc.get_threshold()
class Node: pass
a, b = Node(), Node(); a.peer, b.peer = b, a
del a, b
assert gc.collect() >= 2  # a cycle made after the freeze is still garbage to the collector
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _serve_with_open_files_limit(soft: int, hard: int) -> Serve:
    """``serve`` started with the given limit on open files, as a shell's ulimit would set it."""
    lower = (
        "import resource, runpy, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
        "runpy.run_module('pjrt_rendezvous.coordinator', run_name='__main__')"
    )
    return Serve(program=[sys.executable, "-c", lower])


def _open_files_limit(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open files line")


@pytest.mark.skipif(not pathlib.Path("/proc/self/limits").exists(), reason="reads /proc")
def test_serve_raises_its_open_files_limit_for_a_large_pods_connections():
    """A shell's soft limit of 1,024 open files holds about 500 client processes' two
    connections each: ``serve`` raises it to its hard limit (at most 65,536), and says so
    when even the hard limit is low."""
    hard = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1 << 16)
    if hard <= 1024:
        pytest.skip(f"the hard limit here ({hard}) leaves nothing to raise")
    with _serve_with_open_files_limit(1024, hard) as serve:
        assert _open_files_limit(serve.proc.pid) == hard
        assert "open files" not in serve.stderr() or hard < 8192
        assert serve.stop() == 0
    with _serve_with_open_files_limit(512, 512) as serve:
        line = serve.wait_for_line("open files")
        assert "512" in line and "about 224 client processes" in line, line
        assert _open_files_limit(serve.proc.pid) == 512
        assert serve.stop() == 0


# -- stopping and restarting serve ----------------------------------------------------------


_REGISTER_AND_SLEEP = """
import sys, time
sys.path.insert(0, sys.argv[2])
import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client._demo import simulated_env
from _watch import watch_opened
address = sys.argv[1]
env = simulated_env(address=address, accelerator="v3-8", task=0, processes=1, hosts=1, threads=1)
client = pr.Client(pr.Settings(address=address, connect_timeout=10), pr.detect_topology(env, address=address))
watching = watch_opened(client)  # (its close is what a kill shows first)
client.bind_thread(0)
assert watching.wait(60)
print("bound", flush=True)
time.sleep(600)
"""


def _registered_process(address: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _REGISTER_AND_SLEEP, address, str(pathlib.Path(__file__).parent)],
        env=clean_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "bound"
    return proc


def test_stop_ends_idle_streams_at_once_and_a_second_signal_ends_the_drain():
    """Idle clients (a Watch stream each, a gRPC Session stream with transport=grpc) do not hold
    the drain for its grace, and nothing is logged as an error; with a call in flight a second
    SIGTERM ends the drain at once."""
    with Serve("--grace", "60") as server:
        clients = [simulated_process(server.address, t, processes=3, threads=1) for t in range(2)]
        clients.append(simulated_process(server.address, 2, processes=3, threads=1, transport="grpc"))
        threads = [bound_thread(c, 0)[0] for c in clients]
        wait_until(lambda: all(c.status().jobs[0].registered == 3 for c in clients[:1]), what="registrations")
        started = time.monotonic()
        assert server.stop() == 0
        assert time.monotonic() - started < 20, server.stderr()
        assert "ERROR" not in server.stderr() and "Traceback" not in server.stderr(), server.stderr()
        for c in clients:
            c.close()
        for t in threads:
            t.join(10)

    with Serve("--grace", "60") as server:
        client = simulated_process(server.address, 0, processes=2, threads=1)
        thread, errors = bound_thread(client, 0, lambda binding: client.rendezvous(binding, "never", b"", timeout=120))
        wait_until(lambda: client.status().jobs[0].pending_rounds, what="the rendezvous call in flight")
        server.terminate()
        line = server.wait_for_line(r"stopping \(SIGTERM\): in-flight calls get 60.0 s")
        assert line.endswith(  # (the round its calls wait in, and for whom)
            "; 1 round pending, not kept in a state file: lost: job 'default': rendezvous 'never' on all ordinals "
            "(round 0), 1 of 2 arrived, missing ordinal 1 never registered"
        ), line
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert time.monotonic() - started < 20
        server.wait_for_line("SIGTERM during the drain: in-flight calls are cancelled now")
        client.close()
        thread.join(10)


def test_a_call_cut_by_the_end_of_the_grace_is_not_logged_as_an_error():
    """A round waiting on a gRPC Session stream when the grace runs out: the stop cancels it
    and the stream is reset (its client resends to the next coordinator), quietly (gRPC
    logged an unhandled CancelledError, with a traceback outside the log's format, once
    per waiting process, after 'stopped')."""
    with Serve("--grace", "1") as server:
        clients = [simulated_process(server.address, t, processes=2, threads=1, transport="grpc") for t in range(2)]
        threads = [bound_thread(clients[0], 0, lambda b: clients[0].rendezvous(b, "never", b"", timeout=60))[0]]
        threads.append(bound_thread(clients[1], 0)[0])
        server.wait_for_line("world formed")
        wait_until(lambda: clients[1].status().jobs[0].pending_rounds, what="the round in flight")
        assert server.stop() == 0
        assert "ERROR" not in server.stderr() and "Traceback" not in server.stderr(), server.stderr()
        for c in clients:
            c.close()
        for t in threads:
            t.join(10)


def test_ctrl_c_ends_a_command_with_a_line_not_a_traceback():
    """Ctrl-C (SIGINT) in `health --wait` and in a `status` that waits for its answer: a line
    and exit 130, as a shell counts an interrupt (a traceback was printed)."""
    with socket.socket() as silent:  # takes connections, says nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        for command in (["health", "--wait"], ["status"]):
            proc = subprocess.Popen(
                [*CLI, *command, "--address", address, "--timeout", "60"],
                env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            silent.settimeout(30)
            connection, _ = silent.accept()  # (its call under way: past its imports)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
            connection.close()
            assert proc.returncode == 130 and "Traceback" not in err and "interrupted" in err, (command, out, err)


def test_sighup_stops_serve_as_sigterm_does():
    """The terminal of a `serve` in the foreground closes (an ssh session ends): it drains and
    exits 0, as for SIGTERM (it died at once, exit 129, no drain nor last state write).
    Started with SIGHUP ignored (`nohup`), it serves on (it stopped), nor does one end the
    drain a SIGTERM began (it did)."""
    with Serve(ignoring=()) as server:
        server.proc.send_signal(signal.SIGHUP)
        assert server.proc.wait(15) == 0, server.stderr()
        server.wait_for_line("stopped after")
    with Serve(ignoring=(signal.SIGHUP,)) as server:
        server.proc.send_signal(signal.SIGHUP)
        time.sleep(1)
        health = run_cli("health", "--address", server.address)
        assert server.proc.poll() is None and health.returncode == 0, (health.stdout, server.stderr())
        with grpc.insecure_channel(server.address) as channel:  # a call in flight: the drain waits for it
            stub = pb_grpc.CoordinatorStub(channel)
            stub.KvSet(pb.KvSetRequest(job="j", entries=[pb.KvEntry(key="set", value=b"1")]), timeout=10)
            waiting = stub.KvGet.future(pb.KvGetRequest(job="j", keys=["never"], wait=True, timeout=30), timeout=30)
            time.sleep(0.5)
            assert not waiting.done()
            server.proc.send_signal(signal.SIGTERM)
            server.wait_for_line("stopping")
            server.proc.send_signal(signal.SIGHUP)
            assert server.proc.wait(15) == 0, server.stderr()
            waiting.cancel()
        assert "during the drain" not in server.stderr(), server.stderr()


def test_serve_refuses_a_busy_session_port_and_an_endless_grace_with_a_message():
    with Serve() as first:
        busy = subprocess.run(
            [*CLI, "serve", "--port", "0", "--session-port", str(first.session_port)],
            env=clean_env(), capture_output=True, text=True, timeout=60,
        )
        assert busy.returncode == 1, busy.stderr
        assert f"cannot listen on the session port 127.0.0.1:{first.session_port} (--session-port)" in busy.stderr
        assert "Traceback" not in busy.stderr
        taken = subprocess.run(
            [*CLI, "serve", "--port", str(first.port)], env=clean_env(), capture_output=True, text=True, timeout=60
        )
        assert taken.returncode == 1 and f"cannot listen on 127.0.0.1:{first.port} (--host, --port): Address already in use" in taken.stderr
        assert "Traceback" not in taken.stderr
        first.stop()
    endless = run_cli("serve", "--port", "0", "--grace", "inf")
    assert endless.returncode == 2 and "--grace: must be a finite number of seconds" in endless.stderr


def test_serve_does_without_the_default_session_port_when_it_is_busy():
    """'auto''s session port is 7482 whatever --port says: held by another coordinator on the
    host, the start failed (and a unit restarting into it gave up), while clients do without
    one. It is warned of and done without; a port named with --session-port is still refused
    (above)."""
    from pjrt_rendezvous.coordinator import _server

    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", _server.DEFAULT_SESSION_PORT))
        holder.listen()
    except OSError:
        holder.close()
        pytest.skip(f"port {_server.DEFAULT_SESSION_PORT} is in use here")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([*CLI, "serve", "--port", str(port)], env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []

        def read() -> None:
            for line in proc.stderr:
                lines.append(line)
                if "INFO pjrt_rendezvous.coordinator: listening on" in line:
                    return

        reader = in_thread(read)
        reader.join(60)  # (a serve that hangs without a word fails the test, not the suite)
        text = "".join(lines)
        assert not reader.is_alive(), text
        assert (
            f"the session port 127.0.0.1:{_server.DEFAULT_SESSION_PORT} ('auto', the default) is in use: serving "
            "without one, clients use gRPC's stream" in text
        ), text
        assert f"listening on 127.0.0.1:{port};" in text, text  # (no session port)
        assert proc.poll() is None, text
        client = simulated_process(f"127.0.0.1:{port}", 0, processes=1, threads=1)
        assert client.rendezvous(client.bind_thread(0), "t", b"x") == [b"x"]
        client.unbind_thread()  # (the main thread: bound to a closed client, it failed later tests' calls)
        client.close()
    finally:
        holder.close()
        proc.terminate()
        proc.communicate(timeout=30)


def test_a_death_found_by_the_liveness_watch_is_in_the_state_file(tmp_path):
    """A process declared dead by its missed heartbeats, with no call after it: a coordinator
    restarted from the state file knows it is dead."""
    state = tmp_path / "coordinator.state"
    with Serve("--state-file", str(state), "--heartbeat-timeout", "1") as server:
        proc = _registered_process(server.address)
        proc.kill()
        proc.wait(10)
        server.wait_for_line("process dead")  # (its connection closed, or no heartbeat: killed so soon,
        deadline = time.monotonic() + 10  # its watch stream may not have been open yet)
        while b"died: " not in state.read_bytes():  # the write that follows
            assert time.monotonic() < deadline, "the death was not written to the state file"
            time.sleep(0.05)
        # then no stop's last write: a crash
        server.proc.kill()
        server.proc.wait(10)
    with Serve("--state-file", str(state)) as server:
        out = run_cli("status", "--address", server.address, "--json")
        assert out.returncode == 0, out.stderr
        (participant,) = json.loads(out.stdout)["jobs"][0]["participants"]
        assert participant["alive"] is False
        server.stop()


def test_status_marks_a_killed_process_connection_closed_until_it_is_declared_dead():
    """SIGKILL: its connection closes at once, and status says so (table and --json) while
    the coordinator gives it 10 s to call again; then it is dead, long before the 60 s
    heartbeat timeout."""
    with Serve() as server:
        proc = _registered_process(server.address)  # (its watch stream open)
        proc.kill()
        proc.wait(10)
        killed = time.monotonic()

        def status(*args):
            out = run_cli("status", "--address", server.address, *args)
            assert out.returncode == 0, out.stderr
            return out.stdout

        wait_until(lambda: "(connection closed)" in status(), what="the closed connection in status")
        assert re.search(rf"\s1\s+{proc.pid} \(connection closed\)\s+0\s", status()), status()
        job = json.loads(status("--json"))["jobs"][0]
        (participant,) = job["participants"]
        assert participant["alive"] is True and 0 <= participant["disconnectedAge"] < 10, participant
        assert job["hosts"][0]["closedPids"] == [proc.pid]
        line = server.wait_for_line("died: its connection closed", timeout=30)
        assert 10 <= time.monotonic() - killed < 30, line
        assert "without a Leave and it was not heard from in the" in line and "s after (killed, crashed" in line, line
        assert f"{proc.pid} (dead)" in status()
        assert json.loads(status("--json"))["jobs"][0]["participants"][0]["disconnectedAge"] is None
        server.stop()


def test_a_new_world_size_restarts_the_job_from_the_state_file_instead_of_refusing(tmp_path):
    state = tmp_path / "coordinator.state"
    with Serve("--state-file", str(state), "--world-size", "2") as server:
        server.stop()
    with Serve("--state-file", str(state), "--world-size", "4") as server:
        server.wait_for_line("world size 2 in .*; --world-size 4 starts it afresh")
        out = run_cli("status", "--address", server.address, "--json")
        assert json.loads(out.stdout)["jobs"][0]["worldSize"] == 4, out.stdout
        server.stop()


def test_a_world_size_declared_before_a_restart_without_the_flag_is_lifted(tmp_path):
    """`serve --world-size 4 --state-file F`, then `serve --state-file F` alone: a job of 3
    was refused as "fixed by the coordinator's --world-size", a flag it no longer had (and
    the job could never be dropped at --max-jobs); only deleting the state file, and every
    job's keys, let it run."""
    state = tmp_path / "coordinator.state"
    with Serve("--state-file", str(state), "--world-size", "4") as server:
        server.stop()
    with Serve("--state-file", str(state)) as server:
        server.wait_for_line("job default had a world size fixed by --world-size, which this coordinator does not give it")
        client = simulated_process(server.address, 0, processes=3, threads=1)
        try:
            client.bind_thread(0)
            assert client.status().jobs[0].world_size == 3
        finally:
            client.close()
        server.stop()


def test_bad_demo_serve_and_health_arguments_get_a_message_not_a_traceback(tmp_path):
    demo = run_cli("demo", "--accelerator", "v9-8", "--processes", "1")
    assert demo.returncode == 2 and "--threads" in demo.stderr and "Traceback" not in demo.stderr, demo
    # (100,000 processes were started, one Python each, until the machine gave out)
    many = run_cli("demo", "--processes", "100000", "--timeout", "20")
    assert many.returncode == 2 and "--processes 100000: the demo starts a Python process for each on this machine, at most 512" in many.stderr, many
    wide = run_cli("demo", "--processes", "512", "--threads", "200")
    assert wide.returncode == 2 and "a world of 102400, over the coordinator's limit of 65536 (max_world_size)" in wide.stderr, wide
    same = run_cli("serve", "--port", "24871", "--session-port", "24871")  # (was "address already in use")
    assert same.returncode == 2 and "the session port and the gRPC port are both 24871" in same.stderr, same
    for ports, named in ((("--port", "24871"), "gRPC"), (("--port", "24870", "--session-port", "24871"), "session")):
        same = run_cli("serve", *ports, "--metrics-port", "24871")  # (was "address already in use", naming --metrics-host)
        assert same.returncode == 2 and f"the metrics port and the {named} port are both 24871" in same.stderr, same
    default_port = argparse.Namespace(tls_cert=None, session_port="auto", port=7482)
    assert _cli.session_port(default_port) == 7483  # (auto took 7482 as well)
    for short in ("0.001", "-5"):  # (declared every process dead; -5 was told "must be > 0 seconds")
        short = run_cli("serve", "--port", "0", "--heartbeat-timeout", short)
        assert short.returncode == 2 and "--heartbeat-timeout: must be at least 1 s" in short.stderr, short
    with Serve("--job", "train") as server:  # no --world-size: the job is named for nothing
        server.wait_for_line(r"--job 'train' does nothing without --world-size")
    for command in ("status", "health"):  # an empty address is refused, not taken for none (status dialled localhost)
        empty = run_cli(command, "--address", "", "--timeout", "2")
        assert empty.returncode == 2 and "--address must not be empty" in empty.stderr, empty
    for command in (["demo", "--timeout", "0"], ["health", "--timeout", "nan"], ["status", "--timeout", "-1"]):
        refused = run_cli(*command)
        assert refused.returncode == 2 and "must be a finite number of seconds > 0" in refused.stderr, refused
    # (past gRPC's last deadline, about 292 years on, status and health failed at once as timed out)
    for command in (
        ["health", "--timeout", "1e10"], ["status", "--timeout", "1e10"], ["serve", "--grace", "1e300"],
        ["serve", "--heartbeat-timeout", "1e300"], ["serve", "--late-after", "1e10"],  # (taken, unlike 'none')
        ["serve", "--heartbeat-timeout", "1e400"],  # (inf to float(): the watch was turned off)
    ):
        refused = run_cli(*command)
        assert refused.returncode == 2 and "must be at most 1e+09 s (about 31 years)" in refused.stderr, refused
    # (an empty path was taken for this folder; a FIFO held the start for good, /dev/zero was read without end)
    for option in ("--state-file", "--token-file", "--tls-cert"):
        empty = run_cli("serve", "--port", "0", option, " ")
        assert empty.returncode == 2 and f"argument {option}: must not be empty" in empty.stderr, empty
    fifo = tmp_path / "fifo.state"
    os.mkfifo(fifo)
    for special in (fifo, pathlib.Path("/dev/zero")):
        refused = run_cli("serve", "--port", "0", "--state-file", str(special), timeout=30)
        assert refused.returncode == 2 and f"the state file {special} (--state-file) is not a regular file" in refused.stderr, refused
    no_folder = run_cli("serve", "--port", "0", "--state-file", str(tmp_path / "missing" / "x.state"))
    assert no_folder.returncode == 1, no_folder  # (not 2: a volume mounted late is there on the next try)
    assert f"the folder of the state file {tmp_path / 'missing' / 'x.state'} (--state-file) does not exist" in no_folder.stderr
    corrupt = tmp_path / "corrupt.state"
    corrupt.write_text("{")
    json_log = run_cli("serve", "--port", "0", "--state-file", str(corrupt), "--log-format", "json")
    assert json_log.returncode == 1
    lines = json_log.stderr.splitlines()
    assert lines and all(json.loads(line)["level"] for line in lines), json_log.stderr
    assert "corrupt or truncated" in json_log.stderr


def test_demo_leaves_out_the_callers_client_settings(tls_files, monkeypatch):
    """The demo's processes talk to the demo's own coordinator (no token, no TLS): the
    caller's client settings (exported for a real pod, as the README's TLS recipe does) are
    not theirs, and would make them fail or wait for nothing. The native module's switch stays."""
    caller = {
        "PJRT_RENDEZVOUS_TLS_CA": str(tls_files / "server.pem"), "PJRT_RENDEZVOUS_TOKEN": "sekrit-123",
        "PJRT_RENDEZVOUS_TIMEOUT": "0", "PJRT_RENDEZVOUS_JOB": "train", "PJRT_RENDEZVOUS_NATIVE": "0",
        # nor the caller's TPU shape (a TPU VM's): 4 chips per host made 2 a process, 4 threads each
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
    }
    demo = run_cli("demo", "--processes", "2", "--timeout", "30", env=caller, timeout=90)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    for name, value in caller.items():
        monkeypatch.setenv(name, value)
    env = simulated_env(address="127.0.0.1:1", accelerator="v3-8", task=0, processes=2, hosts=1, threads=None)
    assert {k for k in env if k.startswith("PJRT_RENDEZVOUS_")} == {"PJRT_RENDEZVOUS_ADDRESS", "PJRT_RENDEZVOUS_NATIVE"}
    monkeypatch.setenv("CHIPS_PER_HOST_BOUNDS", "1,1,1")  # (its other name: every process failed)
    env = simulated_env(address="127.0.0.1:1", accelerator="v3-8", task=0, processes=2, hosts=1, threads=None)
    assert not {"TPU_CHIPS_PER_HOST_BOUNDS", "CHIPS_PER_HOST_BOUNDS"} & set(env)
    assert "4 ordinals, world size 4" in demo.stdout, demo.stdout  # (8: 4 threads a process)


def test_a_demo_out_of_time_says_no_thread_reported():
    """A demo whose processes all miss its timeout says so (it printed "0 ordinals, world
    size 0"), and fails; one thread's subset round is "1 payload"."""
    late = run_cli("demo", "--processes", "2", "--hosts", "1", "--threads", "1", "--timeout", "0.05", timeout=90)
    assert late.returncode == 1 and "no thread reported in" in late.stdout and "world size 0" not in late.stdout, late.stdout
    alone = run_cli("demo", "--processes", "1", "--hosts", "1", "--threads", "1", "--timeout", "60", timeout=90)
    assert alone.returncode == 0 and "1 payload, ordinals 0..0" in alone.stdout and "1 ordinal, world size 1" in alone.stdout, alone.stdout


def test_a_command_whose_output_is_cut_short_ends_without_a_traceback():
    """`demo | head -1`, `status --json | head`: the reader goes, and the command ends with
    exit code 1 and nothing on stderr (a BrokenPipeError traceback). Its output buffered, as
    through a pipe unless PYTHONUNBUFFERED is set: the header is flushed, the rest fails at
    the last flush."""
    env = {k: v for k, v in clean_env().items() if k != "PYTHONUNBUFFERED"}
    demo = subprocess.Popen([*CLI, "demo", "--processes", "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert demo.stdout.readline().startswith(b"coordinator on ")
    demo.stdout.close()  # before the table: the demo's processes are still starting
    assert demo.wait(90) == 1
    assert b"Traceback" not in demo.stderr.read()


def test_a_state_file_that_cannot_be_written_stops_serve_instead_of_answering_from_memory(tmp_path):
    """The write of a registration fails (the state file's name taken by a folder): the caller
    is told UNAVAILABLE, never OK, and serve stops with exit code 1 naming the file, to start
    again from what is on disk."""
    state = tmp_path / "coordinator.state"
    with Serve("--state-file", str(state)) as server:
        state.unlink()
        state.mkdir()
        (state / "keep").write_text("")  # a folder os.replace cannot replace, even as root
        client = simulated_process(server.address, 0, processes=1, threads=1)
        try:
            with pytest.raises(pr.CoordinatorUnavailableError):  # (UNKNOWN before: RemoteError)
                client.bind_thread(0)
        finally:
            client.close()
        assert server.proc.wait(30) == 1
        stderr = server.stderr()
        assert "cannot write the state file" in stderr and f"the state file {state} could not be written" in stderr, stderr


def test_an_embedded_coordinator_stops_with_the_grace_it_was_made_with(tmp_path):
    """Coordinator(grace=...) is the grace its stop() (and a with block's end) gives calls in
    flight, as --grace is serve's (it gave 1 s whatever it was made with). (With a state
    file: without one, a waiting get, as a pending round, fails at once, see test_reliability.)"""
    from pjrt_rendezvous.coordinator import Coordinator

    coordinator = Coordinator(port=0, grace=3.0, state_file=tmp_path / "state").start()
    client = simulated_process(coordinator.address, 0, processes=2, threads=1)
    try:
        thread, errors = bound_thread(client, 0, lambda binding: client.get("never", timeout=None))
        waiters = coordinator._running._servicer._waiters
        wait_until(lambda: any(key[0] == "kv" for key in list(waiters)), what="the get waiting")
        started = time.monotonic()
        coordinator.stop()
        assert 2.5 < time.monotonic() - started < 15
    finally:
        client.close()
        coordinator.stop()
    thread.join(30)
    assert not thread.is_alive()


def test_an_embedded_coordinator_serves_once_at_a_time_on_a_port_in_range():
    """start() on a running coordinator is refused (a second start opened a second server
    and lost the first's, which stop() then left running, or failed on its own port);
    ``with Coordinator(...).start()`` enters the running one; a stopped one starts again. A port out of range is
    refused (-1 listened on 65535, 70000 on 4464). A port in use is an OSError of EADDRINUSE for each of the
    three ports (the gRPC port's was a RuntimeError)."""
    import errno

    from pjrt_rendezvous.coordinator import Coordinator

    coordinator = Coordinator(port=0).start()
    address = coordinator.address
    with pytest.raises(RuntimeError, match=f"already running at {address}"):
        coordinator.start()
    for taken, what in (
        ({"port": coordinator.port}, f"127.0.0.1:{coordinator.port} (--host, --port)"),
        ({"session_port": coordinator.session_port}, f"the session port 127.0.0.1:{coordinator.session_port}"),
        ({"metrics_port": coordinator.session_port}, f"the metrics port 127.0.0.1:{coordinator.session_port}"),
    ):
        with pytest.raises(OSError, match=re.escape(f"cannot listen on {what}")) as refused:
            Coordinator(**{"port": 0, **taken}).start()
        assert refused.value.errno == errno.EADDRINUSE, refused.value
    with coordinator as entered:
        assert entered is coordinator and entered.address == address
    assert run_cli("health", "--address", address, "--timeout", "2").returncode == 1  # stopped: nothing left
    with coordinator.start():  # (and started again)
        assert run_cli("health", "--address", coordinator.address, "--timeout", "5").returncode == 0
    for port in (-1, 65536, 70000):
        with pytest.raises(ValueError, match=rf"port must be in \[0, 65535\], got {port}"):
            Coordinator(port=port)
    # Refused as it is made, as serve refuses them (they came at start(), world_size=0 as a
    # CoreError; grace=-1 and a token no client could send were taken).
    for options, said in (
        ({"heartbeat_timeout": 0.5}, "heartbeat_timeout must be at least 1 s"),
        ({"world_size": 0}, "world_size must be an int >= 1"),
        ({"world_size": 2.5}, "world_size must be an int >= 1"),
        ({"grace": -1}, "grace must be >= 0"),
        ({"token": "a\nb"}, "the token from token= holds character 0xa"),
        ({"token": "x" * 5000}, "the token from token= is 5000 characters"),
    ):
        with pytest.raises(ValueError, match=re.escape(said)):
            Coordinator(**options)
    for name in ("tls_cert", "tls_key", "tls_ca"):  # (paths, not the PEM bytes: gRPC's TypeError named neither)
        pem = {"tls_cert": b"cert", "tls_key": b"key", name: "/etc/coordinator/pem"}
        with pytest.raises(TypeError, match=re.escape(f"{name} must be the PEM file's bytes (pathlib.Path(path).read_bytes()), got str")):
            Coordinator(**pem)
    Coordinator(grace=None)  # (none: stop() cancels at once)


def test_an_embedded_stop_without_grace_cancels_a_waiting_call_at_once():
    """Coordinator.stop(grace=None) cancels calls in flight at once, as gRPC's stop(None) does
    (a waiting rendezvous must not hold it for ever)."""
    from pjrt_rendezvous.coordinator import Coordinator

    coordinator = Coordinator(port=0).start()
    client = simulated_process(coordinator.address, 0, processes=2, threads=1)
    try:
        thread, errors = bound_thread(client, 0, lambda binding: client.rendezvous(binding, "never", b"", timeout=None))
        wait_until(lambda: client.status().jobs[0].pending_rounds, what="the pending round")
        stopping = in_thread(lambda: coordinator.stop(grace=None))
        stopping.join(10)
        assert not stopping.is_alive(), "stop(grace=None) waited for the call in flight"
    finally:
        client.close()
        coordinator.stop()
    thread.join(30)
    assert not thread.is_alive()


def test_a_stuck_last_write_of_the_state_file_does_not_hold_the_stop(tmp_path, monkeypatch, caplog):
    """A volume that stops answering: the last write on stop is given FINAL_WRITE_TIMEOUT, then
    the stop goes on, saying so."""
    from pjrt_rendezvous.coordinator import Coordinator, _server, _state

    release = threading.Event()
    monkeypatch.setattr(_server, "FINAL_WRITE_TIMEOUT", 0.5)
    coordinator = Coordinator(port=0, state_file=tmp_path / "state").start()
    client = simulated_process(coordinator.address, 0, processes=1, threads=1)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(_state.Files, "rewrite", lambda self, data: release.wait())
            patch.setattr(_state.Files, "append", lambda self, data: release.wait())
            def register():
                with pytest.raises(pr.RendezvousError):  # its registration's write never ends
                    client.bind_thread(0)

            registering = in_thread(register)
            wait_until(lambda: coordinator.core.jobs.get("default"), what="the registration")
            stopping = in_thread(lambda: coordinator.stop(grace=0.2))
            stopping.join(10)
            assert not stopping.is_alive(), "the stop waited for the stuck write"
    finally:
        release.set()
        client.close()
    registering.join(30)
    assert "the last write of the state file did not finish" in caplog.text


def test_serve_warns_of_variables_nothing_reads_and_logs_the_settings_in_effect(tmp_path):
    """A misspelt PJRT_RENDEZVOUS_STATE_FLE was ignored without a word (the restart after lost
    the job), a client's PJRT_RENDEZVOUS_TLS_CERT set for serve gave a plaintext server, and
    nothing at the start said whether TLS, a token or a state file were in effect."""
    env = {"PJRT_RENDEZVOUS_STATE_FLE": str(tmp_path / "s"), "PJRT_RENDEZVOUS_TLS_CERT": "cert.pem",
           "PJRT_RENDEZVOUS_BOGUS": "1", "PJRT_RENDEZVOUS_TOKEN": "s3cret", "PJRT_RENDEZVOUS_SERVICE_HOST": "10.0.0.1"}
    with Serve("--heartbeat-timeout", "5", env=env) as server:
        listening = server.wait_for_line(r"INFO pjrt_rendezvous.coordinator: listening on ")
        assert server.stop() == 0
    text = server.stderr()
    assert ("PJRT_RENDEZVOUS_STATE_FLE is not a variable pjrt-rendezvous reads (did you mean "
            "PJRT_RENDEZVOUS_STATE_FILE?): ignored") in text, text
    assert "PJRT_RENDEZVOUS_BOGUS is not a variable pjrt-rendezvous reads: ignored" in text, text
    assert ("PJRT_RENDEZVOUS_SERVICE_HOST is not a variable pjrt-rendezvous reads (a Kubernetes service link: "
            "enableServiceLinks: false in the pod's spec): ignored") in text, text
    assert ("PJRT_RENDEZVOUS_TLS_CERT names a client's TLS file, which serve does not read: its own is "
            "PJRT_RENDEZVOUS_SERVER_TLS_CERT (or --tls-cert); serving without TLS") in text, text
    assert "PJRT_RENDEZVOUS_TOKEN " not in text, text  # (read by serve: no warning)
    assert listening.endswith("; no TLS, a token, no state file, heartbeat timeout 5 s, late after 60 s"), listening


def test_every_variable_the_package_reads_is_known_to_serve_s_warning():
    """serve warns of a PJRT_RENDEZVOUS_* variable it does not know: one the package reads but
    that list lacks would be called a mistake."""
    root = pathlib.Path(_cli.__file__).resolve().parents[1]
    sources = [*root.glob("client/*.py"), *root.glob("coordinator/*.py")]
    read = {name for path in sources for name in re.findall(r"PJRT_RENDEZVOUS_[A-Z_]*[A-Z]\b", path.read_text())}
    assert read and read <= _cli.known_variables(), sorted(read - _cli.known_variables())


def test_a_replicas_ended_line_names_its_process_and_why():
    """replicas_ended's JSON line had the job, ordinals and host only: its process's task, pid
    and the reason were in the message alone, unlike the other process lines."""
    with Serve("--log-format", "json") as server:
        client = simulated_process(server.address, 0, processes=1, threads=2)
        client.bind_thread(0)
        client.end_replicas([0], "its replica returned")
        line = json.loads(server.wait_for_line(r'"event": "replicas_ended"'))
        client.unbind_thread()
        client.close()
        assert server.stop() == 0
    assert (line["task"], line["pid"], line["ordinals"], line["host"]) == (0, os.getpid(), "0", "sim-host-0"), line
    assert line["reason"] == "its replica returned", line
