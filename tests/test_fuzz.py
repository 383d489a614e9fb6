"""Fuzz against the real server: hypothesis-generated bad requests for every RPC, random
protobuf bodies and random bytes on the wire, sent to one embedded coordinator on loopback.

After every example the server must answer a health check; after every batch (one test)
it must still run a fresh world of one (register + rendezvous) and a key-value set/get.
Every answer must be OK or a documented status with a non-empty message that the server
wrote (not a transport error such as a client-side deadline on a call that should not wait).

``python -m pytest -s tests/test_fuzz.py`` prints how many requests were fuzzed and the
status codes they got. ``PJRT_RENDEZVOUS_FUZZ_EXAMPLES`` scales the example counts.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import queue
import socket
import struct
import threading
import time
import uuid

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pjrt_rendezvous.client._session import FRAME, frame
from pjrt_rendezvous.coordinator import Coordinator, Limits
from pjrt_rendezvous.client._wire import set_contribution_rows
from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb
from pjrt_rendezvous.protos.v1 import coordinator_pb2_grpc as pb_grpc

SCALE = float(os.environ.get("PJRT_RENDEZVOUS_FUZZ_EXAMPLES", "1"))
EXAMPLES = max(1, int(150 * SCALE))  # per RPC
WIRE_EXAMPLES = max(1, int(60 * SCALE))

DOCUMENTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
CALL_TIMEOUT = 10.0  # a call that should answer at once (or within its own tiny timeout); generous: CI machines are shared
FOREVER_TIMEOUT = 0.3  # a call that may legitimately wait forever: we give up after this
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)

LIMITS = Limits(
    max_payload_bytes=4096,
    max_tag_length=64,
    max_key_length=256,
    max_value_bytes=4096,
    max_name_length=64,
    max_world_size=4096,
    max_jobs=100_000,  # random job names of read-only KV calls create jobs; keep room
    max_pending_rounds=2_000,
)

# Fixture jobs: "solo" is a complete world of one (its rounds finish at once), "duo" a world
# of two where only ordinal 0 registered (its rounds wait). PROBE_JOB is never fuzzed.
SOLO, SOLO_INC = "solo", "solo-incarnation"
DUO, DUO_INC = "duo", "duo-incarnation"
PROBE_JOB = "__liveness-probe-5f1c__"

# Counters of everything sent, for the report.
SENT: collections.Counter = collections.Counter()  # rpc name -> requests
CODES: collections.Counter = collections.Counter()  # status name -> answers


class Server:
    """The module's coordinator, a channel to it and the raw stubs."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.address = coordinator.address
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.probes = 0

    def check_health(self) -> None:
        reply = self.health.Check(health_pb2.HealthCheckRequest(service="pjrt_rendezvous.v1.Coordinator"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    def register(self, job: str, incarnation: str, *, num_tasks: int, host: str = "fixture") -> pb.RegisterResponse:
        """Task 0, with one thread, of a world of ``num_tasks`` one-device tasks."""
        request = pb.RegisterRequest(
            job=job, incarnation=incarnation, host=host, pid=1, task_id=0, num_tasks=num_tasks,
            devices_per_task=1, threads=[pb.ThreadSpec(thread_index=0)],
        )
        return self.stub.Register(request, timeout=5)

    def probe(self) -> None:
        """The server still does real work: a new world of one meets itself, and KV works."""
        self.check_health()
        self.probes += 1
        job, incarnation = f"{PROBE_JOB}{self.probes}", uuid.uuid4().hex
        registered = self.register(job, incarnation, num_tasks=1, host="probe")
        assert registered.world_size == 1 and registered.assignments[0].ordinal == 0
        payload = os.urandom(16)
        reply = self.stub.Rendezvous(
            pb.RendezvousRequest(
                job=job, incarnation=incarnation, round=0, timeout=5,
                contributions=[pb.Contribution(ordinal=0, tag="probe", payload=payload)],
            ),
            timeout=5,
        )
        assert list(reply.payloads) == [payload]
        self.stub.KvSet(pb.KvSetRequest(job=PROBE_JOB, entries=[pb.KvEntry(key="k", value=payload)]), timeout=5)
        (value,) = self.stub.KvGet(pb.KvGetRequest(job=PROBE_JOB, keys=["k"]), timeout=5).values
        assert value.found and value.value == payload
        (status,) = self.stub.Status(pb.StatusRequest(job=job), timeout=5).jobs
        assert status.rounds_completed == 1


@pytest.fixture(scope="module")
def server():
    with Coordinator(port=0, limits=LIMITS) as coordinator:
        s = Server(coordinator)
        for job, incarnation, num_tasks in ((SOLO, SOLO_INC, 1), (DUO, DUO_INC, 2)):
            s.register(job, incarnation, num_tasks=num_tasks)
        s.probe()
        yield s
        s.probe()
        s.channel.close()
    total = sum(SENT.values())
    print(
        f"\nfuzz: {total} requests fuzzed ({dict(sorted(SENT.items()))}); answers {dict(sorted(CODES.items()))}; "
        f"{s.probes} liveness probes passed"
    )


# -- judging an answer ---------------------------------------------------------------------

def judge(rpc: str, call, *, may_wait_forever: bool) -> object:
    """Runs ``call``; asserts the answer is OK or a documented status the server wrote."""
    SENT[rpc] += 1
    try:
        result = call(FOREVER_TIMEOUT if may_wait_forever else CALL_TIMEOUT)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        CODES[code.name] += 1
        assert code in DOCUMENTED, f"{rpc} answered {code.name}: {details!r}"
        assert details.strip(), f"{rpc} answered {code.name} with an empty message"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded":
            # gRPC's own client-side deadline, not the server's answer: only acceptable for a
            # call that asked to wait forever (no timeout, inf, or astronomically long).
            assert may_wait_forever, f"{rpc} did not answer within {CALL_TIMEOUT} s though its wait was bounded"
        return exc
    CODES["OK"] += 1
    return result


# -- strategies ----------------------------------------------------------------------------


def huge_text(*sizes: int):
    return st.sampled_from(sizes).flatmap(
        lambda n: st.sampled_from(["x", "é", "𝔘", "\x00"]).map(lambda c: c * n)
    )


small_text = st.text(max_size=24)
texts = st.one_of(small_text, st.just(""), huge_text(65, 257, 1000, 5000))
jobs = st.one_of(st.sampled_from([SOLO, DUO, "", "default"]), texts, huge_text(20_000, 100_000))
incarnations = st.one_of(st.sampled_from([SOLO_INC, DUO_INC, ""]), texts, huge_text(20_000))
int32s = st.one_of(st.integers(-3, 5), st.integers(*INT32), st.sampled_from(INT32))
int64s = st.one_of(st.integers(-3, 5), st.integers(*INT64), st.sampled_from(INT64))
payloads = st.one_of(st.binary(max_size=64), st.sampled_from([4096, 4097, 100_000]).map(lambda n: b"\xab" * n))
keys = st.one_of(st.sampled_from(["", "a", "n", "k/1", "x" * 256, "x" * 257]), small_text, huge_text(1000, 100_000))
timeouts = st.one_of(
    st.none(),  # absent: wait forever
    st.sampled_from([0.0, -0.0, -1.0, math.nan, -math.nan, math.inf, -math.inf, 5e-324, 1e-300, 1e308]),
    st.floats(min_value=0.001, max_value=0.05),
)


def forever(timeout: float | None) -> bool:
    """Whether a wait with this timeout field is unbounded (absent, inf, ~1e308)."""
    return timeout is None or (timeout > 1e6 and not math.isnan(timeout))


def with_timeout(message, timeout):
    if timeout is not None:
        message.timeout = timeout
    return message


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


# -- one hypothesis test per RPC -------------------------------------------------------------


@st.composite
def register_requests(draw):
    devices = draw(int32s)
    threads = draw(
        st.lists(
            st.builds(
                lambda index, runtime: pb.ThreadSpec(thread_index=index, runtime_ordinal=runtime)
                if runtime is not None
                else pb.ThreadSpec(thread_index=index),
                int32s,
                st.none() | int32s,
            ),
            max_size=6,
        )
        | st.just([pb.ThreadSpec(thread_index=i) for i in range(5000)])
    )
    local_rank = draw(int32s)
    return pb.RegisterRequest(
        job=draw(jobs),
        incarnation=draw(incarnations),
        host=draw(texts),
        pid=draw(int64s),
        task_id=draw(int32s),
        num_tasks=draw(int32s),
        devices_per_task=devices,
        local_rank=local_rank,
        threads=threads,
        runtime_world_size=draw(int32s),
        client_version=draw(texts),
    )


@FUZZ
@given(request=register_requests())
def test_fuzz_register(server, request):
    """Register with random fields (150 examples): wrong/huge/unicode job, host and incarnation, negative and
    overflowing counts, random threads."""
    judge("Register", lambda t: server.stub.Register(request, timeout=t), may_wait_forever=False)
    server.check_health()


@FUZZ
@given(job=jobs, timeout=timeouts)
def test_fuzz_wait_world(server, job, timeout):
    """WaitWorld on random jobs with timeouts 0, negative, NaN, inf and tiny (150 examples)."""
    request = with_timeout(pb.WaitWorldRequest(job=job), timeout)
    judge("WaitWorld", lambda t: server.stub.WaitWorld(request, timeout=t), may_wait_forever=forever(timeout))
    server.check_health()


contributions = st.lists(
    st.builds(
        lambda ordinal, tag, payload: pb.Contribution(ordinal=ordinal, tag=tag, payload=payload),
        st.one_of(st.integers(-1, 2), int32s),
        st.one_of(st.sampled_from(["t", "u"]), texts),
        payloads,
    ),
    max_size=4,
)
replica_lists = st.one_of(
    st.lists(st.one_of(st.integers(-1, 2), int32s), max_size=6),
    st.just(list(range(5000))),
)


@FUZZ
@given(
    job=st.one_of(st.sampled_from([SOLO, DUO]), jobs),
    incarnation=incarnations,
    replicas=replica_lists,
    round_number=st.one_of(st.integers(0, 4), int64s),
    contributions=contributions,
    as_lists=st.booleans(),
    timeout=timeouts,
    generation=st.one_of(st.just(0), st.just(1), int64s),
)
def test_fuzz_rendezvous(server, job, incarnation, replicas, round_number, contributions, as_lists, timeout, generation):
    """Rendezvous with random contributions (as messages or as lists), replicas, rounds, generations and timeouts,
    right and wrong job and incarnation (150 examples)."""
    request = pb.RendezvousRequest(job=job, incarnation=incarnation, replicas=replicas, round=round_number, generation=generation)
    if as_lists and contributions:
        set_contribution_rows(request, [(c.ordinal, c.tag, c.payload, c.incarnation) for c in contributions])
    else:
        request.contributions.extend(contributions)
    request = with_timeout(request, timeout)
    judge("Rendezvous", lambda t: server.stub.Rendezvous(request, timeout=t), may_wait_forever=forever(timeout))
    server.check_health()


@FUZZ
@given(
    round_number=st.integers(0, 1000),
    ordinals=st.lists(st.one_of(st.integers(-1, 2), int32s), max_size=4),
    tags=st.lists(st.one_of(st.sampled_from(["t", "u"]), texts), max_size=4),
    payloads=st.lists(payloads, max_size=4),
    incarnations=st.lists(st.one_of(st.just(""), incarnations), max_size=4),
    messages=contributions,
)
def test_fuzz_rendezvous_contribution_lists(server, round_number, ordinals, tags, payloads, incarnations, messages):
    """Contribution lists of random, mismatched lengths, perhaps beside Contribution messages, in a world of one
    (150 examples)."""
    request = pb.RendezvousRequest(
        job=SOLO, incarnation=SOLO_INC, round=round_number, ordinals=ordinals, tags=tags, payloads=payloads,
        incarnations=incarnations, contributions=messages, timeout=5,
    )
    judge("Rendezvous", lambda t: server.stub.Rendezvous(request, timeout=t), may_wait_forever=False)
    server.check_health()


@FUZZ
@given(job=jobs, incarnation=incarnations)
def test_fuzz_heartbeat(server, job, incarnation):
    """Heartbeat from random jobs and incarnations (150 examples)."""
    request = pb.HeartbeatRequest(job=job, incarnation=incarnation)
    judge("Heartbeat", lambda t: server.stub.Heartbeat(request, timeout=t), may_wait_forever=False)
    server.check_health()


@FUZZ
@given(job=jobs, incarnation=incarnations)
def test_fuzz_watch(server, job, incarnation):
    """Watch from random jobs and incarnations: refused at once, or a stream that stays open (150 examples)."""
    request = pb.WatchRequest(job=job, incarnation=incarnation)
    # A valid watch streams until cancelled; we give up after FOREVER_TIMEOUT.
    judge("Watch", lambda t: list(server.stub.Watch(request, timeout=t)), may_wait_forever=True)
    server.check_health()


kv_entries = st.lists(st.builds(lambda k, v: pb.KvEntry(key=k, value=v), keys, payloads), max_size=4)


@FUZZ
@given(job=jobs, entries=kv_entries)
def test_fuzz_kv_set(server, job, entries):
    """KvSet with empty, huge and unicode keys and oversized values (150 examples)."""
    request = pb.KvSetRequest(job=job, entries=entries)
    judge("KvSet", lambda t: server.stub.KvSet(request, timeout=t), may_wait_forever=False)
    server.check_health()


@FUZZ
@given(job=jobs, keys_=st.lists(keys, max_size=4), wait=st.booleans(), timeout=timeouts)
def test_fuzz_kv_get(server, job, keys_, wait, timeout):
    """KvGet with bad keys, waiting or not, with every kind of timeout (150 examples)."""
    request = with_timeout(pb.KvGetRequest(job=job, keys=keys_, wait=wait), timeout)
    judge("KvGet", lambda t: server.stub.KvGet(request, timeout=t), may_wait_forever=wait and forever(timeout))
    server.check_health()


@FUZZ
@given(
    job=jobs,
    key=keys,
    delta=st.integers(-(2**63), 2**63 - 1),
    request_id=st.one_of(st.just(""), st.sampled_from(["r1", "r2"]), texts),
)
def test_fuzz_kv_add(server, job, key, delta, request_id):
    """KvAdd with bad keys, repeated request ids, and non-integer targets (150 examples)."""
    request = pb.KvAddRequest(job=job, key=key, delta=delta, request_id=request_id)
    judge("KvAdd", lambda t: server.stub.KvAdd(request, timeout=t), may_wait_forever=False)
    server.check_health()


@FUZZ
@given(job=jobs, key=keys, expected=payloads, desired=payloads, request_id=st.one_of(st.just(""), texts))
def test_fuzz_kv_compare_set(server, job, key, expected, desired, request_id):
    """KvCompareSet with bad keys and oversized values (150 examples)."""
    request = pb.KvCompareSetRequest(job=job, key=key, expected=expected, desired=desired, request_id=request_id)
    judge("KvCompareSet", lambda t: server.stub.KvCompareSet(request, timeout=t), may_wait_forever=False)
    server.check_health()


@FUZZ
@given(job=jobs, key=keys, value=payloads, request_id=st.one_of(st.just(""), texts))
def test_fuzz_kv_append(server, job, key, value, request_id):
    """KvAppend until values outgrow their limit, with bad keys (150 examples)."""
    request = pb.KvAppendRequest(job=job, key=key, value=value, request_id=request_id)
    judge("KvAppend", lambda t: server.stub.KvAppend(request, timeout=t), may_wait_forever=False)
    server.check_health()


@FUZZ
@given(job=jobs, key=keys)
def test_fuzz_kv_delete(server, job, key):
    """KvDelete with bad keys and jobs (150 examples)."""
    request = pb.KvDeleteRequest(job=job, key=key)
    judge("KvDelete", lambda t: server.stub.KvDelete(request, timeout=t), may_wait_forever=False)
    server.check_health()


@FUZZ
@given(job=jobs, prefix=keys, count_only=st.booleans())
def test_fuzz_kv_list(server, job, prefix, count_only):
    """KvList with any prefix, counting or listing (150 examples)."""
    request = pb.KvListRequest(job=job, prefix=prefix, count_only=count_only)
    judge("KvList", lambda t: server.stub.KvList(request, timeout=t), may_wait_forever=False)
    server.check_health()


@FUZZ
@given(job=st.one_of(st.just(""), jobs))
def test_fuzz_status(server, job):
    """Status of random jobs and of every job (150 examples)."""
    request = pb.StatusRequest(job=job)
    judge("Status", lambda t: server.stub.Status(request, timeout=t), may_wait_forever=False)
    server.check_health()


# The calls that end things (a process leaving, its replicas ending, a round given up) are
# sent as a process of a world of two made for the example (None), whose rounds wait, or as
# random jobs and incarnations; never as the fixture's processes, which the other tests need.
ENDERS = itertools.count()
enders = st.one_of(
    st.integers(0, 2**16).map(lambda _: None),  # (not st.none(): hypothesis draws one value once)
    st.tuples(jobs, st.one_of(st.just(""), texts, huge_text(20_000))),
)


def as_ender(server: Server, who) -> tuple[str, str]:
    if who is not None:
        return who
    job, incarnation = f"ender{next(ENDERS)}", uuid.uuid4().hex
    server.register(job, incarnation, num_tasks=2)
    return job, incarnation


@FUZZ
@given(who=enders)
def test_fuzz_leave(server, who):
    """Leave as a registered process or random ones (150 examples)."""
    job, incarnation = as_ender(server, who)
    request = pb.LeaveRequest(job=job, incarnation=incarnation)
    judge("Leave", lambda t: server.stub.Leave(request, timeout=t), may_wait_forever=False)
    server.check_health()


@FUZZ
@given(who=enders, ordinals=st.lists(int32s, max_size=6), reason=texts)
def test_fuzz_end_replicas(server, who, ordinals, reason):
    """EndReplicas with random ordinals and reasons (150 examples)."""
    job, incarnation = as_ender(server, who)
    request = pb.EndReplicasRequest(job=job, incarnation=incarnation, ordinals=ordinals, reason=reason)
    judge("EndReplicas", lambda t: server.stub.EndReplicas(request, timeout=t), may_wait_forever=False)
    server.check_health()


@FUZZ
@given(
    who=enders, generation=int64s, replicas=st.lists(int32s, max_size=6), round_number=int64s,
    ordinals=st.lists(int32s, max_size=6), reason=texts, tag=texts, job_id=st.one_of(st.just(""), texts),
)
def test_fuzz_give_up_round(server, who, generation, replicas, round_number, ordinals, reason, tag, job_id):
    """GiveUpRound of random rounds, generations and ordinals (150 examples)."""
    job, incarnation = as_ender(server, who)
    request = pb.GiveUpRoundRequest(
        job=job, incarnation=incarnation, generation=generation, replicas=replicas, round=round_number,
        ordinals=ordinals, reason=reason, tag=tag, job_id=job_id,
    )
    judge("GiveUpRound", lambda t: server.stub.GiveUpRound(request, timeout=t), may_wait_forever=False)
    server.check_health()


# -- random protobuf bodies ------------------------------------------------------------------

METHODS = pb.DESCRIPTOR.services_by_name["Coordinator"].methods
METHODS_BY_NAME = {method.name: method for method in METHODS}


def _raw(server: Server, method):
    path = f"/{method.containing_service.full_name}/{method.name}"
    identity = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    if method.server_streaming:
        stream = server.channel.unary_stream(path, **identity)
        return lambda body, t: list(stream(body, timeout=t))
    unary = server.channel.unary_unary(path, **identity)
    return lambda body, t: unary(body, timeout=t)


def _other_message(draw) -> bytes:
    """A well-formed message of another request type: valid bytes, wrong meaning."""
    message = draw(st.sampled_from([pb.RegisterRequest, pb.RendezvousRequest, pb.KvSetRequest, pb.KvAddRequest]))()
    for field in message.DESCRIPTOR.fields:
        if field.type == field.TYPE_STRING and not field.is_repeated:
            setattr(message, field.name, draw(small_text))
        elif field.type in (field.TYPE_INT32, field.TYPE_INT64) and not field.is_repeated:
            setattr(message, field.name, draw(st.integers(-5, 5)))
    return message.SerializeToString()


def may_hold(method, body: bytes) -> bool:
    """Whether the server may hold a call with this raw body for good: a stream, or a body that
    parses as a wait without a bound (a WaitWorld, Rendezvous or waiting KvGet without a
    timeout); anything else must be answered at once."""
    if method.server_streaming:
        return True
    request_type = getattr(pb, method.input_type.name)
    try:
        request = request_type.FromString(body)
    except DecodeError:
        return False
    if "timeout" not in request_type.DESCRIPTOR.fields_by_name or (method.name == "KvGet" and not request.wait):
        return False
    return forever(request.timeout if request.HasField("timeout") else None)


@st.composite
def bodies(draw):
    kind = draw(st.sampled_from(["random", "other-message", "bad-utf8", "truncated"]))
    if kind == "random":
        return draw(st.binary(max_size=256))
    if kind == "other-message":
        return _other_message(draw)
    if kind == "bad-utf8":  # field 1 (a string in every request) holding invalid UTF-8
        junk = draw(st.sampled_from([b"\xc3\x28", b"\xff", b"\xed\xa0\x80", b"\xe2\x82"]))
        return b"\x0a" + bytes([len(junk)]) + junk
    valid = _other_message(draw)
    return valid[: draw(st.integers(0, max(0, len(valid) - 1)))] + draw(st.sampled_from([b"", b"\x0a\xff\x01"]))


@FUZZ
@given(method=st.sampled_from(list(METHODS)), body=bodies())
def test_fuzz_random_protobuf_bodies(server, method, body):
    """Random bytes, other messages, invalid UTF-8 and truncated messages as the body of every RPC (150 examples): the
    server answers each with a status and keeps serving."""
    SENT["raw-body"] += 1
    judge(method.name, lambda t: _raw(server, method)(body, t), may_wait_forever=may_hold(method, body))
    server.check_health()


def session_calls():
    """1-8 calls of any method name (unknown and streaming ones too) with a random body."""
    return st.lists(
        st.tuples(st.sampled_from([m.name for m in METHODS] + ["", "Nope", "Session", "Watch"]), bodies()),
        min_size=1,
        max_size=8,
    )


@FUZZ
@given(calls=session_calls())
def test_fuzz_session_calls(server, calls):
    """Batches of calls with any method name and a random body on one Session stream (150 examples): every call that
    answers at once gets OK, a documented status or UNIMPLEMENTED (unknown or streaming methods), never UNKNOWN; calls
    still waiting are cancelled; the stream and the server keep working."""
    requests: queue.SimpleQueue = queue.SimpleQueue()
    batch = [pb.SessionCall(id=i + 1, method=name, request=body) for i, (name, body) in enumerate(calls)]
    requests.put(pb.SessionRequest(calls=batch))
    responses = server.stub.Session(iter(requests.get, None), timeout=30)
    answered: dict[int, pb.SessionAnswer] = {}
    started = time.monotonic()
    ready = threading.Event()

    def read() -> None:
        try:
            for response in responses:
                answered.update((a.id, a) for a in response.answers)
        except grpc.RpcError:
            pass
        ready.set()

    reader = threading.Thread(target=read)
    reader.start()
    while not settled(batch, answered, started):
        time.sleep(0.01)
    requests.put(pb.SessionRequest(calls=[pb.SessionCall(id=c.id, cancel=True) for c in batch if c.id not in answered]))
    requests.put(None)  # half-close: the server ends the stream once it answered
    assert ready.wait(30), "the session did not end after the client finished sending"
    reader.join()
    assert responses.code() == grpc.StatusCode.OK, responses.details()
    judge_session("session", batch, answered)
    server.check_health()


def may_hold_call(call: pb.SessionCall) -> bool:
    """Whether the server may hold a session call for good (a ping, an unknown or streaming
    method is answered at once)."""
    method = METHODS_BY_NAME.get(call.method)
    return method is not None and not method.server_streaming and may_hold(method, call.request)


def settled(batch: list[pb.SessionCall], answered: dict[int, pb.SessionAnswer], started: float) -> bool:
    """Whether to stop reading a batch's answers: all in, or those that must come at once in
    and the others given FOREVER_TIMEOUT (or CALL_TIMEOUT gone by: judge_session names the
    calls left unanswered)."""
    waited = time.monotonic() - started
    if len(answered) == len(batch) or waited > CALL_TIMEOUT:
        return True
    return waited > FOREVER_TIMEOUT and all(c.id in answered for c in batch if not may_hold_call(c))


def judge_session(where: str, batch: list[pb.SessionCall], answered: dict[int, pb.SessionAnswer]) -> None:
    """Every call that cannot wait was answered, and every answer is OK, a documented status or
    UNIMPLEMENTED, with a message."""
    for call in batch:
        SENT[f"{where}:{call.method or '(empty)'}"] += 1
        answer = answered.get(call.id)
        if answer is None:  # a wait that never ends (a blocking get, a round of two), cancelled
            assert may_hold_call(call), f"{call.method or 'a ping'} was not answered on a {where} within {CALL_TIMEOUT} s"
            continue
        code = {s.value[0]: s for s in grpc.StatusCode}[answer.code]
        CODES[code.name] += 1
        if code != grpc.StatusCode.OK:
            assert answer.message.strip()
            allowed = DOCUMENTED | {grpc.StatusCode.UNIMPLEMENTED}
            assert code in allowed, f"{call.method} answered {code.name} on a {where}: {answer.message!r}"


@FUZZ
@given(calls=session_calls(), cuts=st.lists(st.integers(min_value=1, max_value=200), max_size=4))
def test_fuzz_session_port_calls(server, calls, cuts):
    """The same kind of batches on the session port, their bytes sent in random pieces (150
    examples), judged as on the gRPC stream (a call without a method is a ping: OK); calls
    still waiting are cancelled, and the connection and the server keep working."""
    batch = [pb.SessionCall(id=i + 1, method=name, request=body) for i, (name, body) in enumerate(calls)]
    data = frame(pb.SessionHello().SerializeToString()) + frame(pb.SessionRequest(calls=batch).SerializeToString())
    answered: dict[int, pb.SessionAnswer] = {}
    with socket.create_connection(("127.0.0.1", server.coordinator.session_port), timeout=5) as sock:
        start = 0
        for cut in sorted(cuts) + [len(data)]:
            sock.sendall(data[start:cut])
            start = max(start, cut)
        sock.settimeout(0.02)
        received = b""
        started = time.monotonic()
        while not settled(batch, answered, started):
            try:
                chunk = sock.recv(1 << 16)
            except socket.timeout:
                continue
            assert chunk, "the session port closed a connection that sent only well-formed messages"
            received += chunk
            while len(received) >= FRAME.size and len(received) >= FRAME.size + FRAME.unpack_from(received)[0]:
                end = FRAME.size + FRAME.unpack_from(received)[0]
                answers = pb.SessionResponse.FromString(received[FRAME.size : end]).answers
                assert all(a.id != 0 for a in answers), [a.message for a in answers]
                answered.update((a.id, a) for a in answers)
                received = received[end:]
        cancels = [pb.SessionCall(id=c.id, cancel=True) for c in batch if c.id not in answered]
        sock.sendall(frame(pb.SessionRequest(calls=cancels).SerializeToString()))
    judge_session("session port", batch, answered)
    server.check_health()


# -- random bytes on the wire ----------------------------------------------------------------

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _send_raw(address: str, data: bytes, *, linger: float = 0.2) -> None:
    host, port = address.rsplit(":", 1)
    SENT["tcp"] += 1
    with socket.create_connection((host, int(port)), timeout=2) as sock:
        try:
            sock.sendall(data)
            sock.settimeout(linger)
            while sock.recv(65536):  # drain whatever the server says until it closes
                pass
        except (socket.timeout, ConnectionError, OSError):
            pass


@settings(max_examples=WIRE_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(
        st.binary(min_size=1, max_size=4096),
        st.binary(max_size=512).map(lambda b: PREFACE + b),  # a valid preface, then garbage
        st.integers(0, len(PREFACE) - 1).map(lambda n: PREFACE[:n]),  # a truncated preface
        st.tuples(st.integers(0, 9), st.integers(0, 255), st.integers(0, 2**31 - 1), st.binary(max_size=64)).map(
            lambda f: PREFACE + _frame(0x4, 0, 0, b"") + _frame(*f)  # settings, then a random frame
        ),
    )
)
def test_random_bytes_on_the_wire(server, data):
    """Random bytes, truncated HTTP/2 prefaces and random frames on raw TCP connections (60 examples): the server keeps
    serving."""
    _send_raw(server.address, data, linger=0.05)
    server.check_health()


def test_half_open_connections_do_not_starve_real_calls(server):
    """Fifty connections that stop mid-preface, plus HTTP/1.1 and TLS hellos, while a real client works."""
    host, port = server.address.rsplit(":", 1)
    idle = []
    try:
        for i in range(50):
            sock = socket.create_connection((host, int(port)), timeout=2)
            sock.sendall(PREFACE[: i % len(PREFACE)])
            idle.append(sock)
        SENT["tcp"] += len(idle)
        _send_raw(server.address, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        _send_raw(server.address, bytes.fromhex("16030100a5010000a10303") + os.urandom(160))  # a TLS ClientHello
        _send_raw(server.address, PREFACE + _frame(0x4, 0, 0, b"") + _frame(0x1, 0x5, 1, os.urandom(40)))  # bad HPACK
        _send_raw(server.address, PREFACE + _frame(0x0, 0x1, 1, b"\x00" * 20))  # DATA on a stream never opened
        _send_raw(server.address, PREFACE + _frame(0x4, 0, 0, b"\x00\x04\xff\xff\xff\xff"))  # window too large
        started = time.monotonic()
        server.probe()
        assert time.monotonic() - started < 5
    finally:
        for sock in idle:
            sock.close()
    server.probe()


def test_batches_leave_a_working_server(server):
    """After all the fuzzing a fresh world of one still meets itself and KV still works."""
    server.probe()


# -- bugs found by this fuzz: minimal repros ---------------------------------------------------


@pytest.fixture
def fresh():
    """A separate coordinator for repros that leave the server in a broken state."""
    with Coordinator(port=0) as coordinator:
        channel = grpc.insecure_channel(coordinator.address)
        yield pb_grpc.CoordinatorStub(channel), channel
        channel.close()


def _code(call) -> tuple[str, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""
    return "OK", ""


def test_local_rank_overflow_poisons_status(fresh):
    """A registration whose local ordinal does not fit int32 is refused (INVALID_ARGUMENT) and Status keeps working."""
    stub, _ = fresh
    request = pb.RegisterRequest(
        job="j", incarnation="i", host="h", num_tasks=1, devices_per_task=2, local_rank=2**31 - 1,
        threads=[pb.ThreadSpec(thread_index=1)],
    )
    assert _code(lambda: stub.Register(request, timeout=5))[0] == "INVALID_ARGUMENT"
    assert _code(lambda: stub.Status(pb.StatusRequest(), timeout=5)) == ("OK", "")


def test_kv_add_overflow_answers_unknown_and_corrupts_the_counter(fresh):
    """An add that would leave int64 is refused with a documented status and leaves the value unchanged."""
    stub, _ = fresh
    stub.KvAdd(pb.KvAddRequest(job="j", key="n", delta=2**63 - 1), timeout=5)
    code, _ = _code(lambda: stub.KvAdd(pb.KvAddRequest(job="j", key="n", delta=2**63 - 1), timeout=5))
    (value,) = stub.KvGet(pb.KvGetRequest(job="j", keys=["n"]), timeout=5).values
    assert code in {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION"}, code
    assert value.value == b"%d" % (2**63 - 1)


def test_long_echoed_input_replaces_the_message_with_a_transport_error(fresh):
    """A wait on twenty long (but legal) keys times out with the server's DEADLINE_EXCEEDED message; a huge unknown job
    gets NOT_FOUND."""
    stub, _ = fresh
    keys = [f"{i}-" + "k" * 4000 for i in range(20)]
    code, details = _code(lambda: stub.KvGet(pb.KvGetRequest(job="j", keys=keys, wait=True, timeout=0.01), timeout=5))
    assert code == "DEADLINE_EXCEEDED" and "still not set" in details, (code, details)
    code, details = _code(lambda: stub.Heartbeat(pb.HeartbeatRequest(job="x" * 20_000, incarnation="i"), timeout=5))
    assert code == "NOT_FOUND", (code, details)


def test_unparseable_request_answers_unknown(fresh):
    """Corrupt protobuf and invalid UTF-8 in a string field are INVALID_ARGUMENT."""
    _, channel = fresh
    kv_set = channel.unary_unary(
        "/pjrt_rendezvous.v1.Coordinator/KvSet", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    assert _code(lambda: kv_set(b"\xff\xff\xff\xff", timeout=5))[0] == "INVALID_ARGUMENT"
    assert _code(lambda: kv_set(b"\x0a\x02\xc3\x28", timeout=5))[0] == "INVALID_ARGUMENT"


def test_long_wait_cycle_hits_the_recursion_limit(fresh):
    """A ring of 1200 pair rounds (each ordinal first calls its right neighbour's pair) is reported as a deadlock."""
    stub, _ = fresh
    n = 1200
    stub.Register(
        pb.RegisterRequest(
            job="ring", incarnation="i", host="h", num_tasks=1, devices_per_task=n,
            threads=[pb.ThreadSpec(thread_index=t) for t in range(n)],
        ),
        timeout=10,
    )

    def pair_round(ordinal, replicas, tag, timeout):
        request = pb.RendezvousRequest(
            job="ring", incarnation="i", replicas=replicas, timeout=timeout,
            contributions=[pb.Contribution(ordinal=ordinal, tag=tag)],
        )
        return stub.Rendezvous.future(request, timeout=timeout + 5)

    waiting = [pair_round(i, [i, i + 1], "right", 20) for i in range(n - 1)]
    deadline = time.monotonic() + 20
    while len(stub.Status(pb.StatusRequest(job="ring"), timeout=5).jobs[0].pending_rounds) < n - 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        closing = pair_round(n - 1, [0, n - 1], "wrap", 3)
        for call in (closing, waiting[0]):  # the closer and a member far down the chain
            code, details = _code(lambda: call.result(timeout=10))
            # The cycle's message would be ~100 KB: the server clips it to fit a gRPC trailer.
            assert code == "FAILED_PRECONDITION" and "more characters)" in details, (code, details[:200])
    finally:
        for call in waiting:
            call.cancel()
