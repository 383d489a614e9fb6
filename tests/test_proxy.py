"""Through a fault-injecting TCP proxy (tests/_proxy.py) on loopback: dropped, refused and
cut connections make the client retry (UNAVAILABLE), and every call still takes effect
exactly once - rendezvous rounds by their (group, round), key-value changes by their request
id; delayed bytes only slow calls down; a silently dead (blackholed) connection is noticed
by the session's ping and its waiting call resent.

The client's own debug line "METHOD to ADDRESS failed (ERROR); retry N" is how the tests
see which status codes a fault produced; any other code than UNAVAILABLE would not be
retried and would surface as an error in the calling thread. ``-s`` prints the figures.
"""

from __future__ import annotations

import collections
import json
import logging
import random
import re
import subprocess
import sys
import threading
import time

import grpc
import pytest

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client._demo import simulated_env
from pjrt_rendezvous.coordinator import Coordinator

from _proxy import Proxy

pytestmark = pytest.mark.slow

ROUNDS = 150
CHAOS_SECONDS = 6.0


class RetryLog(logging.Handler):
    """Collects the status codes of the client's retried failures, by method, from the test's
    thread and those started after it (not from clients an earlier, failed test left open)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.earlier = {thread.ident for thread in threading.enumerate()} - {threading.get_ident()}
        self.codes: collections.Counter = collections.Counter()
        self.methods: collections.Counter = collections.Counter()
        self.details: collections.Counter = collections.Counter()  # gRPC's wording, ports masked

    def emit(self, record: logging.LogRecord) -> None:
        if not (isinstance(record.msg, str) and record.msg.startswith("%s to %s failed") and record.args):
            return
        if record.thread in self.earlier:
            return
        method, _, exc = record.args[:3]
        self.codes[exc.code().name if isinstance(exc, grpc.RpcError) else type(exc).__name__] += 1
        self.methods[method] += 1
        if isinstance(exc, grpc.RpcError):
            self.details[re.sub(r"127\.0\.0\.1:\d+", "ADDR", exc.details() or "")] += 1

    @property
    def total(self) -> int:
        return sum(self.codes.values())


@pytest.fixture
def retries():
    logger = logging.getLogger("pjrt_rendezvous.client")
    handler, level = RetryLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def coordinator():
    with Coordinator(port=0) as c:
        yield c


def make_client(address: str, *, task: int = 0, tasks: int = 2, cores: int = 1, **settings) -> pr.Client:
    topology = pr.detect_topology(
        {
            "PJRT_RENDEZVOUS_NUM_TASKS": str(tasks),
            "PJRT_RENDEZVOUS_TASK_ID": str(task),
            "PJRT_RENDEZVOUS_CORES_PER_CHIP": str(cores),
        },
        address=address,
    )
    options = dict(timeout=30, connect_timeout=30, progress_interval=None) | settings
    return pr.Client(pr.Settings(address=address, **options), topology)


def payload(ordinal: int, k: int) -> bytes:
    """Long enough (up to 3 KiB) that random cuts land inside payloads, not only headers."""
    rng = random.Random(f"{ordinal}/{k}")
    return b"%d/%d/" % (ordinal, k) + rng.randbytes(rng.randrange(0, 3072))


def run_rounds(clients: list[pr.Client], rounds: int, cores: int) -> tuple[dict[int, list], list]:
    """Every thread of every client makes ``rounds`` full-world rendezvous; returns results and errors."""
    results: dict[int, list] = {}
    errors: list = []
    bound = threading.Barrier(len(clients) * cores)

    def thread_main(client: pr.Client, index: int) -> None:
        try:
            binding = client.bind_thread(index)
            try:
                bound.wait(30)
                mine = results.setdefault(binding.ordinal, [])
                for k in range(rounds):
                    mine.append(client.rendezvous(binding, f"step{k % 3}", payload(binding.ordinal, k)))
            finally:
                client.unbind_thread()
        except BaseException as exc:  # reported by the test
            errors.append((index, f"{type(exc).__name__}({getattr(exc, 'code', '')}): {exc}"))
            bound.abort()

    threads = [threading.Thread(target=thread_main, args=(c, i)) for c in clients for i in range(cores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rendezvous thread hung"
    return results, errors


def status_of(address: str):
    observer = make_client(address, tasks=1)
    try:
        (job,) = observer.status().jobs
        return job
    finally:
        observer.close()


def wait_for_arrival(observer: pr.Client, arrived: list[int], timeout: float = 10.0):
    """Polls the coordinator (directly) until its one pending round has exactly ``arrived``."""
    deadline = time.monotonic() + timeout
    pending = None
    while time.monotonic() < deadline:
        try:
            pending = observer.status().jobs[0].pending_rounds
        except pr.UnknownJobError:  # nobody registered yet
            pending = None
        if pending is not None and len(pending) == 1 and list(pending[0].arrived) == arrived:
            return pending[0]
        time.sleep(0.02)
    raise AssertionError(f"no pending round with arrivals {arrived}: {pending}")


def test_rounds_complete_exactly_once_while_the_proxy_drops_refuses_and_cuts(coordinator, retries):
    """2 clients x 2 threads, 150 rounds through a proxy that keeps dropping, refusing and cutting connections:
    identical results for all, each round completed once."""
    world = 4
    with Proxy(coordinator.address, seed=1, session_port=coordinator.session_port) as proxy:
        proxy.delay = 0.002  # keeps calls in flight long enough for faults to land mid-call
        # gRPC pools connections per target, so both clients share one TCP connection here;
        # test_processes_through_the_proxy gives each process its own.
        clients = [make_client(proxy.address, task=t, cores=2) for t in range(2)]
        done = threading.Event()
        faults = collections.Counter()

        def chaos() -> None:
            # Moderate on purpose: refusals make gRPC back off (1 s, 1.6 s, ...) before it
            # reconnects, so back-to-back refusals would only measure its backoff.
            rng = random.Random(7)
            stop_at = time.monotonic() + CHAOS_SECONDS  # bounds the test's time; later rounds run clean
            while not done.wait(rng.uniform(0.03, 0.15)) and time.monotonic() < stop_at:
                roll = rng.random()
                if roll < 0.7:
                    proxy.drop()
                    faults["drop"] += 1
                elif roll < 0.78:
                    proxy.drop(refuse_for=rng.uniform(0.05, 0.2))
                    faults["drop+refuse"] += 1
                else:  # connections made from now on are cut after a random byte count
                    proxy.cut_after = None if proxy.cut_after else (1000, 30000)
                    faults["toggle cuts"] += 1
            proxy.cut_after = None

        chaos_thread = threading.Thread(target=chaos)
        chaos_thread.start()
        started = time.monotonic()
        try:
            results, errors = run_rounds(clients, ROUNDS, cores=2)
        finally:
            done.set()
            chaos_thread.join()
            for c in clients:
                c.close()
        elapsed = time.monotonic() - started
        stats = dict(proxy.stats)

    assert not errors, errors
    expected = [[payload(o, k) for o in range(world)] for k in range(ROUNDS)]
    assert sorted(results) == list(range(world))
    for ordinal, got in results.items():
        assert got == expected, f"ordinal {ordinal} got other results than its peers"
    job = status_of(coordinator.address)
    assert job.rounds_completed == ROUNDS and not job.pending_rounds  # no round lost or doubled
    injected = stats.get("dropped", 0) + stats.get("refused", 0) + stats.get("cut", 0)
    assert injected > 0 and retries.methods["Rendezvous"] > 0, (stats, dict(retries.methods))
    assert set(retries.codes) == {"UNAVAILABLE"}, dict(retries.codes)
    print(
        f"\nproxy chaos: {ROUNDS} rounds x {world} ordinals in {elapsed:.1f} s; chaos actions {dict(faults)}; "
        f"proxy {stats}; retried {dict(retries.codes)} by method {dict(retries.methods)}; "
        f"details {dict(retries.details)}"
    )


def test_a_call_dropped_while_waiting_is_resent_and_joins_its_round_once(coordinator, retries):
    """Ordinal 0 waits in a round; its connection drops; the resent call is the same arrival, and the round completes
    once for both."""
    observer = make_client(coordinator.address, tasks=1)
    with Proxy(coordinator.address, session_port=coordinator.session_port) as proxy:
        via_proxy = make_client(proxy.address, task=0)
        direct = make_client(coordinator.address, task=1)
        outcome = {}

        def member_a() -> None:
            with via_proxy.bind_thread(0) as binding:
                outcome["a"] = via_proxy.rendezvous(binding, "r", b"a")

        a = threading.Thread(target=member_a)
        a.start()
        wait_for_arrival(observer, [0])
        proxy.drop(refuse_for=0.2)
        deadline = time.monotonic() + 10
        while not retries.methods["Rendezvous"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert retries.methods["Rendezvous"] >= 1, "the dropped call was not retried"
        time.sleep(0.5)  # usually the resend lands before ordinal 1 comes; either order is fine
        pending = wait_for_arrival(observer, [0])
        assert list(pending.missing) == [1]  # still waiting for ordinal 1 only
        with direct.bind_thread(0) as binding:
            assert direct.rendezvous(binding, "r", b"b") == [b"a", b"b"]
        a.join(30)
        via_proxy.close()
        direct.close()
    assert outcome["a"] == [b"a", b"b"]
    (job,) = observer.status().jobs
    observer.close()
    assert job.rounds_completed == 1 and not job.pending_rounds
    assert set(retries.codes) == {"UNAVAILABLE"}, dict(retries.codes)


def test_an_answer_lost_on_the_way_back_is_fetched_again_from_the_finished_round(coordinator, retries):
    """The round completes but the proxy loses ordinal 0's answer: the resend gets the stored result; the round is not
    run twice."""
    observer = make_client(coordinator.address, tasks=1)
    with Proxy(coordinator.address, session_port=coordinator.session_port) as proxy:
        via_proxy = make_client(proxy.address, task=0)
        direct = make_client(coordinator.address, task=1)
        outcome = {}
        connected = threading.Event()

        def member_a() -> None:
            with via_proxy.bind_thread(0) as binding:  # registers through the proxy: connected
                connected.set()
                outcome["r"] = via_proxy.rendezvous(binding, "r", b"a")

        proxy_delay = 0.5
        a = threading.Thread(target=member_a)
        a.start()
        assert connected.wait(10)
        proxy.delay = proxy_delay  # from now on every chunk waits inside the proxy
        wait_for_arrival(observer, [0])
        with direct.bind_thread(0) as binding:
            assert direct.rendezvous(binding, "r", b"b") == [b"a", b"b"]
        # The coordinator has answered ordinal 0 as well; that answer now waits in the proxy.
        proxy.drop()
        proxy.delay = 0.0
        a.join(30)
        via_proxy.close()
        direct.close()
    assert outcome["r"] == [b"a", b"b"]
    (job,) = observer.status().jobs
    observer.close()
    assert job.rounds_completed == 1 and not job.pending_rounds  # answered twice, run once
    assert retries.methods["Rendezvous"] >= 1, dict(retries.methods)
    assert set(retries.codes) == {"UNAVAILABLE"}, dict(retries.codes)


def test_kv_changes_apply_once_through_a_proxy_that_cuts_connections(coordinator, retries):
    """4 threads x 50 adds and 25 appends through a proxy cutting every connection after 150-2500 bytes: each add
    counted once, each append present once."""
    threads, adds, appends = 4, 50, 25
    with Proxy(coordinator.address, seed=3, session_port=coordinator.session_port) as proxy:
        proxy.cut_after = (150, 2500)
        client = make_client(proxy.address, tasks=1)
        values, errors = [], []

        def worker(t: int) -> None:
            try:
                for i in range(adds):
                    values.append(client.add("counter", 1))
                    if i < appends:
                        client.append("log", b"<%d:%d>" % (t, i))
            except BaseException as exc:
                errors.append(f"{type(exc).__name__}({getattr(exc, 'code', '')}): {exc}")

        started = time.monotonic()
        workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        elapsed = time.monotonic() - started
        client.close()
        stats = dict(proxy.stats)
    assert not errors, errors
    direct = make_client(coordinator.address, tasks=1)
    total, log = direct.get("counter", wait=False), direct.get("log", wait=False)
    direct.close()
    assert sorted(values) == list(range(1, threads * adds + 1))  # each add applied once, seen once
    assert total == b"%d" % (threads * adds)
    entries = [b"<%d:%d>" % (t, i) for t in range(threads) for i in range(appends)]
    assert sorted(log.replace(b">", b">\n").split()) == sorted(entries)  # each append once
    assert stats.get("cut", 0) > 10 and retries.total > 0, (stats, dict(retries.codes))
    assert set(retries.codes) == {"UNAVAILABLE"}, dict(retries.codes)
    print(
        f"\nproxy cuts: {threads * adds} adds + {threads * appends} appends in {elapsed:.1f} s; proxy {stats}; "
        f"retried {dict(retries.codes)} by method {dict(retries.methods)}; details {dict(retries.details)}"
    )


def test_delayed_bytes_slow_calls_down_but_answers_stay_exact(coordinator, retries):
    """With 50 ms added per chunk, rounds between a proxied and a direct member complete with identical results, and a
    short wait gets the server's own timeout message."""
    rounds, delay = 8, 0.05
    with Proxy(coordinator.address, session_port=coordinator.session_port) as proxy:
        slow = make_client(proxy.address, task=0)
        fast = make_client(coordinator.address, task=1)
        got, connected = {}, threading.Event()

        def member(name: str, client: pr.Client) -> None:
            with client.bind_thread(0) as binding:
                if name == "slow":
                    connected.set()
                got[name] = [client.rendezvous(binding, "d", b"%s%d" % (name.encode(), k)) for k in range(rounds)]

        slow_thread = threading.Thread(target=member, args=("slow", slow))
        slow_thread.start()
        assert connected.wait(10)
        proxy.delay = delay
        started = time.monotonic()
        member("fast", fast)
        slow_thread.join(60)
        elapsed = time.monotonic() - started
        with pytest.raises(pr.RendezvousTimeout, match="still not set"):
            slow.get("never-set", timeout=0.01)  # the server's answer, arriving after the delay
        slow.close()
        fast.close()
    assert got["slow"] == got["fast"] == [[b"slow%d" % k, b"fast%d" % k] for k in range(rounds)]
    assert elapsed >= rounds * delay
    assert status_of(coordinator.address).rounds_completed == rounds
    assert retries.total == 0, dict(retries.codes)  # slowness alone is not a failure


def test_refused_connections_are_retried_until_accepted_or_connect_timeout(coordinator, retries):
    """While the proxy refuses connections a call retries and completes once it accepts; refused beyond connect_timeout
    it fails with CoordinatorUnavailableError naming the address."""
    with Proxy(coordinator.address, session_port=coordinator.session_port) as proxy:
        started = time.monotonic()  # (before the refusal: the client's making counts in neither)
        proxy.refuse(1.5)
        patient = make_client(proxy.address, tasks=1)
        assert patient.add("n", 1) == 1
        waited = time.monotonic() - started
        assert waited >= 1.5 and proxy.stats["refused"] >= 1

        proxy.drop(refuse_for=5.0)  # channels share connections: drop the open one too
        hasty = make_client(proxy.address, tasks=1, connect_timeout=1.0)
        started = time.monotonic()
        with pytest.raises(pr.CoordinatorUnavailableError, match=proxy.address):
            hasty.add("n", 1)
        assert time.monotonic() - started < 4.0
        patient.close()
        hasty.close()
    direct = make_client(coordinator.address, tasks=1)
    assert direct.get("n", wait=False) == b"1"  # the refused call never reached the coordinator
    direct.close()
    assert set(retries.codes) == {"UNAVAILABLE"}, dict(retries.codes)


def test_a_silently_dead_connection_is_noticed_and_the_waiting_call_resent(coordinator):
    """A member whose connections are blackholed while it waits notices (the session port's
    pings; gRPC's keepalive for its watch stream), resends, and gets the round's result within
    20 s."""
    observer = make_client(coordinator.address, tasks=1)
    with Proxy(coordinator.address, session_port=coordinator.session_port) as proxy:
        silent = make_client(proxy.address, task=0, timeout=None)
        direct = make_client(coordinator.address, task=1)
        outcome = {}

        def member_a() -> None:
            try:
                with silent.bind_thread(0) as binding:
                    outcome["a"] = silent.rendezvous(binding, "r", b"a")
            except BaseException as exc:  # reported below
                outcome["a"] = exc

        a = threading.Thread(target=member_a)
        a.start()
        wait_for_arrival(observer, [0])
        assert proxy.blackhole() == 2  # its gRPC channel (the watch stream) and its session
        with direct.bind_thread(0) as binding:
            assert direct.rendezvous(binding, "r", b"b") == [b"a", b"b"]
        a.join(40)  # (noticed by the session's ping: about 15 s)
        noticed = not a.is_alive()
        silent.close()  # cancels the hung call, if any
        direct.close()
        observer.close()
        a.join(10)
    assert noticed and outcome["a"] == [b"a", b"b"], outcome


# A process of the pod for the next test: `python worker.py ROUNDS`, 2 threads, full-world
# rounds; prints per thread its ordinal, a digest per round and the codes it retried.
WORKER = r'''
import collections, hashlib, json, logging, random, sys, threading
import grpc
import pjrt_rendezvous.client as pr

codes = collections.Counter()

class Retries(logging.Handler):
    def emit(self, record):
        if isinstance(record.msg, str) and record.msg.startswith("%s to %s failed") and record.args:
            exc = record.args[2]
            codes[exc.code().name if isinstance(exc, grpc.RpcError) else type(exc).__name__] += 1

logger = logging.getLogger("pjrt_rendezvous.client")
logger.addHandler(Retries())
logger.setLevel(logging.DEBUG)

def payload(ordinal, k):
    rng = random.Random(f"{ordinal}/{k}")
    return b"%d/%d/" % (ordinal, k) + rng.randbytes(rng.randrange(0, 3072))

def main(rounds):
    pr.init()
    lock = threading.Lock()

    def thread_main(index):
        record = dict(thread=index)
        try:
            with pr.bind_thread(index) as b:
                record["ordinal"] = b.ordinal
                digests = []
                for k in range(rounds):
                    result = pr.rendezvous(f"step{k % 3}", payload(b.ordinal, k))
                    assert result == [payload(o, k) for o in range(b.world_size)], f"round {k}: wrong result"
                    digests.append(hashlib.sha256(b"".join(result)).hexdigest()[:16])
                record["digests"] = digests
        except BaseException as exc:
            record.update(error=f"{type(exc).__name__}({getattr(exc, 'code', '')}): {exc}"[:2000])
        with lock:
            record["retried"] = dict(codes)
            print(json.dumps(record), flush=True)

    threads = [threading.Thread(target=thread_main, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

main(int(sys.argv[1]))
'''


def test_processes_through_the_proxy_complete_each_round_once(coordinator, tmp_path):
    """2 real processes x 2 threads, 100 rounds, each process on its own proxied connection while the proxy drops and
    cuts: results identical and checked, each round completed once, only UNAVAILABLE retried."""
    rounds = 100
    worker = tmp_path / "proxy_worker.py"
    worker.write_text(WORKER)
    with Proxy(coordinator.address, seed=5, session_port=coordinator.session_port) as proxy:
        proxy.delay = 0.002
        children = []
        for task in range(2):
            env = simulated_env(
                address=proxy.address, accelerator="v3-8", task=task, processes=2, hosts=2, threads=None
            )
            env.update(PJRT_RENDEZVOUS_TIMEOUT="60", PJRT_RENDEZVOUS_CONNECT_TIMEOUT="30")
            children.append(
                subprocess.Popen([sys.executable, str(worker), str(rounds)], env=env, stdout=subprocess.PIPE, text=True)
            )
        rng = random.Random(11)
        stop_at = time.monotonic() + 4.0
        while time.monotonic() < stop_at and any(c.poll() is None for c in children):
            time.sleep(rng.uniform(0.03, 0.15))
            if rng.random() < 0.8:
                proxy.drop()
            else:
                proxy.cut_after = None if proxy.cut_after else (1000, 30000)
        proxy.cut_after = None
        records, retried = [], collections.Counter()
        try:
            for child in children:
                out, _ = child.communicate(timeout=90)
                lines = [json.loads(line) for line in out.splitlines()]
                records += lines
                if lines:  # process-wide counts; the last thread to print saw them all
                    retried.update(lines[-1]["retried"])
        finally:
            for child in children:
                child.kill()
        stats = dict(proxy.stats)
    assert [r.get("error") for r in records] == [None] * 4, records
    assert sorted(r["ordinal"] for r in records) == [0, 1, 2, 3]
    assert len({tuple(r["digests"]) for r in records}) == 1 and len(records[0]["digests"]) == rounds
    job = status_of(coordinator.address)
    assert job.rounds_completed == rounds and not job.pending_rounds
    assert stats.get("dropped", 0) + stats.get("cut", 0) > 0 and set(retried) <= {"UNAVAILABLE"}, (stats, retried)
    print(f"\nproxy processes: {rounds} rounds x 4 ordinals; proxy {stats}; retried {dict(retried)}")


def test_a_client_cut_off_longer_than_the_heartbeat_timeout_is_told_it_was_declared_dead():
    """A client whose coordinator stays out of reach past the heartbeat timeout (a network
    cut: the coordinator runs on and declares it dead) gave up saying only that the
    coordinator was unavailable; it says too that it has been declared dead if the
    coordinator ran meanwhile."""
    with Coordinator(port=0, heartbeat_timeout=1.0) as coordinator:
        with Proxy(coordinator.address, session_port=coordinator.session_port) as proxy:
            client = make_client(proxy.address, tasks=1, connect_timeout=3)
            try:
                client.bind_thread(0)
                proxy.drop(refuse_for=60)
                with pytest.raises(pr.CoordinatorUnavailableError) as cut:
                    client.set("k", b"v")
            finally:
                client.close()
    assert re.search(r"\(unanswered for \d+ s, longer than its heartbeat timeout of 1 s: if it ran meanwhile, "
                     r"it has declared this process dead\)", str(cut.value)), cut.value


def test_the_coordinator_closes_a_grpc_connection_whose_client_vanished(monkeypatch):
    """A client cut off without a FIN (its host partitioned; the client gone meanwhile): the
    gRPC server kept its connection for good (gRPC's keepalive default, 2 h; a trial on
    network namespaces found them still open minutes after the partition healed). It pings
    a connection silent for the heartbeat timeout (60 s at least) and closes it unanswered
    as long after, as the session port's TCP keepalive does; here 1 s and 1 s. The channel
    below has no keepalive of its own."""
    from pjrt_rendezvous.coordinator import _server

    assert _server._keepalive(None)[0] == _server._keepalive(10)[0] == ("grpc.keepalive_time_ms", 60_000)
    assert set(_server._keepalive(600)) == {  # (a stopped process, answering no ping, is judged by it)
        ("grpc.keepalive_time_ms", 600_000), ("grpc.keepalive_timeout_ms", 600_000), ("grpc.http2.ping_timeout_ms", 600_000),
    }
    monkeypatch.setattr(_server, "_keepalive", lambda _: [
        ("grpc.keepalive_time_ms", 1_000), ("grpc.keepalive_timeout_ms", 1_000), ("grpc.http2.ping_timeout_ms", 1_000),
    ])
    with Coordinator(port=0) as coordinator, Proxy(coordinator.address) as proxy:
        with grpc.insecure_channel(proxy.address) as channel:
            health = channel.unary_unary("/grpc.health.v1.Health/Check")
            assert health(b"", timeout=10)  # (connected: SERVING)
            assert proxy.open_connections == 1
            proxy.blackhole()
            deadline = time.monotonic() + 30
            while proxy.open_connections:
                assert time.monotonic() < deadline, "the server kept the connection of a client gone silent"
                time.sleep(0.1)
