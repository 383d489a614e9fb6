"""The client's exceptions: one root, a shallow tree.

::

    RendezvousError
    ├── UsageError (ValueError)            the caller misused the API; nothing was sent
    │   └── TopologyError                  the environment does not describe a valid topology
    ├── SpawnError                         xla.spawn: a replica raised, a process died, or a timeout
    └── RemoteError                        the coordinator refused a call or a round failed
        ├── InvalidArgumentError           INVALID_ARGUMENT: bad input (replicas, ranges, empty names)
        ├── MismatchError                  FAILED_PRECONDITION: tag / replicas mismatch, world
        │                                  size conflict, unknown incarnation
        ├── DuplicateOrdinalError          ALREADY_EXISTS: another process holds the ordinal
        ├── UnknownJobError                NOT_FOUND: the job does not exist
        ├── RendezvousTimeout (TimeoutError) DEADLINE_EXCEEDED: names every missing ordinal
        │   └── StoreTimeout (DistStoreError)  a torch Store wait timed out (needs torch)
        ├── ParticipantFailedError         ABORTED: a participant died or restarted
        ├── LimitExceededError             RESOURCE_EXHAUSTED: a size or count limit
        ├── AuthenticationError            UNAUTHENTICATED / PERMISSION_DENIED
        ├── CoordinatorUnavailableError    UNAVAILABLE after every retry
        │   └── StoreUnavailable (DistNetworkError)  the same for a torch Store call
        └── StoreError (DistStoreError)    any other refusal of a torch Store call (``code``)

An argument of the wrong type raises ``TypeError`` (a ``payload`` that is not bytes, as torch_xla's
``xm.rendezvous`` does; a tag that is not a str, replicas or a thread index that are not ints).
No ``grpc.RpcError`` escapes the public API: :func:`from_rpc_error` is the one translation.
"""

from __future__ import annotations

import grpc

from ._version import build


# How the rounds an embedded coordinator fails as it stops begin (coordinator/_server.py):
# a client does not ask it for the job's generation after one (it is gone).
EMBEDDED_STOPPED = "the coordinator embedded in process "

# The largest message the coordinator takes (coordinator/_server.py, max_message_bytes).
MAX_MESSAGE_RULE = (
    "16 x the larger of max_payload_bytes and max_value_bytes (with their tag or key), "
    "plus 16 MiB, at most 2 GiB"
)

# The coordinators embedded in this process that stopped for good (no state file to resume
# from): their gRPC port -> (the host they listened on, why they stopped, when: monotonic).
# A client of this process that cannot reach one gives up after 5 s, not after looking for
# it for connect_timeout (Client._call). A Coordinator started again on the port takes its
# entry out.
STOPPED_HERE: dict[int, tuple[str, str, float]] = {}


class RendezvousError(Exception):
    """Root of every error this library raises (apart from TypeError for arguments of the wrong type)."""


class UsageError(RendezvousError, ValueError):
    """The caller misused the API (unbound thread, bad argument, bad configuration)."""


class TopologyError(UsageError):
    """The environment does not describe a valid TPU topology; the message names the variable."""


class RemoteError(RendezvousError):
    """The coordinator refused a call or a round failed. ``code`` is the gRPC status name."""

    code: str = "UNKNOWN"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgumentError(RemoteError):
    code = "INVALID_ARGUMENT"


class MismatchError(RemoteError):
    code = "FAILED_PRECONDITION"


class DuplicateOrdinalError(RemoteError):
    code = "ALREADY_EXISTS"


class UnknownJobError(RemoteError):
    code = "NOT_FOUND"


class RendezvousTimeout(RemoteError, TimeoutError):
    code = "DEADLINE_EXCEEDED"


class ParticipantFailedError(RemoteError):
    code = "ABORTED"


class LimitExceededError(RemoteError):
    code = "RESOURCE_EXHAUSTED"


class AuthenticationError(RemoteError):
    code = "UNAUTHENTICATED"


class CoordinatorUnavailableError(RemoteError):
    code = "UNAVAILABLE"


_BY_CODE: dict[grpc.StatusCode, type[RemoteError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.FAILED_PRECONDITION: MismatchError,
    grpc.StatusCode.ALREADY_EXISTS: DuplicateOrdinalError,
    grpc.StatusCode.NOT_FOUND: UnknownJobError,
    grpc.StatusCode.DEADLINE_EXCEEDED: RendezvousTimeout,
    grpc.StatusCode.ABORTED: ParticipantFailedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceededError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.UNAVAILABLE: CoordinatorUnavailableError,
}


# In an UNAVAILABLE error's details (lowered): a server that does not speak HTTP/2, and a
# TLS client's hello answered in plain text.
_NOT_HTTP2 = ("failed parsing http/2", "http1.x")
_NOT_TLS = "wrong_version_number"
# ... and this client refusing the server's TLS certificate: each with what to do.
_CERTIFICATE_REFUSED = (
    (
        "certificate has expired",
        "The coordinator's TLS certificate has expired (or this host's clock is wrong): reissue serve's --tls-cert.",
    ),
    (
        "hostname verification check failed",
        "The coordinator's TLS certificate does not name the host this client dials: dial a name or address the "
        "certificate names (its subjectAltName; status and health also take --tls-server-name), or reissue it "
        "naming this one.",
    ),
    (
        "certificate_verify_failed",
        "The coordinator's TLS certificate is not signed by the CA this client trusts (PJRT_RENDEZVOUS_TLS_CA): "
        "give it the CA that signed serve's --tls-cert.",
    ),
)


_REFUSED = "this client refuses the server's TLS certificate"


def connection_hint(details: str) -> str:
    """For an UNAVAILABLE error's details: a TLS mismatch looks like a connection cut (a
    plaintext client against a TLS coordinator, or mutual TLS without a client certificate
    from its CA), a server that does not speak HTTP/2 like one that cannot parse it, and a
    certificate this client refuses says only why; "" when the details do not look like
    any."""
    lowered = details.lower()
    if any(marker in lowered for marker in _NOT_HTTP2):
        return (
            " The server there does not speak gRPC: is that the coordinator's gRPC port (7481 by default), "
            "not its session port or metrics port?"
        )
    if _NOT_TLS in lowered:
        return (
            " The server there does not speak TLS: if it is the coordinator, it serves without TLS, and this "
            "client must not set PJRT_RENDEZVOUS_TLS_CA (nor _TLS_CERT, _TLS_KEY)."
        )
    for marker, hint in _CERTIFICATE_REFUSED:
        if marker in lowered:
            return f" {hint}"
    lowered = lowered.replace("tcp handshaker shutdown", "")  # (a TCP connect that timed out: no TLS in it)
    if not any(word in lowered for word in ("handshake", "socket closed", "ssl", "tls")):
        return ""
    return (
        " If it serves TLS, this client needs PJRT_RENDEZVOUS_TLS_CA (and, for mutual TLS, "
        "PJRT_RENDEZVOUS_TLS_CERT and _TLS_KEY from the CA it trusts, not expired); if not, none of them."
    )


def unchanging(details: str) -> str:
    """What an UNAVAILABLE error's details say that waiting does not change: the server
    there speaks another protocol (HTTP/1, or plain text to a TLS client), or this client
    refuses its TLS certificate; "" for anything else. (Not a connection closed as it
    opens, which a TLS server does to a plaintext client or to a client certificate it
    refuses: so does a proxy in front of a coordinator that is restarting.)"""
    lowered = details.lower()
    if any(marker in lowered for marker in (*_NOT_HTTP2, _NOT_TLS)):
        return "the server there speaks another protocol"
    if any(marker in lowered for marker, _ in _CERTIFICATE_REFUSED):
        return _REFUSED
    return ""


def from_rpc_error(exc: grpc.RpcError, *, address: str, method: str, where: str = "", token_from: str = "") -> RemoteError:
    """The one place a gRPC error becomes ours (``Client._call`` raises it ``from None``,
    keeping the gRPC error's details as ``_rpc_details``). ``where``: more on how the client came to
    ``address``, for an unreachable coordinator's error; ``token_from``: where the client's
    token came from, for a wrong token's."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    cls = _BY_CODE.get(code, RemoteError)
    if cls is CoordinatorUnavailableError:
        hint = connection_hint(details)
        details = f"coordinator at {address} unavailable for {method}: {details.rstrip('.')}."
        if unchanging(details) != _REFUSED:  # (a TLS server answered: not one to look for)
            details += (
                " Is `pjrt-rendezvous serve` (or the process embedding a Coordinator, task 0's) running there, and "
                "is that its address (from init(address=), a Store's URL, PJRT_RENDEZVOUS_ADDRESS, or worker 0 of "
                f"TPU_WORKER_HOSTNAMES)?{where}"
            )
        details += hint
    elif cls is LimitExceededError and "received message larger than max" in details.lower():  # (gRPC's own words)
        details = (
            f"{details}: the coordinator takes messages of at most {MAX_MESSAGE_RULE} (serve's --max-payload-bytes "
            "and --max-value-bytes, an embedded Coordinator's limits); send less in one call (fewer keys in one "
            "multi_set), or raise those limits"
        )
    elif cls is AuthenticationError and token_from and "wrong token" in details:
        details = f"{details} (this client's token came from {token_from})"
    elif code == grpc.StatusCode.UNIMPLEMENTED:  # another gRPC server, an HTTP one (404), or an older coordinator
        details = (
            f"{address} does not serve {method}: {details}. Is that the gRPC port of `pjrt-rendezvous serve` "
            f"(not its session or metrics port, nor another server)? If so, the coordinator is a build older than "
            f"this client's ({build()}) from before {method}: "
            f"run one build everywhere (deploy/README.md, Upgrading){where}"
        )
    return cls(details, code=code.name)
