"""The committed stubs match the .proto, and the protocol keeps its versioned package."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _generate_module():
    spec = importlib.util.spec_from_file_location("generate_protos", ROOT / "protos" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_fresh(tmp_path):
    """Regenerating the stubs from the .proto gives exactly the committed files (run protos/generate.py if not)."""
    pytest.importorskip("grpc_tools")
    generate = _generate_module()
    written = generate.generate(tmp_path)
    assert {p.name for p in written} == {"coordinator_pb2.py", "coordinator_pb2.pyi", "coordinator_pb2_grpc.py"}
    for path in written:
        committed = ROOT / "protos" / "v1" / path.name
        assert committed.read_bytes() == path.read_bytes(), (
            f"protos/v1/{path.name} is stale: run `python protos/generate.py` and commit the result"
        )


def test_protocol_package_is_versioned():
    """The wire package is pjrt_rendezvous.v1, whatever the Python import path."""
    from pjrt_rendezvous.protos.v1 import coordinator_pb2

    assert coordinator_pb2.DESCRIPTOR.package == "pjrt_rendezvous.v1"
    assert "Coordinator" in coordinator_pb2.DESCRIPTOR.services_by_name


@pytest.mark.parametrize("sizes", [[0], [1], [127, 128], [300, 0, 16384], [2**21 + 5]])
def test_hand_encoded_session_responses_parse_as_protobuf_would(sizes):
    """The servicer writes SessionResponse bytes by hand (one copy of a shared response per
    caller); they must parse to exactly the message protobuf would have built."""
    from pjrt_rendezvous.client._session import _session_response

    answers = [
        pb.SessionAnswer(id=2**40 + i, response=bytes([i % 251]) * n) if n else pb.SessionAnswer(id=i, code=4, message="late")
        for i, n in enumerate(sizes)
    ]
    pairs = []
    for a in answers:
        head = pb.SessionAnswer(id=a.id, code=a.code, message=a.message).SerializeToString()
        pairs.append((head, a.response))
    assert pb.SessionResponse.FromString(_session_response(pairs)) == pb.SessionResponse(answers=answers)
