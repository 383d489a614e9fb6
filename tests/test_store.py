"""The torch.distributed Store on the coordinator and the pjrt-rendezvous:// init_method:
every Store method against a real coordinator, then gloo process groups in real processes."""

from __future__ import annotations

import datetime
import concurrent.futures
import contextlib
import gc
import itertools
import multiprocessing
import os
import queue
import re
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.coordinator import Coordinator

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from pjrt_rendezvous.client.torch_store import SCHEME, Store, StoreError, StoreTimeout, StoreUnavailable  # noqa: E402

pytestmark = pytest.mark.torch

WORLD = 3
SECOND = datetime.timedelta(seconds=1)


@pytest.fixture(scope="module")
def coordinator():
    with Coordinator(port=0) as c:
        yield c


@pytest.fixture
def client(coordinator):
    topology = pr.detect_topology({}, address=coordinator.address)
    c = pr.Client(pr.Settings(address=coordinator.address, timeout=10), topology)
    yield c
    c.close()


@pytest.fixture
def store(client, request):
    return Store(client, prefix=f"test/{request.node.name}", timeout=datetime.timedelta(seconds=10))


# --- Store methods -------------------------------------------------------------------------------


def test_set_get_add_append_and_multi(store):
    """set/get take str or bytes, add counts, append concatenates, multi_* keep order."""
    store.set("a", "text")
    store.set("b", b"\x00bytes")
    assert store.get("a") == b"text" and store.get("b") == b"\x00bytes"
    assert store.add("n", 5) == 5 and store.add("n", -2) == 3 and store.get("n") == b"3"
    store.append("log", b"ab")
    store.append("log", "cd")
    assert store.get("log") == b"abcd"
    store.multi_set(["x", "y"], [b"1", "2"])
    assert store.multi_get(["y", "x", "a"]) == [b"2", b"1", b"text"]
    assert store.has_extended_api() is True


def test_compare_set_follows_torch_semantics(store):
    """compare_set sets on a match (a missing key matches b''), else returns the current value."""
    assert store.compare_set("cas", b"", b"v1") == b"v1"
    assert store.compare_set("cas", b"other", b"v2") == b"v1"
    assert store.compare_set("cas", "v1", "v2") == b"v2"
    assert store.get("cas") == b"v2"


def test_check_wait_delete_and_count_use_the_names_cpp_calls(store):
    """check, wait, deleteKey/delete_key and getNumKeys/num_keys work and see only the prefix."""
    assert store.check(["k1"]) is False
    store.set("k1", b"")
    store.set("k2", b"")
    assert store.check(["k1", "k2"]) is True
    store.wait(["k1", "k2"])
    store.wait(["k1"], SECOND)
    assert store.getNumKeys() == 2 and store.num_keys() == 2
    assert store.deleteKey("k1") is True and store.delete_key("k1") is False
    assert store.num_keys() == 1 and store.check(["k1"]) is False


def test_prefixes_isolate_stores_and_clone_shares_one(client, store):
    """Stores with different prefixes do not see each other's keys; a clone sees the same keys."""
    other = Store(client, prefix="test/elsewhere")
    store.set("shared-name", b"mine")
    assert other.check(["shared-name"]) is False
    assert store.clone().get("shared-name") == b"mine"
    assert other.num_keys() == 0


def test_get_and_wait_time_out_naming_the_key(store):
    """get and wait raise StoreTimeout, a RendezvousTimeout and a DistStoreError naming the key."""
    store.set_timeout(datetime.timedelta(milliseconds=300))
    started = time.monotonic()
    with pytest.raises(StoreTimeout, match="never-set") as info:
        store.get("never-set")
    assert isinstance(info.value, pr.RendezvousTimeout) and isinstance(info.value, dist.DistStoreError)
    with pytest.raises(dist.DistStoreError, match="also-never-set") as waited:
        store.wait(["also-never-set"], datetime.timedelta(milliseconds=300))
    assert time.monotonic() - started < 5
    # Begun as torch's stores begin theirs ("Wait timeout", "wait timeout after 100ms"):
    # callers tell an idle wait from a broken store by "timeout" in it.
    assert str(info.value).startswith("wait timeout: ") and str(waited.value).startswith("wait timeout: ")


def test_refusals_and_bad_arguments_are_torch_s_kinds_too(client, store, coordinator):
    """A refused call is torch's DistStoreError (our RemoteError, with its code), an
    unreachable coordinator torch's DistNetworkError; keys may be bytes as in torch's
    stores; add takes ints only; a negative timeout is refused when it is set."""
    store.set("text", b"not a number")
    with pytest.raises(StoreError, match="not an integer|integer") as info:
        store.add("text", 1)
    assert isinstance(info.value, dist.DistStoreError) and isinstance(info.value, pr.RemoteError)
    assert info.value.code == "INVALID_ARGUMENT"
    store.set(b"bytes-key", b"v")
    assert store.get("bytes-key") == b"v" and store.check([b"bytes-key"])
    with pytest.raises(ValueError, match="UTF-8"):  # (not a bare UnicodeDecodeError)
        store.set(b"\xff\xfe", b"v")
    for value, kind in [(1.5, "float"), ("1", "str"), (True, "bool"), (False, "bool")]:  # (a bool was added as 1 or 0)
        with pytest.raises(TypeError, match=f"^Store add value must be an int, got {kind}$"):
            store.add("n", value)
    assert not store.check(["n"])
    with pytest.raises(TypeError, match=r"^client must be a pjrt_rendezvous.client.Client .*, got 'localhost:7481'; .*pjrt-rendezvous://HOST:PORT"):
        Store("localhost:7481")  # (an address taken as the client: its first call raised AttributeError)
    with pytest.raises(StoreError, match="multi_set got 2 keys but 1 values") as info:  # (was UsageError)
        store.multi_set(["a", "b"], [b"1"])
    assert isinstance(info.value, dist.DistStoreError) and info.value.code == "INVALID_ARGUMENT"
    with pytest.raises(pr.UsageError, match="must not be negative"):
        store.set_timeout(datetime.timedelta(seconds=-1))
    # C++ sets it past our check (PrefixStore's set_timeout): it expires at once, as in
    # torch's stores; it refused every wait, for keys present too.
    prefixed = dist.PrefixStore("neg", store)
    prefixed.set_timeout(datetime.timedelta(seconds=-1))
    prefixed.set("k", b"v")
    assert prefixed.get("k") == b"v"
    with pytest.raises(StoreTimeout):
        prefixed.get("missing")
    clone = prefixed.clone()  # (it raised a UsageError: a Store made with that timeout)
    assert clone.get("k") == b"v" and clone.timeout == datetime.timedelta(seconds=-1)
    store.set_timeout(datetime.timedelta(seconds=10))
    away = pr.Client(pr.Settings(address="127.0.0.1:1", connect_timeout=0.5), client.topology)
    with pytest.raises(StoreUnavailable) as info:
        Store(away, prefix="x").set("k", b"v")
    assert isinstance(info.value, dist.DistNetworkError) and isinstance(info.value, pr.CoordinatorUnavailableError)
    away.close()


def test_a_timeout_under_a_millisecond_expires_and_is_not_no_timeout(client, store):
    """torch keeps a store's timeout in whole milliseconds, and 0 is no timeout: a timeout
    under a millisecond (set_timeout's or the constructor's) is kept as one millisecond, so a
    get of a missing key times out as on a TCPStore (it became 0 and waited forever)."""
    store.set_timeout(datetime.timedelta(microseconds=500))
    assert store.timeout == datetime.timedelta(milliseconds=1)
    for tiny in (0.0005, 1e-9):  # (timedelta(seconds=1e-9) is 0)
        assert Store(client, prefix=store.prefix, timeout=tiny).timeout == datetime.timedelta(milliseconds=1), tiny
    started = time.monotonic()
    with pytest.raises(StoreTimeout, match="never-set"):
        store.get("never-set")
    assert time.monotonic() - started < 5
    store.set_timeout(datetime.timedelta(0))  # (zero itself stays no timeout)
    assert store.timeout == datetime.timedelta(0)


def test_a_store_made_with_a_timeout_of_21_days_or_more_keeps_it(client, store):
    """Such a timeout waits without a limit, as ours do; the constructor reported it as 0 (no
    timeout) and its clones inherited that, where set_timeout and a TCPStore keep it."""
    month = datetime.timedelta(days=30)
    made = Store(client, prefix=store.prefix, timeout=month)
    assert made.timeout == month and made.clone().timeout == month
    assert made._wait_seconds() is None  # (no limit on the wire)


def test_a_negative_timeout_given_to_a_wait_expires_at_once(store):
    """A negative timeout given to wait (C++ passes any: PrefixStore.wait, a deadline already
    past) expires at once, as a negative store timeout does and as in torch's stores: keys
    present are there, missing ones a StoreTimeout (a DistStoreError), not a UsageError."""
    store.set("k", b"v")
    prefixed = dist.PrefixStore("neg-wait", store)
    prefixed.set("k", b"v")
    past = datetime.timedelta(seconds=-1)
    store.wait(["k"], past)
    prefixed.wait(["k"], past)
    started = time.monotonic()
    for waiting in (store, prefixed):
        with pytest.raises(StoreTimeout, match="missing"):
            waiting.wait(["missing"], past)
    assert time.monotonic() - started < 5


def test_where_a_store_answers_otherwise_than_a_tcpstore_on_purpose(client, store):
    """What the README lists as answered otherwise on purpose (the side-by-side comparison
    leaves it out): a sum past 64 bits is refused (a TCPStore wraps around), a timeout of 0
    is no timeout (a TCPStore's expires at once), keys over 4,096 characters and values over
    64 MiB are refused as DistStoreErrors, and the queue methods are not implemented."""
    store.add("big", 2**63 - 1)
    with pytest.raises(StoreError, match="leaves the 64-bit integer range") as info:
        store.add("big", 1)
    assert isinstance(info.value, dist.DistStoreError) and store.get("big") == str(2**63 - 1).encode()
    for key, value in (("k" * 4097, b"v"), ("huge", b"\0" * ((64 << 20) + 1))):  # (the key with its prefix)
        with pytest.raises(StoreError) as info:
            store.set(key, value)
        assert isinstance(info.value, dist.DistStoreError) and info.value.code == "RESOURCE_EXHAUSTED", info.value
    store.set_timeout(datetime.timedelta(0))
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(store.get, "later")
    time.sleep(1.0)
    assert not waiting.done()  # (no timeout: it waits)
    Store(client, prefix=store.prefix).set("later", b"here")
    assert waiting.result(10) == b"here"
    for method, args in (("queue_push", ("q", b"v")), ("queue_pop", ("q",)), ("queue_len", ("q",))):
        with pytest.raises((NotImplementedError, RuntimeError), match="(?i)not implemented"):
            getattr(store, method)(*args)


def test_stores_and_their_clones_outlive_the_caller_s_reference(client):
    """torch's C++ side does not keep a Python store alive (pytorch#106633): a Store passed
    inline, and the clones PrefixStore makes, still answer once Python dropped them."""
    prefixed = dist.PrefixStore("outer", Store(client, prefix="test/inline"))  # no other reference
    gc.collect()
    prefixed.set("k", b"v")
    clone = prefixed.clone()
    gc.collect()
    assert clone.get("k") == b"v" and prefixed.num_keys() == 1


def test_a_waiting_get_is_released_by_a_set_from_another_store(client, store):
    """A blocking get returns once another store object sets the key."""
    got = queue.Queue()
    waiter = threading.Thread(target=lambda: got.put(store.get("late")))
    waiter.start()
    time.sleep(0.2)
    Store(client, prefix=store.prefix).set("late", b"here")
    assert got.get(timeout=10) == b"here"
    waiter.join(10)


# --- the same calls on a TCPStore ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tcp_store():
    """torch's TCPStore (master, on loopback): what a Store is meant to stand in for."""
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=SECOND, wait_for_workers=False)


# Left out, where a Store answers otherwise on purpose: keys not UTF-8 (a ValueError: the
# coordinator's keys are text), add on a value that is not an integer or leaves int64 (a
# DistStoreError; a TCPStore drops its connection or wraps around), a timeout of 0 (no
# timeout, c10d's kNoTimeout, as FileStore and HashStore; a TCPStore's expires at once) or
# negative (at once; a TCPStore's waits forever), keys over --max-key-length or values over
# --max-value-bytes (a DistStoreError), the queue methods (README), num_keys's count (a
# TCPStore counts its own "init/" key and every prefix's keys: compared as differences).
_examples = itertools.count()
DIFF_KEYS = ["", "a", "\u00e9", "k/1"]  # (the prefix makes the empty key a key of the coordinator's)
DIFF_VALUES = [b"", b"0", b"7", b"-3", b" 12", b"x", b"\xff\x00", b"v" * 70_000]
# add on a value both read as the same integer: a TCPStore drops the connection on others
# ("x", "") and reads "7 12" as 7 (std::stoll), where the coordinator refuses them
DIFF_INTEGER = re.compile(rb" ?-?[0-9]{1,15}")
_key = st.tuples(st.sampled_from(DIFF_KEYS), st.booleans()).map(lambda kb: kb[0].encode() if kb[1] else kb[0])
_value = st.tuples(st.sampled_from(DIFF_VALUES), st.booleans()).map(
    lambda vb: vb[0].decode() if vb[1] and vb[0].isascii() else vb[0]
)
_keys = st.lists(_key, max_size=3)
DIFF_OPS = st.one_of(
    st.tuples(st.just("set"), _key, _value),
    st.tuples(st.just("get"), _key),
    st.tuples(st.just("add"), _key, st.integers(-5, 5)),
    st.tuples(st.just("compare_set"), _key, _value, _value),
    st.tuples(st.just("check"), _keys),
    st.tuples(st.just("wait"), _keys, st.just(datetime.timedelta(milliseconds=50))),
    st.tuples(st.just("multi_get"), _keys),
    _keys.flatmap(  # (now and then a value too many: a DistStoreError)
        lambda keys: st.tuples(st.just("multi_set"), st.just(keys), st.lists(_value, min_size=len(keys), max_size=len(keys) + 1))
    ),
    st.tuples(st.just("append"), _key, _value),
    st.tuples(st.just("delete_key"), _key),
    st.tuples(st.just("num_keys")),
    st.tuples(st.just("set_timeout"), st.sampled_from([datetime.timedelta(milliseconds=m) for m in (50, 100)])),
)
DIST_ERRORS = (dist.DistNetworkError, dist.DistStoreError, dist.DistError, TypeError, ValueError, RuntimeError)


def _outcome(store, start, op):
    """What a call answers (num_keys: how many keys more than ``start``), or the first of
    torch's error kinds it raised."""
    try:
        result = getattr(store, op[0])(*op[1:])
    except DIST_ERRORS as exc:
        return "raised", next(kind.__name__ for kind in DIST_ERRORS if isinstance(exc, kind))
    return "ok", result - start if op[0] == "num_keys" else result


def _observed(store, start):
    """The keys' values (None: missing) and how many keys more than ``start`` there are."""
    return [store.get(k) if store.check([k]) else None for k in DIFF_KEYS], store.num_keys() - start


@pytest.mark.parametrize("via", ["python", "cpp"])
@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(DIFF_OPS, max_size=12))
def test_a_store_answers_every_call_as_a_tcpstore(client, tcp_store, via, ops):
    """The same calls on a Store and on torch's TCPStore answer the same values, raise the
    same kinds of torch errors (a get or wait of a missing key a DistStoreError after the
    timeout, multi_set of unequal lengths one too) and leave the same keys, values and key
    count: keys str or bytes (empty, non-ASCII), values str or bytes (empty, not UTF-8,
    70 kB), add on missing keys and integers, compare_set on missing keys with an empty or
    other expected value. Called from Python (the Store's methods) and from C++ (through a
    PrefixStore on each: torch's bridge calls the Store's methods as gloo does)."""
    n = next(_examples)
    reference = dist.PrefixStore(f"diff/{n}", tcp_store)
    ours = Store(client, prefix=f"test/diff/{via}/{n}")
    if via == "cpp":
        reference, ours = dist.PrefixStore("cpp", reference), dist.PrefixStore("cpp", ours)
    for store in (reference, ours):
        store.set_timeout(datetime.timedelta(milliseconds=80))  # (a get of a missing key waits that long)
    start = {"ours": ours.num_keys(), "reference": reference.num_keys()}  # (a TCPStore counts every key it holds)
    for op in ops:
        if op[0] == "add" and reference.check([op[1]]) and not DIFF_INTEGER.fullmatch(reference.get(op[1])):
            continue
        assert _outcome(ours, start["ours"], op) == _outcome(reference, start["reference"], op), op
    assert _observed(ours, start["ours"]) == _observed(reference, start["reference"])


def _gloo_calls(store):
    """A process group of one on ``store`` (torch's C++ side calls it: gloo, new_group, the
    barriers), then torch's Python callers of a store; what they return, and how many keys
    they made."""
    from torch.distributed.elastic.utils import store as elastic_store

    start = store.num_keys()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=20))
    try:
        dist.barrier()
        summed = torch.ones(3)
        dist.all_reduce(summed)
        group = dist.new_group([0])
        dist.barrier(group=group)
        objects = [None]
        dist.all_gather_object(objects, {"rank": 0})
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))
    finally:
        dist.destroy_process_group()
    synced = elastic_store.synchronize(store, b"data", 0, 1, "sync/", timeout=20)
    elastic_store.barrier(store, 1, "barrier/", 20, rank=0, rank_tracing_decoder=str, trace_timeout=1)
    return summed.tolist(), objects, synced, store.num_keys() - start


def test_gloo_and_torch_s_store_callers_see_what_they_see_on_a_tcpstore(client, tcp_store):
    """A gloo process group on a Store (barrier, all_reduce, new_group, all_gather_object,
    monitored_barrier) and torchelastic's store helpers (synchronize, barrier) answer as on a
    TCPStore, and make as many keys."""
    reference = _gloo_calls(dist.PrefixStore("gloo", tcp_store))
    assert _gloo_calls(Store(client, prefix="test/gloo-diff", timeout=datetime.timedelta(seconds=20))) == reference
    assert reference[:3] == ([1.0, 1.0, 1.0], [{"rank": 0}], [b"data"]) and reference[3] > 0


# --- the pjrt-rendezvous:// handler --------------------------------------------------------------


def test_url_handler_yields_a_store_per_group(coordinator):
    """The handler takes rank and world size from the arguments, the job and prefix from the URL,
    and numbers successive groups so a re-created group does not meet the old one's keys."""
    url = f"{SCHEME}://{coordinator.address}?job=url-test&prefix=grp"
    store, rank, world = next(dist.rendezvous(url, rank=1, world_size=3))
    assert (rank, world) == (1, 3)
    assert isinstance(store, Store) and store.prefix == "grp/0"
    store.set("k", b"v")
    again, _, _ = next(dist.rendezvous(url, rank=1, world_size=3))
    assert again.prefix == "grp/1" and again.check(["k"]) is False
    with pytest.raises(pr.UsageError, match="out of range"):
        next(dist.rendezvous(url, rank=3, world_size=3))


def test_a_later_run_under_the_same_prefix_is_refused_at_once(coordinator, monkeypatch):
    """A second run of a script on one long-lived coordinator, outside torchrun and without a
    prefix of its own, read the first run's gloo addresses and hung without a word: each rank
    now joins a namespace once, and a later process's rank there is refused, naming the fix."""
    from pjrt_rendezvous.client import _store

    url = f"{SCHEME}://{coordinator.address}?job=rerun&prefix=same"
    for rank in (0, 1):
        next(dist.rendezvous(url, rank=rank, world_size=2))  # (two ranks' groups: this process counts 2)
    monkeypatch.setattr(_store, "_generations", {})  # a new process: it counts its groups from 0
    with pytest.raises(pr.UsageError, match=r"rank 0 joined a process group under prefix 'same/0' of job 'rerun' on this "
                       r"coordinator before, in another process.*\?prefix=<run id>"):
        next(dist.rendezvous(url, rank=0, world_size=2))
    store, _, _ = next(dist.rendezvous(url, rank=0, world_size=2))  # (its next group: 'same/1', where rank 0 is new)
    assert store.prefix == "same/1" and store.num_keys() == 0  # (the marks are not the Store's keys)
    for _ in range(2):  # a world of one, whose runs read no peer's address, runs again as it did
        monkeypatch.setattr(_store, "_generations", {})
        next(dist.rendezvous(f"{SCHEME}://{coordinator.address}?job=rerun&prefix=alone", rank=0, world_size=1))


def test_the_url_handler_does_not_take_a_closed_process_client(coordinator):
    """A process client closed by hand (``init()`` would replace it) is not the one a new
    group's Store uses: it makes its own (it took the closed one, and every call of the
    group's Store failed as closed)."""
    pr.init(coordinator.address, env={}).close()
    try:
        store, _, _ = next(dist.rendezvous(f"{SCHEME}://{coordinator.address}?prefix=closed", rank=0, world_size=1))
        store.set("k", b"v")
        assert store.get("k") == b"v" and store.client is not pr.get_client()
        # Without a timeout (rpc's stores), torch's handlers' default: 30 min (it was 5).
        assert store.timeout == dist.constants.default_pg_timeout
    finally:
        pr.shutdown()


def test_a_url_store_outlives_its_process_client(coordinator):
    """A group's Store made while the process client talked to its coordinator goes on after
    that client is shut down and init() is called again (every call, new_group's too, failed
    as "this client was closed; call init() again", when init() had been), in the job it
    was made in."""
    pr.init(coordinator.address, env={})
    try:
        store, _, _ = next(dist.rendezvous(f"{SCHEME}://{coordinator.address}?prefix=reinit", rank=0, world_size=1))
        clone = store.clone()  # (as PrefixStore and group splitting make)
        assert store.client is pr.get_client()
        store.set("k", b"v")
        pr.shutdown()
        pr.init(coordinator.address, env={})
        assert store.get("k") == b"v" == clone.get("k")
        clone.set("k", b"w")
        assert store.get("k") == b"w"
        pr.shutdown()
        pr.init(coordinator.address, env={}, job="another")  # (it moved to that job's keys: none)
        assert store.check(["k"]) and store.get("k") == b"w" and store.client is not pr.get_client()
    finally:
        pr.shutdown()


_FORK_SCENARIO = """
import faulthandler, multiprocessing, os, sys
import torch.distributed as dist
import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client.torch_store import SCHEME

def in_child(results, store, url, address):
    faulthandler.dump_traceback_later(50, exit=True)  # stuck: where, in the test's output
    try:
        store.set("from-child", b"c")  # the parent's Store
        again, _, _ = next(dist.rendezvous(url, rank=0, world_size=1))  # an address and job the parent used
        again.set("k", b"child")
        # The child's process client: from its environment (another task, as xla.spawn's children are).
        os.environ.update(PJRT_RENDEZVOUS_ADDRESS=address, PJRT_RENDEZVOUS_NUM_TASKS="2", PJRT_RENDEZVOUS_TASK_ID="1")
        client = pr.get_client()
        results.put(("ok", store.get("from-parent"), client.get("api-key", wait=False), client.topology.task_id))
    except BaseException as exc:
        results.put(("error", repr(exc)))

address = sys.argv[1]
pr.init(address, env={}).set("api-key", b"a")
url = f"{SCHEME}://{address}?job=fork-test&prefix=fork"
store, _, _ = next(dist.rendezvous(url, rank=0, world_size=1))
store.set("from-parent", b"p")
context = multiprocessing.get_context("fork")
results = context.Queue()
child = context.Process(target=in_child, args=(results, store, url, address))
child.start()
outcome = results.get(timeout=60)
child.join(30)
assert outcome == ("ok", b"p", b"a", 1), outcome
assert store.get("from-child") == b"c" and pr.get_client().get("api-key", wait=False) == b"a"
pr.shutdown()
print("ok")
"""


@contextlib.contextmanager
def serve_apart():
    """``serve`` in a process of its own, and an environment naming no coordinator or
    topology for a script's: (the server, its address, the environment)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "pjrt_rendezvous.coordinator", "serve", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        address = re.search(r"listening on (127\.0\.0\.1:\d+)", server.stdout.readline()).group(1)
        yield server, address, {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "TPU_", "CLOUD_TPU"))}
    finally:
        server.kill()
        server.wait(30)


def test_a_forked_child_makes_its_own_clients():
    """A forked child cannot use its parent's clients (their channel, session socket and
    threads are the parent's: its calls hung for their retry budget, then timed out): the
    parent's Stores (with their settings), the URL handler and the process client (from the
    child's environment, as after shutdown()) make their own there, and the parent's go on
    working. (The coordinator and the forking process run in processes of their own: gRPC
    survives a fork only while no thread of the process is inside it, which a server's
    always are, and the earlier tests' clients may be, in this one.)"""
    with serve_apart() as (_, address, env):
        run = subprocess.run([sys.executable, "-c", _FORK_SCENARIO, address], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


_WAITING_AT_EXIT = """
import sys, threading, time
from datetime import timedelta
import torch.distributed as dist
import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client.torch_store import Store

if sys.argv[2] == "store":  # (on the process client, which init's exit hook closes)
    pr.init(sys.argv[1], env={}, connect_timeout=60)
    store = Store(prefix="exit")
else:  # (a client of the URL's own)
    store, _, _ = next(dist.rendezvous(f"pjrt-rendezvous://{sys.argv[1]}?prefix=exit", rank=0, world_size=1, timeout=timedelta(seconds=60)))
waiting = dist.PrefixStore("p", store)

def wait():
    try:
        waiting.get("never")
    except pr.UsageError as exc:
        print("woken:", exc, flush=True)

threading.Thread(target=wait, daemon=True).start()
time.sleep(0.5)
print("waiting", flush=True)
sys.stdin.readline()  # (the coordinator is killed)
time.sleep(0.5)  # (its get retries)
print("exits", flush=True)
"""


@pytest.mark.parametrize("how", ["store", "url"])
def test_a_daemon_thread_waiting_in_a_store_on_a_coordinator_gone_lets_the_process_exit(how):
    """A daemon thread in a Store's get through torch's PrefixStore, retrying for a
    coordinator killed, when the main thread ends: the exit's shutdown (or, for a URL's own
    client, the Store module's exit hook) ends its retry at once and waits for it to leave.
    It slept on in its backoff, and finalization stopped it inside torch's C++ frames: the
    process aborted (134, or 139), 3 times in 5."""
    with serve_apart() as (server, address, env):
        script = subprocess.Popen(
            [sys.executable, "-c", _WAITING_AT_EXIT, address, how], env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        assert script.stdout.readline() == "waiting\n"
        server.kill()
        server.wait(30)
        out, err = script.communicate("\n", timeout=60)
        assert script.returncode == 0 and out.startswith("exits\n"), (script.returncode, out, err)  # (its print may be cut)


def test_under_torchrun_the_default_prefix_is_the_run_s_own(client, coordinator, monkeypatch):
    """Under torchrun (TORCHELASTIC_RUN_ID) a Store and the URL handler put their keys under
    the run id and an attempt id by default, so a later run or restart on a long-lived
    coordinator does not read this one's keys (stale gloo addresses, say): agreed once per
    process by its ranks (RANK, WORLD_SIZE), else the restart count. A Store's explicit
    prefix stays as given; a URL's gets the run and attempt too (a restarted attempt's
    workers count their groups from 0 again, and met the failed attempt's gloo addresses).
    Two threads making a Store at once agree once (each agreed with a nonce of its own, and
    both waited out their timeout); an error of the agreement is torch's kind too."""
    from pjrt_rendezvous.client import _store

    monkeypatch.setattr(_store, "_attempts", {})
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert Store(client).prefix == "torch.distributed"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.delenv("RANK", raising=False)
    assert Store(client).prefix == "torch.distributed/run-7/2"  # (a dynamic group: no ranks to agree)
    assert Store(client, prefix="mine").prefix == "mine"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-8")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    first = Store(client)
    assert re.fullmatch(r"torch\.distributed/run-8/[0-9a-f]{12}", first.prefix), first.prefix
    assert Store(client).prefix == first.prefix  # once per process
    store, _, _ = next(dist.rendezvous(f"{SCHEME}://{coordinator.address}?job=url-run", rank=0, world_size=1))
    assert re.fullmatch(r"torch\.distributed/run-8/[0-9a-f]{12}/0", store.prefix), store.prefix
    given, _, _ = next(dist.rendezvous(f"{SCHEME}://{coordinator.address}?job=url-run&prefix=mine", rank=0, world_size=1))
    assert re.fullmatch(r"mine/run-8/[0-9a-f]{12}/0", given.prefix), given.prefix
    unnamed, _, _ = next(dist.rendezvous(f"{SCHEME}://{coordinator.address}?prefix=other", rank=0, world_size=1))
    named, _, _ = next(dist.rendezvous(f"{SCHEME}://{coordinator.address}?job=default&prefix=other", rank=0, world_size=1))
    assert (unnamed.prefix[-2:], named.prefix[-2:]) == ("/0", "/1")  # the same job: counted on (from 0, it met the keys of the first)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-threads")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # rank 0's two threads, then rank 1 comes
        both = [pool.submit(Store, client, timeout=20) for _ in range(2)]
        time.sleep(0.3)
        attempt = _store._agree(client, "torch.distributed/run-threads/attempts/", 1, 2, 20)  # (rank 1, elsewhere)
        assert [f.result().prefix for f in both] == [f"torch.distributed/run-threads/{attempt}"] * 2
    monkeypatch.setenv("WORLD_SIZE", "2")  # a rank that never comes: torch's kind of timeout, naming it
    for rank, says in (("0", "rank 0 waited 1 s for rank 1 of this torchrun attempt to start"), ("1", "still not set")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"run-9-{rank}")
        with pytest.raises(StoreTimeout, match=re.escape(says)) as info:
            Store(client, timeout=1)
        assert isinstance(info.value, dist.DistStoreError)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-10")
    unreachable = pr.Client(pr.Settings(address="127.0.0.1:1", connect_timeout=1), pr.detect_topology({}, address="127.0.0.1:1"))
    with pytest.raises(dist.DistNetworkError):  # (a bare CoordinatorUnavailableError, no RuntimeError)
        Store(unreachable, timeout=5)
    unreachable.close()


def test_rank_0_names_the_ranks_that_never_came_as_ranges(client):
    """Rank 0 of a torchrun attempt of 64 whose other ranks never start named them as a
    Python list, [1, 2, 3, ..., 63]; now as ranges, as every other wait names who is missing."""
    from pjrt_rendezvous.client import _store

    with pytest.raises(pr.RendezvousTimeout) as info:
        _store._agree(client, "agree-ranges/", 0, 64, 0.3)
    assert "rank 0 waited 0.3 s for ranks 1-63 of this torchrun attempt to start" in str(info.value), info.value


def test_url_handler_needs_rank_and_world_size(coordinator, monkeypatch):
    """Without rank/world_size in the arguments, the URL or RANK/WORLD_SIZE, the error says where."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(pr.UsageError, match="rank is missing"):
        next(dist.rendezvous(f"{SCHEME}://{coordinator.address}"))
    monkeypatch.setenv("RANK", "abc")
    monkeypatch.setenv("WORLD_SIZE", "0")
    with pytest.raises(pr.UsageError, match=r"rank 'abc' \(from RANK\) is not an int"):
        next(dist.rendezvous(f"{SCHEME}://{coordinator.address}"))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(pr.UsageError, match=r"world size must be at least 1 \(or -1: not known\), got 0"):
        next(dist.rendezvous(f"{SCHEME}://{coordinator.address}"))
    # -1: not known, as torch.distributed.rpc passes for a dynamic group (tcp:// takes it; it was refused).
    monkeypatch.setenv("WORLD_SIZE", "-1")
    monkeypatch.setenv("RANK", "3")
    store, rank, world_size = next(dist.rendezvous(f"{SCHEME}://{coordinator.address}?prefix=dynamic"))
    assert (rank, world_size) == (3, -1)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    # A parameter nothing reads is refused (?prefx= put the keys under the default prefix, shared across runs).
    with pytest.raises(pr.UsageError, match=r"unknown parameter\(s\) prefx, timeout in .*\(known: job, prefix, rank, world_size\); prefx: did you mean prefix\?"):
        next(dist.rendezvous(f"{SCHEME}://{coordinator.address}?prefx=run-a&timeout=3"))


# --- gloo process groups in real processes -------------------------------------------------------


def gloo_worker(rank: int, address: str, how: str, results) -> None:
    """One rank: init_process_group over our store or URL, then a real all_reduce."""
    import sys

    import torch
    import torch.distributed as dist

    from pjrt_rendezvous.client.torch_store import SCHEME, Store

    timeout = datetime.timedelta(seconds=60)
    try:
        if how == "store":
            os.environ["PJRT_RENDEZVOUS_ADDRESS"] = address  # Store() uses the process client
            dist.init_process_group("gloo", store=Store(prefix="pg-store"), rank=rank, world_size=WORLD, timeout=timeout)
        else:
            url = f"{SCHEME}://{address}?job=pg-url"
            dist.init_process_group("gloo", init_method=url, rank=rank, world_size=WORLD, timeout=timeout)
        value = torch.tensor([float(rank + 1), 10.0 * rank])
        dist.all_reduce(value)
        dist.barrier()
        # A group made after init uses the store again (it must still be alive; every rank
        # makes it, its members reduce in it).
        pair = dist.new_group([0, 1])
        in_pair = torch.tensor([float(rank + 1)])
        if rank in (0, 1):
            dist.all_reduce(in_pair, group=pair)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, value.tolist() + in_pair.tolist(), "torch_xla" in sys.modules))
    except BaseException as exc:  # noqa: BLE001 -- reported to the test
        results.put((rank, repr(exc), None))


def _run_gloo(address: str, how: str):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=gloo_worker, args=(r, address, how, results)) for r in range(WORLD)]
    for p in processes:
        p.start()
    collected = []
    try:
        deadline = time.monotonic() + 120
        while len(collected) < WORLD:
            collected.append(results.get(timeout=max(1, deadline - time.monotonic())))
    finally:
        for p in processes:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return sorted(collected)


@pytest.mark.parametrize("how", ["store", "url"])
def test_gloo_all_reduce_in_three_processes(coordinator, how):
    """init_process_group('gloo') through Store(...) (passed inline) or the pjrt-rendezvous://
    URL in three processes, then all_reduce sums every rank's tensor (without importing
    torch_xla), and a group made afterwards (new_group, on the same store) reduces too."""
    results = _run_gloo(coordinator.address, how)
    expected = [1.0 + 2.0 + 3.0, 0.0 + 10.0 + 20.0]
    assert results == [(rank, expected + [3.0 if rank < 2 else rank + 1.0], False) for rank in range(WORLD)]


_TORCHRUN_WORKER = """
import sys
import torch, torch.distributed as dist
import pjrt_rendezvous.client.torch_store as ts
dist.init_process_group("gloo", init_method=f"{ts.SCHEME}://{sys.argv[1]}")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
from pjrt_rendezvous.client._store import _run_prefix
import os
os.write(1, f"prefix {_run_prefix('torch.distributed')} sum {float(t)}\\n".encode())  # one write: lines stay whole
dist.destroy_process_group()
"""


def test_plain_torchrun_runs_on_one_coordinator_do_not_share_keys(coordinator, tmp_path):
    """torchrun without --rdzv-id gives every run the run id "none": the keys go under an id its
    workers agree on through torchrun's store instead, so a second run does not read the
    first one's gloo addresses (it failed to connect to them, most times)."""
    import socket
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(_TORCHRUN_WORKER)
    prefixes = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_RENDEZVOUS_", "TORCHELASTIC_"))}
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
             str(script), coordinator.address],
            env={**env, "GLOO_SOCKET_IFNAME": "lo"}, capture_output=True, text=True, timeout=180,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        lines = sorted(line for line in out.stdout.splitlines() if line.startswith("prefix"))
        assert len(lines) == 2 and all(line.endswith("sum 3.0") for line in lines), out.stdout
        (prefix,) = {line.split()[1] for line in lines}
        prefixes.append(prefix)
    assert prefixes[0] != prefixes[1] and all(p.startswith("torch.distributed/") and "/none/" not in p for p in prefixes)


_ATTEMPT_WORKER = """
import datetime, sys
import torch, torch.distributed as dist
import pjrt_rendezvous.client.torch_store as ts
dist.init_process_group("gloo", init_method=f"{ts.SCHEME}://{sys.argv[1]}", timeout=datetime.timedelta(seconds=30))
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("sum", float(t), flush=True)
dist.destroy_process_group()
"""


def test_torchrun_workers_agree_on_their_attempt_whatever_their_nodes_restart_counts(coordinator, tmp_path):
    """torchrun's agents count restarts each for its own node: one whose workers are restarted
    because another node failed (or joined) keeps its count. Three attempts of one run of two
    workers, as on two nodes: restart counts (0, 0), then (1, 0) as after rank 0's node
    failed, then (1, 1). Each attempt all-reduces, and none meets an earlier one's keys (the
    prefix took the restart count: the second attempt's ranks waited under two prefixes
    until their timeout, and the third met the second's gloo addresses)."""
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(_ATTEMPT_WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_RENDEZVOUS_", "TORCHELASTIC_"))}
    for counts in ((0, 0), (1, 0), (1, 1)):
        workers = [
            subprocess.Popen(
                [sys.executable, str(script), coordinator.address],
                env={**env, "GLOO_SOCKET_IFNAME": "lo", "TORCHELASTIC_RUN_ID": "run-1", "TORCHELASTIC_RESTART_COUNT": str(count),
                     "RANK": str(rank), "WORLD_SIZE": "2"},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for rank, count in enumerate(counts)
        ]
        outs = [w.communicate(timeout=120) for w in workers]
        assert [w.returncode for w in workers] == [0, 0], (counts, [err[-2000:] for _, err in outs])
        assert all("sum 3.0" in out for out, _ in outs), (counts, outs)


def test_the_url_handler_looks_for_a_coordinator_as_long_as_its_timeout_and_refuses_port_0(monkeypatch):
    """As TCPStore's connect: init_process_group's timeout bounds the search for an unreachable
    coordinator (it was always connect_timeout's 60 s); port 0 names no coordinator."""
    import torch.distributed as dist

    monkeypatch.delenv("PJRT_RENDEZVOUS_CONNECT_TIMEOUT", raising=False)
    with pytest.raises(pr.UsageError, match="port 0"):
        next(dist.rendezvous(f"{SCHEME}://127.0.0.1:0?rank=0&world_size=1"))
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):  # (the handler marks its rank: it connects, as TCPStore's does)
        next(dist.rendezvous(f"{SCHEME}://127.0.0.1:1?job=unreachable&rank=0&world_size=2", timeout=datetime.timedelta(seconds=2)))
    assert time.monotonic() - started < 20
    # So too where the process client talks to that address (it looks for 60 s: torch_xla's
    # processes all have one), as the URL's own client does.
    from pjrt_rendezvous.client import _api

    process_client = pr.Client(pr.Settings(address="127.0.0.1:1"), pr.detect_topology({}, address="127.0.0.1:1"))
    monkeypatch.setattr(_api, "_client", process_client)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        next(dist.rendezvous(f"{SCHEME}://127.0.0.1:1?rank=0&world_size=2", timeout=datetime.timedelta(seconds=2)))
    assert time.monotonic() - started < 20
    process_client.close()
