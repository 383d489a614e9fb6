"""Tests for topology detection: cores per chip, ordinals, precedence, addresses, metadata, errors."""

from __future__ import annotations

import dataclasses
import socket
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pjrt_rendezvous.client._topology import (
    DEFAULT_PORT,
    Topology,
    TopologyError,
    cores_per_chip,
    detect_address,
    detect_topology,
    metadata_fetcher,
)

ATTRIBUTES = "/computeMetadata/v1/instance/attributes/"
V3_32_HOSTS = "t1v-n-0-w-0,t1v-n-0-w-1,t1v-n-0-w-2,t1v-n-0-w-3"


def _no_hostname() -> str:
    raise AssertionError("hostname() must not be called when worker hostnames are known")


def _no_metadata(key: str) -> str:
    raise AssertionError(f"metadata({key!r}) must not be called")


# --- a local stand-in for the GCE metadata server ------------------------------------------------


class _MetadataHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        server = self.server
        flavor = self.headers.get("Metadata-Flavor")
        server.requests.append((self.path, flavor))
        if server.require_flavor and flavor != "Google":
            self._reply(403, "Missing Metadata-Flavor:Google header.")
        elif self.path.startswith(ATTRIBUTES) and self.path[len(ATTRIBUTES):] in server.attributes:
            self._reply(200, server.attributes[self.path[len(ATTRIBUTES):]])
        else:
            self._reply(404, "not found")

    def _reply(self, status: int, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metadata_server():
    """Start local metadata servers on 127.0.0.1:0; each records (path, Metadata-Flavor) per request."""
    started = []

    def start(attributes: dict[str, str], *, require_flavor: bool = False) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _MetadataHandler)
        server.attributes = attributes
        server.require_flavor = require_flavor
        server.requests = []
        thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        thread.start()
        started.append((server, thread))
        return server

    yield start
    for server, thread in started:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _plain_fetcher(server: ThreadingHTTPServer):
    """The brief's fetcher: a bare urllib GET of the attribute, no headers."""
    port = server.server_address[1]

    def fetch(key: str) -> str:
        url = f"http://127.0.0.1:{port}/computeMetadata/v1/instance/attributes/{key}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()

    return fetch


def _requested_keys(server: ThreadingHTTPServer) -> list[str]:
    return [path[len(ATTRIBUTES):] for path, _ in server.requests]


V4_32_TPU_ENV = """\
ACCELERATOR_TYPE: 'v4-32'
CHIPS_PER_HOST_BOUNDS: '2,2,1'
HOST_BOUNDS: '1,1,4'
# a comment line

NODE_ID: 'it''s-my-node'
TPU_CHIPS_PER_PROCESS_BOUNDS: '2,2,1'
TPU_PROCESS_BOUNDS: '1,1,4'
WORKER_ID: '2'
ZONE: us-central2-b  # unquoted value with a comment
"""
V4_32_ENDPOINTS = (
    "t1v-n-w-0:8470:10.130.0.3,t1v-n-w-1:8470:10.130.0.4,"
    "t1v-n-w-2:8470:10.130.0.5,t1v-n-w-3:8470:10.130.0.6"
)
V4_32_IPS = ("10.130.0.3", "10.130.0.4", "10.130.0.5", "10.130.0.6")


# --- cores per chip ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accelerator_type", "expected"),
    [
        ("v2-8", 2), ("v2-32", 2), ("v3-8", 2), ("v3-32", 2), ("v3-128", 2),
        ("v4-8", 1), ("v4-32", 1), ("v5litepod-16", 1), ("v5litepod-8", 1), ("v5e-4", 1),
        ("v5p-8", 1), ("v5p-128", 1), ("v6e-8", 1), ("v6e-16", 1),
    ],
)
def test_cores_per_chip_known_types(accelerator_type, expected):
    """Each known TPU generation maps to its number of PJRT devices per chip."""
    assert cores_per_chip(accelerator_type) == expected


@pytest.mark.parametrize("accelerator_type", ["tpu7x-8", "v7-8", "v9x-4", "", "banana", "v3", "v3-", "v4-0"])
def test_cores_per_chip_unknown_types_raise(accelerator_type):
    """An unknown or unconfirmed type raises, naming the type and the override variable."""
    with pytest.raises(TopologyError) as info:
        cores_per_chip(accelerator_type)
    assert repr(accelerator_type) in str(info.value)
    assert "PJRT_RENDEZVOUS_CORES_PER_CHIP" in str(info.value)
    # What is known of TPU7x is said; nothing is guessed for the others.
    assert ("two TensorCores" in str(info.value)) == accelerator_type.startswith("tpu7")


def test_tpu7x_cores_per_chip_come_from_the_runtime_once_it_has_started():
    """TPU7x's devices per chip are taken from the XLA runtime's device count (over
    the process's chips) when torch_xla has started it; never guessed, and the override wins."""
    asked = []

    def devices(count):
        return lambda: asked.append(count) or count

    env = {"TPU_ACCELERATOR_TYPE": "tpu7x-8", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1", "PJRT_RENDEZVOUS_NUM_TASKS": "1"}
    topology = detect_topology(env, hostname=lambda: "h", runtime_devices=devices(8))
    assert (topology.cores_per_chip, topology.chips_per_process, topology.world_size) == (2, 4, 8)
    with pytest.raises(TopologyError, match="'tpu7x-8'.*PJRT_RENDEZVOUS_CORES_PER_CHIP.*start torch_xla's runtime"):
        detect_topology(env, hostname=lambda: "h", runtime_devices=devices(None))  # not started
    with pytest.raises(TopologyError, match=r"gives this process 6 device\(s\), which do not divide evenly among its 4"):
        detect_topology(env, hostname=lambda: "h", runtime_devices=devices(6))
    asked.clear()
    overridden = detect_topology({**env, "PJRT_RENDEZVOUS_CORES_PER_CHIP": "1"}, hostname=lambda: "h", runtime_devices=devices(8))
    known = detect_topology({**env, "TPU_ACCELERATOR_TYPE": "v3-8"}, hostname=lambda: "h", runtime_devices=devices(8))
    with pytest.raises(TopologyError, match="'banana'"):
        detect_topology({**env, "TPU_ACCELERATOR_TYPE": "banana"}, hostname=lambda: "h", runtime_devices=devices(8))
    assert (overridden.cores_per_chip, known.cores_per_chip, asked) == (1, 2, [])  # asked for TPU7x only


# --- detect_topology: full cases -----------------------------------------------------------------


@pytest.mark.parametrize("process", range(4))
def test_v3_8_four_processes(process):
    """Simulated v3-8: four local processes, CLOUD_TPU_TASK_ID=i drives ordinals 2i and 2i+1 of 8."""
    env = {
        "TPU_ACCELERATOR_TYPE": "v3-8",
        "CLOUD_TPU_TASK_ID": str(process),
        "PJRT_LOCAL_PROCESS_RANK": str(process),
        "PJRT_LOCAL_PROCESS_COUNT": "4",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": "2,2,1",
    }
    topo = detect_topology(env, hostname=lambda: "my-tpu-vm")
    assert (topo.cores_per_chip, topo.devices_per_process, topo.world_size) == (2, 2, 8)
    assert (topo.task_id, topo.num_tasks) == (process, 4)
    assert [topo.ordinal(t) for t in range(2)] == [2 * process, 2 * process + 1]
    assert [topo.local_ordinal(t) for t in range(2)] == [2 * process, 2 * process + 1]
    assert topo.host == "my-tpu-vm"
    assert topo.address == f"localhost:{DEFAULT_PORT}"


@pytest.mark.parametrize(("worker", "rank"), [(w, r) for w in range(4) for r in range(4)])
def test_v3_32_four_hosts_four_processes(worker, rank):
    """v3-32, 4 hosts × 4 processes, no CLOUD_TPU_TASK_ID: task = 4w + r, world 32, host 0 coordinates."""
    env = {
        "TPU_ACCELERATOR_TYPE": "v3-32",
        "TPU_WORKER_ID": str(worker),
        "TPU_WORKER_HOSTNAMES": V3_32_HOSTS,
        "PJRT_LOCAL_PROCESS_RANK": str(rank),
        "PJRT_LOCAL_PROCESS_COUNT": "4",
    }
    topo = detect_topology(env, hostname=_no_hostname)
    hosts = V3_32_HOSTS.split(",")
    assert (topo.task_id, topo.num_tasks, topo.world_size) == (4 * worker + rank, 16, 32)
    assert [topo.ordinal(t) for t in range(2)] == [8 * worker + 2 * rank, 8 * worker + 2 * rank + 1]
    assert [topo.local_ordinal(t) for t in range(2)] == [2 * rank, 2 * rank + 1]
    assert topo.worker_hostnames == tuple(hosts)
    assert topo.host == hosts[worker]
    assert topo.address == f"{hosts[0]}:7481"


def test_v3_32_ordinals_cover_the_world_exactly_once():
    """Across all 16 processes of a v3-32, the ordinals are exactly 0..31 with no duplicates."""
    ordinals = []
    for worker in range(4):
        for rank in range(4):
            env = {
                "TPU_ACCELERATOR_TYPE": "v3-32", "TPU_WORKER_ID": str(worker),
                "TPU_WORKER_HOSTNAMES": V3_32_HOSTS,
                "PJRT_LOCAL_PROCESS_RANK": str(rank), "PJRT_LOCAL_PROCESS_COUNT": "4",
            }
            topo = detect_topology(env)
            ordinals += [topo.ordinal(t) for t in range(topo.devices_per_process)]
    assert sorted(ordinals) == list(range(32))


@pytest.mark.parametrize(
    ("env", "expected", "ordinals"),
    [
        pytest.param(
            {"TPU_ACCELERATOR_TYPE": "v4-8", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
             "TPU_PROCESS_BOUNDS": "1,1,1", "CLOUD_TPU_TASK_ID": "0"},
            dict(accelerator_type="v4-8", cores_per_chip=1, chips_per_process=4, task_id=0,
                 num_tasks=1, devices_per_process=4, world_size=4, address="localhost:7481"),
            [0, 1, 2, 3],
            id="v4-8-single-process",
        ),
        pytest.param(
            {"TPU_ACCELERATOR_TYPE": "v5litepod-16", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
             "TPU_WORKER_ID": "2", "TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3"},
            dict(cores_per_chip=1, chips_per_process=4, task_id=2, num_tasks=4, world_size=16,
                 worker_id=2, host="h2", address="h0:7481"),
            [8, 9, 10, 11],
            id="v5litepod-16-host-2",
        ),
        pytest.param(
            {"TPU_ACCELERATOR_TYPE": "v6e-8", "TPU_PROCESS_BOUNDS": "2,4,1",
             "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "CLOUD_TPU_TASK_ID": "5",
             "PJRT_LOCAL_PROCESS_RANK": "5", "PJRT_LOCAL_PROCESS_COUNT": "8"},
            dict(cores_per_chip=1, chips_per_process=1, task_id=5, num_tasks=8, world_size=8,
                 local_rank=5, local_world_size=8),
            [5],
            id="v6e-8-eight-processes",
        ),
        pytest.param(
            {"TPU_ACCELERATOR_TYPE": "v6e-8", "TPU_PROCESS_BOUNDS": "1,1,1",
             "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,4,1"},
            dict(cores_per_chip=1, chips_per_process=8, task_id=0, num_tasks=1, world_size=8),
            list(range(8)),
            id="v6e-8-one-process",
        ),
        pytest.param(
            {"TPU_ACCELERATOR_TYPE": "v5p-128", "TPU_PROCESS_BOUNDS": "2,2,4",
             "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1", "CLOUD_TPU_TASK_ID": "15"},
            dict(cores_per_chip=1, chips_per_process=4, task_id=15, num_tasks=16, world_size=64),
            [60, 61, 62, 63],
            id="v5p-128-last-host",
        ),
        pytest.param(
            {"TPU_ACCELERATOR_TYPE": "tpu7x-8", "PJRT_RENDEZVOUS_CORES_PER_CHIP": "2"},
            dict(accelerator_type="tpu7x-8", cores_per_chip=2, world_size=2),
            [0, 1],
            id="unconfirmed-type-with-explicit-cores",
        ),
        pytest.param(
            {"TPU_ACCELERATOR_TYPE": "v3-32", "TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": V3_32_HOSTS,
             "CLOUD_TPU_TASK_ID": "1", "PJRT_LOCAL_PROCESS_RANK": "1", "PJRT_LOCAL_PROCESS_COUNT": "4",
             "TPU_PROCESS_BOUNDS": "2,2,1", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
             "PJRT_RENDEZVOUS_TASK_ID": "7", "PJRT_RENDEZVOUS_NUM_TASKS": "10",
             "PJRT_RENDEZVOUS_LOCAL_RANK": "0", "PJRT_RENDEZVOUS_LOCAL_WORLD_SIZE": "2",
             "PJRT_RENDEZVOUS_CORES_PER_CHIP": "1", "PJRT_RENDEZVOUS_ADDRESS": "coord.example:9000"},
            dict(task_id=7, num_tasks=10, local_rank=0, local_world_size=2, cores_per_chip=1,
                 chips_per_process=4, world_size=40, address="coord.example:9000",
                 host="t1v-n-0-w-1", worker_id=1),
            [28, 29, 30, 31],
            id="pjrt-rendezvous-overrides-win",
        ),
        pytest.param(
            {},
            dict(accelerator_type=None, cores_per_chip=1, chips_per_process=1, task_id=0, num_tasks=1,
                 local_rank=0, local_world_size=1, worker_id=0, worker_hostnames=(),
                 world_size=1, host="laptop", address="localhost:7481"),
            [0],
            id="no-tpu-world-of-one",
        ),
        pytest.param(
            {"TPU_WORKER_HOSTNAMES": " a , b ,, c ,", "TPU_WORKER_ID": "2"},
            dict(worker_hostnames=("a", "b", "c"), host="c", num_tasks=3, task_id=2, address="a:7481"),
            [2],
            id="hostnames-are-stripped-and-empties-dropped",
        ),
        pytest.param(
            {"CLOUD_TPU_TASK_ID": "  ", "TPU_ACCELERATOR_TYPE": "", "PJRT_LOCAL_PROCESS_COUNT": ""},
            dict(task_id=0, accelerator_type=None, local_world_size=1, world_size=1),
            [0],
            id="blank-values-count-as-unset",
        ),
    ],
)
def test_detect_topology_cases(env, expected, ordinals):
    """Each simulated environment yields the expected topology and this process's ordinals."""
    topo = detect_topology(env, hostname=lambda: "laptop")
    for field, value in expected.items():
        assert getattr(topo, field) == value, field
    assert [topo.ordinal(t) for t in range(topo.devices_per_process)] == ordinals


def test_detect_topology_ignores_os_environ(monkeypatch):
    """detect_topology reads only the mapping it is given, never os.environ."""
    monkeypatch.setenv("CLOUD_TPU_TASK_ID", "3")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v3-8")
    monkeypatch.setenv("PJRT_RENDEZVOUS_ADDRESS", "elsewhere:1")
    topo = detect_topology({}, hostname=lambda: "h")
    assert (topo.task_id, topo.accelerator_type, topo.address) == (0, None, "localhost:7481")


# --- addresses -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("coord", "coord:7481"),
        ("coord:9000", "coord:9000"),
        ("10.0.0.1", "10.0.0.1:7481"),
        ("10.0.0.1:1", "10.0.0.1:1"),
        ("[::1]", "[::1]:7481"),
        ("[::1]:9000", "[::1]:9000"),
        ("::1", "[::1]:7481"),
        ("fe80::1:2", "[fe80::1:2]:7481"),
        ("  coord:65535 ", "coord:65535"),
    ],
)
@pytest.mark.parametrize("via", ["argument", "env"])
def test_address_forms(given, expected, via):
    """Addresses get the default port when they lack one, including bracketed and bare IPv6."""
    if via == "argument":
        topo = detect_topology({}, address=given, hostname=lambda: "h")
    else:
        topo = detect_topology({"PJRT_RENDEZVOUS_ADDRESS": given}, hostname=lambda: "h")
    assert topo.address == expected


@pytest.mark.parametrize(
    ("env", "address", "expected"),
    [
        ({"PJRT_RENDEZVOUS_ADDRESS": "env-host", "TPU_WORKER_HOSTNAMES": "w0,w1", "TPU_WORKER_ID": "1"}, "arg:1", "arg:1"),
        ({"PJRT_RENDEZVOUS_ADDRESS": "env-host", "TPU_WORKER_HOSTNAMES": "w0,w1", "TPU_WORKER_ID": "1"}, None, "env-host:7481"),
        ({"TPU_WORKER_HOSTNAMES": "w0,w1", "TPU_WORKER_ID": "1"}, None, "w0:7481"),
        ({"TPU_WORKER_HOSTNAMES": "fd00::a,fd00::b", "TPU_WORKER_ID": "1"}, None, "[fd00::a]:7481"),
        ({}, None, "localhost:7481"),
    ],
)
def test_address_precedence(env, address, expected):
    """The address comes from the argument, then PJRT_RENDEZVOUS_ADDRESS, then worker 0, then localhost."""
    assert detect_topology(env, address=address, hostname=lambda: "h").address == expected


@pytest.mark.parametrize("entry", ["w0:8470", "10.0.0.1:8470", "[fd00::a]", "w 0", "w0/24"])
def test_worker_hostname_with_a_port_is_refused(entry):
    """A worker hostname with a port (or brackets, a blank, a slash) is refused naming the
    entry; with a port it was taken for an IPv6 address and dialed as '[w0:8470]:7481'."""
    env = {"TPU_WORKER_HOSTNAMES": f"{entry},w1", "TPU_WORKER_ID": "1"}
    for detect in (detect_topology, detect_address):
        with pytest.raises(TopologyError) as info:
            detect(env)
        assert f"TPU_WORKER_HOSTNAMES entry {entry!r} is not a hostname or IP address" in str(info.value)
        assert "PJRT_RENDEZVOUS_ADDRESS" in str(info.value)


# --- ordinal validation --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ordinal", "local_ordinal"])
@pytest.mark.parametrize("thread_index", [-1, 2, 100])
def test_thread_index_out_of_range(method, thread_index):
    """A thread index outside [0, devices_per_process) raises, naming the value and the range."""
    topo = detect_topology({"TPU_ACCELERATOR_TYPE": "v3-8"})
    with pytest.raises(TopologyError) as info:
        getattr(topo, method)(thread_index)
    assert f"thread index {thread_index}" in str(info.value)
    assert "[0, 2)" in str(info.value)


@pytest.mark.parametrize("thread_index", [True, 1.0, "1", None])
def test_thread_index_must_be_an_int(thread_index):
    """A thread index that is not an int is a TypeError."""
    topo = detect_topology({"TPU_ACCELERATOR_TYPE": "v3-8"})
    with pytest.raises(TypeError):
        topo.ordinal(thread_index)


def test_topology_is_frozen_and_keyword_only():
    """Topology is immutable and must be built with keyword arguments."""
    topo = detect_topology({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.task_id = 1
    with pytest.raises(TypeError):
        Topology(None, 1, 1, 0, 1, 0, 1, 0, (), "h", "a:1")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(task_id=1), "task_id 1 must be less than num_tasks 1"),
        (dict(local_rank=-1), "local_rank must not be negative"),
        (dict(cores_per_chip=0), "cores_per_chip must be at least 1"),
        (dict(worker_hostnames=("a",), worker_id=1), "worker_id 1 is out of range"),
    ],
)
def test_topology_constructor_validates(overrides, message):
    """Building a Topology by hand still rejects impossible values."""
    fields = dict(accelerator_type=None, cores_per_chip=1, chips_per_process=1, task_id=0, num_tasks=1,
                  local_rank=0, local_world_size=1, worker_id=0, worker_hostnames=(), host="h",
                  address="h:1")
    with pytest.raises(TopologyError, match=message):
        Topology(**{**fields, **overrides})


# --- metadata server -----------------------------------------------------------------------------


def test_metadata_values_flow_through(metadata_server):
    """With no TPU variables, tpu-env and worker-network-endpoints from the server fill in the topology."""
    server = metadata_server({"tpu-env": V4_32_TPU_ENV, "worker-network-endpoints": V4_32_ENDPOINTS})
    topo = detect_topology({}, metadata=_plain_fetcher(server), hostname=_no_hostname)
    assert topo.accelerator_type == "v4-32"
    assert (topo.cores_per_chip, topo.chips_per_process, topo.devices_per_process) == (1, 4, 4)
    assert (topo.worker_id, topo.task_id, topo.num_tasks, topo.world_size) == (2, 2, 4, 16)
    assert topo.worker_hostnames == V4_32_IPS
    assert topo.host == "10.130.0.5"
    assert topo.address == "10.130.0.3:7481"
    assert [topo.ordinal(t) for t in range(4)] == [8, 9, 10, 11]
    assert sorted(_requested_keys(server)) == ["tpu-env", "worker-network-endpoints"]


def test_metadata_bounds_are_split_among_local_processes(metadata_server):
    """Metadata bounds describe one process per host, so four local processes get one chip each."""
    server = metadata_server({"tpu-env": V4_32_TPU_ENV, "worker-network-endpoints": V4_32_ENDPOINTS})
    env = {"PJRT_LOCAL_PROCESS_RANK": "1", "PJRT_LOCAL_PROCESS_COUNT": "4"}
    topo = detect_topology(env, metadata=_plain_fetcher(server))
    assert (topo.chips_per_process, topo.num_tasks, topo.task_id, topo.world_size) == (1, 16, 9, 16)
    assert topo.ordinal(0) == 9


def test_environment_wins_over_metadata(metadata_server):
    """A TPU variable present in the environment beats the same value from tpu-env."""
    server = metadata_server({"tpu-env": V4_32_TPU_ENV, "worker-network-endpoints": V4_32_ENDPOINTS})
    env = {"TPU_WORKER_ID": "3", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "a,b,c,d"}
    topo = detect_topology(env, metadata=_plain_fetcher(server))
    assert (topo.accelerator_type, topo.worker_id, topo.chips_per_process) == ("v4-32", 3, 1)
    assert (topo.host, topo.address, topo.task_id) == ("d", "a:7481", 3)
    assert _requested_keys(server) == ["tpu-env"]


def test_tpu_env_gives_the_chips_when_accelerator_type_is_set(metadata_server):
    """With TPU_ACCELERATOR_TYPE set and no chip bounds in the environment, tpu-env still
    gives the host's chips (one chip per process was guessed: a process of a v4-32 host
    that drives its 4 chips made a world of 4); with the bounds in the environment, tpu-env
    is not fetched."""
    server = metadata_server({"tpu-env": V4_32_TPU_ENV, "worker-network-endpoints": V4_32_ENDPOINTS})
    topo = detect_topology({"TPU_ACCELERATOR_TYPE": "v4-32", "TPU_WORKER_ID": "1"},
                           metadata=_plain_fetcher(server))
    assert topo.worker_hostnames == V4_32_IPS
    assert (topo.host, topo.chips_per_process, topo.num_tasks, topo.world_size) == ("10.130.0.4", 4, 4, 16)
    assert sorted(_requested_keys(server)) == ["tpu-env", "worker-network-endpoints"]
    server = metadata_server({"tpu-env": V4_32_TPU_ENV, "worker-network-endpoints": V4_32_ENDPOINTS})
    topo = detect_topology({"TPU_ACCELERATOR_TYPE": "v4-32", "TPU_WORKER_ID": "1", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1"},
                           metadata=_plain_fetcher(server))
    assert topo.chips_per_process == 1 and _requested_keys(server) == ["worker-network-endpoints"]


@pytest.mark.parametrize("skip", ["1", "true", "True", "yes", "0", "false"])
def test_skip_mds_query_stops_the_fetch(skip):
    """TPU_SKIP_MDS_QUERY set to anything means the fetcher is never called: torch_xla
    skips the metadata server for any value but an empty one, "0" and "false" too, and
    the topology must be the one its runtime sees (these two fetched it)."""
    topo = detect_topology({"TPU_SKIP_MDS_QUERY": skip}, metadata=_no_metadata, hostname=lambda: "h")
    assert (topo.accelerator_type, topo.world_size, topo.address) == (None, 1, "localhost:7481")


@pytest.mark.parametrize("skip", [""])
def test_skip_mds_query_false_values_still_fetch(metadata_server, skip):
    """TPU_SKIP_MDS_QUERY set empty does not stop the metadata fetch (nor torch_xla's)."""
    server = metadata_server({"tpu-env": V4_32_TPU_ENV, "worker-network-endpoints": V4_32_ENDPOINTS})
    topo = detect_topology({"TPU_SKIP_MDS_QUERY": skip}, metadata=_plain_fetcher(server))
    assert topo.accelerator_type == "v4-32"


def test_unreachable_or_missing_metadata_means_no_tpu(metadata_server):
    """A metadata server without tpu-env (HTTP 404) leaves a world of one and asks for nothing else."""
    server = metadata_server({})
    topo = detect_topology({}, metadata=_plain_fetcher(server), hostname=lambda: "gce-vm")
    assert (topo.accelerator_type, topo.world_size, topo.host) == (None, 1, "gce-vm")
    assert _requested_keys(server) == ["tpu-env"]


def test_the_process_asks_the_metadata_server_each_key_once(metadata_server):
    """What the server says (a value, or HTTP 404) is kept for the process: an unbound
    thread's xm calls detect the topology at each call, and asked the server each time."""
    from pjrt_rendezvous.client import _api

    server = metadata_server({"worker-network-endpoints": V4_32_ENDPOINTS})  # no tpu-env: 404
    port = server.server_address[1]
    env = {"PJRT_RENDEZVOUS_METADATA_URL": f"http://127.0.0.1:{port}{ATTRIBUTES.rstrip('/')}", "TPU_ACCELERATOR_TYPE": "v4-32", "TPU_WORKER_ID": "0"}
    for _ in range(3):
        topo = _api._detect(env, None)
        assert topo.worker_hostnames == V4_32_IPS
    env.pop("TPU_ACCELERATOR_TYPE")
    for _ in range(3):
        assert _api._detect(env, None).accelerator_type is None
    assert sorted(_requested_keys(server)) == ["tpu-env", "worker-network-endpoints"]


def test_the_worker_id_comes_from_tpu_env_when_the_accelerator_type_is_set(metadata_server):
    """With TPU_ACCELERATOR_TYPE in the environment tpu-env was not read, so its WORKER_ID
    neither: every host of a pod took worker id 0 (now refused as naming no task). It is read
    for the worker id when the metadata names several workers."""
    server = metadata_server({"tpu-env": V4_32_TPU_ENV, "worker-network-endpoints": V4_32_ENDPOINTS})
    topo = detect_topology({"TPU_ACCELERATOR_TYPE": "v4-32"}, metadata=_plain_fetcher(server))
    assert (topo.worker_id, topo.task_id, topo.num_tasks) == (2, 2, 4)


def test_malformed_worker_endpoints_raise(metadata_server):
    """A worker-network-endpoints entry without three fields raises, pointing at TPU_WORKER_HOSTNAMES."""
    server = metadata_server({"tpu-env": V4_32_TPU_ENV, "worker-network-endpoints": "host-only,x:y"})
    with pytest.raises(TopologyError) as info:
        detect_topology({}, metadata=_plain_fetcher(server))
    assert "'host-only'" in str(info.value) and "TPU_WORKER_HOSTNAMES" in str(info.value)


def test_metadata_chips_that_do_not_divide_raise():
    """Chips per host from tpu-env that do not split evenly among local processes raise."""
    tpu_env = "ACCELERATOR_TYPE: 'v4-8'\nTPU_CHIPS_PER_PROCESS_BOUNDS: '2,2,1'\n"
    metadata = {"tpu-env": tpu_env, "worker-network-endpoints": ""}.__getitem__
    with pytest.raises(TopologyError) as info:
        detect_topology({"PJRT_LOCAL_PROCESS_COUNT": "3"}, metadata=metadata)
    assert "TPU_CHIPS_PER_PROCESS_BOUNDS" in str(info.value) and "3" in str(info.value)


# --- chips per host from the environment ---------------------------------------------------------

V5E_16_WORKER_1 = {
    "TPU_ACCELERATOR_TYPE": "v5litepod-16", "TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "a,b",
    "PJRT_LOCAL_PROCESS_RANK": "0", "PJRT_LOCAL_PROCESS_COUNT": "1",
}


@pytest.mark.parametrize("name", ["TPU_CHIPS_PER_HOST_BOUNDS", "CHIPS_PER_HOST_BOUNDS"])
def test_chips_per_host_bounds_are_read_from_the_environment(name):
    """A host's chip bounds in the environment (as torch_xla reads them with TPU_SKIP_MDS_QUERY)
    give one process per host all 8 of a v5litepod-16 host's chips, not 1."""
    topo = detect_topology({**V5E_16_WORKER_1, name: "2,4,1"}, metadata=_no_metadata)
    assert (topo.chips_per_process, topo.devices_per_process, topo.world_size) == (8, 8, 16)
    assert [topo.ordinal(t) for t in (0, 7)] == [8, 15]


def test_chips_per_host_bounds_from_the_environment_are_split_among_local_processes():
    """Four local processes share a host's 8 chips: 2 each."""
    env = {**V5E_16_WORKER_1, "PJRT_LOCAL_PROCESS_RANK": "3", "PJRT_LOCAL_PROCESS_COUNT": "4",
           "TPU_CHIPS_PER_HOST_BOUNDS": "2,4,1"}
    topo = detect_topology(env)
    assert (topo.chips_per_process, topo.task_id, topo.num_tasks, topo.ordinal(0)) == (2, 7, 8, 14)


def test_chips_per_host_bounds_precedence(metadata_server):
    """TPU_CHIPS_PER_PROCESS_BOUNDS beats a host's bounds; TPU_CHIPS_PER_HOST_BOUNDS beats
    CHIPS_PER_HOST_BOUNDS; a host's bounds in the environment beat tpu-env's."""
    both = {**V5E_16_WORKER_1, "TPU_CHIPS_PER_HOST_BOUNDS": "2,4,1", "CHIPS_PER_HOST_BOUNDS": "2,2,1"}
    assert detect_topology(both).chips_per_process == 8
    assert detect_topology({**both, "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1"}).chips_per_process == 1
    server = metadata_server({"tpu-env": V4_32_TPU_ENV, "worker-network-endpoints": V4_32_ENDPOINTS})
    topo = detect_topology({"CHIPS_PER_HOST_BOUNDS": "1,2,1"}, metadata=_plain_fetcher(server))
    assert (topo.accelerator_type, topo.chips_per_process) == ("v4-32", 2)  # tpu-env says 4


@pytest.mark.parametrize("name", ["TPU_CHIPS_PER_HOST_BOUNDS", "CHIPS_PER_HOST_BOUNDS"])
def test_bad_chips_per_host_bounds_in_the_environment_raise_naming_the_variable(name):
    """Malformed bounds, or chips that do not divide among the local processes, name the variable."""
    with pytest.raises(TopologyError, match=f"^{name} must be 3 comma-separated positive integers.*'2,4'"):
        detect_topology({**V5E_16_WORKER_1, name: "2,4"})
    with pytest.raises(TopologyError) as info:
        detect_topology({**V5E_16_WORKER_1, name: "2,4,1", "PJRT_LOCAL_PROCESS_COUNT": "3"})
    assert f"{name}='2,4,1' gives 8 chip(s) per host" in str(info.value)
    assert "local world size 3" in str(info.value) and "TPU_CHIPS_PER_PROCESS_BOUNDS" in str(info.value)


# --- the coordinator's address alone -------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "address", "expected"),
    [
        ({}, None, "localhost:7481"),
        ({"TPU_WORKER_HOSTNAMES": "w0,w1", "TPU_WORKER_ID": "1"}, None, "w0:7481"),
        ({"TPU_WORKER_HOSTNAMES": "w0,w1", "TPU_WORKER_ID": "1", "PJRT_RENDEZVOUS_ADDRESS": "coord:9000"}, None, "coord:9000"),
        ({"PJRT_RENDEZVOUS_ADDRESS": "coord:9000"}, "other", "other:7481"),
        ({"TPU_WORKER_HOSTNAMES": "fd00::1,fd00::2", "TPU_WORKER_ID": "1"}, None, "[fd00::1]:7481"),
    ],
)
def test_detect_address_finds_the_coordinator_as_detect_topology_does(env, address, expected):
    """The address alone, by the same precedence as detect_topology's."""
    assert detect_address(env, address=address, metadata=_no_metadata if env else None) == expected
    assert detect_topology(env, address=address, hostname=lambda: "h").address == expected


@pytest.mark.parametrize(
    "extra",
    [
        {"TPU_ACCELERATOR_TYPE": "tpu7x-8"},  # cores per chip not known
        {"TPU_ACCELERATOR_TYPE": "v9-8"},
        {"TPU_WORKER_ID": "7", "PJRT_LOCAL_PROCESS_RANK": "x"},  # a layout the rest would refuse
        {"TPU_CHIPS_PER_HOST_BOUNDS": "bad"},
    ],
)
def test_detect_address_needs_no_layout_the_client_can_use(extra):
    """Worker 0 is found where detect_topology refuses the rest of the layout."""
    env = {"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3", **extra}
    with pytest.raises(TopologyError):
        detect_topology(env)
    assert detect_address(env) == "10.0.0.2:7481"


def test_detect_address_asks_the_metadata_server_for_worker_0_only_when_needed(metadata_server):
    """On a TPU VM whose type the client cannot lay out, worker 0 comes from the metadata server;
    a given address asks it nothing."""
    tpu_env = "ACCELERATOR_TYPE: 'tpu7x-16'\nWORKER_ID: '1'\n"
    server = metadata_server({"tpu-env": tpu_env, "worker-network-endpoints": V4_32_ENDPOINTS})
    assert detect_address({}, metadata=_plain_fetcher(server)) == "10.130.0.3:7481"
    assert _requested_keys(server) == ["tpu-env", "worker-network-endpoints"]
    assert detect_address({"PJRT_RENDEZVOUS_ADDRESS": "c"}, metadata=_no_metadata) == "c:7481"
    assert detect_address({"TPU_SKIP_MDS_QUERY": "1"}, metadata=_no_metadata) == "localhost:7481"
    with pytest.raises(TopologyError, match="PJRT_RENDEZVOUS_ADDRESS"):
        detect_address({"PJRT_RENDEZVOUS_ADDRESS": "coord:0"})


def test_metadata_fetcher_sends_the_flavor_header(metadata_server):
    """metadata_fetcher GETs base_url/key with Metadata-Flavor: Google, which the server requires."""
    server = metadata_server({"tpu-env": V4_32_TPU_ENV}, require_flavor=True)
    base = f"http://127.0.0.1:{server.server_address[1]}/computeMetadata/v1/instance/attributes"
    assert metadata_fetcher(base)("tpu-env") == V4_32_TPU_ENV
    assert metadata_fetcher(base + "/", timeout=5)("tpu-env") == V4_32_TPU_ENV
    assert server.requests == [(ATTRIBUTES + "tpu-env", "Google")] * 2
    with pytest.raises(urllib.error.HTTPError) as info:
        _plain_fetcher(server)("tpu-env")
    info.value.close()
    assert info.value.code == 403


def test_metadata_fetcher_end_to_end(metadata_server):
    """detect_topology with metadata_fetcher against a header-checking server sees the TPU values."""
    server = metadata_server(
        {"tpu-env": V4_32_TPU_ENV, "worker-network-endpoints": V4_32_ENDPOINTS}, require_flavor=True
    )
    base = f"http://127.0.0.1:{server.server_address[1]}/computeMetadata/v1/instance/attributes"
    topo = detect_topology({}, metadata=metadata_fetcher(base))
    assert (topo.accelerator_type, topo.world_size, topo.task_id) == ("v4-32", 16, 2)


def test_metadata_fetcher_errors_are_oserror_and_count_as_absent(metadata_server):
    """A missing key or a dead server raises OSError from the fetcher, which detect_topology tolerates."""
    server = metadata_server({}, require_flavor=True)
    base = f"http://127.0.0.1:{server.server_address[1]}/computeMetadata/v1/instance/attributes"
    with pytest.raises(OSError):
        metadata_fetcher(base)("tpu-env")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    dead = metadata_fetcher(f"http://127.0.0.1:{dead_port}/attributes", timeout=2)
    with pytest.raises(OSError):
        dead("tpu-env")
    assert detect_topology({}, metadata=dead, hostname=lambda: "h").world_size == 1


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        # Non-integers name the variable and the bad text.
        ({"CLOUD_TPU_TASK_ID": "abc"}, ["CLOUD_TPU_TASK_ID", "'abc'", "integer"]),
        ({"PJRT_RENDEZVOUS_TASK_ID": "1.0"}, ["PJRT_RENDEZVOUS_TASK_ID", "'1.0'", "integer"]),
        ({"PJRT_LOCAL_PROCESS_RANK": "1.5"}, ["PJRT_LOCAL_PROCESS_RANK", "'1.5'", "integer"]),
        ({"PJRT_LOCAL_PROCESS_COUNT": "four"}, ["PJRT_LOCAL_PROCESS_COUNT", "'four'", "integer"]),
        ({"PJRT_RENDEZVOUS_LOCAL_WORLD_SIZE": "0x4"}, ["PJRT_RENDEZVOUS_LOCAL_WORLD_SIZE", "'0x4'"]),
        ({"TPU_WORKER_ID": "w1"}, ["TPU_WORKER_ID", "'w1'", "integer"]),
        ({"PJRT_RENDEZVOUS_NUM_TASKS": "many"}, ["PJRT_RENDEZVOUS_NUM_TASKS", "'many'", "integer"]),
        ({"PJRT_RENDEZVOUS_CORES_PER_CHIP": "two"}, ["PJRT_RENDEZVOUS_CORES_PER_CHIP", "'two'"]),
        # Negative ids and non-positive counts.
        ({"CLOUD_TPU_TASK_ID": "-1"}, ["CLOUD_TPU_TASK_ID", "must not be negative", "-1"]),
        ({"TPU_WORKER_ID": "-2"}, ["TPU_WORKER_ID", "must not be negative", "-2"]),
        ({"PJRT_LOCAL_PROCESS_RANK": "-1"}, ["PJRT_LOCAL_PROCESS_RANK", "must not be negative"]),
        ({"PJRT_RENDEZVOUS_LOCAL_RANK": "-3"}, ["PJRT_RENDEZVOUS_LOCAL_RANK", "must not be negative"]),
        ({"PJRT_LOCAL_PROCESS_COUNT": "0"}, ["PJRT_LOCAL_PROCESS_COUNT", "at least 1", "0"]),
        ({"PJRT_RENDEZVOUS_NUM_TASKS": "0"}, ["PJRT_RENDEZVOUS_NUM_TASKS", "at least 1"]),
        # Past what the wire's 32-bit fields take (it failed at the first call, protobuf's ValueError).
        ({"PJRT_RENDEZVOUS_NUM_TASKS": "2147483648", "PJRT_RENDEZVOUS_TASK_ID": "5"},
         ["PJRT_RENDEZVOUS_NUM_TASKS", "at most 2147483647", "2147483648"]),
        ({"PJRT_RENDEZVOUS_CORES_PER_CHIP": "99999999999999999999999"}, ["PJRT_RENDEZVOUS_CORES_PER_CHIP", "at most 2147483647"]),
        ({"PJRT_RENDEZVOUS_NUM_TASKS": "1073741824", "PJRT_RENDEZVOUS_TASK_ID": "0", "PJRT_RENDEZVOUS_CORES_PER_CHIP": "2"},
         ["1073741824 tasks x 2 devices", "2147483648 ordinals, over 2147483647"]),
        # Cores per chip below one, and a type whose cores are unknown.
        ({"PJRT_RENDEZVOUS_CORES_PER_CHIP": "0"}, ["PJRT_RENDEZVOUS_CORES_PER_CHIP", "at least 1", "0"]),
        ({"PJRT_RENDEZVOUS_CORES_PER_CHIP": "-2"}, ["PJRT_RENDEZVOUS_CORES_PER_CHIP", "at least 1"]),
        ({"TPU_ACCELERATOR_TYPE": "tpu7x-8"},
         ["'tpu7x-8'", "PJRT_RENDEZVOUS_CORES_PER_CHIP", "TPU_ACCELERATOR_TYPE"]),
        # task id >= number of tasks, given or derived.
        ({"CLOUD_TPU_TASK_ID": "4", "PJRT_LOCAL_PROCESS_COUNT": "4"},
         ["task id 4", "number of tasks 4", "CLOUD_TPU_TASK_ID", "PJRT_RENDEZVOUS_NUM_TASKS"]),
        ({"PJRT_RENDEZVOUS_TASK_ID": "8", "TPU_PROCESS_BOUNDS": "2,2,2"},
         ["task id 8", "number of tasks 8", "PJRT_RENDEZVOUS_TASK_ID", "TPU_PROCESS_BOUNDS"]),
        ({"TPU_WORKER_ID": "1"}, ["task id 1", "number of tasks 1", "worker id 1", "TPU_WORKER_ID"]),
        # Several tasks, and nothing says which this process is (every one would be task 0).
        ({"PJRT_RENDEZVOUS_NUM_TASKS": "4"},
         ["4 tasks", "PJRT_RENDEZVOUS_NUM_TASKS", "worker id is not set", "PJRT_RENDEZVOUS_TASK_ID", "TPU_WORKER_ID"]),
        ({"PJRT_LOCAL_PROCESS_COUNT": "4"}, ["4 tasks", "local rank is not set", "PJRT_LOCAL_PROCESS_RANK"]),
        ({"TPU_WORKER_HOSTNAMES": "a,b", "PJRT_LOCAL_PROCESS_COUNT": "2"},
         ["4 tasks", "worker id and local rank", "or TPU_WORKER_ID and PJRT_LOCAL_PROCESS_RANK"]),
        ({"TPU_PROCESS_BOUNDS": "2,1,1"}, ["2 tasks", "TPU_PROCESS_BOUNDS", "worker id is not set"]),
        # local rank >= local world size.
        ({"PJRT_LOCAL_PROCESS_RANK": "4", "PJRT_LOCAL_PROCESS_COUNT": "4"},
         ["local rank 4", "local world size 4", "PJRT_LOCAL_PROCESS_RANK", "PJRT_LOCAL_PROCESS_COUNT"]),
        ({"PJRT_RENDEZVOUS_LOCAL_RANK": "1"},
         ["local rank 1", "local world size 1", "PJRT_RENDEZVOUS_LOCAL_RANK"]),
        # worker id out of range of the hostnames.
        ({"TPU_WORKER_ID": "4", "TPU_WORKER_HOSTNAMES": "a,b,c,d"},
         ["worker id 4", "4 worker hostnames", "0..3", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES"]),
        # Malformed bounds.
        ({"TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2"},
         ["TPU_CHIPS_PER_PROCESS_BOUNDS", "3 comma-separated", "'2,2'"]),
        ({"TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,0"}, ["TPU_CHIPS_PER_PROCESS_BOUNDS", "positive", "'2,2,0'"]),
        ({"TPU_CHIPS_PER_PROCESS_BOUNDS": "a,b,c"}, ["TPU_CHIPS_PER_PROCESS_BOUNDS", "'a,b,c'"]),
        ({"TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1,1"}, ["TPU_CHIPS_PER_PROCESS_BOUNDS", "'1,1,1,1'"]),
        ({"TPU_PROCESS_BOUNDS": "-1,1,1"}, ["TPU_PROCESS_BOUNDS", "3 comma-separated", "'-1,1,1'"]),
        ({"TPU_PROCESS_BOUNDS": "2x2x1"}, ["TPU_PROCESS_BOUNDS", "'2x2x1'"]),
        # Bad addresses.
        ({"PJRT_RENDEZVOUS_ADDRESS": "coord:http"}, ["PJRT_RENDEZVOUS_ADDRESS", "port", "'coord:http'"]),
        ({"PJRT_RENDEZVOUS_ADDRESS": "coord:0"}, ["PJRT_RENDEZVOUS_ADDRESS", "1..65535"]),
        ({"PJRT_RENDEZVOUS_ADDRESS": "coord:70000"}, ["PJRT_RENDEZVOUS_ADDRESS", "1..65535"]),
        ({"PJRT_RENDEZVOUS_ADDRESS": "coord:"}, ["PJRT_RENDEZVOUS_ADDRESS", "port"]),
        ({"PJRT_RENDEZVOUS_ADDRESS": "[::1"}, ["PJRT_RENDEZVOUS_ADDRESS", "'['"]),
        ({"PJRT_RENDEZVOUS_ADDRESS": "[::1]9000"}, ["PJRT_RENDEZVOUS_ADDRESS", "':port'"]),
        ({"PJRT_RENDEZVOUS_ADDRESS": "[coord]:1"}, ["PJRT_RENDEZVOUS_ADDRESS", "not a valid address"]),
        ({"PJRT_RENDEZVOUS_ADDRESS": ":9000"}, ["PJRT_RENDEZVOUS_ADDRESS", "not a valid address"]),
        ({"PJRT_RENDEZVOUS_ADDRESS": "http://coord:1"}, ["PJRT_RENDEZVOUS_ADDRESS", "'http://coord:1'"]),
        ({"PJRT_RENDEZVOUS_ADDRESS": "a:b:c"}, ["PJRT_RENDEZVOUS_ADDRESS", "not a valid address"]),
    ],
)
def test_detect_topology_errors(env, fragments):
    """Each invalid environment raises TopologyError naming the rule, the value and the variable."""
    with pytest.raises(TopologyError) as info:
        detect_topology(env, hostname=lambda: "h")
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("env", "task"),
    [
        ({"PJRT_RENDEZVOUS_NUM_TASKS": "4", "TPU_WORKER_ID": "2"}, 2),
        ({"PJRT_LOCAL_PROCESS_COUNT": "4", "PJRT_LOCAL_PROCESS_RANK": "3"}, 3),
        ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "1", "PJRT_LOCAL_PROCESS_COUNT": "2",
          "PJRT_RENDEZVOUS_LOCAL_RANK": "1"}, 3),
        ({"TPU_PROCESS_BOUNDS": "2,1,1", "CLOUD_TPU_TASK_ID": "1"}, 1),
        ({"PJRT_RENDEZVOUS_NUM_TASKS": "1"}, 0),  # a world of one needs no id
    ],
)
def test_a_world_of_several_tasks_needs_to_know_which_this_is(env, task):
    """Any one source of the task id, or of the parts it is derived from, will do."""
    assert detect_topology(env, hostname=lambda: "h").task_id == task


def test_a_tpu7x_process_bounds_names_the_variables_that_set_the_world():
    """torch_xla writes TPU_PROCESS_BOUNDS with a fourth number for TPU7x: refused naming what
    to set instead (it said "must be 3 comma-separated positive integers"); with them set,
    the bounds are not read."""
    env = {"TPU_PROCESS_BOUNDS": "2,2,1,2", "CLOUD_TPU_TASK_ID": "1", "TPU_SKIP_MDS_QUERY": "1"}
    with pytest.raises(TopologyError, match="has a fourth number, as torch_xla writes for TPU7x.*set PJRT_RENDEZVOUS_NUM_TASKS"):
        detect_topology(env, metadata=_no_metadata)
    assert detect_topology({**env, "PJRT_RENDEZVOUS_NUM_TASKS": "8"}, metadata=_no_metadata).num_tasks == 8


def test_a_task_id_without_a_worker_id_names_its_own_host():
    """Task 5 of 2 hosts x 4 processes is on host b: without TPU_WORKER_ID it said worker 0,
    host a, where the coordinator takes a process of the same host and local rank for a
    restart of the task (a duplicate task id elsewhere replaced the live one). A worker id
    given stays as given."""
    env = {"TPU_WORKER_HOSTNAMES": "a,b", "CLOUD_TPU_TASK_ID": "5", "PJRT_LOCAL_PROCESS_COUNT": "4",
           "PJRT_LOCAL_PROCESS_RANK": "1", "TPU_SKIP_MDS_QUERY": "1"}
    topo = detect_topology(env, metadata=_no_metadata)
    assert (topo.worker_id, topo.host, topo.task_id, topo.num_tasks) == (1, "b", 5, 8)
    assert detect_topology({**env, "TPU_WORKER_ID": "0"}, metadata=_no_metadata).host == "a"


@pytest.mark.parametrize("task, local_rank, local_ordinal, ordinal", [(5, 1, 3, 11), (6, 2, 5, 13), (1, 1, 3, 3)])
def test_a_task_id_without_a_local_rank_gives_the_local_rank(task, local_rank, local_ordinal, ordinal):
    """Task 5 of 2 hosts x 4 processes is the second on its host (6 the third, 1 the second
    of the first): without a local rank every process of a host was local rank 0 (the same
    local ordinals, each its host's local master). A local rank given stays as given; so does
    the default where the worker id given is not the task's host (tasks counted otherwise)."""
    env = {"TPU_WORKER_HOSTNAMES": "a,b", "CLOUD_TPU_TASK_ID": str(task), "PJRT_LOCAL_PROCESS_COUNT": "4",
           "TPU_ACCELERATOR_TYPE": "v3-32", "TPU_SKIP_MDS_QUERY": "1"}
    topo = detect_topology(env, metadata=_no_metadata)
    assert (topo.local_rank, topo.local_ordinal(1), topo.ordinal(1)) == (local_rank, local_ordinal, ordinal)
    assert detect_topology({**env, "PJRT_LOCAL_PROCESS_RANK": "0"}, metadata=_no_metadata).local_rank == 0
    # (tasks not counted host by host, as the worker id given says: not derived)
    assert detect_topology({**env, "TPU_WORKER_ID": str(1 - task // 4)}, metadata=_no_metadata).local_rank == 0


@pytest.mark.parametrize("address", ["", "   ", "coord:x"])
def test_bad_address_argument_names_the_argument(address):
    """An unusable explicit address argument raises, naming the argument rather than a variable."""
    with pytest.raises(TopologyError, match="the address argument"):
        detect_topology({}, address=address)


def test_topology_error_is_a_value_error():
    """TopologyError is a ValueError, so callers that catch ValueError keep working."""
    assert issubclass(TopologyError, ValueError)
