"""Prometheus metrics: the text format, the HTTP endpoint, and the numbers of a real job."""

from __future__ import annotations

import asyncio
import re
import select
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client._session import frame
from pjrt_rendezvous.coordinator import Coordinator
from pjrt_rendezvous.coordinator._metrics import Family, Histogram, exposition, start_http_server
from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_cli import Serve, bound_thread, run_cli, simulated_process, wait_until  # noqa: E402

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def parse(text: str) -> dict[str, dict[tuple, float]]:
    """A strict reader of the Prometheus text format 0.0.4: every sample belongs to a family
    declared by HELP and TYPE before it, label values unescape, histograms are cumulative
    and end in +Inf = _count. Returns {sample name: {sorted label items: value}}."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    samples: dict[str, dict[tuple, float]] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram") and name not in types, line
            types[name] = kind
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, labels_text, value = match.groups()
        family = next(
            (f for f in types if name == f or (types[f] == "histogram" and name in (f + "_bucket", f + "_sum", f + "_count"))),
            None,
        )
        assert family is not None, f"{name} appears before its TYPE line"
        labels = {}
        rest = labels_text or ""
        while rest:
            label = _LABEL.match(rest)
            assert label, f"bad labels in {line!r}"
            labels[label.group(1)] = re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), label.group(2))
            rest = rest[label.end():]
        key = tuple(sorted(labels.items()))
        assert key not in samples.get(name, {}), f"duplicate sample {line!r}"
        samples.setdefault(name, {})[key] = float(value)
    for family, kind in types.items():
        if kind != "histogram":
            continue
        series: dict[tuple, list[tuple[float, float]]] = {}
        for key, count in samples.get(family + "_bucket", {}).items():
            labels = dict(key)
            le = float(labels.pop("le"))
            series.setdefault(tuple(sorted(labels.items())), []).append((le, count))
        for key, buckets in series.items():
            buckets.sort()
            counts = [c for _, c in buckets]
            assert counts == sorted(counts), f"{family} buckets are not cumulative: {buckets}"
            assert buckets[-1][0] == float("inf") and counts[-1] == samples[family + "_count"][key]
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        return parse(response.read().decode())


# -- format ---------------------------------------------------------------------------------


def test_exposition_escapes_label_values_and_histograms_are_cumulative():
    """Quotes, backslashes and newlines in a job name are escaped; histogram buckets are
    cumulative with +Inf equal to the count; integers print without a fraction."""
    hist = Histogram([0.1, 1.0])
    for seconds in (0.05, 0.5, 1.0, 30.0):  # (1.0 in le="1": a bound counts its own value)
        hist.observe((("job", 'we"ird\\job\n'),), seconds)
    wait = Family("x_wait_seconds", "histogram", "help with \\ and\nnewline")
    hist.fill(wait)
    gauge = Family("x_up", "gauge", "g")
    gauge.add({}, 1)
    text = exposition([gauge, wait])
    assert 'x_wait_seconds_bucket{job="we\\"ird\\\\job\\n",le="0.1"} 1\n' in text
    assert "# HELP x_wait_seconds help with \\\\ and\\nnewline\n" in text
    samples = parse(text)
    key = (("job", 'we"ird\\job\n'),)
    assert samples["x_wait_seconds_count"][key] == 4 and samples["x_wait_seconds_sum"][key] == pytest.approx(31.55)
    assert samples["x_wait_seconds_bucket"][(("job", 'we"ird\\job\n'), ("le", "1"))] == 3
    assert samples["x_up"][()] == 1 and "x_up 1\n" in text


def test_http_endpoint_answers_get_head_and_refuses_the_rest():
    """GET and HEAD /metrics serve the text; other paths are 404, other methods 405 (with
    the Allow header HTTP asks for)."""

    async def main():
        server = await start_http_server(lambda: "# TYPE a gauge\na 1\n", "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        def request(method, path):
            req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
            try:
                with urllib.request.urlopen(req, timeout=10) as response:
                    return response.status, response.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.headers.get("Allow", "").encode()

        results = [await asyncio.to_thread(request, m, p) for m, p in
                   [("GET", "/metrics"), ("HEAD", "/metrics"), ("GET", "/nope"), ("POST", "/metrics"), ("GET", "/")]]
        server.close()
        return results

    assert asyncio.run(main()) == [
        (200, b"# TYPE a gauge\na 1\n"), (200, b""), (404, b""), (405, b"GET, HEAD"),
        (200, b"pjrt-rendezvous coordinator: metrics at /metrics\n"),
    ]


def read_until_closed(sock: socket.socket) -> int:
    """Reads ``sock`` until its peer closes or resets it; how many bytes came."""
    total = 0
    try:
        while data := sock.recv(1 << 20):
            total += len(data)
    except OSError:
        pass
    return total


def test_a_scraper_that_does_not_read_is_dropped_and_close_drops_every_connection(monkeypatch):
    """An answer not read within the read timeout ends its connection (its send waited for
    ever, holding a task, a file and, from Python 3.12, the coordinator's stop); close()
    drops the connections still open (one that never sent its request was served until its
    own timeout)."""
    from pjrt_rendezvous.coordinator import _metrics

    monkeypatch.setattr(_metrics, "_READ_TIMEOUT", 0.5)

    async def main():
        server = await start_http_server(lambda: "x" * (16 << 20), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as unread:
            unread.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            await asyncio.sleep(2.0)  # not read: dropped after 0.5 s
            assert await asyncio.to_thread(read_until_closed, unread) < 16 << 20
        monkeypatch.setattr(_metrics, "_READ_TIMEOUT", 30.0)
        with socket.create_connection(("127.0.0.1", port)) as silent:
            silent.settimeout(10)
            silent.sendall(b"GET /metr")  # the rest never comes
            await asyncio.sleep(0.2)
            server.close()
            started = time.monotonic()
            assert await asyncio.to_thread(read_until_closed, silent) == 0 and time.monotonic() - started < 5

    asyncio.run(main())


def test_idle_connections_beyond_the_cap_are_closed_at_once():
    """The port takes no token: 3,000 idle connections held 3,000 of the coordinator's open
    files (shared with the clients' ports) for 10 s each. Past _MAX_CONNECTIONS a new one is
    closed at once, and one that sends nothing is closed after _HEAD_TIMEOUT; a scrape then
    works."""
    from pjrt_rendezvous.coordinator import _metrics

    async def main():
        server = await start_http_server(lambda: "# TYPE a gauge\na 1\n", "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(_metrics._MAX_CONNECTIONS + 20)]

        def closed() -> int:  # (readable: at its end, or reset; an idle one is sent nothing)
            return len(select.select(idle, [], [], 0.2)[0])

        deadline = time.monotonic() + _metrics._HEAD_TIMEOUT / 2
        while (beyond := await asyncio.to_thread(closed)) != 20 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert beyond == 20
        await asyncio.sleep(_metrics._HEAD_TIMEOUT + 0.5)
        assert await asyncio.to_thread(closed) == len(idle)
        for sock in idle:
            sock.close()
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read())
        server.close()
        return text

    assert asyncio.run(main()) == b"# TYPE a gauge\na 1\n"


# -- a real coordinator ---------------------------------------------------------------------


def test_metrics_move_during_a_real_job():
    """Scraped from `serve --metrics-port 0` while 2 processes x 2 threads run rounds: registered
    and expected participants, rounds completed, the wait histogram and RPC counts grow with the
    job; a stuck round shows as pending with a growing age, then as a timeout failure."""
    with Serve("--metrics-port", "0", "--world-size", "4") as server:
        before = scrape(server.metrics_port)
        assert value(before, "pjrt_rendezvous_participants_expected", rendezvous_job="default") == 4
        assert value(before, "pjrt_rendezvous_participants_registered", rendezvous_job="default") == 0
        assert value(before, "pjrt_rendezvous_rounds_completed_total", rendezvous_job="default") == 0
        # Every job's usual failure codes are there from 0 (rate() then sees the first failure).
        failed = before["pjrt_rendezvous_rounds_failed_total"]
        assert failed[(("code", "DEADLINE_EXCEEDED"), ("rendezvous_job", "default"))] == 0
        assert not any(label == "job" for series in before.values() for key in series for label, _ in key)
        assert value(before, "pjrt_rendezvous_build_info", version=before and next(
            dict(k)["version"] for k in before["pjrt_rendezvous_build_info"])) == 1

        clients = [simulated_process(server.address, task, processes=2) for task in range(2)]
        phase = [threading.Barrier(5) for _ in range(3)]  # 4 workers + the test, per phase

        def work(binding):
            for k in range(5):
                binding.client.rendezvous(binding, f"a{k}", b"x")
            phase[0].wait(30)
            phase[1].wait(30)
            for k in range(5):
                binding.client.rendezvous(binding, f"b{k}", b"y")
            phase[2].wait(30)

        workers = [bound_thread(clients[t], i, work) for t in range(2) for i in range(2)]
        phase[0].wait(30)
        middle = scrape(server.metrics_port)
        phase[1].wait(30)
        phase[2].wait(30)
        after = scrape(server.metrics_port)
        for thread, errors in workers:
            thread.join(30)
            assert not errors, errors

        job = {"rendezvous_job": "default"}
        assert value(middle, "pjrt_rendezvous_participants_registered", **job) == 4
        assert value(middle, "pjrt_rendezvous_processes", **job, state="alive") == 2
        assert value(middle, "pjrt_rendezvous_rounds_completed_total", **job) == 5
        assert value(after, "pjrt_rendezvous_rounds_completed_total", **job) == 10
        assert value(middle, "pjrt_rendezvous_round_wait_seconds_count", **job) == 5
        assert value(after, "pjrt_rendezvous_round_wait_seconds_count", **job) == 10
        assert value(after, "pjrt_rendezvous_round_wait_seconds_bucket", **job, le="+Inf") == 10
        assert 0 < value(after, "pjrt_rendezvous_round_wait_seconds_sum", **job) < 60
        rdv = dict(service="pjrt_rendezvous.v1.Coordinator", method="Rendezvous", code="OK")
        # Threads of one process arrive together: one RPC per process and round, at least.
        assert 10 <= value(middle, "pjrt_rendezvous_rpcs_total", **rdv) < value(after, "pjrt_rendezvous_rpcs_total", **rdv)
        register = dict(service="pjrt_rendezvous.v1.Coordinator", method="Register", code="OK")
        assert value(after, "pjrt_rendezvous_rpcs_total", **register) == 4
        assert value(after, "pjrt_rendezvous_rounds_pending", **job) == 0

        # A round only process 0 joins: pending, older at every scrape, then timed out.
        def stuck(binding):
            binding.client.rendezvous(binding, "stuck", b"", replicas=[0, 1, 2], timeout=3)

        timed_out = [bound_thread(clients[0], i, stuck) for i in range(2)]
        first = wait_until(
            lambda: (s := scrape(server.metrics_port)) and value(s, "pjrt_rendezvous_rounds_pending", **job) == 1 and s,
            what="a pending round",
        )
        time.sleep(0.5)
        second = scrape(server.metrics_port)
        age = "pjrt_rendezvous_round_oldest_pending_age_seconds"
        assert value(second, age, **job) >= value(first, age, **job) + 0.4
        for thread, errors in timed_out:
            thread.join(30)
            assert [type(e) for e in errors] == [pr.RendezvousTimeout]
        final = scrape(server.metrics_port)
        assert value(final, "pjrt_rendezvous_rounds_pending", **job) == 0
        assert value(final, age, **job) == 0
        assert value(final, "pjrt_rendezvous_rounds_failed_total", **job, code="DEADLINE_EXCEEDED") == 1
        assert value(final, "pjrt_rendezvous_rounds_completed_total", **job) == 10
        for client in clients:
            client.close()
        assert server.stop() == 0


def test_dead_processes_and_generation_are_counted():
    """A process that stops heartbeating shows as dead; its replacement raises the generation;
    one that closes its client shows as left."""
    with Coordinator(port=0, metrics_port=0, heartbeat_timeout=3.0) as coordinator:
        first = simulated_process(coordinator.address, 0, processes=2, threads=1)
        second = simulated_process(coordinator.address, 1, processes=2, threads=1)
        bound_thread(first, 0)
        bound_thread(second, 0)
        job = {"rendezvous_job": "default"}
        assert value(scrape(coordinator.metrics_port), "pjrt_rendezvous_processes", **job, state="alive") == 2
        second.close(leave=False)  # heartbeats stop without a goodbye
        wait_until(
            lambda: value(scrape(coordinator.metrics_port), "pjrt_rendezvous_processes", **job, state="dead") == 1,
            what="a dead process",
        )
        replacement = simulated_process(coordinator.address, 1, processes=2, threads=1)
        bound_thread(replacement, 0)
        samples = scrape(coordinator.metrics_port)
        assert value(samples, "pjrt_rendezvous_processes", **job, state="dead") == 0
        assert value(samples, "pjrt_rendezvous_processes", **job, state="alive") == 2
        assert value(samples, "pjrt_rendezvous_job_generation", **job) == 2
        first.close()  # leaves: counted as left, not dead (no alert after a normal end)
        samples = scrape(coordinator.metrics_port)
        assert value(samples, "pjrt_rendezvous_processes", **job, state="left") == 1
        assert value(samples, "pjrt_rendezvous_processes", **job, state="dead") == 0
        replacement.close()


def test_rpcs_are_counted_by_code_including_refusals():
    """Calls the token check refuses count as UNAUTHENTICATED (a client's Session stream is
    refused as a whole), unknown methods as (unknown), key-value calls carried on a Session
    with their own method names, a session on the session port once as a Session when it
    ends (it was not: only a wrong token's was; CANCELLED if a call of it still waited) or
    is refused, a connection that sent no
    hello (garbage, a port probe) not at all; the endpoint listens on the serve host."""
    with Coordinator(host="127.0.0.1", port=0, metrics_port=0, token="t0ken-xyz") as coordinator:
        anonymous = pr.Client(pr.Settings(address=coordinator.address, connect_timeout=1), pr.detect_topology({}))
        with pytest.raises(pr.AuthenticationError):
            anonymous.set("k", b"v")
        anonymous.close()
        member = pr.Client(pr.Settings(address=coordinator.address, token="t0ken-xyz"), pr.detect_topology({}))
        member.set("k", b"v")
        assert member.get("k") == b"v"
        member.close()
        with grpc.insecure_channel(coordinator.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary("/no.Such/Method")(b"", timeout=10)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with socket.create_connection(("127.0.0.1", coordinator.session_port), timeout=10) as sock:
            sock.sendall(frame(pb.SessionHello(authorization="Bearer wrong").SerializeToString()))
            assert sock.recv(65536)  # the refusal, then the end
        with socket.create_connection(("127.0.0.1", coordinator.session_port), timeout=10) as sock:
            sock.sendall(b"garbage\0\0")  # (a length over the hello's limit)
            assert sock.recv(65536)
        socket.create_connection(("127.0.0.1", coordinator.session_port), timeout=10).close()  # a port probe
        with socket.create_connection(("127.0.0.1", coordinator.session_port), timeout=10) as sock:
            sock.sendall(frame(pb.SessionHello(authorization="Bearer t0ken-xyz").SerializeToString()))
            sock.sendall(frame(pb.SessionRequest(calls=[pb.SessionCall(id=1)]).SerializeToString()))  # a ping
            assert sock.recv(65536)  # its answer: the session was taken
        with socket.create_connection(("127.0.0.1", coordinator.session_port), timeout=10) as sock:
            sock.sendall(frame(pb.SessionHello(authorization="Bearer t0ken-xyz").SerializeToString()))
            waiting = pb.KvGetRequest(job="default", keys=["never"], wait=True, timeout=60).SerializeToString()
            sock.sendall(frame(pb.SessionRequest(calls=[pb.SessionCall(id=1, method="KvGet", request=waiting)]).SerializeToString()))
            time.sleep(0.5)  # (its call waiting, the session ends: CANCELLED, not OK)
        service = "pjrt_rendezvous.v1.Coordinator"
        # The member's gRPC stream, and the session on the session port.
        wait_until(
            lambda: value(scrape(coordinator.metrics_port), "pjrt_rendezvous_rpcs_total", service=service, method="Session", code="OK") == 2,
            what="both sessions counted",
        )
        wait_until(
            lambda: value(scrape(coordinator.metrics_port), "pjrt_rendezvous_rpcs_total", service=service, method="Session", code="CANCELLED") == 1,
            what="the session ended with its call waiting counted",
        )
        samples = scrape(coordinator.metrics_port)
        # One on gRPC's Session stream, one on the session port.
        assert value(samples, "pjrt_rendezvous_rpcs_total", service=service, method="Session", code="UNAUTHENTICATED") == 2
        assert sum(samples["pjrt_rendezvous_rpcs_total"][key] for key in samples["pjrt_rendezvous_rpcs_total"] if ("method", "Session") in key) == 5
        assert value(samples, "pjrt_rendezvous_rpcs_total", service=service, method="KvSet", code="UNAUTHENTICATED") == 0
        assert value(samples, "pjrt_rendezvous_rpcs_total", service=service, method="KvSet", code="OK") == 1
        assert value(samples, "pjrt_rendezvous_rpcs_total", service=service, method="KvGet", code="OK") == 1
        assert value(samples, "pjrt_rendezvous_rpcs_total", service="(unknown)", method="(unknown)", code="UNIMPLEMENTED") == 1
        assert value(samples, "pjrt_rendezvous_kv_keys", rendezvous_job="default") == 1
        assert coordinator._running._metrics_server.sockets[0].getsockname()[0] == "127.0.0.1"


def test_no_metrics_endpoint_unless_asked():
    """Without metrics_port there is no endpoint and no RPC counting."""
    with Coordinator(port=0) as coordinator:
        assert coordinator.metrics_port is None
        assert coordinator._running.metrics is None


def test_a_taken_metrics_port_stops_serve_with_a_message():
    """`serve --metrics-port` on a port already in use exits 1 naming the problem, serving nothing."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("serve", "--port", "0", "--metrics-port", str(port), timeout=60)
    assert result.returncode == 1 and "address already in use" in result.stderr, result.stderr
    assert "listening" not in result.stdout


def test_late_rounds_are_reported_a_few_per_check_and_forgotten_once_gone(caplog):
    """Naming who a late round misses costs its group's size: one check reports at most
    LATE_PER_CHECK late rounds, the next ones the rest, each once; rounds reported late are
    forgotten once they are no longer pending (past LATE_KEPT)."""
    from pjrt_rendezvous.coordinator import Core
    from pjrt_rendezvous.coordinator._core import Contribution, Registration, ThreadRequest
    from pjrt_rendezvous.coordinator._monitor import Monitor

    core = Core()
    jobs = [f"j{n}" for n in range(40)]
    for job in jobs:  # a world of 1,000, one ordinal there: its round waits
        core.register(0.0, Registration(job=job, incarnation=f"i-{job}", host="h", pid=1, task_id=0, num_tasks=1000,
                                        devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),)))
        core.arrive(0.0, job=job, incarnation=f"i-{job}", replicas=[], round_number=0,
                    contributions=[Contribution(0, "t", b"")], deadline=None)
    monitor = Monitor(core, None, clock=lambda: 100.0, late_after=1.0)
    monitor.LATE_KEPT = 20
    reported = []
    for _ in range(4):
        caplog.clear()
        monitor.check_late()
        reported.append([r.getMessage() for r in caplog.records if "round late" in r.getMessage()])
    assert [len(r) for r in reported] == [16, 16, 8, 0]
    assert len({m.split("'")[1] for r in reported for m in r}) == 40  # each job's round once
    assert "missing ordinals 1-999 never registered" in reported[0][0]
    for job in jobs[:30]:
        core.leave(job, f"i-{job}")  # their rounds fail: no longer pending
    monitor.check_late()
    assert len(monitor._late) == 10


def test_a_late_round_is_reported_again_each_time_its_wait_doubles(caplog):
    """Once at late_after only, a round waiting out the default 600 s timeout was named at
    60 s and then never: it is named again at 120, 240 and 480 s, as checks find it (they
    doubled the wait each found, and drifted: 60.3, 121.3, 243.3, 487.3 s at 1 s checks)."""
    from pjrt_rendezvous.coordinator import Core
    from pjrt_rendezvous.coordinator._core import Contribution, Registration, ThreadRequest
    from pjrt_rendezvous.coordinator._monitor import Monitor

    core = Core()
    core.register(0.0, Registration(job="j", incarnation="i", host="h", pid=1, task_id=0, num_tasks=2,
                                    devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),)))
    core.arrive(0.0, job="j", incarnation="i", replicas=[], round_number=0, contributions=[Contribution(0, "t", b"")], deadline=None)
    now = [0.0]
    monitor = Monitor(core, None, clock=lambda: now[0], late_after=60.0)
    waits = []
    for check in range(460):
        now[0] = check * 1.3
        caplog.clear()
        monitor.check_late()
        waits += [r.waited for r in caplog.records if getattr(r, "event", "") == "round_late"]
    dues = (60, 120, 240, 480)  # each named at the first check after it
    assert len(waits) == len(dues) and all(due <= wait < due + 1.3 for wait, due in zip(waits, dues)), waits


def test_a_monitor_refuses_a_late_after_it_cannot_double():
    """check_late doubles late_after for each report: 0 would loop for ever."""
    from pjrt_rendezvous.coordinator import Core
    from pjrt_rendezvous.coordinator._monitor import Monitor

    for late_after in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="late_after must be > 0 seconds or None"):
            Monitor(Core(), None, clock=lambda: 0.0, late_after=late_after)


def test_log_lines_of_a_strided_group_stay_short(caplog):
    """A round of every other ordinal of 4,096, late and then failed: its lines stay within
    a few KiB (round_late's was 26,838 characters and round_failed's 25,173, every member of
    the group written out, and a log pipeline splits lines over 16 KiB); the group is cut
    short as the missing ordinals are."""
    from pjrt_rendezvous.coordinator import Core
    from pjrt_rendezvous.coordinator._core import Contribution, Registration, ThreadRequest
    from pjrt_rendezvous.coordinator._logging import JsonFormatter
    from pjrt_rendezvous.coordinator._monitor import Monitor

    core = Core()
    for task in range(4096):
        core.register(0.0, Registration(job="j", incarnation=f"i{task}", host=f"h{task // 8}", pid=task, task_id=task,
                                        num_tasks=4096, devices_per_task=1, local_rank=task % 8,
                                        threads=(ThreadRequest(thread_index=0),)))
    group = list(range(0, 4096, 2))
    core.arrive(0.0, job="j", incarnation="i0", replicas=group, round_number=0, contributions=[Contribution(0, "t", b"")],
                deadline=None)
    clock = [100.0]
    monitor = Monitor(core, None, clock=lambda: clock[0], late_after=1.0)
    core.take_wakeups()
    with caplog.at_level("WARNING", logger="pjrt_rendezvous.coordinator"):
        monitor.check_late()
        core.leave("j", "i2")  # a member leaves: the round fails
        monitor.woke(core.take_wakeups())
    lines = {r.event: r for r in caplog.records if getattr(r, "event", "") in ("round_late", "round_failed")}
    assert set(lines) == {"round_late", "round_failed"}, [r.getMessage() for r in caplog.records]
    for event, record in lines.items():
        text = JsonFormatter().format(record)
        assert len(text) < 8192 and record.group.endswith(", ... (2048 ordinals)") and len(record.group) < 1030, (event, len(text))
        assert record.group.startswith("0, 2, 4, 6, ")


def test_a_world_still_incomplete_after_late_after_is_logged_once_naming_who_is_missing(caplog):
    """A world that does not form (task 2 never starts, task 1 binds one of its two threads)
    left nothing in the coordinator's log past the registrations that came: who was missing
    took `status`, or a wait_world's timeout in some process. Now, as for a late round, one
    line once the world has waited --late-after, naming the missing ordinals and where they are."""
    from pjrt_rendezvous.coordinator import Core
    from pjrt_rendezvous.coordinator._core import Registration, ThreadRequest
    from pjrt_rendezvous.coordinator._monitor import Monitor

    def register(now: float, task: int, threads: tuple[int, ...]) -> None:
        core.register(now, Registration(job="j", incarnation=f"i{task}", host=f"h{task}", pid=task, task_id=task,
                                        num_tasks=3, devices_per_task=2, local_rank=0,
                                        threads=tuple(ThreadRequest(thread_index=i) for i in threads)))

    core, clock = Core(), [0.0]
    monitor = Monitor(core, None, clock=lambda: clock[0], late_after=10.0)
    register(0.0, 0, (0, 1))
    register(0.0, 1, (0,))

    def late() -> list:
        caplog.clear()
        with caplog.at_level("WARNING", logger="pjrt_rendezvous.coordinator"):
            monitor.check_late()
        return [r for r in caplog.records if getattr(r, "event", "") == "world_late"]

    for now in (0.0, 5.0, 9.9):
        clock[0] = now
        assert late() == []
    clock[0] = 10.5
    (line,) = late()
    assert line.getMessage() == (
        "world late in job 'j': 3 of 6 ordinals registered after 10.5 s; missing ordinals 3-5 "
        "(3 on h1 (pid 1, last seen 10.5 s ago); 4-5 never registered)"
    ), line.getMessage()
    assert (line.job, line.generation, line.registered, line.expected, line.missing, line.missing_count) == (
        "j", 1, 3, 6, "3-5", 3
    )
    clock[0] = 30.0
    assert late() == []  # once
    register(30.0, 1, (0, 1))
    register(30.0, 2, (0, 1))
    assert late() == [] and not monitor._worlds  # formed: forgotten


def test_world_formed_line_counts_in_words(caplog):
    """The world's line says "1 host" and "2 processes" ("on 1 hosts" before)."""
    from pjrt_rendezvous.coordinator import Core
    from pjrt_rendezvous.coordinator._core import Registration, ThreadRequest
    from pjrt_rendezvous.coordinator._monitor import Monitor

    core = Core()
    monitor = Monitor(core, None, clock=lambda: 1.0)
    for task in range(2):
        core.register(1.0, Registration(job="j", incarnation=f"i{task}", host="h", pid=task, task_id=task,
                                        num_tasks=2, devices_per_task=1, local_rank=task,
                                        threads=(ThreadRequest(thread_index=0),)))
    with caplog.at_level("INFO", logger="pjrt_rendezvous.coordinator"):
        monitor.woke(core.take_wakeups())
    (line,) = [r.getMessage() for r in caplog.records if getattr(r, "event", "") == "world_formed"]
    assert line == "world formed in job 'j': 2 ordinals, 2 processes on 1 host, generation 1", line


def test_a_job_run_again_and_again_is_one_entry_of_the_monitor_s(caplog):
    """Each run of a job under one name (all its processes gone, the next starts afresh) gets
    its world_formed line; the monitor kept every run's (job, generation) for the job's life:
    133 bytes a run (a soak trial)."""
    from pjrt_rendezvous.coordinator import Core
    from pjrt_rendezvous.coordinator._core import Registration, ThreadRequest
    from pjrt_rendezvous.coordinator._monitor import Monitor

    core = Core()
    monitor = Monitor(core, None, clock=lambda: 1.0)
    with caplog.at_level("INFO", logger="pjrt_rendezvous.coordinator"):
        for run in range(20):
            for task in range(2):
                core.register(1.0, Registration(job="j", incarnation=f"i{run}-{task}", host="h", pid=task,
                                                task_id=task, num_tasks=2, devices_per_task=1, local_rank=task,
                                                threads=(ThreadRequest(thread_index=0),)))
            monitor.woke(core.take_wakeups())
            for task in range(2):
                core.leave("j", f"i{run}-{task}")
            monitor.woke(core.take_wakeups())
    formed = [r.generation for r in caplog.records if getattr(r, "event", "") == "world_formed"]
    assert len(formed) == 20 and len(set(formed)) == 20, formed
    assert len(monitor._formed) == 1


def test_a_job_dropped_and_made_again_under_its_name_starts_its_series_afresh():
    """A finished job dropped at max_jobs (Monitor calls Metrics.forget) and made again under
    the same name: its counters and its round-wait histogram start at 0, not at the old
    run's counts."""
    from pjrt_rendezvous.coordinator import Core
    from pjrt_rendezvous.coordinator._metrics import Metrics

    core, metrics = Core(), Metrics()
    core.kv_set("j", [("k", b"v")])
    metrics.round_completed("j", 0.5)
    metrics.round_failed("j", "ABORTED", 1.0)
    metrics.process_event("j", "dead", 1.0)
    metrics.forget("j")
    samples = parse(metrics.render(core, 2.0))
    job = ("rendezvous_job", "j")
    assert samples["pjrt_rendezvous_rounds_failed_total"][(("code", "ABORTED"), job)] == 0
    assert samples["pjrt_rendezvous_process_events_total"][(("event", "dead"), job)] == 0
    assert not any(job in labels for labels in samples.get("pjrt_rendezvous_round_wait_seconds_count", {})), samples


def test_every_round_a_death_fails_is_counted_and_logged(caplog):
    """A death fails three pending rounds of one group at once: each is counted and logged
    (the monitor looked each up after the fact, and the core keeps a group's last two)."""
    from pjrt_rendezvous.coordinator import Core
    from pjrt_rendezvous.coordinator._core import Contribution, Registration, ThreadRequest
    from pjrt_rendezvous.coordinator._metrics import Metrics
    from pjrt_rendezvous.coordinator._monitor import Monitor

    core, metrics = Core(), Metrics()
    monitor = Monitor(core, metrics, clock=lambda: 5.0)
    for task in range(2):
        core.register(0.0, Registration(job="j", incarnation=f"i{task}", host="h", pid=task, task_id=task, num_tasks=2,
                                        devices_per_task=1, local_rank=task, threads=(ThreadRequest(thread_index=0),)))
    for number in range(3):  # (each an interrupted call of task 0: its rounds stay pending)
        core.arrive(1.0, job="j", incarnation="i0", replicas=[], round_number=number,
                    contributions=[Contribution(0, "t", b"")], deadline=None)
    monitor.woke(core.take_wakeups())
    core.declare_dead("j", "i1", "silent")
    with caplog.at_level("WARNING", logger="pjrt_rendezvous.coordinator"):
        monitor.woke(core.take_wakeups())
    failed = [r for r in caplog.records if getattr(r, "event", "") == "round_failed"]
    assert sorted(r.round for r in failed) == [0, 1, 2]
    assert 'pjrt_rendezvous_rounds_failed_total{rendezvous_job="j",code="ABORTED"} 3' in metrics.render(core, 5.0)


def test_a_job_killed_and_relaunched_at_once_counts_and_logs_its_processes_dead(caplog):
    """Every process of a job killed (their connections closed) and the job relaunched before
    any was declared dead: the new run starts afresh, and the last run's processes went
    without a log line or a count (the documented alert on process_events_total{event="dead"}
    never fired for a job a controller relaunches). Each is now declared dead as it ends."""
    from pjrt_rendezvous.coordinator import Core
    from pjrt_rendezvous.coordinator._core import Registration, ThreadRequest
    from pjrt_rendezvous.coordinator._metrics import Metrics
    from pjrt_rendezvous.coordinator._monitor import Monitor

    def register(run: str, task: int, now: float) -> None:
        core.register(now, Registration(job="j", incarnation=f"{run}{task}", host="h", pid=10 * len(run) + task,
                                        task_id=task, num_tasks=2, devices_per_task=1, local_rank=task,
                                        threads=(ThreadRequest(thread_index=0),)))

    core, metrics = Core(heartbeat_timeout=60.0), Metrics()
    monitor = Monitor(core, metrics, clock=lambda: 5.0)
    for task in range(2):
        register("a", task, 0.0)
    for task in range(2):
        core.disconnect("j", f"a{task}", 1.0)  # kill -9
    register("bb", 0, 2.0)  # relaunched: a new run
    with caplog.at_level("WARNING", logger="pjrt_rendezvous.coordinator"):
        monitor.woke(core.take_wakeups())
    dead = [(r.pid, r.getMessage()) for r in caplog.records if getattr(r, "event", "") == "process_dead"]
    assert dead == [
        (10 + task, f"process dead in job 'j': ordinal {task} (h pid {10 + task}, task {task}) was dropped: its connection "
         "closed without a Leave, and a new run of job 'j' registered before it was heard from again")
        for task in range(2)
    ], dead
    assert 'pjrt_rendezvous_process_events_total{rendezvous_job="j",event="dead"} 2' in metrics.render(core, 5.0)


def test_rounds_failed_again_for_a_cause_told_are_counted_not_each_logged(caplog):
    """A program that catches ParticipantFailedError and goes on calling fails every round at
    once after a death: each was a full WARNING (thousands of lines a second). The first
    REPEATS_TOLD are; the rest are counted in one line at most every REPEATS_EVERY, from
    the next failure or the monitor's watch. Events come before the rounds they fail, every
    job's process events are counted from 0, and a line's missing ordinals are capped."""
    from pjrt_rendezvous.coordinator import Core
    from pjrt_rendezvous.coordinator._core import Contribution, Registration, ThreadRequest
    from pjrt_rendezvous.coordinator._metrics import Metrics
    from pjrt_rendezvous.coordinator._monitor import Monitor

    clock = [5.0]
    core, metrics = Core(), Metrics()
    monitor = Monitor(core, metrics, clock=lambda: clock[0])
    for task in range(2):
        core.register(0.0, Registration(job="j", incarnation=f"i{task}", host="h", pid=task, task_id=task, num_tasks=2,
                                        devices_per_task=1, local_rank=task, threads=(ThreadRequest(thread_index=0),)))
    core.arrive(1.0, job="j", incarnation="i0", replicas=[], round_number=0,
                contributions=[Contribution(0, "t", b"")], deadline=None)
    assert 'pjrt_rendezvous_process_events_total{rendezvous_job="j",event="dead"} 0' in metrics.render(core, 5.0)
    monitor.woke(core.take_wakeups())
    core.declare_dead("j", "i1", "silent")
    with caplog.at_level("WARNING", logger="pjrt_rendezvous.coordinator"):
        monitor.woke(core.take_wakeups())
        for number in range(1, 31):  # the survivor goes on: each round fails at once
            rnd = core.arrive(6.0, job="j", incarnation="i0", replicas=[], round_number=number,
                              contributions=[Contribution(0, "t", b"")], deadline=None)
            assert "cannot complete: a member died" in rnd.error.message
            monitor.woke(core.take_wakeups())
        events = [getattr(r, "event", "") for r in caplog.records]
        assert events[0] == "process_dead" and events.count("round_failed") == Monitor.REPEATS_TOLD, events
        assert "rounds_failed_again" not in events
        clock[0] += Monitor.REPEATS_EVERY
        monitor._say_repeats(clock[0])  # (as the watch does)
    again = [r for r in caplog.records if getattr(r, "event", "") == "rounds_failed_again"]
    assert len(again) == 1 and again[0].rounds == 31 - Monitor.REPEATS_TOLD, [r.getMessage() for r in again]
    assert "more round(s) failed in job 'j' for the same cause as before: a member died (ordinal 1 on h pid 1: silent)" in again[0].getMessage()
    text = metrics.render(core, clock[0])
    assert 'pjrt_rendezvous_rounds_failed_total{rendezvous_job="j",code="ABORTED"} 31' in text
    assert 'pjrt_rendezvous_process_events_total{rendezvous_job="j",event="dead"} 1' in text
    first = next(r for r in caplog.records if getattr(r, "event", "") == "round_failed")
    assert (first.tag, first.arrived, first.expected, first.missing, first.missing_count) == ("t", 1, 2, "1", 1)

    from pjrt_rendezvous.coordinator._monitor import _missing_fields

    assert (first.missing_hosts, first.missing_hosts_count) == (["h"], 1), first.__dict__
    capped = _missing_fields(Core(), "j", list(range(0, 20000, 2)))
    assert len(capped["missing"]) <= 1030 and capped["missing"].endswith(", ... (10000 ordinals)") and capped["missing_count"] == 10000


def test_a_death_counted_long_after_its_process_was_heard_from_is_exported():
    """A finished job's ten minutes count from its last event too: a process declared dead
    for silence was last heard heartbeat_timeout s before, and with a timeout of 900 s its
    job was no longer exported when the death was counted (an alert on the dead events
    never fired)."""
    from pjrt_rendezvous.coordinator import Core
    from pjrt_rendezvous.coordinator._core import Registration, ThreadRequest
    from pjrt_rendezvous.coordinator._metrics import FINISHED_SHOWN, Metrics
    from pjrt_rendezvous.coordinator._monitor import Monitor

    now = [0.0]
    core, metrics = Core(heartbeat_timeout=900.0), Metrics()
    monitor = Monitor(core, metrics, clock=lambda: now[0], late_after=None)
    for task in range(2):
        core.register(0.0, Registration(job="j", incarnation=f"i-{task}", host="h", pid=1 + task, task_id=task, num_tasks=2,
                                        devices_per_task=1, local_rank=task, threads=(ThreadRequest(thread_index=0),)))
    core.leave("j", "i-0")
    dead = []
    for now[0] in (899.0, 901.0, 901.0 + FINISHED_SHOWN - 1, 901.0 + FINISHED_SHOWN + 1):  # task 1 silent
        core.check_liveness(now[0])
        monitor.woke(core.take_wakeups())
        dead.append(parse(metrics.render(core, now[0])).get("pjrt_rendezvous_process_events_total", {}).get(
            (("event", "dead"), ("rendezvous_job", "j"))))
    assert dead == [0, 1, 1, None], dead


def test_a_finished_job_is_exported_for_ten_minutes_after_its_last_process_went():
    """A coordinator keeps finished jobs until --max-jobs (1,024 by default), and each was
    exported, about 32 series a job, making every scrape large and slow. A job whose
    processes are all gone, with no round pending, is exported for FINISHED_SHOWN after
    the last was heard from; a job of keys alone, or with a live process, always."""
    from pjrt_rendezvous.coordinator import Core
    from pjrt_rendezvous.coordinator._core import Registration, ThreadRequest
    from pjrt_rendezvous.coordinator._metrics import FINISHED_SHOWN, Metrics

    core, metrics = Core(), Metrics()
    for job in ("done", "running"):
        core.register(0.0, Registration(job=job, incarnation=f"i-{job}", host="h", pid=1, task_id=0, num_tasks=1,
                                        devices_per_task=1, local_rank=0, threads=(ThreadRequest(thread_index=0),)))
        metrics.round_completed(job, 0.1)
    core.leave("done", "i-done")
    core.kv_set("keys", [("k", b"v")])
    for now, shown in ((FINISHED_SHOWN - 1, {"done", "running", "keys"}), (FINISHED_SHOWN + 1, {"running", "keys"})):
        samples = parse(metrics.render(core, now))
        jobs = {dict(key).get("rendezvous_job") for series in samples.values() for key in series} - {None}
        assert jobs == shown, (now, jobs)

