"""The native path (client/_native.c) against protobuf: what it decodes (a RendezvousRequest,
a SessionRequest's calls) it decodes as protobuf does, and it never takes what protobuf
refuses. Its encoder of session answers is checked in test_protos.py."""

from __future__ import annotations

import math
import shutil
import struct
import types

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from pjrt_rendezvous.client import _wire
from pjrt_rendezvous.client._session import (
    NATIVE_INTERFACE,
    Malformed,
    decode_answers_in_python,
    decode_session_calls_in_python,
    native_if_current,
    session_request,
)
from pjrt_rendezvous.client._wire import (
    decode_rendezvous_in_python,
    decode_payloads_in_python,
    decode_rendezvous,
    encode_payloads_in_python,
    encode_rendezvous_in_python,
    set_contribution_rows,
)
from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

native = pytest.importorskip("pjrt_rendezvous.client._native", reason="built without a C compiler")

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
TEXT = st.text(max_size=12)


def test_the_native_path_is_built_where_a_compiler_is():
    """pyproject.toml builds it optionally: a compiler at hand and no module means the build
    broke, and every coordinator here would silently take the slow path."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    assert _wire._native is native


def test_a_module_built_from_another_version_of_the_file_is_not_used(caplog):
    """An editable install keeps the module built before a checkout changed _native.c:
    one whose functions take other arguments made every round fail with a bare TypeError
    ("function takes exactly 8 arguments (7 given)"). Such a module is set aside with a
    warning naming it and what to do; the Python path runs instead."""
    assert native.INTERFACE == NATIVE_INTERFACE
    assert native_if_current(native) is native
    for stale in (types.SimpleNamespace(__file__="/x/_native.so"), types.SimpleNamespace(__file__="/x/_native.so", INTERFACE=99)):
        caplog.clear()
        assert native_if_current(stale) is None
        (record,) = caplog.records
        assert record.levelname == "WARNING"
        assert "/x/_native.so was built from another version of client/_native.c (interface" in record.getMessage()
        assert "reinstall the package (pip install -e .)" in record.getMessage()


def same(a, b) -> bool:
    """Equal tuples, with NaN timeouts equal."""
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 7:
        if isinstance(a[4], float) and isinstance(b[4], float) and math.isnan(a[4]) and math.isnan(b[4]):
            return a[:4] + a[5:] == b[:4] + b[5:]
    return a == b


def damage(data: bytes, cut: int, flips: list[tuple[int, int]], tail: bytes) -> bytes:
    damaged = bytearray(data)
    for at, value in flips:
        if damaged:
            damaged[at % len(damaged)] = value
    return bytes(damaged[: cut % (len(damaged) + 1)]) + tail


DAMAGE = dict(cut=st.integers(0, 200), flips=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=3), tail=st.binary(max_size=8))

@st.composite
def requests(draw) -> pb.RendezvousRequest:
    """Well-formed requests in the parallel-lists form, every shape the lists allow."""
    n = draw(st.integers(1, 20))
    request = pb.RendezvousRequest(
        job=draw(TEXT),
        incarnation=draw(TEXT),
        replicas=draw(st.lists(INT32, max_size=5)),
        round=draw(INT64),
        generation=draw(INT64),
    )
    if draw(st.booleans()):
        request.timeout = draw(st.floats(allow_nan=True, allow_infinity=True))
    names = draw(st.lists(TEXT, min_size=1, max_size=3))
    rows = [
        (draw(INT32), draw(st.sampled_from(["t", draw(TEXT)])), draw(st.binary(max_size=8)), draw(st.sampled_from(names)))
        for _ in range(n)
    ]
    set_contribution_rows(request, rows, index_processes=draw(st.booleans()))
    return request


@settings(max_examples=400, deadline=None)
@given(request=requests())
def test_well_formed_requests_decode_as_protobuf_decodes_them(request):
    data = request.SerializeToString()
    decoded = native.decode_rendezvous(data)
    assert decoded is not None
    assert same(decoded, decode_rendezvous_in_python(data))
    assert same(decode_rendezvous(data), decoded)


@settings(max_examples=1500, deadline=None)
@given(request=requests(), **DAMAGE)
def test_damaged_requests_are_never_taken_where_protobuf_refuses_them(request, cut, flips, tail):
    data = damage(request.SerializeToString(), cut, flips, tail)
    decoded = native.decode_rendezvous(data)
    reference = decode_rendezvous_in_python(data)
    if decoded is not None:  # else left to protobuf, which decodes it or names what is wrong
        assert not isinstance(reference, Malformed), reference.message
        assert same(decoded, reference)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=64))
def test_random_bytes_are_never_taken_where_protobuf_refuses_them(data):
    decoded = native.decode_rendezvous(data)
    reference = decode_rendezvous_in_python(data)
    assert decoded is None or (not isinstance(reference, Malformed) and same(decoded, reference))


def field(number: int, wire_type: int, body: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + body


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out) + bytes((value,))


def _length_delimited(body: bytes) -> bytes:
    return _varint(len(body)) + body


BASE = pb.RendezvousRequest(job="j", incarnation="i", round=3, ordinals=[0, 1], tags=["t"]).SerializeToString()


@pytest.mark.parametrize(
    "extra",
    [
        field(99, 0, _varint(2**40)),  # unknown fields of every wire type are skipped
        field(99, 1, b"\0" * 8),
        field(99, 2, _length_delimited(b"abc")),
        field(99, 5, b"\0" * 4),
        field(8, 0, _varint(7)),  # a packed field's values given one by one are added
        field(8, 2, _length_delimited(_varint(5) + _varint(2**64 - 3))),  # negative int32 as ten bytes
        field(4, 0, _varint(9)),  # a scalar given again: the last one counts (a string: left to protobuf)
        field(4, 0, _varint(2**64 - 1)),  # round -1
        field(6, 1, struct.pack("<d", 2.5)),
    ],
)
def test_what_protobuf_allows_is_decoded_alike(extra):
    data = BASE + extra
    decoded = native.decode_rendezvous(data)
    assert decoded is not None
    assert same(decoded, decode_rendezvous_in_python(data))


@pytest.mark.parametrize(
    "data, why",
    [
        (BASE + field(5, 2, _length_delimited(b"")), "the Contribution-message form"),
        (pb.RendezvousRequest(job="j", contributions=[pb.Contribution(ordinal=1, tag="t")]).SerializeToString(), "the Contribution-message form"),
        (BASE + field(1, 2, _length_delimited(b"\xff")), "a job that is not UTF-8"),
        (BASE + field(9, 2, _length_delimited(b"\xc3")), "a tag that is not UTF-8"),
        (BASE + field(4, 2, _length_delimited(b"")), "a known field with another wire type"),
        (BASE + field(99, 3, b""), "a group"),
        (BASE + b"\x00", "field number 0"),
        (BASE + field(1, 2, _varint(5) + b"ab"), "a length past the end"),
        (BASE + b"\x80", "a varint cut off"),
        (BASE + field(99, 0, b"\xff" * 10 + b"\x01"), "a varint of eleven bytes"),
        (pb.RendezvousRequest(job="j", ordinals=[0, 1], tags=["a", "b", "c"]).SerializeToString(), "three tags for two ordinals"),
        (pb.RendezvousRequest(job="j", ordinals=[0, 1], tags=["a"], payloads=[b"x"]).SerializeToString(), "one payload for two ordinals"),
        (pb.RendezvousRequest(job="j", ordinals=[0], tags=["a"], processes=["p"], process_indexes=[1]).SerializeToString(), "a process index past the processes"),
        (pb.RendezvousRequest(job="j", ordinals=[0], tags=["a"], incarnations=["p"], process_indexes=[0]).SerializeToString(), "both forms of incarnations"),
        (pb.RendezvousRequest(job="j").SerializeToString(), "no contributions"),
        # (these two were taken, where protobuf refuses them: the native review)
        (field(1, 2, _length_delimited(b"\xff")) + BASE, "a job given twice, its first copy not UTF-8"),
        (b"\xc0\x80\x80\x80\x80\x00\x07" + BASE, "a key of six bytes"),
        # (these three too: a fuzzer under sanitizers)
        (bytes.fromhex("0a8180808080006a4201074a0174"), "a string's length in six bytes"),
        (bytes.fromhex("0a016a42818080808000074a0174"), "a packed field's length in six bytes"),
        (bytes.fromhex("0a016a4201074a0174fa0680808080808080808002"), "an unknown field's length wrapping to 0"),
    ],
)
def test_what_it_does_not_take_is_left_to_protobuf(data, why):
    assert native.decode_rendezvous(data) is None, why


def test_session_messages_protobuf_refuses_are_left_to_it():
    """A string given twice with a first copy that is not UTF-8, an overlong key (the native
    review) and a length written in more than five bytes (a fuzzer) were taken by the native
    decoders, where protobuf refuses them."""
    twice = bytes([0x0a, 8, 0x12, 1, 0xff, 0x12, 1, 0x4d, 0x08, 1])  # a SessionCall's method twice
    overlong = bytes([0x8a, 0x80, 0x80, 0x80, 0x80, 0x00, 4, 0x12, 2, 0x4d, 0x4d])  # field 1 with a six-byte key
    answer_twice = bytes([0x0a, 6, 0x1a, 1, 0xff, 0x1a, 1, 0x4d])  # a SessionAnswer's message twice
    for data, decode, message in (
        (twice, native.decode_session_calls, pb.SessionRequest),
        (overlong, native.decode_session_calls, pb.SessionRequest),
        (answer_twice, native.decode_answers, pb.SessionResponse),
        (field(1, 2, _length_delimited(b"\xff")) + BASE, native.decode_rendezvous, pb.RendezvousRequest),
        (b"\xc0\x80\x80\x80\x80\x00\x07" + BASE, native.decode_rendezvous, pb.RendezvousRequest),
        # (lengths in six to ten bytes, taken by every decoder: a fuzzer under sanitizers)
        (bytes.fromhex("0a83808080800012014d"), native.decode_session_calls, pb.SessionRequest),
        (bytes.fromhex("0a08128180808080004d"), native.decode_session_calls, pb.SessionRequest),
        (bytes.fromhex("8a01808080808000"), native.decode_session_calls, pb.SessionRequest),
        (bytes.fromhex("0a081a8180808080004d"), native.decode_answers, pb.SessionResponse),
        (bytes.fromhex("0a000a000a000a000a000a000a808080808080808080000a00"), native.decode_payloads, pb.RendezvousResponse),
    ):
        with pytest.raises(DecodeError):
            message.FromString(data)
        assert decode(data) is None, data


@st.composite
def session_requests(draw) -> bytes:
    calls = draw(st.lists(st.builds(
        pb.SessionCall, id=st.integers(0, 2**64 - 1), method=TEXT, request=st.binary(max_size=16), cancel=st.booleans(),
    ), max_size=4))
    return pb.SessionRequest(calls=calls).SerializeToString()


@settings(max_examples=300, deadline=None)
@given(data=session_requests())
def test_session_calls_decode_as_protobuf_decodes_them(data):
    decoded = native.decode_session_calls(data)
    assert decoded is not None
    assert decoded == decode_session_calls_in_python(data)


@settings(max_examples=1000, deadline=None)
@given(data=session_requests(), **DAMAGE)
def test_damaged_session_calls_are_never_taken_where_protobuf_refuses_them(data, cut, flips, tail):
    damaged = damage(data, cut, flips, tail)
    decoded = native.decode_session_calls(damaged)
    reference = decode_session_calls_in_python(damaged)
    if decoded is not None:  # else left to protobuf
        assert not isinstance(reference, Malformed), reference.message
        assert decoded == reference


answers = st.builds(
    lambda answers: pb.SessionResponse(answers=answers).SerializeToString(),
    st.lists(st.builds(pb.SessionAnswer, id=st.integers(0, 2**64 - 1), code=INT32, message=TEXT, response=st.binary(max_size=16)), max_size=4),
)
payloads = st.builds(lambda p: pb.RendezvousResponse(payloads=p).SerializeToString(), st.lists(st.binary(max_size=16), max_size=6))


def protobuf_or_refusal(decode, data):
    try:
        return decode(data)
    except DecodeError:
        return None


@settings(max_examples=600, deadline=None)
@given(data=st.one_of(answers, payloads), **DAMAGE)
def test_answers_and_payloads_decode_as_protobuf_decodes_them_or_are_left_to_it(data, cut, flips, tail):
    """The caller's end: a session's answers and a round's payloads, whole and damaged."""
    for natively, in_python in [(native.decode_answers, decode_answers_in_python), (native.decode_payloads, decode_payloads_in_python)]:
        for message in (data, damage(data, cut, flips, tail)):
            decoded = natively(message)
            if decoded is not None:
                assert decoded == protobuf_or_refusal(in_python, message)


@settings(max_examples=200, deadline=None)
@given(data=answers)
def test_whole_answers_are_taken_natively(data):
    assert native.decode_answers(data) == decode_answers_in_python(data)


@settings(max_examples=200, deadline=None)
@given(data=payloads)
def test_whole_payloads_are_taken_natively(data):
    assert native.decode_payloads(data) == decode_payloads_in_python(data)


@settings(max_examples=300, deadline=None)
@given(call_id=st.integers(0, 2**64 - 1), method=TEXT, request=st.binary(max_size=300), cancel=st.booleans(), framed=st.booleans())
def test_calls_encode_as_session_request_encodes_them(call_id, method, request, cancel, framed):
    assert native.encode_call(call_id, method, request, cancel, framed) == session_request(call_id, method, request, cancel, framed=framed)


@settings(max_examples=200, deadline=None)
@given(payloads=st.lists(st.binary(max_size=300), max_size=6))
def test_payloads_encode_as_protobuf_encodes_them(payloads):
    assert native.encode_payloads(payloads) == encode_payloads_in_python(payloads)


@settings(max_examples=400, deadline=None)
@given(
    job=TEXT, incarnation=TEXT, replicas=st.lists(INT32, max_size=4), round_number=INT64,
    timeout=st.none() | st.floats(allow_nan=False), generation=INT64,
    rows=st.lists(st.tuples(INT32, st.sampled_from(["t", "u", ""]), st.sampled_from([b"", b"x", b"\0" * 200]), st.sampled_from(["", "p", "q\u00e9"])), min_size=1, max_size=12),
)
def test_requests_encode_as_protobuf_encodes_them(job, incarnation, replicas, round_number, timeout, generation, rows):
    args = (job, incarnation, replicas, round_number, timeout, generation, rows)
    assert native.encode_rendezvous(*args) == encode_rendezvous_in_python(*args)


def test_an_unknown_field_numbered_past_31_does_not_count_as_a_known_one():
    """A SessionCall's or SessionAnswer's unknown field 34 set the bit of field 2 (a shift by
    34 of a 32-bit int: undefined, and taken modulo 32 on x86), so the method (or message)
    that followed was taken for a second one and the message left to protobuf (UBSan)."""
    call = bytes.fromhex("0a0692020012014d")  # field 34, then the method 'M'
    answer = bytes.fromhex("0a069a02001a014d")  # field 35, then the message 'M'
    assert native.decode_session_calls(call) == [(0, "M", b"", False)]
    assert [(c.id, c.method) for c in pb.SessionRequest.FromString(call).calls] == [(0, "M")]
    assert native.decode_answers(answer) == [(0, 0, "M", b"")]
