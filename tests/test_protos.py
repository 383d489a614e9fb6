"""The committed stubs match the .proto, and the protocol keeps its versioned package."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pjrt_rendezvous.client._wire import contribution_rows, set_contribution_rows
from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _generate_module():
    spec = importlib.util.spec_from_file_location("generate_protos", ROOT / "protos" / "pjrt_rendezvous" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_fresh(tmp_path):
    """Regenerating the stubs from the .proto gives exactly the committed files (run protos/pjrt_rendezvous/generate.py, or make protos, if not)."""
    pytest.importorskip("grpc_tools")
    generate = _generate_module()
    written = generate.generate(tmp_path)
    assert {p.name for p in written} == {"coordinator_pb2.py", "coordinator_pb2.pyi", "coordinator_pb2_grpc.py"}
    for path in written:
        committed = ROOT / "protos" / "v1" / path.name
        assert committed.read_bytes() == path.read_bytes(), (
            f"protos/v1/{path.name} is stale: run `python protos/pjrt_rendezvous/generate.py` and commit the result"
        )


def test_protocol_package_is_versioned():
    """The wire package is pjrt_rendezvous.v1, whatever the Python import path."""
    from pjrt_rendezvous.protos.v1 import coordinator_pb2

    assert coordinator_pb2.DESCRIPTOR.package == "pjrt_rendezvous.v1"
    assert "Coordinator" in coordinator_pb2.DESCRIPTOR.services_by_name


@pytest.mark.parametrize("sizes", [[], [0], [1], [127, 128], [300, 0, 16383, 16384], [2**21 - 9, 2**21 + 5]])
@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_hand_encoded_session_responses_parse_as_protobuf_would(sizes, native):
    """The servicer writes SessionResponse bytes by hand (one copy of a shared response per
    caller); they must parse to exactly the message protobuf would have built, natively
    encoded or not."""
    from pjrt_rendezvous.client._session import encode_answers_in_python, take_frames

    if native:
        encode = pytest.importorskip("pjrt_rendezvous.client._native", reason="built without a C compiler").encode_answers
    else:
        encode = encode_answers_in_python

    answers = [
        pb.SessionAnswer(id=2**40 + i, response=bytes([i % 251]) * n) if n else pb.SessionAnswer(id=i, code=4, message="late")
        for i, n in enumerate(sizes)
    ]
    pairs = []
    for a in answers:
        head = pb.SessionAnswer(id=a.id, code=a.code, message=a.message).SerializeToString()
        pairs.append((head, a.response))
    assert pb.SessionResponse.FromString(encode(pairs, False)) == pb.SessionResponse(answers=answers)
    assert encode(pairs, False) == encode_answers_in_python(pairs, False)
    assert take_frames(bytearray(encode(pairs, True))) == [encode(pairs, False)]


@pytest.mark.parametrize("call_id", [0, 1, 127, 128, 300, 2**14 - 1, 2**14, 2**21 - 1, 2**21, 2**40, 2**64 - 1])
def test_hand_encoded_session_answers_are_protobufs_bytes(call_id):
    """An OK answer's head is written by hand too: byte for byte what protobuf writes."""
    from pjrt_rendezvous.client._session import session_answer

    assert session_answer(call_id, response=b"r") == (pb.SessionAnswer(id=call_id).SerializeToString(), b"r")


@pytest.mark.parametrize(
    "call",
    [
        dict(id=1, method="Rendezvous", request=b"\x0a\x03job" * 50),
        dict(id=2**40, method="KvGet", request=b""),
        dict(id=300, cancel=True),
        dict(id=2**14, method="KvSet", request=bytes(2**14 - 20)),
        dict(id=2**21 - 1, method="KvSet", request=bytes(2**21)),
        dict(id=5),  # a ping
        dict(id=7, method="Rendezvous", request=bytes(70_000)),
    ],
)
def test_hand_encoded_session_requests_are_protobufs_bytes(call):
    """Clients write their SessionRequest by hand: byte for byte what protobuf writes."""
    from pjrt_rendezvous.client._session import session_request, take_frames

    expected = pb.SessionRequest(calls=[pb.SessionCall(**call)]).SerializeToString()
    args = (call["id"], call.get("method", ""), call.get("request", b""), call.get("cancel", False))
    assert session_request(*args) == expected
    assert take_frames(bytearray(session_request(*args, framed=True))) == [expected]


rows = st.lists(
    st.tuples(
        st.integers(-(2**31), 2**31 - 1),
        st.sampled_from(["", "t", "tag", "ü"]),
        st.sampled_from([b"", b"p", b"\x00" * 3]),
        st.sampled_from(["", "inc-a", "inc-b"]),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(rows=rows, index_processes=st.booleans())
def test_contributions_as_lists_read_back_as_written_and_as_messages_would(rows, index_processes):
    """Rows written as parallel lists (each as short as the form allows; incarnations named,
    or each process named once and indexed) read back the same, after a trip through the
    wire, and the same as from Contribution messages."""
    request = pb.RendezvousRequest()
    set_contribution_rows(request, rows, index_processes=index_processes)
    request = pb.RendezvousRequest.FromString(request.SerializeToString())
    assert contribution_rows(request) == rows
    assert len(request.tags) == (1 if len({r[1] for r in rows}) == 1 else len(rows))
    names = {r[3] for r in rows}
    if index_processes and names != {""}:
        assert not request.incarnations and sorted(request.processes) == sorted(names)
    as_messages = pb.RendezvousRequest(
        contributions=[pb.Contribution(ordinal=o, tag=t, payload=p, incarnation=i) for o, t, p, i in rows]
    )
    assert contribution_rows(as_messages) == rows


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(ordinals=[1, 2], tags=["a", "b", "c"]), "3 tags for 2 ordinals: give one for all or one per ordinal"),
        (dict(ordinals=[1, 2]), "0 tags for 2 ordinals"),
        (dict(ordinals=[1, 2], tags=["a"], payloads=[b""]), "1 payloads for 2 ordinals: give none or one per ordinal"),
        (dict(ordinals=[1], tags=["a"], incarnations=["x", "y"]), "2 incarnations for 1 ordinals"),
        (dict(tags=["a"]), "tags, payloads or incarnations without ordinals"),
        (dict(ordinals=[1], tags=["a"], contributions=[pb.Contribution(ordinal=1)]), "send one form"),
        (dict(ordinals=[1], tags=["a"], incarnations=["x"], processes=["x"], process_indexes=[0]), "send one form"),
        (dict(ordinals=[1, 2], tags=["a"], processes=["x"], process_indexes=[0]), "1 process indexes for 2 ordinals"),
        (dict(ordinals=[1], tags=["a"], processes=["x"], process_indexes=[1]), "a process index past the 1 processes"),
    ],
)
def test_malformed_contribution_lists_are_named(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        contribution_rows(pb.RendezvousRequest(**fields))
