"""A Rendezvous request's contributions on the wire, shared by the client, the host relay
and the coordinator.

A request carries them either as Contribution messages (``contributions``) or as parallel
lists (``ordinals``, ``tags``, ``payloads``, ``incarnations``; see the .proto). The lists
parse in about half the time per contribution, which is what a coordinator pays for each
of the thousands a host relay sends in one call; our clients and relays send the lists, and
the coordinator reads both.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Sequence

from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

Row = tuple[int, str, bytes, str]  # ordinal, tag, payload, incarnation ("": the caller's)

_FIELDS = operator.attrgetter("ordinal", "tag", "payload", "incarnation")


def contribution_rows(request: pb.RendezvousRequest) -> list[Row]:
    """The request's contributions in either form; ValueError says what is malformed."""
    # Slices: lists at C speed (upb's containers have no iterator: iterating one goes item by
    # item and ends with an IndexError).
    ordinals, tags, payloads, incarnations = request.ordinals[:], request.tags[:], request.payloads[:], request.incarnations[:]
    n = len(ordinals)
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


def set_contribution_rows(request: pb.RendezvousRequest, rows: Sequence[Row]) -> None:
    """Writes ``rows`` (at least one) into ``request`` as parallel lists, each list as short
    as the form allows."""
    ordinals, tags, payloads, incarnations = zip(*rows)
    request.ordinals.extend(ordinals)
    request.tags.extend(tags if tags.count(tags[0]) != len(tags) else tags[:1])
    if any(payloads):
        request.payloads.extend(payloads)
    if any(incarnations):
        request.incarnations.extend(incarnations)
