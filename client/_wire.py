"""A Rendezvous request's contributions on the wire, shared by the client, the host relay
and the coordinator.

A request carries them either as Contribution messages (``contributions``) or as parallel
lists (``ordinals``, ``tags``, ``payloads``, and ``incarnations`` or ``processes`` with
``process_indexes``; see the .proto). The lists parse in about half the time per
contribution, which is what a coordinator pays for each of the thousands a host relay sends
in one call; our clients and relays send the lists, and the coordinator reads every form.

The coordinator decodes a request with ``decode_rendezvous`` and a client encodes one with
``encode_rendezvous`` (the round's payloads likewise): through the native path
(``_native.c``) when the package was built with a C compiler, else with protobuf and
:func:`contribution_rows` / :func:`set_contribution_rows`, to the same tuple and bytes.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Callable, Sequence

from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

from ._session import Malformed, _native, natively_or, parser  # _native: None when built without a C compiler

Row = tuple[int, str, bytes, str]  # ordinal, tag, payload, incarnation ("": the caller's)
# A RendezvousRequest decoded: job, incarnation, replicas, round, timeout (None: not given),
# generation, and its contributions as rows. A plain tuple: the native path makes it.
RendezvousCall = tuple[str, str, list[int], int, "float | None", int, list[Row]]

_parse_rendezvous = parser(pb.RendezvousRequest)


def encode_rendezvous_in_python(
    job: str, incarnation: str, replicas: Sequence[int], round_number: int, timeout: float | None,
    generation: int, rows: Sequence[Row],
) -> bytes:
    """A serialized RendezvousRequest of ``rows`` (at least one; see :func:`set_contribution_rows`)."""
    request = pb.RendezvousRequest(job=job, incarnation=incarnation, replicas=replicas, round=round_number, generation=generation)
    if timeout is not None:
        request.timeout = timeout
    set_contribution_rows(request, rows)
    return request.SerializeToString()


encode_rendezvous = _native.encode_rendezvous if _native is not None else encode_rendezvous_in_python


def encode_payloads_in_python(payloads: list[bytes]) -> bytes:
    """A RendezvousResponse of ``payloads``, serialized."""
    return pb.RendezvousResponse(payloads=payloads).SerializeToString()


encode_payloads = _native.encode_payloads if _native is not None else encode_payloads_in_python


def decode_payloads_in_python(data: bytes) -> list[bytes]:
    """A serialized RendezvousResponse's payloads: protobuf's way (DecodeError if malformed)."""
    return pb.RendezvousResponse.FromString(data).payloads[:]  # a slice: upb's containers iterate by IndexError


def decode_rendezvous_in_python(data: bytes) -> RendezvousCall | Malformed:
    """A serialized RendezvousRequest decoded, or what is malformed in it: protobuf's way."""
    request = _parse_rendezvous(data)
    if isinstance(request, Malformed):
        return request
    try:
        rows = contribution_rows(request)
    except ValueError as exc:
        return Malformed(f"malformed rendezvous request: {exc}")
    timeout = request.timeout if request.HasField("timeout") else None
    return request.job, request.incarnation, request.replicas[:], request.round, timeout, request.generation, rows


# A serialized RendezvousRequest decoded, or what is malformed in it.
decode_rendezvous: Callable[[bytes], RendezvousCall | Malformed] = natively_or("decode_rendezvous", decode_rendezvous_in_python)
# A serialized RendezvousResponse's payloads; DecodeError if it is malformed.
decode_payloads: Callable[[bytes], list[bytes]] = natively_or("decode_payloads", decode_payloads_in_python)

_FIELDS = operator.attrgetter("ordinal", "tag", "payload", "incarnation")


def contribution_rows(request: pb.RendezvousRequest) -> list[Row]:
    """The request's contributions in either form; ValueError says what is malformed."""
    # Slices: lists at C speed (upb's containers have no iterator: iterating one goes item by
    # item and ends with an IndexError).
    ordinals, tags, payloads, incarnations = request.ordinals[:], request.tags[:], request.payloads[:], request.incarnations[:]
    n = len(ordinals)
    if request.process_indexes:
        if incarnations:
            raise ValueError("incarnations both as names and as process indexes; send one form")
        if len(request.process_indexes) != n:
            raise ValueError(f"{len(request.process_indexes)} process indexes for {n} ordinals: give one per ordinal")
        processes = request.processes[:]
        try:  # one string object per process, however many of its ordinals
            incarnations = list(map(processes.__getitem__, request.process_indexes[:]))
        except IndexError:
            raise ValueError(f"a process index past the {len(processes)} processes named") from None
    if not n:
        if tags or payloads or incarnations:
            raise ValueError("tags, payloads or incarnations without ordinals")
        return list(map(_FIELDS, request.contributions[:]))
    if request.contributions:
        raise ValueError("contributions both as Contribution messages and as ordinals; send one form")
    if len(tags) != n:
        if len(tags) != 1:
            raise ValueError(f"{len(tags)} tags for {n} ordinals: give one for all or one per ordinal")
        tags = repeat(tags[0], n)
    if len(payloads) != n:
        if payloads:
            raise ValueError(f"{len(payloads)} payloads for {n} ordinals: give none or one per ordinal")
        payloads = repeat(b"", n)
    if len(incarnations) != n:
        if incarnations:
            raise ValueError(f"{len(incarnations)} incarnations for {n} ordinals: give none or one per ordinal")
        incarnations = repeat("", n)
    return list(zip(ordinals, tags, payloads, incarnations))


def set_contribution_rows(request: pb.RendezvousRequest, rows: Sequence[Row], *, index_processes: bool = False) -> None:
    """Writes ``rows`` (at least one) into ``request`` as parallel lists, each list as short
    as the form allows; with ``index_processes`` (for a coordinator that reads them), each
    incarnation is named once and indexed."""
    ordinals, tags, payloads, incarnations = zip(*rows)
    request.ordinals.extend(ordinals)
    request.tags.extend(tags if tags.count(tags[0]) != len(tags) else tags[:1])
    if any(payloads):
        request.payloads.extend(payloads)
    if not any(incarnations):
        return
    if index_processes:
        index = {name: i for i, name in enumerate(dict.fromkeys(incarnations))}
        request.processes.extend(index)
        request.process_indexes.extend(map(index.__getitem__, incarnations))
    else:
        request.incarnations.extend(incarnations)
