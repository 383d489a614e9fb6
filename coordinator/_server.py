"""Running the coordinator: a grpc.aio server with health checking, reflection, optional
shared-secret token, TLS / mutual TLS, liveness watching, a state file, event logging and
an optional Prometheus endpoint.

:class:`Coordinator` runs one in a background thread of the calling process (task 0
embedding it, the demo, tests); :func:`serve_forever` runs one in the foreground
(``pjrt-rendezvous serve``) until SIGINT, SIGTERM or SIGHUP (or a failed write of the state
file), telling systemd when it is ready and when it stops (``_notify``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import gc
import hmac
import ipaddress
import logging
import os
import pathlib
import queue
import signal
import socket
import threading
import time
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pjrt_rendezvous.client._config import DEFAULT_JOB, check_token
from pjrt_rendezvous.client._errors import EMBEDDED_STOPPED, MAX_MESSAGE_RULE, STOPPED_HERE, UsageError
from pjrt_rendezvous.client._session import MAX_MESSAGE, PING_EVERY, FramedSession, clip, give_freed_memory_back
from pjrt_rendezvous.client._topology import host_port
from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

from . import _notify, _state
from ._core import MIN_HEARTBEAT_TIMEOUT, Code, Core, CoreError, Limits, _plural
from ._listener import Listener
from ._metrics import HttpServer, Metrics, RpcInterceptor, start_http_server
from ._monitor import DEFAULT_LATE_AFTER, Monitor
from ._servicer import Servicer, add_to_server

log = logging.getLogger("pjrt_rendezvous.coordinator")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
DEFAULT_HEARTBEAT_TIMEOUT = 60.0
DEFAULT_SESSION_PORT = 7482  # of `pjrt-rendezvous serve`; next to the gRPC port, 7481
FINAL_WRITE_TIMEOUT = 10.0  # seconds the state file's last write on stop may take
_ANSWERS_OUT = 0.1  # seconds a stop for good gives the calls it failed to send their answers

# Our own limits (Limits) give precise messages; gRPC's 4 MiB default would refuse large
# rendezvous results with a generic error first. What it receives is capped at the largest
# message the limits allow (max_message_bytes, set per server).
_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    # Two coordinators on one port must fail loudly, not share the traffic.
    ("grpc.so_reuseport", 0),
    # gRPC cancels calls beyond 1,000 not yet picked up by the (Python) server, at random up
    # to 3,000 and all of them above. World formation is a burst of one Register per thread:
    # at 512 processes x 8 threads, 5-25 % of them came back CANCELLED (bench/, scale run).
    # Allow a whole world of them.
    ("grpc.server.max_pending_requests", 65_536),
    ("grpc.server.max_pending_requests_hard_limit", 131_072),
    # Clients ping idle connections every 10 s to notice a dead path (see the client).
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.http2.max_ping_strikes", 0),
]


_SILENT_AFTER = 60.0  # seconds at least before a silent connection is looked into (_keepalive, _Connection)


def silent_after(heartbeat_timeout: float | None) -> float:
    """How long a connection may be silent before it is looked into: the heartbeat timeout,
    and not less than _SILENT_AFTER (None: no timeout)."""
    return max(_SILENT_AFTER, heartbeat_timeout or 0.0)


def _keepalive(heartbeat_timeout: float | None) -> list[tuple[str, int]]:
    """The server pings a connection silent for the heartbeat timeout (60 s at least) and
    closes it if the ping is not answered within as long again: one whose client vanished
    without a FIN (its host cut off, the client gone meanwhile) stayed open for good (gRPC's
    default: 2 h), its streams and descriptor kept; the session port's are closed by TCP
    keepalive (_Connection). No sooner: a process stopped (SIGSTOP, a frozen VM) answers no
    ping, gRPC's own (flow control's) included, and a closed connection is judged sooner
    than silence (Core.check_liveness). (The wait is gRPC's ping timeout, 60 s by default,
    for every ping; its keepalive timeout alone did not close the connection, gRPC 1.7x.)"""
    after = int(silent_after(heartbeat_timeout) * 1000)
    return [("grpc.keepalive_time_ms", after), ("grpc.keepalive_timeout_ms", after), ("grpc.http2.ping_timeout_ms", after)]


# A host relay sends one call for its host's ordinals: a TPU host has at most 8 chips of at
# most 2 cores (v2, v3), so 16 contributions.
_ITEMS_PER_MESSAGE = 16
# Room in a message beyond its payloads or values: names, keys, replicas, protobuf's framing.
_MESSAGE_SLACK = 16 << 20


def listen_host(text: str) -> str:
    """``text`` as the listening sockets take a host: without spaces at its ends (a stray one
    in a variable) and an IPv6 literal without the brackets of an address (``[::1]``: gRPC's
    port reads those, the session port's and the metrics port's sockets do not).

    Raises:
        ValueError: an empty host, brackets around something other than an IPv6 address, or
            a host with a port or a scheme, or an IPv4 address out of range.
    """
    host = text.strip()
    if not host:
        raise ValueError(f"the host to listen on is empty ({text!r}); 0.0.0.0 or :: listen on every address, 127.0.0.1 on this machine's alone")
    if host.startswith("[") or host.endswith("]"):
        try:
            if not (host.startswith("[") and host.endswith("]")):
                raise ValueError
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"brackets are for an IPv6 address, as in [::1], got {text!r}") from None
        host = host[1:-1]
    try:
        if ":" in host:  # (only an IPv6 address has one: not host:port, nor a URL)
            ipaddress.IPv6Address(host)
        elif host.replace(".", "").isdigit():  # (a name is not all digits)
            ipaddress.IPv4Address(host)
        elif "/" in host or " " in host:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"the host to listen on is an address or a name of this machine, without a port or a scheme "
            f"(0.0.0.0, ::, 10.0.0.2, worker-0), got {text!r}"
        ) from None
    return host


def max_message_bytes(limits: Limits) -> int:
    """The largest request the coordinator receives, on gRPC or its session port: a host
    relay's rendezvous call carrying a payload of the largest size (and a tag of the longest)
    for each of a TPU host's up to 16 ordinals, or a key-value call carrying as many values
    of the largest size; plus room for everything else (``MAX_MESSAGE_RULE``). Within it,
    the limits give their own precise errors; a bigger message is refused before it is read
    (RESOURCE_EXHAUSTED): a peer, authenticated or not, cannot make us hold more."""
    text = 4  # bytes a character may take in UTF-8
    item = max(
        limits.max_payload_bytes + text * (limits.max_tag_length + limits.max_name_length),
        limits.max_value_bytes + text * limits.max_key_length,
    )
    return min(MAX_MESSAGE, _ITEMS_PER_MESSAGE * (item + 64) + _MESSAGE_SLACK)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """How a coordinator serves. Times in seconds; None disables.

    Attributes:
        host, port: where to listen (port 0 picks a free one).
        world_size, job: fix ``job``'s world size up front.
        limits: size and count limits.
        heartbeat_timeout: a process silent this long is declared dead (at least 1 s); None never.
        state_file: keep ranks, job config, finished rounds and keys here across restarts.
        token: shared secret every call must carry (``authorization: Bearer <token>``);
            health Checks are exempt so probes work (not health Watch streams).
        tls_cert, tls_key: PEM server certificate and key; enables TLS.
        tls_ca: PEM CA; with TLS, clients must present a certificate it signed (mutual TLS).
        grace: on stop, in-flight calls get this long to finish before they are cancelled.
        metrics_port: serve Prometheus metrics over HTTP at ``/metrics`` on this port (0
            picks a free one); None serves none. Unauthenticated, like most exporters.
        metrics_host: where the metrics endpoint listens; None: the same as ``host``.
        session_port: also serve the Session stream as length-prefixed messages on plain
            TCP on this port (0 picks a free one; clients learn it from their Register and
            Heartbeat answers). Cheaper than gRPC's stream for both ends; None serves none.
            With TLS, 0 means none: the session port has no TLS.
        late_after: log a rendezvous round still waiting after this long, and again each
            time its wait doubles (naming who is missing), and a job's world still
            incomplete (once, until it forms); None never.
    """

    host: str = "127.0.0.1"
    port: int = 0
    world_size: int | None = None
    job: str = DEFAULT_JOB
    limits: Limits = dataclasses.field(default_factory=Limits)
    heartbeat_timeout: float | None = DEFAULT_HEARTBEAT_TIMEOUT
    state_file: pathlib.Path | None = None
    token: str | None = dataclasses.field(default=None, repr=False)
    tls_cert: bytes | None = dataclasses.field(default=None, repr=False)
    tls_key: bytes | None = dataclasses.field(default=None, repr=False)
    tls_ca: bytes | None = dataclasses.field(default=None, repr=False)
    grace: float = 5.0
    metrics_port: int | None = None
    metrics_host: str | None = None
    session_port: int | None = 0
    # False: a session port in use is warned of and done without ("auto"'s default port,
    # which another coordinator on the host may hold: its clients use gRPC's stream).
    session_port_required: bool = True
    late_after: float | None = DEFAULT_LATE_AFTER

    def __post_init__(self) -> None:
        object.__setattr__(self, "host", listen_host(self.host))
        if self.metrics_host is not None and self.metrics_port is None:
            raise ValueError("--metrics-host (where the metrics endpoint listens) needs --metrics-port: without it there is no endpoint")
        if self.metrics_host is not None:
            object.__setattr__(self, "metrics_host", listen_host(self.metrics_host))
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics port must be in [0, 65535], got {self.metrics_port}")
        if self.late_after is not None and not self.late_after > 0:
            raise ValueError(f"late_after must be > 0 seconds or None, got {self.late_after!r}")
        # (refused here, not at start(): the core's own checks came only then, one as a CoreError)
        if self.heartbeat_timeout is not None and not self.heartbeat_timeout >= MIN_HEARTBEAT_TIMEOUT:
            raise ValueError(f"heartbeat_timeout must be at least {MIN_HEARTBEAT_TIMEOUT:g} s or None, got {self.heartbeat_timeout!r}")
        if self.grace is not None and not self.grace >= 0:  # (None: none, as for stop())
            raise ValueError(f"grace must be >= 0 seconds or None, got {self.grace!r}")
        size = self.world_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"world_size must be an int >= 1 or None, got {size!r}")
        for name in ("tls_cert", "tls_key", "tls_ca"):  # (a path given as str met gRPC's bare TypeError)
            value = getattr(self, name)
            if value is not None and not isinstance(value, bytes):
                raise TypeError(
                    f"{name} must be the PEM file's bytes (pathlib.Path(path).read_bytes()), got {type(value).__name__}"
                )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key too")
        if self.session_port is not None and not 0 <= self.session_port <= 65535:
            raise ValueError(f"session port must be in [0, 65535], got {self.session_port}")
        if self.session_port and self.session_port == self.port:
            raise ValueError(f"the session port and the gRPC port are both {self.port}: give them two ports")
        if self.metrics_port and self.metrics_host in (None, self.host):  # (on another address it may share one)
            for name, port in (("gRPC", self.port), ("session", self.session_port)):
                if self.metrics_port == port:
                    raise ValueError(f"the metrics port and the {name} port are both {port}: give them two ports")
        if self.session_port and self.tls_cert is not None:
            raise ValueError("the session port is plain TCP: with TLS, leave it out (clients use gRPC's stream)")
        if self.token is not None:  # stripped and checked as serve and the clients do (else every client was refused)
            try:
                object.__setattr__(self, "token", check_token(self.token.strip(), "token="))
            except UsageError as exc:
                raise ValueError(str(exc)) from None
        if self.state_file is not None and not pathlib.Path(self.state_file).parent.is_dir():
            raise ValueError(  # (from an OSError: serve exits 1, to try again: a volume mounted late)
                f"the folder of the state file {self.state_file} (--state-file) does not exist"
            ) from FileNotFoundError(errno.ENOENT, "no such folder", str(pathlib.Path(self.state_file).parent))
        if self.state_file is not None and pathlib.Path(self.state_file).is_dir():
            raise ValueError(
                f"the state file {self.state_file} (--state-file) is a folder; give the path of a file, "
                f"such as {pathlib.Path(self.state_file) / 'coordinator.state'}"
            )
        if self.state_file is not None and os.path.exists(self.state_file) and not os.path.isfile(self.state_file):
            # (a FIFO held the start for good; /dev/zero was read without end)
            raise ValueError(f"the state file {self.state_file} (--state-file) is not a regular file; give the path of one")
        # The job --world-size declares: refused here, as settings (the core would refuse it
        # once serving, naming its limits by their field names).
        if self.world_size is not None and self.world_size > self.limits.max_world_size:
            raise ValueError(
                f"a world size of {self.world_size} (--world-size) is over the largest this coordinator "
                f"takes, {self.limits.max_world_size} (--max-world-size)"
            )
        if self.world_size is not None and len(self.job) > self.limits.max_name_length:
            raise ValueError(
                f"a job name of {len(self.job)} characters (--job) is over the limit of "
                f"{self.limits.max_name_length} (--max-name-length)"
            )


class _Token:
    """The shared secret's check, for gRPC's port and the session port alike. A refusal is
    logged without the secret, each reason (no token, a wrong token) at most once a minute
    with a count of those not logged: anyone who reaches the port may call as often as they
    like, and must not fill the log."""

    LOGGED_EVERY = 60.0  # seconds

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (when last logged, refusals since)

    def refusal(self, given: str | bytes, what: str) -> str | None:
        """None when ``given`` (the ``authorization`` a caller sent) is the token, else the
        message to refuse ``what`` with."""
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._expected):
            return None
        reason = "no token" if not given else "a wrong token"
        now = time.monotonic()
        logged, unlogged = self._logged.get(reason, (float("-inf"), 0))
        if now - logged >= self.LOGGED_EVERY:
            self._logged[reason] = (now, 0)
            log.warning(
                "refused %s: the caller sent %s%s", what, reason,
                f" ({unlogged} more such refusals since the last line, not logged)" if unlogged else "",
                extra={"event": "refused", "what": what, "reason": reason, "unlogged": unlogged},
            )
        else:
            self._logged[reason] = (logged, unlogged + 1)
        return f"{what} refused: {reason}; set PJRT_RENDEZVOUS_TOKEN or PJRT_RENDEZVOUS_TOKEN_FILE"


class _TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses calls without the shared secret: UNAUTHENTICATED, logged without the secret."""

    def __init__(self, token: _Token) -> None:
        self._token = token

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        # Probes carry no token: a health Check needs none. A health Watch (a stream held
        # open, memory each) does.
        if handler is None or details.method == "/grpc.health.v1.Health/Check":
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        message = self._token.refusal(given, details.method)
        if message is None:
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this an async generator

        # The request of a refused call is never read, let alone parsed: the handlers take a
        # stream of requests (whatever the method's shape) and end the call before reading
        # one, so gRPC does not receive a message a caller without the token sends.
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream, _ignore, handler.response_serializer)
        return grpc.stream_unary_rpc_method_handler(deny, _ignore, handler.response_serializer)


def _ignore(data: bytes) -> None:
    """The request deserializer of a refused call (never read): the bytes are not looked at."""
    return None


class _SessionPort:
    """The Session stream without gRPC: length-prefixed messages on plain TCP
    (``client/_session.py``: ``SocketSession``, ``FramedSession``). An echo server spends
    a sixth of the CPU per message it spends on gRPC's stream (bench/grpc_floor.py), and
    the client saves gRPC's thread hand-offs. The token check is the same as gRPC's."""

    def __init__(self, servicer: Servicer, token: _Token | None, max_message: int) -> None:
        self._servicer = servicer
        self._token = token
        self._max_message = max_message
        self._connections: set[FramedSession] = set()
        # (a connection that sends no SessionHello within HELLO_TIMEOUT is closed: _Connection)
        self._listener = Listener(self._connection, "the session port", lambda: len(self._connections))

    async def start(self, host: str, port: int) -> int:
        return await self._listener.start(host, port, "--session-port")

    def _hello(self, greeting: pb.SessionHello) -> tuple[grpc.StatusCode, str] | None:
        if self._token is None:
            return None
        message = self._token.refusal(greeting.authorization, "a session on the session port")
        if message is None:
            return None
        if self._servicer._on_call is not None:  # counted as a refused Session stream is
            self._servicer._on_call("Session", grpc.StatusCode.UNAUTHENTICATED.name)
        return grpc.StatusCode.UNAUTHENTICATED, message

    def _connection(self) -> FramedSession:
        connection = _Connection(
            self._servicer._session_call,
            self._hello,
            self._connections.discard,
            max_message=self._max_message,
            max_message_rule=f"the coordinator's max message size: {MAX_MESSAGE_RULE}",
        )
        connection.silent_after = silent_after(self._servicer._core.heartbeat_timeout)
        if self._servicer._on_call is not None:  # (counted as gRPC's Session streams are)
            connection.on_end = functools.partial(self._servicer._on_call, "Session")
        self._connections.add(connection)
        return connection

    def calls_in_flight(self) -> bool:
        return any(connection.busy() for connection in self._connections)

    def close_listener(self) -> None:
        self._listener.close()

    def close(self) -> None:
        """Drops every connection (their clients resend, to a restarted coordinator)."""
        self._listener.close()
        for connection in list(self._connections):
            if connection.transport is not None:
                connection.transport.abort()


# Seconds a session port connection may take to send its SessionHello (SocketSession sends
# it as it connects); then it is closed, so idle connections cannot hold our open files.
HELLO_TIMEOUT = 10.0


class _Connection(FramedSession):
    """A client's connection to the session port, with TCP keepalive, closed unless it
    sends its hello within HELLO_TIMEOUT. Once its hello was taken, ``on_end(code)``
    counts its session once, as a gRPC Session stream is: refused with the refusal's code,
    else when it ends (OK, or CANCELLED with calls running or the connection broken). A
    connection that sends no hello that parses (a port probe, a scanner) is not a session:
    not counted; one whose token is refused is, by _SessionPort._hello."""

    _hello_timer: asyncio.TimerHandle | None = None
    _log = log
    on_end: Callable[[str], None] | None = None
    # A connection that gets nothing and is answered nothing for this long (a live client
    # pings every 10 s: PING_EVERY) is closed at the next look, as the gRPC port's unanswered
    # ping closes one (_keepalive): TCP keepalive cannot close one whose peer's kernel still
    # answers it (a process stopped, a proxy holding the connection). Set by _SessionPort.
    silent_after = _SILENT_AFTER

    def _refuse(self, code: grpc.StatusCode, message: str) -> bool:
        if self._hello is None:
            self._ended(code.name)
        return super()._refuse(code, message)

    def _ended(self, code: str) -> None:
        if self.on_end is not None:
            self.on_end(code)
            self.on_end = None  # (once)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        loop = asyncio.get_running_loop()
        self._hello_timer = loop.call_later(HELLO_TIMEOUT, self._hello_overdue)
        self._silence_timer = loop.call_later(self.silent_after, self._look, None)
        # A client host that vanished is noticed (its connection and waiting calls freed)
        # after about two minutes of silence, as on the gRPC port (_keepalive).
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)

    def _hello_overdue(self) -> None:
        if self._hello is None or self.transport.is_closing():  # it came, or the connection ended
            return
        log.debug(  # (not louder: anyone can open connections, as many as they like)
            "closed a session port connection from %s: no SessionHello within %g s",
            self.transport.get_extra_info("peername"), HELLO_TIMEOUT,
        )
        # UNAVAILABLE: a client that was this slow resends its calls on a new connection.
        self._refuse(grpc.StatusCode.UNAVAILABLE, f"the session port got no SessionHello within {HELLO_TIMEOUT:g} s of connecting")

    def _look(self, before: tuple | None) -> None:
        """Closes the connection if nothing came or went since the last look (calls, pings
        and their answers, a large message arriving in pieces), else looks again later."""
        if self.transport.is_closing():
            return
        seen = (self._written, len(self._buffer), self._skip)
        if seen != before:
            self._silence_timer = asyncio.get_running_loop().call_later(self.silent_after, self._look, seen)
            return
        log.debug(
            "closed a session port connection from %s: nothing came or went for %g s (a live client pings "
            "every %g s: its process stopped, or a proxy holds the connection open)",
            self.transport.get_extra_info("peername"), self.silent_after, PING_EVERY,
        )
        self.transport.abort()

    def connection_lost(self, exc) -> None:
        self._silence_timer.cancel()
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self._hello is None:  # its hello was taken: a session, now ended
            self._ended("CANCELLED" if exc is not None or self.busy() else "OK")
        super().connection_lost(exc)


class _StateWriter:
    """Group commit of the state file: a caller returns once a write covering its change
    (``core.version`` at the call) is on disk. Finished rounds and key-value changes are
    appended to the journal; any other change rewrites the state file (``_state``). The
    core is read and encoded on the event loop (it is not thread-safe, and encoding holds
    the GIL anyway); the writing and fsyncs run in the writer's own thread, one hop away
    (``asyncio.to_thread`` costs twice the CPU, a cost every round pays)."""

    def __init__(self, core: Core, files: _state.Files) -> None:
        self._core = core
        self._files = files  # used by the writer's thread alone (once it started)
        self._written = -1  # core.version on disk
        self._state_written = -1  # core.state_version in the state file
        self._journal_size = 0
        self._inflight: asyncio.Future | None = None  # the write under way
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        core.journal = []  # the core keeps the changes for the journal from now on
        # Set by the first write that fails: what is in memory is no longer on disk, so the
        # coordinator stops (serve_forever) and restarts from what is, as etcd does.
        self.failed = asyncio.Event()
        self._removed_said = float("-inf")  # when a removed journal or state file was last logged

    async def flush(self) -> None:
        """Returns once the core's changes so far are on disk; raises UNAVAILABLE (clients
        retry, reaching the restarted coordinator) when they cannot be written."""
        wanted = self._core.version
        while self._written < wanted:
            if self._inflight is None:
                self._write()
            # Every caller waiting on a write wakes when it is done, in one pass of the
            # loop. A cancelled Task would cancel what it awaits: gRPC's calls wait behind a
            # shield (the session port's calls, run without a Task, cancel no future).
            try:
                await (self._inflight if asyncio.current_task() is None else asyncio.shield(self._inflight))
            except OSError as exc:
                raise CoreError(
                    Code.UNAVAILABLE,
                    f"the coordinator cannot write its state file ({exc}); `serve` stops, to start again from what is on disk",
                ) from exc

    def _write(self) -> None:
        """Starts writing what the core holds now: the changes since the last write to the
        journal (finished rounds, key-value changes), or (after any other) the whole state."""
        core = self._core
        version = core.version
        changes = core.take_journal()
        try:
            if core.state_version == self._state_written and self._journal_size < _state.JOURNAL_LIMIT:
                completed = {c[1]: core.jobs[c[1]].rounds_completed for c in changes if c[0] == "round"}
                entry = _state.journal_entry(version, changes, completed)
                after = (version, self._state_written, self._journal_size + len(entry))
                request = (self._files.append, entry)
            else:
                after = (version, core.state_version, 0)
                request = (self._files.rewrite, _state.encode(_state.snapshot(core, time.monotonic())))  # (serve's clock)
        except BaseException:
            self._state_written = -1  # the changes taken are not on disk: the next write is whole
            raise
        loop = asyncio.get_running_loop()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, args=(loop,), name="pjrt-rendezvous-state", daemon=True)
            self._thread.start()
        self._inflight = loop.create_future()
        self._requests.put((*request, after))

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        """The writer's thread: writes what it is asked, in order."""
        try:
            while (request := self._requests.get()) is not None:
                write, data, after = request
                try:
                    write(data)
                    error = None
                except BaseException as exc:  # handed to the waiting callers
                    error = exc
                try:
                    loop.call_soon_threadsafe(self._written_up_to, after, error)
                except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                    return
        finally:
            self._files.close()

    def _written_up_to(self, after: tuple[int, int, int], error: BaseException | None) -> None:
        """On the loop: the write under way is done. The bookkeeping comes first: a caller
        must never find a finished write still under way (it would wait on it in a loop)."""
        done, self._inflight = self._inflight, None
        if isinstance(error, _state.Removed):  # written again whole, at once (flush's next pass)
            now = time.monotonic()
            if now - self._removed_said >= 60:  # (a file system that keeps saying so must not flood the log)
                self._removed_said = now
                log.warning("%s: writing the whole state again", error, extra={"event": "state_file_removed"})
            self._state_written, error = -1, None
        elif error is None:
            self._written, self._state_written, self._journal_size = after
        else:
            self._state_written = -1  # the changes taken are not on disk: the next write is whole
            if not self.failed.is_set():
                log.critical("cannot write the state file: %s", error, extra={"event": "state_write_failed"})
                self.failed.set()
        if not done.cancelled():  # cannot be (see flush), but a loop callback must not raise
            done.set_result(None) if error is None else done.set_exception(error)

    def close(self, wait: bool = True) -> None:
        """Ends the writer's thread once the writes asked for are done; with ``wait``, lets
        go of the state file before returning: a coordinator started on it next (in this
        process or another) finds its lock free. (Without, after a write that does not end,
        its thread lets go once it does.)"""
        if self._thread is None:
            self._files.close()
        else:
            self._requests.put(None)
            if wait:
                self._thread.join()


class RunningServer:
    """A started server: its port, its core, its metrics endpoint's port, and how to stop it."""

    def __init__(
        self,
        server: grpc.aio.Server,
        port: int,
        core: Core,
        servicer: Servicer,
        health_servicer,
        tasks,
        *,
        metrics: Metrics | None = None,
        metrics_server: HttpServer | None = None,
        sessions: _SessionPort | None = None,
        session_port: int | None = None,
        writer: _StateWriter | None = None,
    ) -> None:
        self.server = server
        self.port = port
        self.session_port = session_port
        self.core = core
        self.metrics = metrics
        self.metrics_port: int | None = (
            None if metrics_server is None else metrics_server.sockets[0].getsockname()[1]
        )
        self._metrics_server = metrics_server
        self._sessions = sessions
        self.writer = writer
        self._servicer = servicer
        self._health = health_servicer
        self._tasks = tasks
        self._hurried = asyncio.Event()
        self._hurry_task: asyncio.Task | None = None  # (kept: the loop holds tasks weakly)

    async def stop(self, grace: float | None, *, for_good: str | None = None) -> None:
        """Marks health NOT_SERVING, lets in-flight calls finish for ``grace`` seconds (or
        until :meth:`hurry`), stops, and writes the state file a last time. With
        ``for_good`` (why) and no state file, the pending rounds and the waits for keys or a
        world fail first, saying so (Servicer.stop_for_good)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (grace or 0.0)  # (None: none, as for gRPC's stop)
        failing = for_good is not None and self.writer is None

        def fail() -> None:  # (the rounds pending now, and any a call in the grace makes)
            if failing:
                self._servicer.stop_for_good(for_good)

        fail()
        # Their answers go out, even without a grace: a session call's at once, a gRPC
        # handler's some turns of the loop later (cancelled before, its caller got none).
        await asyncio.sleep(_ANSWERS_OUT if failing else 0)
        for task in self._tasks:
            task.cancel()
        await self._health.enter_graceful_shutdown()
        # No new connections to the session port. Calls running on it or on a gRPC Session
        # stream get the grace; idle streams (and every Watch stream) end now.
        sessions = self._sessions
        if sessions is not None:
            sessions.close_listener()
        while self._servicer.end_streams() or (sessions is not None and sessions.calls_in_flight()):
            if self._hurried.is_set() or loop.time() >= deadline:
                break
            await asyncio.sleep(0.02)
            fail()
        await self.server.stop(max(0.0, deadline - loop.time()))
        if sessions is not None:
            sessions.close()
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self.writer is not None:
            self.writer.close(wait=await self._last_write())

    async def _last_write(self) -> bool:
        """What changed without a call (deaths the liveness watch found) goes to disk, within
        FINAL_WRITE_TIMEOUT or until :meth:`hurry` (a stuck volume must not hold the exit);
        False when the write did not end."""
        flush = asyncio.ensure_future(self.writer.flush())
        hurried = asyncio.ensure_future(self._hurried.wait())
        await asyncio.wait((flush, hurried), timeout=FINAL_WRITE_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
        hurried.cancel()
        if not flush.done():
            flush.cancel()
            log.error("the last write of the state file did not finish; the state file may miss the last changes", extra={"event": "state_write_failed"})
            return False
        if isinstance(flush.exception(), CoreError):  # (the writer logged why)
            log.error("%s", flush.exception().message, extra={"event": "state_write_failed"})
        elif flush.exception() is not None:
            log.error("the last write of the state file failed", exc_info=flush.exception(), extra={"event": "state_write_failed"})
        return True

    def hurry(self) -> None:
        """Ends a :meth:`stop` under way now: in-flight calls are cancelled."""
        self._hurried.set()
        self._hurry_task = asyncio.get_running_loop().create_task(self.server.stop(0))


async def start_server(options: ServerOptions = ServerOptions()) -> RunningServer:
    """Starts serving on the current event loop.

    Raises:
        StateFileError: the state file exists but is torn, edited or foreign.
        OSError: a port (gRPC's, the session port, the metrics port) could not be bound;
            its ``errno`` is the system's (EADDRINUSE: in use).
        ValueError: the TLS certificate and key, or the client CA, are not valid PEM, or the
            key is not the certificate's (the message says which).
    """
    # Locked first: no other coordinator writes the state file once it is read.
    files = _state.Files(options.state_file) if options.state_file is not None else None
    writer = None
    try:
        core = _core_to_serve(options, files)
        writer = _StateWriter(core, files) if files is not None else None
        return await _serving(options, core, writer)
    except BaseException:  # the state file's lock goes, for a start again in this process
        if writer is not None:
            writer.close()
        elif files is not None:
            files.close()
        raise


def _core_to_serve(options: ServerOptions, files: "_state.Files | None") -> Core:
    """The core the state file holds, else a new one; with ``--world-size``'s job declared
    (and the declarations it restored that this coordinator does not make, lifted)."""
    core = None
    if files is not None:
        core = _state.load(
            files.path,
            given=files.given,
            now=time.monotonic(),
            limits=options.limits,
            heartbeat_timeout=options.heartbeat_timeout,
        )
        if core is not None:
            log.info(
                "restored %d job(s) from %s%s",
                len(core.jobs),
                options.state_file,
                "" if not core.jobs else ": " + ", ".join(
                    f"{j.name} ({len(j.members)}/{j.world_size} ordinals, generation {j.generation})"
                    if j.world_size is not None else f"{j.name} ({_plural(len(j.kv), 'key')}, no world yet)"
                    for j in core.jobs.values()
                ),
                extra={"event": "restored", "jobs": len(core.jobs)},
            )
            if len(core.jobs) > options.limits.max_jobs:
                log.warning(
                    "restored %d jobs, more than --max-jobs %d: each new job drops the finished ones down to it "
                    "(a job is finished once every process of it is gone)", len(core.jobs), options.limits.max_jobs,
                    extra={"event": "over_max_jobs", "jobs": len(core.jobs)},
                )
            for name in core.undeclare_jobs(options.job if options.world_size is not None else None):
                log.warning(
                    "job %s had a world size fixed by --world-size, which this coordinator does not give it: "
                    "a new run may have another size", name, extra={"event": "world_size_lifted", "job": name},
                )
    core = core or Core(options.limits, heartbeat_timeout=options.heartbeat_timeout)
    if options.world_size is not None:
        restored = core.jobs.get(options.job)
        if restored is not None and restored.world_size not in (None, options.world_size):
            log.warning(
                "job %s had world size %d in %s; --world-size %d starts it afresh (its keys stay)",
                options.job, restored.world_size, options.state_file, options.world_size,
                extra={"event": "world_size_changed", "job": options.job},
            )
        core.declare_job(options.job, options.world_size)
    return core


async def _serving(options: ServerOptions, core: Core, writer: "_StateWriter | None") -> "RunningServer":
    """The rest of :func:`start_server`, once the core and its state writer are there."""
    metrics = Metrics() if options.metrics_port is not None else None
    monitor = Monitor(core, metrics, clock=time.monotonic, late_after=options.late_after)
    # The RPC counter goes first so that it also counts the token check's refusals.
    interceptors = [RpcInterceptor(metrics)] if metrics is not None else []
    token = _Token(options.token) if options.token else None
    interceptors += [_TokenCheck(token)] if token is not None else []
    max_message = max_message_bytes(options.limits)
    server = grpc.aio.server(
        options=[*_OPTIONS, *_keepalive(options.heartbeat_timeout), ("grpc.max_receive_message_length", max_message)],
        interceptors=interceptors,
    )
    servicer = Servicer(
        core,
        clock=time.monotonic,
        persist=writer.flush if writer else None,
        monitor=monitor,
        on_call=None if metrics is None else functools.partial(metrics.rpc_handled, SERVICE_NAME),
    )
    add_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    host = options.host
    address = host_port(host, options.port)
    credentials = None if options.tls_cert is None else grpc.ssl_server_credentials(
        [(options.tls_key, options.tls_cert)],
        root_certificates=options.tls_ca,
        require_client_auth=options.tls_ca is not None,
    )
    try:
        port = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    except RuntimeError:  # gRPC says only "Failed to bind to address ...; set GRPC_VERBOSITY=debug"
        raise await _why_not_bound(address, options) from None
    await server.start()
    metrics_server = None
    sessions = session_port = None
    try:
        if options.session_port is not None and options.tls_cert is None:
            sessions = _SessionPort(servicer, token, max_message)
            try:
                session_port = servicer.session_port = await sessions.start(options.host, options.session_port)
            except OSError as exc:
                if options.session_port_required or exc.errno != errno.EADDRINUSE:
                    raise
                sessions = None
                log.warning(
                    "the session port %s ('auto', the default) is in use: serving without one, clients use "
                    "gRPC's stream (name a free port with --session-port PORT, 0 for any, or 'off')",
                    host_port(options.host, options.session_port), extra={"event": "session_port_busy"},
                )
        if writer is not None:
            await writer.flush()  # a new state file exists from the start
        if metrics is not None:
            metrics_host = options.host if options.metrics_host is None else options.metrics_host
            metrics_server = await start_http_server(
                lambda: metrics.render(core, time.monotonic()), metrics_host, options.metrics_port
            )
    except BaseException:
        if sessions is not None:
            sessions.close()
        await server.stop(None)
        raise
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    core.serving_from(time.monotonic())  # (restored: the heartbeat clocks start now)
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(servicer.watch_liveness()), loop.create_task(monitor.watch())]
    return RunningServer(
        server,
        port,
        core,
        servicer,
        health_servicer,
        tasks,
        metrics=metrics,
        metrics_server=metrics_server,
        sessions=sessions,
        session_port=session_port,
        writer=writer,
    )


async def _why_not_bound(address: str, options: ServerOptions) -> Exception:
    """Why gRPC could not listen on ``address``, which it does not say: the port (OSError,
    as for the session and metrics ports, its ``errno`` the system's), or (with TLS) the
    certificate and key, or the client CA (ValueError). Found by trying each part alone on a
    throwaway server: the address without TLS, then the certificate and key on any port."""

    async def takes(where: str, credentials=None) -> bool:
        probe = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        try:
            probe.add_insecure_port(where) if credentials is None else probe.add_secure_port(where, credentials)
            return True
        except RuntimeError:
            return False
        finally:
            await probe.stop(None)

    def port_taken() -> OSError:
        strerror, code = _bind_error(options.host, options.port)
        error = OSError(f"cannot listen on {address} (--host, --port): {strerror}")
        error.errno = code  # (its message stays the one above)
        return error

    if options.tls_cert is None or not await takes(address):
        return port_taken()
    if not await takes(host_port(options.host, 0), grpc.ssl_server_credentials([(options.tls_key, options.tls_cert)])):
        return ValueError("the TLS certificate and key (--tls-cert, --tls-key) are not valid PEM, or the key is not the certificate's")
    if options.tls_ca is not None:
        return ValueError("the client CA (--tls-ca) holds no valid PEM certificate")
    return port_taken()  # (taken meanwhile, or free again)


def _bind_error(host: str, port: int) -> tuple[str, int]:
    """What the system says to listening on ``host:port`` (a port in use, one below 1024
    without the privilege, a host that is not this machine's or that does not resolve),
    which gRPC does not, and its errno."""
    try:
        for family, kind, proto, _, where in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as gRPC's port)
                sock.bind(where)
    except OSError as exc:
        return exc.strerror or str(exc), exc.errno or errno.EADDRINUSE
    return "the port is in use, or the host is not an address of this machine", errno.EADDRINUSE  # (free again meanwhile)


_MADE_WITH = object()  # Coordinator.stop's grace when not given: the one it was made with


class Coordinator:
    """A coordinator serving from a background thread of this process.

    >>> with Coordinator(port=0) as coordinator:
    ...     address = coordinator.address   # "127.0.0.1:PORT"

    Keyword arguments are :class:`ServerOptions` fields, with its defaults: as under
    ``serve``, a process silent for ``heartbeat_timeout`` (60 s) is declared dead, and
    ``heartbeat_timeout=None`` turns the watch off. Except ``grace``: calls still running at
    :meth:`stop` get 1 s by default here (5 s under ``serve``); and the session port is a
    free one (7482 under ``serve``).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **options) -> None:
        options.setdefault("grace", 1.0)
        self._options = ServerOptions(host=host, port=port, **options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._running: RunningServer | None = None
        self._stopping: asyncio.Event | None = None
        self._grace: float | None = self._options.grace
        self._why = ""  # why it stops (told to the rounds it fails: RunningServer.stop)

    @property
    def port(self) -> int | None:
        return None if self._running is None else self._running.port

    @property
    def core(self) -> Core | None:
        return None if self._running is None else self._running.core

    @property
    def session_port(self) -> int | None:
        """The session port (``session_port=`` option), or None."""
        return None if self._running is None else self._running.session_port

    @property
    def metrics_port(self) -> int | None:
        """The port of the Prometheus endpoint (``metrics_port=`` option), or None."""
        return None if self._running is None else self._running.metrics_port

    @property
    def address(self) -> str:
        if self._running is None:
            raise RuntimeError("the coordinator is not running; call start() first")
        host = "127.0.0.1" if self._options.host in ("0.0.0.0", "::") else self._options.host
        return host_port(host, self.port)

    def start(self) -> "Coordinator":
        """Starts serving in a thread of its own; returns once it listens (or raises why it
        cannot). A coordinator serves once at a time: starting a running one is refused."""
        if self._running is not None:
            raise RuntimeError(f"the coordinator is already running at {self.address}; stop() it first")
        started = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            self._stopping = asyncio.Event()
            try:
                self._running = await start_server(self._options)
            except BaseException as exc:  # reported to start()'s caller
                failure.append(exc)
                return
            finally:
                started.set()
            await self._stopping.wait()
            await self._running.stop(self._grace, for_good=self._stopped())
            await _let_calls_end()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(main())
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name="pjrt-rendezvous-coordinator", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        STOPPED_HERE.pop(self._running.port, None)
        return self

    def stop(self, grace: float | None | object = _MADE_WITH, *, _why: str = "Coordinator.stop() was called") -> None:
        """Stops serving; calls still running get ``grace`` seconds (default: the ``grace``
        it was made with; None: none), then are cancelled. Without a state file, the rounds,
        gets of keys and waits for the world still pending fail at once, saying the
        coordinator stopped: none will take them up again (every process's work should be
        done first, its own included)."""
        if self._running is None or self._loop is None or self._thread is None:
            return
        self._grace = self._options.grace if grace is _MADE_WITH else grace
        self._why = _why
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join()
        if self._running.writer is None:  # (for good: this process's clients give up on it at once)
            STOPPED_HERE[self._running.port] = (self._options.host, self._stopped(), time.monotonic())
        self._running = None

    def _stopped(self) -> str:
        """Why it stopped, as told to the calls it fails (and, after, to this process's)."""
        return f"{EMBEDDED_STOPPED}{os.getpid()} on {socket.gethostname()} stopped ({self._why})"

    def __enter__(self) -> "Coordinator":
        # (``with Coordinator(...).start() as c:`` enters one already running)
        return self if self._running is not None else self.start()

    def __exit__(self, kind, exc, traceback) -> None:
        left = "its process left the `with Coordinator(...)` block"
        said = clip(str(exc).partition("\n")[0]) if exc is not None else ""  # (its first line)
        self.stop(_why=left if exc is None else f"{left} on {kind.__name__}: {said}" if said else f"{left} on {kind.__name__}")


_ROUNDS_NAMED_AT_STOP = 3


def _pending_at_stop(core: Core, kept: bool) -> str:
    """For the stopping line: the rounds still waiting and for whom (their members' calls end
    unanswered: ``kept`` in a state file, they call again once a coordinator is back, and
    the round is made again from their resends; else it is forgotten)."""
    now = time.monotonic()
    pending = [(job, rnd) for job in core.jobs.values() for rnd in job.pending.values()]
    if not pending:
        return ""
    named = "; ".join(
        f"job {job.name!r}: {rnd.describe()}, {len(rnd.arrivals)} of {rnd.size} arrived, "
        + core.with_missing(job, "missing ", rnd.missing(), now)
        for job, rnd in pending[:_ROUNDS_NAMED_AT_STOP]
    )
    more = f"; and {len(pending) - _ROUNDS_NAMED_AT_STOP} more" if len(pending) > _ROUNDS_NAMED_AT_STOP else ""
    # (the state file keeps finished rounds: a pending one is made again by its members'
    # resends, its age counted from then; "kept in the state file" said otherwise)
    after = "to be resent by its members to a coordinator restarted from the state file" if kept else "not kept in a state file: lost"
    return f"; {_plural(len(pending), 'round')} pending, {after}: {named}{more}"


async def _let_calls_end() -> None:
    """Calls cancelled by a stop still have tasks winding down: lets them end (for up to a
    second) before the loop closes, so that nothing is destroyed while pending, nor
    cancelled twice (``asyncio.run`` cancels what is left, and gRPC logs a call cancelled
    again as an unhandled error, with a traceback on stderr)."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=1.0)


async def _keep_watchdog_fed(interval: float) -> None:
    while True:
        _notify.notify("WATCHDOG=1")
        await asyncio.sleep(interval)


# Generation thresholds of the cyclic garbage collector while serving (CPython's: 700, 10, 10).
GC_THRESHOLDS = (20_000, 20, 100)


def tune_collector() -> None:
    """Tunes the cyclic garbage collector for a serving process (not an embedded coordinator:
    the process is not ours). Measured at 4,096 participants (bench/_scale.py): collections
    cost a tenth of the coordinator's CPU and full ones paused it 15 ms, longer than a
    barrier round takes, walking objects that live as long as the process (modules,
    descriptors, the server), which ``gc.freeze`` sets aside for good. A round allocates tens
    of thousands of short-lived objects that reference counting frees; cycles are rare, and
    the higher thresholds still collect them."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


# Seconds between two looks at whether the coordinator is idle, when it gives the heap's
# free memory back to the system (give_freed_memory_back).
TRIM_EVERY = 10.0


async def _trim_when_idle(core: Core) -> None:
    """Runs until cancelled: every TRIM_EVERY s, gives freed memory back if no round is
    pending and something was called since the last time (serve only: not an embedded
    coordinator, whose process is not ours)."""
    trimmed = None
    while True:
        await asyncio.sleep(TRIM_EVERY)
        if core.version != trimmed and not any(job.pending for job in core.jobs.values()):
            give_freed_memory_back()
            trimmed = core.version


# Open files a serving process asks for: a client process holds two connections (gRPC and
# the session port), so a pod of 4,096 processes needs some 8,200.
OPEN_FILES_WANTED = 1 << 16


def raise_open_files_limit() -> None:
    """Raises this process's soft limit on open files to its hard limit (at most
    ``OPEN_FILES_WANTED``), as a serving process may (not an embedded coordinator: the
    process is not ours). A shell's soft limit is often 1,024, where about 500 client
    processes connect: for the next ones ``accept`` fails (EMFILE), and asyncio and gRPC
    stop accepting for a while before they try again."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:  # pragma: no cover - a sandbox refusing it
            log.debug("cannot raise the open files limit from %d to %d: %s", soft, wanted, exc)
    if soft != resource.RLIM_INFINITY and soft < OPEN_FILES_WANTED // 8:
        log.warning(
            "this process may hold %d open files (its hard limit): about %d client processes "
            "can connect (two connections each); raise it for a larger pod (ulimit -Hn, or "
            "LimitNOFILE= in a systemd unit)", soft, max(0, soft - 64) // 2,
            extra={"event": "open_files_low"},
        )


# SIGHUP too: the terminal of a `serve` in the foreground closed (an ssh session ended);
# there is nothing to reload, and dying at once would skip the drain and the last state write.
# A signal the process was started ignoring (`nohup`, a shell's background job's SIGINT)
# stays ignored.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def serve_forever(options: ServerOptions, *, on_ready=None) -> None:
    """Serves until SIGINT/SIGTERM/SIGHUP (or until the state file cannot be written), then
    drains for ``options.grace`` seconds. Meant to own
    its process (``pjrt-rendezvous serve``): it raises the process's open files limit
    (:func:`raise_open_files_limit`) and tunes its garbage collector once it listens
    (:func:`tune_collector`).

    Under systemd (``NOTIFY_SOCKET`` set, ``Type=notify``) it sends ``READY=1`` once the
    gRPC port (and the session and metrics ports) listen and the state file is written,
    ``STOPPING=1`` when a stop signal arrives, and
    ``WATCHDOG=1`` keep-alives from the event loop when the unit sets ``WatchdogSec=``.

    Args:
        options: how to serve.
        on_ready: called with the :class:`RunningServer` once it listens and a stop signal
            drains it (before READY=1).

    Raises:
        RuntimeError: it stopped because the state file could not be written.
    """

    async def main() -> None:
        raise_open_files_limit()
        running = await start_server(options)
        tune_collector()
        stopping = asyncio.Event()
        received: list[str] = []  # the stop signals, by name

        def stop_on(sig: signal.Signals) -> None:
            received.append(sig.name)
            stopping.set()

        loop = asyncio.get_running_loop()
        # (not one the process started ignoring: SIGHUP under nohup, SIGINT in a job run with &)
        handled = [sig for sig in _STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]
        for sig in handled:
            loop.add_signal_handler(sig, stop_on, sig)
        if on_ready is not None:  # after the handlers: a stop signal from here on drains
            on_ready(running)
        where = host_port(options.host, running.port)
        if running.session_port is not None:
            where += f" (session port {running.session_port})"
        metrics = "" if running.metrics_port is None else f", metrics on port {running.metrics_port}"
        tls = "mutual TLS" if options.tls_ca else "TLS" if options.tls_cert else "no TLS"
        seconds = {"heartbeat_timeout": options.heartbeat_timeout, "late_after": options.late_after}
        log.info(  # (what is in effect, beside the warnings of variables it does not know: _cli)
            "listening on %s%s; %s, %s, %s, heartbeat timeout %s, late after %s",
            where,
            metrics,
            tls,
            "a token" if options.token else "no token",
            f"state file {options.state_file}" if options.state_file else "no state file",
            *("none" if v is None else f"{v:g} s" for v in seconds.values()),
            extra={
                "event": "listening",
                "port": running.port,
                "session_port": running.session_port,
                "metrics_port": running.metrics_port,
                "tls": tls,
                "token": bool(options.token),
                "state_file": None if options.state_file is None else str(options.state_file),
                **seconds,
            },
        )
        _notify.notify(f"READY=1\nSTATUS=serving on {where}{metrics}")
        interval = _notify.watchdog_interval()
        watchdog = None if interval is None else loop.create_task(_keep_watchdog_fed(interval))
        trimming = loop.create_task(_trim_when_idle(running.core))
        waits = [loop.create_task(stopping.wait())]
        if running.writer is not None:
            waits.append(loop.create_task(running.writer.failed.wait()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        def hurry(sig: signal.Signals) -> None:
            log.info("%s during the drain: in-flight calls are cancelled now", sig.name, extra={"event": "hurried", "signal": sig.name})
            running.hurry()

        for sig in handled:  # a second one ends the drain (under nohup, an ssh session's end did)
            loop.add_signal_handler(sig, hurry, sig)
        why = received[0] if received else "the state file could not be written"
        _notify.notify(f"STOPPING=1\nSTATUS=stopping ({why}): in-flight calls get {options.grace:g} s")
        log.info(
            "stopping (%s): in-flight calls get %.1f s%s", why, options.grace,
            _pending_at_stop(running.core, running.writer is not None and not running.writer.failed.is_set()),
            extra={"event": "stopping", "signal": received[0] if received else None},
        )
        started = time.monotonic()
        trimming.cancel()
        await running.stop(options.grace)
        if watchdog is not None:  # fed through the drain: systemd may still be watching
            watchdog.cancel()
        await _let_calls_end()
        log.info("stopped after %.1f s", time.monotonic() - started, extra={"event": "stopped"})
        if running.writer is not None and running.writer.failed.is_set():
            raise RuntimeError(f"stopped: the state file {options.state_file} could not be written (see the log)")

    asyncio.run(main())
