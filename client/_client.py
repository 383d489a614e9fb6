"""The process-wide client: one channel and one Session stream (``_session``), thread
bindings, combined rendezvous calls, host fan-in (``_relay``), key-value.

Thread safety: a :class:`Client` is shared by every thread of a process. ``_lock`` guards
the binding table and the open rendezvous batches; it is held only to read or change them,
never across a call. ``_session_lock`` guards the sessions.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import logging
import math
import operator
import os
import queue
import socket
import sys
import threading
import time
import uuid
import weakref
from _thread import LockType, allocate_lock as _allocate_lock, get_ident as _get_ident
from typing import Callable, Sequence

import grpc
import tenacity

from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb
from pjrt_rendezvous.protos.v1 import coordinator_pb2_grpc as pb_grpc

from ._config import _VARIABLES, DEFAULT, FAN_IN_AUTO_HOSTS, LAUNCH_VARIABLE, TOPOLOGY_VARIABLES, Settings, check_timeout
from ._errors import (
    EMBEDDED_STOPPED, STOPPED_HERE, CoordinatorUnavailableError, InvalidArgumentError, MismatchError, ParticipantFailedError,
    RendezvousError, RendezvousTimeout, UnknownJobError, UsageError, connection_hint, from_rpc_error, unchanging,
)
from ._relay import Relay, relay_path
from ._session import PING_EVERY, PING_TIMEOUT, Session, SocketSession, StatusError, trim_if_due
from ._topology import Topology
from ._version import build
from ._wire import Row, decode_payloads, encode_rendezvous

log = logging.getLogger("pjrt_rendezvous.client")

_CLIENT_VARIABLES = frozenset({*_VARIABLES.values(), *TOPOLOGY_VARIABLES, LAUNCH_VARIABLE})  # (the others: serve's, or unknown)
_variables_checked: set[str] = set()  # PJRT_RENDEZVOUS_* names this process has judged


def _warn_of_variables(env) -> None:
    """Warns once per process of a ``PJRT_RENDEZVOUS_*`` variable nothing reads, naming the
    one it resembles (a misspelt setting was ignored without a word), as serve does."""
    names = [n for n in env if n.startswith("PJRT_RENDEZVOUS_") and n not in _variables_checked]
    names = [n for n in names if n not in _CLIENT_VARIABLES]
    if not names:
        return
    _variables_checked.update(names)
    from pjrt_rendezvous.coordinator._cli import unknown_variables  # (serve's names are known too)

    for _, warning in unknown_variables(dict.fromkeys(names, "")):
        log.warning("%s", warning)

ALL: tuple[int, ...] = ()
# The server answers a timed-out wait with the list of missing ordinals; the transport
# deadline is this much later so that answer, not a bare DEADLINE_EXCEEDED, arrives.
_TRANSPORT_GRACE = 10.0
_BACKOFF_CAP = 2.0  # seconds: the longest pause between two retries
# Seconds a call keeps trying a server that answers in another protocol (HTTP/1, plain text to
# TLS), or whose TLS certificate it refuses, or a coordinator of this process stopped for good:
# a port taken over in a restart, a certificate being replaced, a coordinator started again
# in this process, not the whole connect_timeout of a misconfiguration or a coordinator gone.
_WRONG_PROTOCOL_PATIENCE = 5.0
_CLOSED = "this client was closed; call init() again"
# Why each client closed, when its closer said (close(why=)): told to the calls it ends.
_close_why: "weakref.WeakKeyDictionary[Client, str]" = weakref.WeakKeyDictionary()
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    # A connection that silently stops passing bytes (a dead host, a dropped NAT entry)
    # must fail within seconds so the call is retried, not wait forever: ping every 10 s,
    # give up on a ping after 5 s (without ping_timeout an unanswered ping waits 60 s).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect quickly after an outage: gRPC's own backoff (1 s growing to 120 s) would
    # otherwise add up to minutes on top of ours.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Directly, as the session port's plain sockets connect: the coordinator is on the pod's
    # own network, and a proxy set for the internet (http_proxy, https_proxy, grpc_proxy)
    # sent every call, loopback's too, through it.
    ("grpc.enable_http_proxy", 0),
]

_METHODS = pb.DESCRIPTOR.services_by_name["Coordinator"].methods
# Each method's response parser: protobuf's, but a round's payloads decoded as a list.
_RESPONSES = {m.name: getattr(pb, m.output_type.name).FromString for m in _METHODS} | {"Rendezvous": decode_payloads}
_TIMED = {m.name for m in _METHODS if "timeout" in m.input_type.fields_by_name}  # requests with a timeout

# After the host's relay failed, calls go to the coordinator directly this long, twice as
# long after each failure to connect to it in a row (a relay that never comes, or is frozen).
_RELAY_RETRY = 5.0
_RELAY_RETRY_MAX = 80.0
_REFRESH_TIMEOUT = 5.0  # seconds for the job's generation after a failed round (_refresh_generation)
_END_TIMEOUT = 5.0  # seconds to tell the coordinator that replicas ended (end_replicas)
_LEAVE_TIMEOUT = 2.0  # seconds close() gives its Leave, and a registration under way before it
# The coordinator's session port: how long to try connecting. After a connection refused (a
# coordinator restarting, a container that does not publish the port) or one that timed out
# (a firewall, or SYNs lost in a start-up burst) calls stay on gRPC, and the heartbeat
# thread, never a call, tries the port again after 10 s or a minute, then after twice as
# long each time it fails again, at most hourly.
_SESSION_PORT_CONNECT = 2.0
_SESSION_PORT_RETRY = 10.0
_SESSION_PORT_PROBE = 60.0
_SESSION_PORT_PROBE_MAX = 3600.0
# A "still waiting" warning asks the coordinator what the round waits for this long at most.
_DESCRIBE_TIMEOUT = 2.0
# A call through the host's relay that failed after this long beyond connect_timeout got
# through to the coordinator: a relay that cannot reach it says so after its own retries,
# each failing within a ping's wait and timeout.
_RELAY_GIVES_UP = 2 * (PING_EVERY + PING_TIMEOUT)


class _NoAnswer(StatusError):
    """A call's transport cut-off passed without an answer: its deadline and the grace after
    it (or, without a deadline, the longest a call that does not wait may take). The
    coordinator answers a round that timed out at its deadline, naming who is missing, so
    silence until the cut-off is the coordinator's (frozen, overloaded, or the network to it
    gone): reported as unavailable, and not retried (there is no time left to)."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, details)


def _with_rpc(error: RendezvousError, exc: grpc.RpcError) -> RendezvousError:
    """``error``, raised ``from None`` (the gRPC error's details are in its message), keeping
    those details (``_rpc_details``: a str, which pickles, as ``xla.spawn`` sends a replica's
    error) for the host relay, which passes them on alone (client/_relay.py)."""
    error._rpc_details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    return error


def _retried(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE and not isinstance(exc, _NoAnswer)


def _stopped_here(address: str, made: float) -> str | None:
    """When the coordinator at ``address`` was embedded in this process and stopped for good
    (``STOPPED_HERE``) after a client ``made`` then, why; None otherwise."""
    host, _, port = address.rpartition(":")
    entry = STOPPED_HERE.get(int(port)) if port.isdigit() else None
    if entry is None or entry[2] < made:
        return None
    served, why, _ = entry

    def ips(host: str) -> set[str]:
        try:
            return {info[4][0] for info in socket.getaddrinfo(host.strip("[]"), None)}
        except OSError:
            return set()

    def here(ip: str) -> bool:  # (an address of this host: one a socket can bind)
        try:
            with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.bind((ip, 0))
        except OSError:
            return False
        return True

    dialled = ips(host)
    if not (dialled & ips(served) if served not in ("0.0.0.0", "::") else any(map(here, dialled))):
        return None
    return f"{why} without a state file to resume from, and nothing was started there again"


_IMPORTED = time.monotonic()


def _process_age() -> float:
    """Seconds since this process started, as Linux's /proc tells (elsewhere, since this
    module was imported). A registration sends it: one that comes while the processes of an
    unformed run all have their connections closed joins their run if it started before the
    last close (a network cut), and starts a new run if after (a relaunch after a kill)."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()  # (the name before it may hold anything)
        # (field 22, starttime: clock ticks after boot)
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (AttributeError, OSError, ValueError, IndexError):  # (not Linux: no CLOCK_BOOTTIME or /proc)
        age = 0.0
    return age if age > 0 else time.monotonic() - _IMPORTED


_bound = threading.local()

# Every live client, and in a forked child those of its parent, with the parent's pid: a
# child cannot use them (their connection and threads, and the ordinals they registered,
# are the parent's), so each refuses at once instead of hanging on the parent's locks and
# threads, or reading the parent's answers off the shared connection.
_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()
# The job's key-value store each client saw last (a KvXResponse's store_id; Client._kv):
# kept here, not as an attribute, because a 30th attribute slows every round (Client).
_store_ids: "weakref.WeakKeyDictionary[Client, str]" = weakref.WeakKeyDictionary()
# The job each client registered in (RegisterResponse.job_id), kept here for the same reason.
_job_ids: "weakref.WeakKeyDictionary[Client, str]" = weakref.WeakKeyDictionary()
# When each client was made (monotonic): one made after a coordinator of this process
# stopped for good dials another at its port, should the port be taken again (_stopped_here).
_made: "weakref.WeakKeyDictionary[Client, float]" = weakref.WeakKeyDictionary()
# How many of each client's registrations are under way (changed under its lock; close() reads it
# without, and waits for them: Client._leave).
_registering: "weakref.WeakKeyDictionary[Client, int]" = weakref.WeakKeyDictionary()
# Each client's ordinals whose replica it ended (end_replicas) with their thread still bound:
# no batch waits for them (Client._gathered) until bound again.
_ended_bound: "weakref.WeakKeyDictionary[Client, set[int]]" = weakref.WeakKeyDictionary()
# Bindings whose thread ended bound, said so (Client._wait_for_sender): once each.
_said_ended: "weakref.WeakSet[Binding]" = weakref.WeakSet()
# The rounds each client gave up on without an answer, to tell the coordinator (Client._tell_given_up),
# one thread at a time: a sibling's next round must not overtake the telling.
_given_up: "weakref.WeakKeyDictionary[Client, list[pb.GiveUpRoundRequest]]" = weakref.WeakKeyDictionary()
_telling = threading.Lock()
_NOT_AFTER_GIVE_UPS = frozenset({"GiveUpRound", "Register"})  # (the telling's own call; a registration is told nothing)
_inherited: "weakref.WeakKeyDictionary[Client, int]" = weakref.WeakKeyDictionary()
_forked = False  # whether _inherited may hold any (a bool: cheap to test at every call)
# In a forked child: the session ports its parent's clients used, by coordinator address. A
# client the child makes calls there from the start: gRPC, whose threads the parent had
# inside it at the fork, aborted in about one child of ten once the child called through it
# ("Check failed: ... g_active_poller"); the session port is plain sockets.
_ports_at_fork: dict[str, int] = {}


def _after_fork_in_child() -> None:
    global _forked, _closing, _telling
    _closing, _telling = threading.Condition(), threading.Lock()  # (either may be held by a parent's thread)
    store_callers.clear()  # (the parent's threads)
    clients = list(_clients)
    if not clients:
        return  # (no check for this process's own clients to pay at each call)
    _forked = True
    parent = os.getppid()
    for client in clients:
        _inherited.setdefault(client, parent)
        port, _, backoff = client._session_port
        if port and not backoff:
            _ports_at_fork.setdefault(client.settings.address, port)
        # Held by a parent's thread at the fork, they would stay held: what the child may
        # still do (unbind a thread, close) must not wait for them.
        client._lock, client._session_lock = threading.Lock(), threading.Lock()
    _clients.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def inherited(client: "Client") -> bool:
    """Whether ``client`` is a parent's, in this forked child (the one test of it)."""
    return _forked and client in _inherited


def _fan_in(settings: Settings, topology: Topology) -> bool:
    """Whether this process's rounds go through its host's relay (``Settings.fan_in``)."""
    if settings.fan_in != "auto":
        return settings.fan_in == "host"
    per_host = topology.local_world_size
    return per_host > 1 and topology.num_tasks // per_host >= FAN_IN_AUTO_HOSTS


@dataclasses.dataclass(frozen=True, kw_only=True)
class Binding:
    """A thread's place in the world. Usable as a context manager that unbinds on exit; left by
    an exception (but a clean ``sys.exit`` or a generator's close), it ends the thread's replica first
    (:meth:`Client.end_replicas`, naming the exception), as a thread that dies bound of an
    uncaught exception does (``_ThreadFailed``; the main thread, ``_main_thread_died``, which
    cannot tell ``sys.exit(1)``)."""

    client: "Client" = dataclasses.field(repr=False)
    thread_index: int
    ordinal: int
    local_ordinal: int
    world_size: int
    device_index: int
    # The bound thread: once it has ended, another thread may take its index (bind_thread).
    _thread: threading.Thread | None = dataclasses.field(default=None, repr=False, compare=False)

    def __enter__(self) -> "Binding":
        if getattr(_bound, "binding", None) is not self:  # (a with block again after release did nothing)
            raise UsageError(
                f"this binding of ordinal {self.ordinal} is not the calling thread's (released at the end of its "
                "with block or by unbind_thread, made in another thread, or of a client closed since): enter "
                "bind_thread(...) again"
            )
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            # (A generator closed early is not a failure; a coordinator out of reach cannot
            # be told: trying would only hold the raise 5 s.)
            clean = exc is None or isinstance(exc, GeneratorExit) or (isinstance(exc, SystemExit) and exc.code in (None, 0))
            if not clean and not isinstance(exc, CoordinatorUnavailableError):
                client = self.client
                if current_binding() is self and not inherited(client):
                    # Its thread is out of its rounds: the rounds that need it, waiting anywhere
                    # or called later, fail now naming why (they waited for it until their
                    # timeout, 10 minutes by default), as ``xla.spawn``'s do; bound again, it is back.
                    try:
                        client.end_replicas([self.ordinal], how_it_ended(exc))
                    except Exception as error:  # noqa: BLE001 -- never in place of the user's exception
                        log.warning("could not tell the coordinator that ordinal %d ended: %r", self.ordinal, error)
        finally:
            self.client.unbind_thread()


def how_it_ended(exc: BaseException) -> str:
    """How a replica that raised ended, for the errors of the rounds that needed it."""
    if isinstance(exc, ParticipantFailedError):  # (its message names the member that went first)
        return f"raised {type(exc).__name__} (another member had gone)"
    try:
        line = str(exc).partition("\n")[0]
    except Exception:  # noqa: BLE001 -- a broken __str__
        line = ""
    return f"raised {type(exc).__name__}" + (f": {line}" if line else "")


class _ThreadFailed:
    """``threading.excepthook`` once a thread is bound: a thread that dies bound (not in a
    ``with`` block, which did this on its way out) of an uncaught exception ends its replica
    and unbinds first, then the hook that was in place when this one was put in front of it
    reports the exception. Each keeps its own: a hook set later that calls the one it replaced
    (ours), put behind a new one of ours at the next bind, ends the chain there, and ours
    restored by whoever replaced it (a test's monkeypatch) passes on to its own again."""

    __slots__ = ("before",)

    def __init__(self, before: Callable) -> None:
        self.before = before

    def __call__(self, args) -> None:
        try:
            binding = current_binding()  # (the hook runs in the dying thread)
            if binding is not None and args.thread is binding._thread:
                binding.__exit__(args.exc_type, args.exc_value, args.exc_traceback)
        finally:
            self.before(args)


_main_hooked = False  # whether _main_thread_died is registered (_hook_thread_failures)


def _hook_thread_failures() -> None:
    """Puts a ``_ThreadFailed`` in front of ``threading.excepthook`` unless one is there (a
    hook set since may have replaced it); has ``_main_thread_died`` run at the interpreter's
    exit, once per process (bound in any thread: a main thread bound to nothing may be
    interrupted while it joins bound threads)."""
    current = threading.excepthook  # (read once: two threads binding at once set the same)
    if not isinstance(current, _ThreadFailed):
        threading.excepthook = _ThreadFailed(current)
    global _main_hooked
    if not _main_hooked:
        # (the hook the interpreter's exit runs before it waits for the other threads, as
        # concurrent.futures uses it; private, so where it is missing nothing is hooked)
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            # The hooks run newest first: a thread pool's, registered at its module's import,
            # joins its workers, which may wait in rounds that need the main thread's ordinal.
            import concurrent.futures.thread  # noqa: F401

            with contextlib.suppress(RuntimeError):  # (the interpreter is shutting down already)
                register(_main_thread_died)
                _main_hooked = True


def _main_thread_died() -> None:
    """At the interpreter's exit, before it waits for the process's other threads: a main
    thread still bound (no ``with`` block left) that died of an uncaught exception ends its
    replica as any thread does (``_ThreadFailed``; threading.excepthook never sees the main
    thread's), so threads that run on need not wait for it until their rounds' timeout (a
    worker thread that is not a daemon keeps the process alive; Ctrl-C stops the main thread
    alone). ``sys.last_value`` is that exception (the interpreter sets it before it prints
    one) only if its traceback starts at the bottom of the main thread's stack (the script's
    module, or runpy's for ``-m``): pytest, ``code.interact`` and tkinter set it for
    exceptions they caught, which ended nothing; so does an interactive prompt. A main
    thread bound to nothing that an interrupt (KeyboardInterrupt, and only that) stopped ends
    the replicas of the process's bound threads: the interpreter waits for them next, and
    they, in rounds, for other processes, which wait for them."""
    binding = current_binding()  # (run in the main thread)
    exc = getattr(sys, "last_value", None)
    if exc is None or hasattr(sys, "ps1") or sys.flags.interactive:
        return
    tb = exc.__traceback__
    if tb is None or tb.tb_frame.f_back is not None:  # caught on its way, by a caller of that frame
        return
    if binding is not None:
        if not inherited(binding.client):
            binding.__exit__(type(exc), exc, tb)
        return
    if not isinstance(exc, KeyboardInterrupt):  # (a main thread that raised, its workers alone may finish)
        return
    # Ctrl-C while the main thread, bound to nothing, waited for bound threads (a join): the
    # interpreter waits for them, in rounds that may wait for others, and others for them.
    # Their replicas end: their rounds fail everywhere, naming the interrupt, and they raise.
    for client in list(_clients):
        ordinals = sorted(b.ordinal for b in list(client._bindings.values()) if b is not None)
        if ordinals and not client._closed and not inherited(client):
            try:
                client.end_replicas(ordinals, "ended when the process's main thread was interrupted (KeyboardInterrupt)")
            except Exception as error:  # noqa: BLE001 -- the exit goes on
                log.warning("could not tell the coordinator that ordinals %s ended: %r", ordinals, error)


def _asked_by(deadline: float | None) -> float:
    """The deadline of a call a waiting thread makes to describe its wait: _DESCRIBE_TIMEOUT
    from now, never past the wait's own ``deadline``."""
    bound = time.monotonic() + _DESCRIBE_TIMEOUT
    return bound if deadline is None else min(bound, deadline)


def open_channel(settings: Settings) -> grpc.Channel:
    """A gRPC channel to the coordinator, with TLS when ``settings`` ask for it."""
    credentials = settings.credentials()
    if credentials is None:
        return grpc.insecure_channel(settings.address, options=_CHANNEL_OPTIONS)
    return grpc.secure_channel(settings.address, credentials, options=_CHANNEL_OPTIONS)


def token_metadata(settings: Settings) -> tuple[tuple[str, str], ...] | None:
    """A call's metadata: the token, if any."""
    return (("authorization", f"Bearer {settings.token}"),) if settings.token else None


def describe_round(r: pb.PendingRound) -> str:
    """A pending round's tag(s) and who it waits for, as the coordinator has them."""
    tags = ", ".join(f"{t.tag!r}" for t in r.tags)
    missing = len(r.missing)
    return f"tag {tags}, missing {missing} of {missing + len(r.arrived)}: ordinal{'s' if missing != 1 else ''} {r.missing_summary}"


def pending_rounds(settings: Settings, timeout: float = _DESCRIBE_TIMEOUT) -> list[pb.PendingRound]:
    """The job's pending rounds, asked once on a channel of its own, for someone who is not a
    client of the job (spawn's parent, when a process crashed).

    Raises:
        grpc.RpcError: the coordinator did not answer within ``timeout``, or has no such job.
    """
    with open_channel(settings) as channel:
        request = pb.StatusRequest(job=settings.job, rounds_only=True)
        response = pb_grpc.CoordinatorStub(channel).Status(request, timeout=timeout, metadata=token_metadata(settings))
    return [r for job in response.jobs for r in job.pending_rounds]


def current_binding() -> Binding | None:
    """The calling thread's binding, or None (also once its client was closed: the thread
    may then bind again, to a new client)."""
    binding = getattr(_bound, "binding", None)
    if binding is not None and binding.client._closed:
        _bound.binding, _bound.closed = None, binding
        binding = None
    return binding


def xm_binding(what: str) -> Binding | None:
    """``current_binding()`` for a call whose unbound form answers for another world (a world
    of one, the XLA runtime's): a thread bound through a client closed since is refused, as
    its answers would be silently wrong (every thread its process's master, ordinal 0)."""
    binding = current_binding()
    if binding is None:
        closed = getattr(_bound, "closed", None)
        if closed is not None:
            why = _close_why.get(closed.client)
            if why is not None:  # (closed for its process's end: no advice to bind again)
                raise UsageError(f"{what}: this thread was bound as ordinal {closed.ordinal} through a client that was closed: {why}")
            raise UsageError(
                f"{what}: this thread was bound as ordinal {closed.ordinal} through a client that "
                "was closed since (pjrt_rendezvous.client.shutdown() or Client.close()); bind it "
                "again, or unbind it (Client.unbind_thread) to get the answers of an unbound thread"
            )
    return binding


def _payload_bytes(payload, what: str = "payload") -> bytes:
    # torch_xla's xm.rendezvous raises TypeError for str payloads; so do we.
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, (bytearray, memoryview)):
        return bytes(payload)
    raise TypeError(f"{what} must be bytes, got {type(payload).__name__}")


def _text(value, what: str) -> str:
    """``value``, a str the wire can carry (UTF-8), or a TypeError / UsageError naming ``what``."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be str, got {type(value).__name__}")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise UsageError(f"{what} {value!r} is not valid text (UTF-8): {exc.reason}") from None
    return value


def _ints(values, what: str) -> list[int]:
    """``values``, a sequence of ints (a numpy array's, a range, a set, a generator: read
    once), as a list of ints; else a TypeError naming ``what``. A str, bytes or mapping is
    refused: their items are characters, bytes' values or keys (b"\\x00\\x01" would be read
    as [0, 1], {0: 1} as [0])."""
    if type(values) is not list and type(values) is not tuple and isinstance(values, _NOT_SEQUENCES):
        raise TypeError(f"{what} must be a sequence of ints, got {type(values).__name__} {values!r}")
    try:
        values = [] if values is None else list(values)  # (a numpy array has no truth value)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of ints, got {type(values).__name__} {values!r}") from None
    if values and any(type(v) is not int for v in values):  # numpy's ints too, not bools
        try:
            if any(isinstance(v, bool) for v in values):
                raise TypeError
            values = [operator.index(v) for v in values]
        except TypeError:
            raise TypeError(f"{what} must be ints, got {values!r}") from None
    return values


_NOT_SEQUENCES = (str, bytes, bytearray, memoryview, collections.abc.Mapping)


def _integer(value, what: str) -> int:
    """``value`` as an int (numpy's too); a bool (an int subclass: True would count as 1),
    float or str is a TypeError naming ``what``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None


def _check_call(tag, replicas) -> list[int]:
    """A rendezvous call's tag and replicas as the coordinator takes them, checked before
    the round counts (its peers must not wait for a call refused here); the replicas as a
    list. :meth:`Client.rendezvous` checks the common case inline."""
    _text(tag, "tag")
    replicas = _ints(replicas, "replicas")
    if replicas and not -(2**31) <= min(replicas) <= max(replicas) < 2**31:
        # Out of range of any world (ordinals are 32-bit on the wire): sent as the nearest
        # 32-bit value, still out of range, so the coordinator fails the round for every member
        # as for any ordinal out of range (refused here, the call failed in its thread alone,
        # and its peers waited out their timeout, one round out of step after it).
        replicas = [min(max(r, -(2**31)), 2**31 - 1) for r in replicas]
    return replicas


class _Batch:
    """One process's arrivals at one round, sent in one call by the sibling whose arrival
    completes it, or by the first to arrive once the batch window passes."""

    __slots__ = ("group", "number", "members", "expected", "generation", "contributions", "deadline",
                 "first", "waiters", "done", "payloads", "error")

    def __init__(self, group: tuple[int, ...], number: int, generation: int, local: frozenset[int]) -> None:
        self.group = group
        self.number = number  # the round of the group
        self.members = None if group == ALL else frozenset(group)  # None: every local ordinal
        # Local ordinals the round may get: once all are in, the round is complete at once.
        self.expected = len(local) if self.members is None else len(local & self.members)
        self.generation = generation  # the one its round number belongs to
        self.contributions: dict[int, Row] = {}  # ordinal -> its row on the wire
        self.deadline: float | None = None
        # One held lock per thread waiting for the sender, released when the round is done:
        # cheaper to wake than an Event (a Condition and a lock per wait). ``first`` is the
        # first thread's, released early to make it send (``Client._signal_gathered``).
        self.first: LockType | None = None
        self.waiters: list[LockType] = []
        self.done = False  # the sender has the answer; no waiter joins any more
        self.payloads: list[bytes] | None = None
        self.error: BaseException | None = None


def _pass_on(batch: _Batch, waiter: LockType | None = None) -> None:
    """Wakes the waiter after ``waiter`` (None: the first). A done round's waiters are woken
    one after another, each by the one before: woken together, they would only queue for
    the GIL, most of them switched in twice (about a quarter fewer thread switches per round
    at 8 threads a process). The list no longer changes once the round is done, so the
    hand-off takes no lock; and no thread in the chain can be interrupted before it passes
    on (signals go to the main thread, whose rounds run on ``Client._stand_in``).
    """
    waiters = batch.waiters
    following = 0 if waiter is None else waiters.index(waiter) + 1
    if following < len(waiters):
        waiters[following].release()


_STILL_TRYING_AFTER = 5.0  # seconds of an outage before a call says that it keeps trying
# Address -> when it was said last (once in _STILL_TRYING_AFTER per address: a client of a
# coordinator gone for good, left open, does not silence another's).
_still_trying_said: dict[str, float] = {}
# Address -> (since when the calls to it fail, when one last failed): an outage as long as
# failures follow each other and no call is answered (a call's own budget counts from its
# own first failure).
_failing: dict[str, tuple[float, float]] = {}


def _outage_began(address: str, since: float, now: float) -> float:
    """When the outage at ``address`` that a call failing since ``since`` is part of began."""
    began, last = _failing.get(address, (since, -math.inf))
    if now - last > 2 * _BACKOFF_CAP + 1:  # (none failed a while: answered since, or nothing called)
        return since
    return min(began, since)


def _retrying(method: str, address: str, exc: BaseException, since: float, budget: float) -> None:
    """Before a call tries again: a debug line, and a warning once the outage has lasted
    _STILL_TRYING_AFTER (then at most as often, per address), so that a coordinator that is
    not there is not waited for in silence for the whole connect_timeout."""
    now = time.monotonic()
    began = _outage_began(address, since, now)
    _failing[address] = (began, now)
    if now - began < _STILL_TRYING_AFTER or now - _still_trying_said.get(address, -math.inf) < _STILL_TRYING_AFTER:
        log.debug("%s to %s failed (%s); retrying", method, address, exc)
        return
    _still_trying_said[address] = now
    details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
    log.warning(  # (the outage may be older than the call: its budget counts from its own first failure)
        "the coordinator at %s has not answered for %.0f s (%s: %s); this call tries again for up to %.0f s more "
        "(connect_timeout, %.0f s from its first failure).%s", address, now - began, method, details,
        max(0.0, since + budget - now), budget, connection_hint(details),
    )


def _serve_stand_in(client: "Client", calls: queue.SimpleQueue) -> None:
    """The stand-in thread of a client (``Client._stand_in_calls``): runs the main thread's
    rounds, one after another, until a None."""
    while _stand_in_round(client, calls):
        pass


def _stand_in_round(client: "Client", calls: queue.SimpleQueue) -> bool:
    """Runs the next call handed over (False: the None that ends the thread). Nothing of
    the call stays referenced here once the main thread is woken: this frame may live on in
    an exception's traceback, and the thread waits for the next call for as long as the
    main thread takes to make one."""
    item = calls.get()
    if item is None:
        return False
    call, done, outcome = item
    outcome.append(True)  # started: the call's own cut-offs bound it from here on
    try:
        binding, tag, payload, replicas, deadline = call
        # The deadline the main thread's call set (if it passed while the call was queued
        # behind an interrupted one, the round fails as timed out).
        timeout = None if deadline is None else max(deadline - time.monotonic(), 1e-6)
        outcome += (client.rendezvous(binding, tag, payload, replicas, timeout=timeout), None)
    except BaseException as exc:  # the main thread raises it, if still waiting
        outcome += (None, exc)
    finally:
        item = call = outcome = binding = tag = payload = replicas = None
        done.release()
    return True


# Each client's latest call handed to its stand-in, while the main thread has not taken its
# outcome (interrupted, or gone at its deadline): the list the stand-in fills (Client._stand_in_calls).
_stand_in_latest: "weakref.WeakKeyDictionary[Client, list]" = weakref.WeakKeyDictionary()

# Threads inside a torch Store's call (client/_store.py) -> the client it calls through, and the thread:
# Client.close() lets them leave. (Not an attribute: see Client.__init__.)
store_callers: dict[int, tuple["Client", threading.Thread]] = {}
_closing = threading.Condition()  # notified by Client.close(): calls waiting to retry end


class Client:
    """Talks to the coordinator for every thread of one process.

    Create it through :func:`pjrt_rendezvous.client.init`; it is cheap until first used
    (the channel connects lazily).
    """

    def __init__(self, settings: Settings, topology: Topology) -> None:
        # Fewer than 30 attributes: from 30 on, CPython (3.11-3.13) no longer shares an
        # instance's keys with its class, and every attribute and method access in
        # rendezvous() takes the slow path (+3 % client instructions per round at 2x8).
        _warn_of_variables(os.environ)
        self.settings = settings
        self.topology = topology
        self.incarnation = uuid.uuid4().hex
        self._channel = open_channel(settings)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._lock = threading.Lock()
        self._bindings: dict[int, Binding] = {}  # thread index -> binding
        self._local: frozenset[int] | None = None  # their ordinals (_local_ordinals)
        # (group, round, the replicas list as given, generation) -> the batch of this process's arrivals
        self._batches: dict[tuple[tuple[int, ...], int, tuple[int, ...], int], _Batch] = {}
        self._rounds: dict[tuple[int, tuple[int, ...]], int] = {}  # (ordinal, group) -> next round
        self._generation = 0  # the job generation our round counters belong to
        # ordinal -> the generation its thread was last told of, None after a failed round
        # (_moved): each thread learns of a move by an error, waiting then or calling later.
        self._told: dict[int, int | None] = {}
        self._heartbeat_timeout = 0.0
        self._background_started = False
        self._stopped = threading.Event()
        self.events: list[pb.WatchEvent] = []  # deaths and restarts in the job, as streamed
        self._inside: dict[int, _Batch] = {}  # ordinal -> the batch of the round its thread is inside
        self._main_thread = threading.main_thread().ident
        # The main thread's rounds once it has had siblings (_stand_in_calls): its calls in
        # order, to a thread of its own, started with the first of them.
        self._stand_in: queue.SimpleQueue | None = None
        self._closed = False
        self._session_lock = threading.Lock()
        self._current_session: Session | None = None
        # Fan-in (client/_relay.py): the host's relay, its socket and our session with it.
        self._relay_path = relay_path(settings.address, settings.job, topology.host) if _fan_in(settings, topology) else None
        self._relay: Relay | None = None  # ours, when we are the host's first process
        self._relay_started = False
        self._relay_session: SocketSession | None = None
        self._relay_retry = (0.0, _RELAY_RETRY)  # (not before, then how long to stay away after a failure)
        # The coordinator's session port, once a Register or Heartbeat answer names it (0:
        # none), and the time (monotonic) before which it is not tried again after failing.
        self._session_port = (0, 0.0, 0.0)  # (port, retry at, probe backoff: > 0 after a failure)
        if _ports_at_fork.get(settings.address):  # (a forked child's: see _ports_at_fork)
            self._learn_session_port(_ports_at_fork[settings.address])
        # Whether the coordinator reads a relay's processes named once (Register, Heartbeat).
        self.reads_process_indexes = False
        _clients.add(self)
        _made[self] = time.monotonic()

    # -- plumbing -------------------------------------------------------------------------

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The gRPC calls' metadata: the token, if any. (A property, not an attribute: see
        ``tests/test_client.py``, ``test_a_client_has_fewer_than_30_attributes``.)"""
        return token_metadata(self.settings)

    def _deadline(self, timeout) -> float | None:
        timeout = self.settings.timeout if timeout is DEFAULT else check_timeout(timeout)
        return None if timeout is None else time.monotonic() + timeout

    def _refuse_if_inherited(self, what: str, tag: str | None = None) -> None:
        parent = _inherited.get(self)
        if parent is not None:
            raise UsageError(
                f"{what if tag is None else f'{what}({tag!r})'}: this client was made in process "
                f"{parent}, the parent of this forked process ({os.getpid()}); its connection, "
                "threads and ordinals are the parent's: make the call in the parent (this process "
                "may use the key-value store through a client of its own, "
                "pjrt_rendezvous.client.get_client())"
            )

    def _refuse_parents_task(self) -> None:
        """In a forked child: refuses to register the task a parent's client registered (the
        child reads the parent's environment, so a client of its own is the same task): the
        coordinator took the child for the task's process restarted, and the parent, replaced,
        failed with the rest of its job."""
        for parent, pid in list(_inherited.items()):
            if (
                parent._background_started and parent.settings.address == self.settings.address
                and parent.settings.job == self.settings.job and parent.topology.task_id == self.topology.task_id
            ):
                raise UsageError(
                    f"bind_thread: task {self.topology.task_id} of job {self.settings.job!r} is registered by this "
                    f"process's parent ({pid}), of which it is a fork ({os.getpid()}); bound here, it would replace "
                    "the parent in the job: make rendezvous calls in the parent (a thread's binding from the parent "
                    "answers get_ordinal here), or start the child with a task of its own"
                )

    def _call(
        self,
        method: str,
        request,
        deadline: float | None = None,
        *,
        waits: bool = False,
        progress: Callable[[float], None] | None = None,
        relay: bool = False,
        raw: bool = False,
    ):
        """Sends one call on a session, retrying transient failures, and maps errors (the one place).

        Retries stop at ``connect_timeout`` or at ``deadline``, whichever is first. Every
        request is safe to resend: rounds carry (group, round), non-idempotent key-value
        changes carry a request id. While a call waits, ``progress(seconds waited)`` runs
        every ``progress_interval``. With ``relay``, the call goes through the host's relay
        when there is one (fan-in), else (or when the relay fails) to the coordinator. With
        ``raw``, the response is returned serialized, as it came.

        ``request`` is a protobuf message, or a function of the seconds left before
        ``deadline`` (None without one) that returns the request serialized.
        """
        if self._closed:
            raise UsageError(self._closed_message())
        if _forked:
            self._refuse_if_inherited(method)
        if _given_up and method not in _NOT_AFTER_GIVE_UPS and self in _given_up:
            self._tell_given_up(deadline)
        attempt = (method, request, deadline, waits, progress, relay, raw)
        began = time.monotonic()
        try:
            answer = self._attempt(*attempt)  # the common case, without building a Retrying
            if _failing:
                _failing.pop(self.settings.address, None)  # (answered: see _retrying)
            return answer
        except grpc.RpcError as exc:
            if self._closed:  # cancelled by close(), not refused by the coordinator
                raise UsageError(self._closed_message()) from exc
            if not _retried(exc) or (deadline is not None and time.monotonic() >= deadline):
                # (from None: the gRPC error's details are in the message; its chain printed them twice)
                raise _with_rpc(self._error(exc, method), exc) from None
            log.debug("%s to %s failed (%s); retrying", method, self.settings.address, exc)
            first = exc.details() if hasattr(exc, "details") else None  # (for the final error)
        # The retry budget counts from the start of the current outage, not of the call: a
        # round that waited ten minutes and then lost its coordinator still gets the full
        # connect_timeout to find it again. An attempt that got through restarts the outage
        # after it: on a socket session to the coordinator, one during which it answered
        # anything but a refusal of the call itself (it pings a silent peer, so a frozen or
        # unreachable coordinator answers nothing, and each attempt there fails only after
        # its ping times out; one that answers UNAVAILABLE is the outage); through the
        # host's relay, which answers its pings itself, one longer than the relay takes to
        # give up on a silent coordinator; on gRPC's stream, whose keepalive we do not see,
        # one that lasted longer than the backoff cap.
        now = time.monotonic()
        outage = {"since": now, "attempt": now, "session": None, "heard": 0.0, "relayed": False}  # (since: the first failure)
        # Since when every attempt met a server speaking another protocol (None: not the last one).
        outage["wrong"] = now if unchanging(first or "") else None

        def before(state) -> None:
            outage["attempt"], outage["session"] = time.monotonic(), None

        def stop(state) -> bool:
            now = time.monotonic()
            session = outage["session"]
            if session is not None and outage["relayed"]:
                got_through = now - outage["attempt"] > self.settings.connect_timeout + _RELAY_GIVES_UP
            elif isinstance(session, SocketSession):
                got_through = session.heard != outage["heard"] and not getattr(state.outcome.exception(), "answered", False)
            else:
                got_through = now - outage["attempt"] > _BACKOFF_CAP
            if got_through:
                outage["since"] = now
            if self._closed or (deadline is not None and now >= deadline):
                return True
            if (  # (looked for as briefly as a server of another protocol: one started there again is found)
                STOPPED_HERE and now - outage["since"] >= _WRONG_PROTOCOL_PATIENCE and _stopped_here(self.settings.address, _made[self])
            ):
                return True
            details = state.outcome.exception().details() or ""
            outage["wrong"] = (outage["wrong"] or now) if unchanging(details) else None
            if outage["wrong"] is not None and now - outage["wrong"] >= _WRONG_PROTOCOL_PATIENCE:
                return True  # (not a coordinator starting: it would not answer at all)
            return now - outage["since"] >= self.settings.connect_timeout

        backoff = tenacity.wait_random_exponential(multiplier=0.05, max=_BACKOFF_CAP)

        def wait(state) -> float:  # never past the budget or the deadline
            now = time.monotonic()
            left = self.settings.connect_timeout - (now - outage["since"])
            if deadline is not None:
                left = min(left, deadline - now)
            if outage["wrong"] is not None:  # (its patience, not past it by the backoff)
                left = min(left, outage["wrong"] + _WRONG_PROTOCOL_PATIENCE - now)
            return max(0.0, min(backoff(state), left))

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_retried),
            wait=wait,
            stop=stop,
            before=before,
            reraise=True,
            sleep=self._retry_wait,
            before_sleep=lambda state: _retrying(method, self.settings.address, state.outcome.exception(), outage["since"], self.settings.connect_timeout),
        )
        try:
            answer = retrying(self._attempt, *attempt, outage)
            _failing.pop(self.settings.address, None)  # (answered: see _retrying)
            return answer
        except grpc.RpcError as exc:
            if self._closed:
                raise UsageError(self._closed_message()) from exc
            error = self._error(exc, method)
            gone = STOPPED_HERE and isinstance(error, CoordinatorUnavailableError) and _stopped_here(self.settings.address, _made[self])
            if gone:
                waited = time.monotonic() - outage["since"]
                error = CoordinatorUnavailableError(
                    f"coordinator at {self.settings.address} unavailable for {method}: {gone}"
                    + (f" (given up after {waited:.1f} s, not its connect_timeout)" if waited >= _WRONG_PROTOCOL_PATIENCE else "")
                )
            elif isinstance(error, RendezvousTimeout):  # (its times count from the resend the coordinator saw)
                error = RendezvousTimeout(
                    f"{error} (the call waited {time.monotonic() - began:.1f} s in all: it was sent again "
                    "after an attempt failed)"
                )
            elif (
                isinstance(error, CoordinatorUnavailableError)
                and outage["wrong"] is not None
                and time.monotonic() - outage["wrong"] >= _WRONG_PROTOCOL_PATIENCE
            ):
                error = CoordinatorUnavailableError(
                    f"{error} (given up after {time.monotonic() - outage['wrong']:.1f} s, not its connect_timeout: "
                    f"{unchanging(exc.details() or '')}, which waiting does not change)"
                )
            elif (
                isinstance(error, CoordinatorUnavailableError)
                and (first or "").startswith("the coordinator ")
                and first not in str(error)
            ):
                # What the coordinator said first, before it went away (it could not write
                # its state file, or was stopping): the last attempt only found nobody there.
                error = CoordinatorUnavailableError(f"{error} (its first failed attempt: {first})")
            if isinstance(error, CoordinatorUnavailableError) and self._heartbeat_timeout and not gone:
                now = time.monotonic()
                unanswered = now - _outage_began(self.settings.address, outage["since"], now)
                if unanswered > self._heartbeat_timeout:  # (a network cut, not a restart: it judged this process)
                    error = CoordinatorUnavailableError(
                        f"{error} (unanswered for {unanswered:.0f} s, longer than its heartbeat timeout of "
                        f"{self._heartbeat_timeout:g} s: if it ran meanwhile, it has declared this process dead)"
                    )
            raise _with_rpc(error, exc) from None

    def _error(self, exc: grpc.RpcError, method: str) -> RendezvousError:
        return from_rpc_error(
            exc, address=self.settings.address, method=method, where=self._where(),
            token_from=self.settings.token_from,
        )

    def _where(self) -> str:
        """For an unreachable coordinator at the address a client takes when nothing names
        one: that it was that default, and, in a world of more tasks than one host runs,
        that a process on any host but the coordinator's must be told where it is."""
        topo = self.topology
        if not topo.address_defaulted or self.settings.address != topo.address:
            return ""
        return f" Nothing named the coordinator, so this client looked on its own host ({topo.address})" + (
            f"; in a world of {topo.num_tasks} tasks on more than one host, set PJRT_RENDEZVOUS_ADDRESS (or "
            "TPU_WORKER_HOSTNAMES) on every host but the coordinator's." if topo.num_tasks > topo.local_world_size else "."
        )

    def _attempt(
        self, method: str, request, deadline: float | None, waits: bool, progress, relay: bool, raw: bool,
        outage: dict | None = None,
    ):
        """One try of :meth:`_call`: the parsed response, or the call's ``grpc.RpcError``.
        A retry notes in ``outage`` the session it used, when that last heard its peer, and
        whether it is the host relay's (see ``_call``)."""
        # A resend (after a coordinator restart) asks only for what is left of the deadline.
        if callable(request):  # a function of the seconds left (None: no deadline) encoding it
            body = request(None if deadline is None else max(1e-3, deadline - time.monotonic()))
        else:
            if deadline is not None and method in _TIMED and request.HasField("timeout"):
                request.timeout = max(1e-3, deadline - time.monotonic())
            body = request.SerializeToString()
        transport = None
        if deadline is not None:  # (a resend gets only what is left of the grace too)
            transport = max(0.0, deadline + (_TRANSPORT_GRACE if waits else 0) - time.monotonic())
        elif not waits:
            transport = max(self.settings.connect_timeout, 30.0)
        interval = self.settings.progress_interval
        session = self._session(relay=relay)
        if outage is not None:
            outage.update(session=session, heard=session.heard, relayed=session is self._relay_session)
        started = time.monotonic()
        try:
            answer = session.call(method, body, transport, progress if interval is not None else None, interval)
        except grpc.RpcError as exc:
            if session is self._relay_session and exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._relay_failed(exc)
            if (
                exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                and (waits or deadline is None)  # (else the cut-off is the caller's own timeout)
                and transport is not None
                and time.monotonic() - started >= transport - 0.05  # (gRPC's clock started later)
            ):
                within = f"{_TRANSPORT_GRACE:.3g} s past its deadline" if deadline is not None else f"within {transport:.3g} s"
                late = getattr(exc, "late", 0.0)
                raise _NoAnswer(
                    f"no answer to {method} {within}"
                    + (
                        f"; this process did not run for {late:.1f} s past that (it was stopped, or starved of CPU), "
                        "so the coordinator may not be at fault"
                        if late else ": the coordinator, or the network to it, is frozen or overloaded"
                    )
                ) from exc
            raise
        return answer if raw else _RESPONSES[method](answer)

    def _session(self, *, relay: bool = False) -> Session:
        """The open session to the coordinator, or with ``relay`` to the host's relay when
        fan-in is on and the relay has not failed lately; a new one after the last broke
        (they are opened lazily)."""
        path = self._relay_path  # (read once: a relay that fails to start sets it to None)
        if relay and path is not None:
            session = self._relay_or_none(path)
            if session is not None:
                return session
        with self._session_lock:
            if self._closed:
                raise UsageError(self._closed_message())
            if self._current_session is None or self._current_session.broken is not None:
                self._current_session = self._open_session()
            return self._current_session

    def _relay_or_none(self, path: str) -> SocketSession | None:
        """The session with the host's relay; None while it is avoided, or when a new one
        cannot be had (then it is avoided longer). A new one is opened outside the session
        lock: it waits for the relay's answer to a ping, which other calls must not."""
        with self._session_lock:
            if self._closed:
                raise UsageError(self._closed_message())
            if time.monotonic() < self._relay_retry[0]:
                return None
            if self._relay_session is not None and self._relay_session.broken is None:
                return self._relay_session
        try:
            session = SocketSession.local(path)
        except grpc.RpcError as exc:
            with self._session_lock:
                if time.monotonic() >= self._relay_retry[0]:  # (not already by another thread)
                    self._avoid_relay(exc, again=True)
            return None
        with self._session_lock:
            current = self._relay_session
            if self._closed or (current is not None and current.broken is None):
                session.close()  # another thread's is in place (or we are closing)
                if self._closed:
                    raise UsageError(self._closed_message())
                return current
            self._relay_session, self._relay_retry = session, (0.0, _RELAY_RETRY)
            return session

    def _open_session(self) -> Session:
        """On the coordinator's session port when it offers one and it has not failed
        lately, else on gRPC. Called with the session lock held."""
        port, _, backoff = self._session_port
        if port and not backoff:
            authorization = f"Bearer {self.settings.token}" if self.settings.token else ""
            try:
                return SocketSession.tcp(self._coordinator_host(), port, authorization, _SESSION_PORT_CONNECT)
            except grpc.RpcError as exc:
                # The heartbeat thread tries the port again (_probe_session_port): a working
                # gRPC stream is not given up for a port that may refuse again.
                timed_out = isinstance(exc.__cause__, TimeoutError)
                backoff = _SESSION_PORT_PROBE if timed_out else _SESSION_PORT_RETRY
                self._session_port = (port, time.monotonic() + backoff, backoff)
                if timed_out:
                    log.warning(
                        "%s; using gRPC, and trying the port again in the background from time to "
                        "time (if gRPC gets through, a firewall drops the session port: open it to the "
                        "coordinator, or set PJRT_RENDEZVOUS_TRANSPORT=grpc; if not, the coordinator's host "
                        "is out of reach)",
                        exc.details(),
                    )
                else:
                    log.info("%s; using gRPC, and trying the port again in %.0f s", exc.details(), backoff)
        return Session(self._stub, self._metadata)

    def _coordinator_host(self) -> str:
        return self.settings.address.rpartition(":")[0].strip("[]")

    def _probe_session_port(self) -> None:
        """In the heartbeat thread: a session port that refused or timed out is tried again
        when its backoff has passed; once it answers, the next session uses it."""
        port, retry_at, backoff = self._session_port
        if not backoff or time.monotonic() < retry_at:
            return
        try:
            socket.create_connection((self._coordinator_host(), port), timeout=_SESSION_PORT_CONNECT).close()
        except OSError as exc:
            backoff = min(2 * backoff, _SESSION_PORT_PROBE_MAX)
            with self._session_lock:
                if self._session_port[0] == port:
                    self._session_port = (port, time.monotonic() + backoff, backoff)
            log.debug("the session port %d is still unreachable (%s); next try in %.0f s", port, exc, backoff)
            return
        log.info("the coordinator's session port %d answers again; calls move to it", port)
        with self._session_lock:
            if self._session_port[0] == port:
                self._session_port = (port, 0.0, 0.0)
        self._learn_session_port(port)

    def _learn_session_port(self, port: int) -> None:
        """The coordinator offers ``port`` (0: none), told in a Register or Heartbeat answer:
        the next session uses it (``Settings.transport``), so a gRPC stream in use ends once
        its calls are answered, unless the port failed lately (``_open_session``)."""
        if self.settings.transport != "auto" or self.settings.tls_ca is not None:
            return  # never the token in plain text next to a TLS channel
        with self._session_lock:
            if port != self._session_port[0]:
                self._session_port = (port, 0.0, 0.0)
            if port and not self._session_port[2] and type(self._current_session) is Session:
                self._current_session.retire()
                self._current_session = None

    def _relay_failed(self, exc: grpc.RpcError) -> None:
        """The host's relay is not there (yet, or any more): the coordinator directly for a while."""
        with self._session_lock:
            self._avoid_relay(exc)

    def _avoid_relay(self, exc: grpc.RpcError, again: bool = False) -> None:
        """With the session lock held: calls go to the coordinator directly for a while,
        longer ``again`` (the relay failed once more when tried again). Our connection to
        the relay is closed, so that it stops waiting for our calls (it held each of its
        rounds for the batch window, for ordinals that came directly; a call still on it
        is resent directly, and counted once)."""
        _, away = self._relay_retry
        self._relay_retry = (time.monotonic() + away, min(2 * away, _RELAY_RETRY_MAX) if again else away)
        session, self._relay_session = self._relay_session, None
        if session is not None:
            session.close(f"the host relay failed ({exc.details()}); calls go to the coordinator directly for a while")
        # Said once the relay has failed every try for a while (then again after each time
        # it answered): a relay not there yet at the start is usual, one never reached
        # (another TMPDIR or user than its process's, its process gone) left no word.
        loud = again and away < 16 * _RELAY_RETRY <= 2 * away  # (its 4th failed try in a row: 35 s after the first)
        log.log(
            logging.WARNING if loud else logging.DEBUG,
            "host relay at %s unavailable (%s); calling the coordinator directly for %.0f s%s",
            self._relay_path, exc.details(), away,
            "; it has failed every try for a while: the host's first process (local rank 0) serves it, at a "
            "path made from its TMPDIR and user, the coordinator's address, the job and the host: check that it "
            "runs, as this process's user and with its TMPDIR" if loud else "",
        )

    def _leave_relay(self) -> None:
        """A process of our host is gone, perhaps the one running the relay (a stuck relay
        would keep our rounds from hearing of it): calls waiting there are resent directly,
        and the coordinator answers them (a resent contribution counts once)."""
        with self._session_lock:
            session = self._relay_session
        if session is not None:
            session.close()

    def _start_relay(self) -> None:
        """Fan-in: the host's first process (local rank 0) starts the host's relay."""
        with self._lock:
            if self._relay_path is None or self.topology.local_rank != 0 or self._relay_started:
                return
            self._relay_started = True
        try:
            relay = Relay(self, self._relay_path)
        except Exception as exc:  # the host's processes call the coordinator directly
            log.warning("cannot start the host relay at %s: %s; calling the coordinator directly", self._relay_path, exc)
            self._relay_path = None
            return
        with self._lock:
            if not self._closed:
                self._relay, relay = relay, None
        if relay is not None:  # close() ran while it started
            relay.close()

    def close(self, *, leave: bool = True, why: str | None = None) -> None:
        """Stops heartbeats and the event watch and closes the channel. Calls other threads
        are making end with UsageError ("this client was closed"), and a thread binding
        meanwhile is refused so (its registration, once answered, is left too).

        Args:
            leave: tell the coordinator this process is done, so its ordinals are gone at once
                (best effort). With ``leave=False`` the coordinator declares the process dead
                when it is not heard from again within 10 s (or twice its heartbeat interval) of
                its connection closing, as if it had crashed.
            why: why it closes, told to the calls it ends and, with the Leave, to its peers
                and the coordinator's log (default: "its client closed").
        """
        if self._closed:
            return
        if why:
            _close_why[self] = why
        if inherited(self):
            # The parent's: its Leave would end the parent's registration, and closing its
            # sessions would shut the connection the parent shares with this process.
            self._closed = True
            return
        self._stopped.set()
        # Closed before the Leave (a call its Leave fails, this process's round, is told the
        # client was closed, not that this process died), and the Leave sent before any lock
        # is taken: a signal handler runs this (xla's SIGTERM), perhaps while its thread
        # holds one. The sessions are closed under the session lock below, once no new one
        # is opened.
        self._closed = True
        _stand_in_latest.pop(self, None)  # (what it holds, an interrupted call's, goes too)
        if leave:
            self._leave(why or "")
        with self._session_lock:
            for session in (self._current_session, self._relay_session):
                if session is not None:
                    session.close()
        with _closing:
            _closing.notify_all()  # (calls waiting to retry: they end, UsageError)
        me = threading.get_ident()
        inside = {key: thread for key, (client, thread) in list(store_callers.items()) if client is self and key != me}
        with self._lock:  # from here on the main thread makes its calls itself (they fail)
            calls, self._stand_in = self._stand_in, None
            relay, self._relay = self._relay, None  # (one started meanwhile closes itself: _start_relay)
        if relay is not None:
            relay.close()
        if calls is not None:
            calls.put(None)  # ends the thread once the calls before it are done
        self._channel.close()
        if inside:
            # A Store's callers are let leave, and out of the torch frames they were called
            # from: at the interpreter's exit (shutdown) a daemon thread still in one when
            # finalization began was stopped inside torch's C++ (a PrefixStore's, a process
            # group's), and the process aborted (134 or 139) instead of exiting. Each is given
            # a moment to end (a thread torch started has no Python thread to join).
            left = time.monotonic() + 1.0
            while any(key in store_callers for key in inside) and time.monotonic() < left:
                time.sleep(0.005)
            left = time.monotonic() + 0.25
            for thread in inside.values():
                if isinstance(thread, threading._DummyThread):
                    time.sleep(max(0.0, min(0.05, left - time.monotonic())))
                else:
                    thread.join(max(0.0, left - time.monotonic()))

    def _closed_message(self) -> str:
        """What a call this client's close() ended is told: why, when close() said."""
        why = _close_why.get(self)
        return _CLOSED if why is None else f"this client was closed: {why}"

    def _leave(self, reason: str) -> None:
        """close()'s goodbye (best effort), within _LEAVE_TIMEOUT in all: first the
        registrations under way are waited for (a Leave that reached the coordinator before
        one would leave the process registered); none when nothing was registered, or when
        a registration is still unanswered then (the coordinator declares the process dead
        once its connection closes)."""
        give_up = time.monotonic() + _LEAVE_TIMEOUT
        if _registering.get(self):
            with _closing:
                _closing.notify_all()  # (one waiting to try again ends now: UsageError)
        # The count is read before whether any registration was answered, which bind_thread
        # sets before it lowers the count: one answered in between counts as registered.
        while (registering := _registering.get(self, 0)) and time.monotonic() < give_up:
            time.sleep(0.005)
        if registering or not self._background_started:
            return
        try:
            self._stub.Leave(
                pb.LeaveRequest(job=self.settings.job, incarnation=self.incarnation, reason=reason),
                timeout=max(0.1, give_up - time.monotonic()),
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            log.debug("leaving job %s failed: %s", self.settings.job, exc)

    def _retry_wait(self, seconds: float) -> None:
        """The wait before a call's next attempt, ended by close()."""
        closing = _closing  # (once: a forked child makes its own)
        with closing:
            closing.wait_for(lambda: self._closed, seconds)

    def end_replicas(self, ordinals: Sequence[int], reason: str) -> None:
        """Tells the coordinator that the threads of these ordinals (this process's) are
        done, the process perhaps going on with others: the rounds that need one fail now
        and later, naming ``reason``, instead of waiting for them until their timeout (best
        effort: a failure is logged; ``xla.spawn`` refuses this process's own calls anyway).
        ``ordinals`` of the wrong type or ``reason`` not a str: TypeError; an ordinal outside
        the wire's 32 bits: UsageError."""
        ordinals = _ints(ordinals, "ordinals")
        reason = _text(reason, "reason")
        if ordinals and not 0 <= min(ordinals) <= max(ordinals) < 2**31:
            raise UsageError(f"ordinals must be in [0, 2**31), got {ordinals!r}")  # (protobuf's "Value out of range")
        if self._closed:  # (its Leave said more)
            return
        with self._lock:  # a sibling's batch waiting for one still bound goes now (it waited a batch window)
            ended = self._local_ordinals().intersection(ordinals)
            if ended:
                _ended_bound.setdefault(self, set()).update(ended)
                self._signal_gathered(None)
        request = pb.EndReplicasRequest(job=self.settings.job, incarnation=self.incarnation, ordinals=ordinals, reason=reason)
        try:
            self._call("EndReplicas", request, time.monotonic() + _END_TIMEOUT)
        except (RendezvousError, UsageError) as exc:
            log.warning("could not tell the coordinator that the replicas of ordinals %s ended: %s", list(ordinals), exc)

    # -- liveness -------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """The job generation this client's rounds belong to (it grows when a process of
        the job restarts; 0 before the first registration)."""
        return self._generation

    def _adopt_generation(self, generation: int, *, registered: bool = False, job_id: str = "") -> None:
        """A new job generation (a process restarted): round counters start again, and the
        first threads of batches of the old one send them now (no sibling joins them: see
        ``_moved``). A Register answer's (``registered``) is taken even when lower, or the
        same number of another job (``job_id``): the coordinator restarted without its state
        file, or dropped the job, and the job is new to it (at generation 1 again, the
        counters of a process that had been at 1 would go on, out of step for good with a new
        process's)."""
        with self._lock:
            known = _job_ids.get(self)
            if job_id:
                _job_ids[self] = job_id
            if generation > self._generation or (
                registered and (generation != self._generation or (known is not None and job_id and job_id != known))
            ):
                if self._generation:
                    log.warning(
                        "job %s %s generation %d; round numbers restart", self.settings.job,
                        "is new to the coordinator, at" if generation == self._generation else "moved to", generation,
                    )
                    self._rounds.clear()
                    _given_up.pop(self, None)  # (rounds of the old generation or job: void)
                if generation < self._generation:  # (a number its threads may have had before: told again)
                    for ordinal, told in self._told.items():
                        if told is not None:
                            self._told[ordinal] = self._generation
                self._generation = generation
                self._signal_gathered(None)
                if self._relay is not None:
                    self._relay.generation_moved(generation)

    def _refresh_generation(self) -> None:
        """After a round failed (ABORTED): the job's generation now, so that a thread told
        of a move by the failure calls next in the new generation, whether or not our Watch
        has heard of it yet. Its siblings wait for it, so it is bounded: a coordinator lost
        just then makes them fail once more, in the old generation, rather than wait."""
        request = pb.HeartbeatRequest(job=self.settings.job, incarnation=self.incarnation)
        try:
            self._adopt_generation(self._call("Heartbeat", request, time.monotonic() + _REFRESH_TIMEOUT).generation)
        except RendezvousError:
            pass  # (this process replaced or declared dead: its calls say so; or no answer in time)

    def _moved(self, ordinal: int) -> None:
        """With the lock held, at a call of a thread whose last call was in another generation
        than the job's now. After a failed round (a member died, left or restarted) the thread
        is resynchronizing: the call is of the new generation. Else it raises: the job moved
        since the thread's last round, rounds of the old generation are void, and so is its
        place in their sequence. Its peers' threads likewise fail once (their round pending
        then, or their next call), so all meet again in the new generation whatever each had
        heard of the move when it called."""
        told, self._told[ordinal] = self._told[ordinal], self._generation
        restart = next(
            (e for e in reversed(self.events) if e.generation == self._generation and e.kind == pb.WatchEvent.PROCESS_RESTARTED),
            None,
        )
        if told is None or (restart is not None and ordinal in restart.ordinals):
            return  # (the restart replaced this process: the coordinator's answer says so)
        why = "a process restarted" if restart is None else restart.message
        raise ParticipantFailedError(
            f"job {self.settings.job!r} moved from generation {told} to {self._generation} ({why}); rounds of "
            f"generation {told} are void, and this call of ordinal {ordinal}, its first since, is refused: its next "
            f"call is of generation {self._generation}"
        )

    def _start_background(self) -> None:
        """Heartbeats and the event watch run once this process has registered (called once)."""
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._watch_loop, "watch")):
            threading.Thread(target=target, name=f"pjrt-rendezvous-{name}", daemon=True).start()

    def _heartbeat_loop(self) -> None:
        request = pb.HeartbeatRequest(job=self.settings.job, incarnation=self.incarnation)
        refused = None  # the last refusal warned of: each is warned of once while it lasts
        # At most a third of the coordinator's timeout, as its last answer gives it (a
        # coordinator restarted with a shorter one must not find every process silent).
        while not self._stopped.wait(min(self.settings.heartbeat_interval, (self._heartbeat_timeout or math.inf) / 3)):
            try:
                response = self._call("Heartbeat", request)
            except ValueError:  # closed under us: close() was called (_call's UsageError, or the channel's)
                return
            except RendezvousError as exc:
                if self._stopped.is_set():
                    return
                if str(exc) != refused:
                    log.warning("heartbeat to %s failed: %s", self.settings.address, exc)
                    refused = str(exc)
                if getattr(exc, "code", "") == "ABORTED":
                    return  # declared dead: nothing left to keep alive
                continue  # a replaced process, or one a restarted coordinator forgot, may bind again
            refused = None
            self._heartbeat_timeout = response.heartbeat_timeout
            self._adopt_generation(response.generation)
            self._learn_session_port(response.session_port)
            self._probe_session_port()
            self.reads_process_indexes = response.reads_process_indexes
            trim_if_due()

    def _watch_loop(self) -> None:
        request = pb.WatchRequest(job=self.settings.job, incarnation=self.incarnation)
        while not self._stopped.is_set():
            try:
                for event in self._stub.Watch(request, metadata=self._metadata):
                    request.after = event.index  # a stream opened again resumes here
                    if self._stopped.is_set():  # closing (its own Leave's event among those still coming)
                        return
                    if event.kind == pb.WatchEvent.KIND_UNSPECIFIED:  # the stream's marker
                        continue
                    request.after += 1
                    self.events.append(event)
                    level = logging.INFO if event.kind == pb.WatchEvent.PROCESS_LEFT else logging.WARNING
                    log.log(level, "job %s: %s", self.settings.job, event.message)
                    self._adopt_generation(event.generation)
                    if event.host == self.topology.host and event.kind in (
                        pb.WatchEvent.PROCESS_DEAD,
                        pb.WatchEvent.PROCESS_LEFT,
                        pb.WatchEvent.PROCESS_RESTARTED,
                    ):
                        self._leave_relay()
            except grpc.RpcError as exc:
                exc.__traceback__ = None  # the stream's call raised itself: free it now (see Session._read)
                if self._stopped.is_set() or exc.code() in (
                    grpc.StatusCode.CANCELLED,
                    grpc.StatusCode.ABORTED,  # declared dead: nothing to watch for any more
                    grpc.StatusCode.UNAUTHENTICATED,
                ):
                    return
                # The coordinator went away, or forgot this process (restarted without a
                # state file: the process may register again) or was told of its
                # replacement (as the heartbeats, it keeps trying): again a little later.
                self._stopped.wait(1.0 if exc.code() == grpc.StatusCode.UNAVAILABLE else 5.0)
            except ValueError:  # the channel was closed under us: close() was called
                return

    # -- binding --------------------------------------------------------------------------

    def bind_thread(
        self,
        thread_index: int,
        *,
        runtime_ordinal: int | None = None,
        runtime_world_size: int = 0,
    ) -> Binding:
        """Registers the calling thread as device ``thread_index`` of this process.

        Args:
            thread_index: the thread's device index within the process, in
                ``[0, devices per process)``.
            runtime_ordinal: the XLA runtime's global ordinal of the thread's device, if
                known; the coordinator cross-checks it against the rank table.
            runtime_world_size: the XLA runtime's world size, if known.

        Returns:
            The :class:`Binding`; also a context manager that unbinds on exit (and, left by
            an exception, ends the replica first: see :class:`Binding`).

        Raises:
            UsageError: the thread is already bound, or another thread holds the index.
            DuplicateOrdinalError: another process holds the ordinal.
            MismatchError: world size or runtime ordinal disagrees with the job.
        """
        try:
            if isinstance(thread_index, bool):
                raise TypeError
            thread_index = operator.index(thread_index)  # (numpy's ints too, as for replicas)
        except TypeError:
            raise TypeError(f"thread_index must be an int, got {thread_index!r}") from None
        for name, value in (("runtime_ordinal", runtime_ordinal), ("runtime_world_size", runtime_world_size)):
            if value is not None and (type(value) is not int or not 0 <= value < 2**31):  # (the wire's int32)
                raise (TypeError if type(value) is not int else UsageError)(
                    f"{name} must be an int in [0, 2**31), got {value!r}"
                )
        if _forked:
            self._refuse_if_inherited("bind_thread")
            self._refuse_parents_task()
        self.topology.ordinal(thread_index)  # validates the range with a clear message
        existing = current_binding()
        if existing is not None and existing.client is not self and inherited(existing.client):
            existing = None  # a forked child's thread, bound through its parent's client: it may bind to its own
        if existing is not None:
            raise UsageError(
                f"this thread is already bound to thread index {existing.thread_index} "
                f"(ordinal {existing.ordinal}); unbind it first"
            )
        with self._lock:
            if self._closed:
                raise UsageError(self._closed_message())
            held = self._bindings.get(thread_index)
            if held is not None and held._thread is not None and not held._thread.is_alive():
                # Its thread ended bound (no `with`, no unbind_thread): nothing can use it now.
                del self._bindings[thread_index]
                self._local = None
            if thread_index in self._bindings:
                raise UsageError(
                    f"thread index {thread_index} is already bound by another thread of this "
                    "process; each thread binds its own index"
                )
            self._bindings[thread_index] = None  # reserved while registering
            _registering[self] = _registering.get(self, 0) + 1
        try:
            topo = self.topology
            thread = pb.ThreadSpec(thread_index=thread_index)
            if runtime_ordinal is not None:
                thread.runtime_ordinal = runtime_ordinal
            request = pb.RegisterRequest(
                job=self.settings.job,
                incarnation=self.incarnation,
                host=topo.host,
                pid=os.getpid(),
                task_id=topo.task_id,
                num_tasks=topo.num_tasks,
                devices_per_task=topo.devices_per_process,
                local_rank=topo.local_rank,
                threads=[thread],
                runtime_world_size=runtime_world_size,
                client_version=build(),
                heartbeat_interval=self.settings.heartbeat_interval,
                launch=os.environ.get(LAUNCH_VARIABLE, ""),
            )

            def register(_left) -> bytes:  # (its age as it is sent: a resend may be much later)
                request.process_age = _process_age()
                return request.SerializeToString()

            response = self._call("Register", register)
        except BaseException:
            with self._lock:
                del self._bindings[thread_index]
                _registering[self] -= 1
            raise
        with self._lock:  # registered: close() leaves from now on (and waited for this answer)
            first, self._background_started = not self._background_started, True
            _registering[self] -= 1  # (after: close() reads the count first, without the lock)
            if self._closed:
                del self._bindings[thread_index]
                raise UsageError(self._closed_message())
        (assignment,) = response.assignments
        self._heartbeat_timeout = response.heartbeat_timeout
        self._learn_session_port(response.session_port)
        self.reads_process_indexes = response.reads_process_indexes
        self._adopt_generation(response.generation, registered=True, job_id=response.job_id)
        if first:
            self._start_background()
        self._start_relay()
        _hook_thread_failures()
        binding = Binding(
            client=self,
            thread_index=thread_index,
            ordinal=assignment.ordinal,
            local_ordinal=assignment.local_ordinal,
            world_size=response.world_size,
            device_index=thread_index,
            _thread=threading.current_thread(),
        )
        with self._lock:
            if self._closed:  # (meanwhile, after its Leave: see close)
                del self._bindings[thread_index]
                raise UsageError(self._closed_message())
            self._bindings[thread_index] = binding
            self._local = None
            self._told.setdefault(binding.ordinal, self._generation)  # (bound again: its sequence goes on)
            if _ended_bound:
                _ended_bound.get(self, set()).discard(binding.ordinal)  # (bound again, it is back)
        _bound.binding, _bound.closed = binding, None
        return binding

    def unbind_thread(self) -> None:
        """Forgets the calling thread's binding (its ordinal stays registered, its replica not
        ended: unlike a ``with`` block left by an exception, see :class:`Binding`)."""
        binding = current_binding()
        _bound.closed = None
        if binding is not None and binding.client is not self and inherited(binding.client):
            _bound.binding = None  # a forked child's thread forgets its parent's binding
            return
        if binding is None or binding.client is not self:
            return
        with self._lock:
            self._bindings.pop(binding.thread_index, None)
            self._local = None
            self._signal_gathered(None)  # (a sibling's batch waited for it a batch window)
        _bound.binding = None

    def _local_ordinals(self) -> frozenset[int]:
        """The ordinals of the bound threads (cached: asked at every arrival of every round)."""
        if self._local is None:
            self._local = frozenset(b.ordinal for b in self._bindings.values() if b is not None)
        return self._local

    def wait_world(self, *, timeout=DEFAULT) -> list[pb.Participant]:
        """Blocks until every ordinal of the job is registered; returns the rank table (one
        Participant per ordinal, in ordinal order)."""
        deadline = self._deadline(timeout)
        request = pb.WaitWorldRequest(job=self.settings.job)
        if deadline is not None:
            request.timeout = max(1e-3, deadline - time.monotonic())
        started = time.monotonic()

        def progress(_: float) -> None:
            from pjrt_rendezvous.coordinator._core import _duration

            log.warning(
                "still waiting after %s s for the world of job %r: %s", _duration(time.monotonic() - started), self.settings.job,
                self._describe_world(deadline),
            )

        response = self._call("WaitWorld", request, deadline, waits=True, progress=progress)
        table = []
        for process in response.processes:
            for thread in process.threads:
                participant = pb.Participant(
                    ordinal=thread.ordinal,
                    local_ordinal=thread.local_ordinal,
                    task_id=process.task_id,
                    thread_index=thread.thread_index,
                    host=process.host,
                    pid=process.pid,
                    incarnation=process.incarnation,
                    last_seen_age=process.last_seen_age,
                    alive=process.alive,
                )
                if thread.HasField("runtime_ordinal"):
                    participant.runtime_ordinal = thread.runtime_ordinal
                table.append(participant)
        return sorted(table, key=lambda p: p.ordinal)

    # -- rendezvous -----------------------------------------------------------------------

    def rendezvous(
        self,
        binding: Binding,
        tag: str,
        payload: bytes = b"",
        replicas: Sequence[int] = (),
        *,
        timeout=DEFAULT,
    ) -> list[bytes]:
        """One rendezvous round for the ordinal of ``binding``; see the module-level
        :func:`pjrt_rendezvous.client.rendezvous` for the contract."""
        if _forked:
            self._refuse_if_inherited("rendezvous", tag)
        if type(payload) is not bytes:
            payload = _payload_bytes(payload)
        if type(tag) is str and tag.isascii() and (type(replicas) is tuple or type(replicas) is list) and not replicas:  # the common case, checked inline
            replicas = []
        else:
            replicas = _check_call(tag, replicas)
        deadline = self._deadline(timeout)
        world = binding.world_size
        if world == 1 and (not replicas or replicas == [binding.ordinal]):
            return [payload]
        group = ALL
        if replicas:
            # The round counts on the group of its ordinals in range, as the coordinator's
            # does (it refuses the others, and fails that group's round for every member).
            members = sorted({r for r in replicas if 0 <= r < world})
            if not members:
                raise InvalidArgumentError(
                    f"replicas {sorted(set(replicas))} are out of range [0, {world}) for job "
                    f"{self.settings.job!r} (called by ordinal {binding.ordinal} with tag {tag!r})"
                )
            if members != list(range(world)):
                group = tuple(members)
        main = _get_ident() == self._main_thread
        ordinal = binding.ordinal
        with self._lock:
            # The main thread's hand-off is decided in the same hold of the lock as its
            # arrival: a sibling bound in between would make it a batch's first or sending
            # thread, which an interrupt must not stop.
            handed = main and self._stand_in_calls((binding, tag, payload, replicas, deadline))
            if not handed:
                if self._told.get(ordinal, self._generation) != self._generation:
                    self._moved(ordinal)
                counter = (ordinal, group)
                round_number = self._rounds.get(counter, 0)
                self._rounds[counter] = round_number + 1
                # Siblings share a call only with the very same replicas list: the coordinator
                # must see (and refuse) a sibling's malformed list too.
                key = (group, round_number, tuple(replicas) if replicas else (), self._generation)
                batch = self._batches.get(key)
                first = batch is None
                if first:
                    batch = self._batches[key] = _Batch(group, round_number, self._generation, self._local_ordinals())
                batch.contributions[ordinal] = (ordinal, tag, payload, "")
                nearer = deadline is not None and (batch.deadline is None or deadline < batch.deadline)
                if nearer:
                    batch.deadline = deadline
                self._inside[ordinal] = batch
                # The thread whose arrival completes the round sends it: no thread is woken to
                # send, and siblings are not woken at each arrival.
                send = self._gathered(batch)
                if send:
                    del self._batches[key]
                else:
                    waiter = _allocate_lock()
                    waiter.acquire()
                    batch.waiters.append(waiter)
                    if first:
                        batch.first = waiter
                    elif nearer and batch.first in batch.waiters:  # its wait was set by a later deadline
                        batch.waiters.remove(batch.first)
                        batch.first.release()
                if len(self._batches) > (not send):  # other open batches (ours is one unless sent)
                    self._signal_gathered(batch)
        if handed:  # from here on an interrupt stops only the wait
            done, outcome, queued = handed
            if not done.acquire(True, -1 if deadline is None or not queued else max(0.0, deadline - time.monotonic())):
                if not outcome:
                    # Queued behind an earlier call that was interrupted and still waits: the
                    # stand-in runs this one later, expired (its round fails for its peers too).
                    raise RendezvousTimeout(
                        f"rendezvous({tag!r}) of ordinal {ordinal} timed out before it started: an earlier "
                        "call of the main thread, interrupted, is still waiting for its round"
                    )
                done.acquire()  # under way, and bounded by its own cut-offs (_call)
            _stand_in_latest.pop(self, None)  # (done: kept only while one is not, what it holds with it)
            _, payloads, error = outcome
            if error is not None:
                try:
                    raise error
                finally:
                    del error, handed, outcome  # no cycle through this frame (it holds the payload)
            return payloads
        held = None  # how long the first thread waited for its siblings before it sent
        if not send:
            if first:
                began = time.monotonic()
                send = self._wait_for_sender(key, batch, waiter)
                held = time.monotonic() - began if send else None
            else:
                waiter.acquire()  # released when the round is done (_pass_on)
                _pass_on(batch, waiter)
        if send:
            try:
                batch.payloads = self._send_round(replicas, group, round_number, batch)
            except BaseException as exc:
                if isinstance(exc, RendezvousTimeout):
                    exc = self._local_timeout(exc, held, batch)
                batch.error = exc
                if isinstance(exc, ParticipantFailedError) and EMBEDDED_STOPPED not in str(exc):  # (no one to ask)
                    self._refresh_generation()
                elif isinstance(exc, CoordinatorUnavailableError):
                    self._give_up(replicas, round_number, batch)
            finally:
                with self._lock:  # no member is blocked in this round any more
                    batch.done = True
                    for member in batch.contributions:
                        if self._inside.get(member) is batch:
                            del self._inside[member]
                    _pass_on(batch)  # each waiter then wakes the next
        if batch.error is not None:
            if isinstance(batch.error, ParticipantFailedError):  # its thread resynchronizes (_moved)
                self._told[ordinal] = None
            if send or not isinstance(batch.error, RendezvousError):
                raise batch.error
            raise _copy_error(batch.error) from batch.error.__cause__
        return list(batch.payloads)

    def _local_timeout(self, exc: RendezvousTimeout, held: float | None, batch: _Batch) -> RendezvousTimeout:
        """``exc``, with what this process knows of it: that the call waited here first
        (``held`` s; the coordinator counts from when it came: "timed out after 0.0014 s"
        for a timeout of 0.5 s), and which of this process's ordinals in the round no thread
        is bound to (unbound, or never bound: the coordinator names them as alive), or bound
        but absent."""
        from pjrt_rendezvous.coordinator._core import FAILED_BEFORE_IT_CAME, _ordinals_word

        topo = self.topology
        ours = [topo.ordinal(i) for i in range(topo.devices_per_process)]
        with self._lock:
            bound = self._local_ordinals()
            # (not those that came to the round in another call: a sibling sent apart, its
            # with block since ended by the same timeout, is not unbound in this round)
            ours = [
                o for o in ours
                if o not in batch.contributions and (batch.members is None or o in batch.members)
                and self._rounds.get((o, batch.group), 0) <= batch.number
            ]
        absent, unbound = [o for o in ours if o in bound], [o for o in ours if o not in bound]
        notes = []
        if held is not None and held >= 0.01:
            waited_for = f"{_ordinals_word(absent)} of its own" if absent else "its other threads"
            notes.append(
                f"this process sent its call {held:.2g} s after its first thread arrived: it waited for {waited_for} "
                "for up to the batch window"
            )
        late = FAILED_BEFORE_IT_CAME in str(exc)  # (a round it came late to waited for others)
        if absent and not late and not notes:  # (bound since the call went out, or sent by an arrival elsewhere)
            notes.append(f"{_ordinals_word(absent)} of this process {'is' if len(absent) == 1 else 'are'} bound but did not come to this round")
        if unbound and not late:
            notes.append(f"no thread of this process is bound to {_ordinals_word(unbound)}")
        if not notes:
            return exc
        error = RendezvousTimeout(f"{exc} ({'; '.join(notes)})")
        error.__suppress_context__ = True  # (exc's message is in it)
        return error

    def _stand_in_calls(self, call: tuple) -> tuple[LockType, list, bool] | None:
        """With the lock held (against close() and the bindings changing): hands a call of
        the main thread to the stand-in thread, started with the first call the main thread
        makes while other threads of the process are bound; returns a lock released once
        the outcome, (payloads, None) or (None, the exception), is in the list, after the
        True the stand-in puts there when it starts the call; and whether it is queued
        behind an earlier call not done yet (one interrupted). None: the main thread makes
        the call itself (it has never had siblings, or the client is closed).

        The main thread is the one a signal interrupts (Ctrl-C), at almost any point. In a
        round its siblings depend on whichever thread sends their batch, or waits out the
        batch window for one that does not come; interrupted in either part, it would leave
        them waiting. So once it has siblings, its rounds run on a thread of its own, which
        no signal interrupts, in the order they were made (its round counters stay in
        step), and the main thread only waits for the outcome.
        """
        calls = self._stand_in
        if calls is None:
            if self._closed or len(self._local_ordinals()) < 2:
                return None
            calls = self._stand_in = queue.SimpleQueue()
            try:
                threading.Thread(
                    target=_serve_stand_in, args=(self, calls), name="pjrt-rendezvous-stand-in", daemon=True
                ).start()
            except BaseException:  # a thread that started after all ends at once
                self._stand_in = None
                calls.put(None)
                raise
        done, outcome = _allocate_lock(), []
        done.acquire()
        earlier = _stand_in_latest.get(self)
        _stand_in_latest[self] = outcome
        calls.put((call, done, outcome))
        return done, outcome, earlier is not None and len(earlier) < 3  # (an earlier call not done)

    def _signal_gathered(self, arrived: _Batch) -> None:
        """With the lock held: an arrival may complete other batches too (its thread is no
        longer awaited there: it is blocked in another round); their first threads send them."""
        for batch in self._batches.values():
            if batch is not arrived and batch.first in batch.waiters and self._gathered(batch):
                batch.waiters.remove(batch.first)
                batch.first.release()

    def _wait_for_sender(self, key: tuple, batch: _Batch, waiter) -> bool:
        """The first thread of a batch waits until the round is done; True when it must send
        it instead: its siblings did not complete the round within the batch window (or an
        arrival elsewhere completed it, ``_signal_gathered``). It waits at most half the time
        left before the batch's deadline, as a host relay holds a round: held until its own
        deadline, the call came after the round's (its peers', called earlier), and the round
        named the ordinals that had come in time missing too."""
        window_ends = time.monotonic() + self.settings.batch_window
        while True:
            now = time.monotonic()
            end = window_ends if batch.deadline is None else min(window_ends, now + (batch.deadline - now) / 2)
            released = waiter.acquire(True, max(0.0, end - now))
            with self._lock:
                send = self._batches.get(key) is batch
                if send and released and not self._gathered(batch):
                    # Woken by a sibling whose deadline is nearer (rendezvous): wait again, less.
                    waiter = batch.first = _allocate_lock()
                    waiter.acquire()
                    batch.waiters.append(waiter)
                    continue
                if send:  # no sibling sends it: send what arrived
                    del self._batches[key]
                    if waiter in batch.waiters:
                        batch.waiters.remove(waiter)
                    ended = [
                        b for b in self._bindings.values()
                        if b is not None and b.ordinal not in batch.contributions
                        and (batch.members is None or b.ordinal in batch.members)
                        and b._thread is not None and not b._thread.is_alive() and b not in _said_ended
                    ]
                    _said_ended.update(ended)
                elif waiter not in batch.waiters:  # signalled, but a late sibling sends it
                    if batch.done:
                        return False
                    waiter = _allocate_lock()
                    waiter.acquire()
                    batch.waiters.append(waiter)
                    released = False
            break
        if send:
            for b in ended:  # (a binding may be used from another thread: this only says so)
                log.warning(
                    "ordinal %d (thread index %d) was bound by thread %r, which ended without unbinding; "
                    "rounds that need it wait for it until their timeout unless another thread calls "
                    "with its binding (bind in a `with bind_thread(...)` block, or call unbind_thread())",
                    b.ordinal, b.thread_index, b._thread.name,
                )
            return True
        if not released:  # else the round is done, and it is this waiter's turn
            waiter.acquire()
        _pass_on(batch, waiter)
        return False

    def _gathered(self, batch: _Batch) -> bool:
        """With the lock held: whether no sibling the batch's round may still get is missing.

        A sibling is awaited only while it has not reached this round yet (its round counter
        for the group is not past it) and is not blocked in another rendezvous.
        """
        contributions, members = batch.contributions, batch.members
        if batch.generation != self._generation:
            return True  # of a generation no sibling calls in any more
        if len(contributions) >= batch.expected and (
            members is None or contributions.keys() <= members  # no outsider counted
        ):
            return True
        for ordinal in self._local_ordinals():
            if ordinal in contributions or (members is not None and ordinal not in members):
                continue
            if self._rounds.get((ordinal, batch.group), 0) > batch.number:
                continue  # already arrived at this round
            inside = self._inside.get(ordinal)
            # Blocked in another group's round, it cannot come now; still finishing an
            # earlier round of this group (its result is on the way), it will.
            if inside is None or inside.group == batch.group:
                if _ended_bound and ordinal in _ended_bound.get(self, ()):
                    continue  # its replica ended, its thread still bound (end_replicas): it does not come
                return False
        return True

    def _send_round(self, replicas: list[int], group: tuple[int, ...], round_number: int, batch: _Batch) -> list[bytes]:
        job, incarnation, generation = self.settings.job, self.incarnation, batch.generation
        rows = sorted(batch.contributions.values())  # by ordinal (each once)

        def request(timeout: float | None) -> bytes:
            return encode_rendezvous(job, incarnation, replicas, round_number, timeout, generation, rows)

        started = time.monotonic()

        def progress(_: float) -> None:  # (counted from the call, not from its latest resend)
            from pjrt_rendezvous.coordinator._core import _duration, _ordinals_word, describe_group

            log.warning(  # (the group and ordinals named as the coordinator names them)
                "still waiting after %s s in round %d of %s (%s here): %s",
                _duration(time.monotonic() - started), round_number, describe_group(group),
                _ordinals_word(list(batch.contributions)), self._describe_wait((group, round_number), batch.deadline),
            )

        try:
            return self._call("Rendezvous", request, batch.deadline, waits=True, progress=progress, relay=True)
        except CoordinatorUnavailableError as exc:  # (which round it left, and after how long)
            from pjrt_rendezvous.coordinator._core import _duration, describe_group

            error = CoordinatorUnavailableError(
                f"{exc} (the call was round {round_number} of {describe_group(group)}, tag {rows[0][1]!r}, "
                f"sent {_duration(time.monotonic() - started)} s before)"
            )
            raise error from None

    def _give_up(self, replicas: list[int], round_number: int, batch: _Batch) -> None:
        """A round's call ended without an answer, the coordinator out of reach: its threads
        raise, and their next calls are of the next round. Its peers may reach the
        coordinator in time and wait there for this process's ordinals in this round; the
        coordinator is told, before this process's next call (a heartbeat's too), to fail it
        for them."""
        request = pb.GiveUpRoundRequest(
            job=self.settings.job, incarnation=self.incarnation, generation=batch.generation, replicas=replicas,
            round=round_number, ordinals=sorted(batch.contributions), tag=next(iter(batch.contributions.values()))[1],
            job_id=_job_ids.get(self, ""),
            reason=f"no answer within connect_timeout ({self.settings.connect_timeout:g} s) or its timeout: the "
            "coordinator was out of reach",
        )
        _given_up.setdefault(self, []).append(request)

    def _tell_given_up(self, deadline: float | None) -> None:
        """Before a call: the coordinator fails the rounds this client gave up on (unless they
        finished), so its peers do not wait there for ordinals that come to later rounds.
        Unreachable still, the call fails as they did (and they are told later). A thread
        that finds another telling them waits for it, up to ``deadline``."""
        if not _telling.acquire(True, -1 if deadline is None else max(0.0, deadline - time.monotonic())):
            return  # (its time is up: the call fails at once anyway)
        try:
            while requests := _given_up.get(self):
                try:
                    self._call("GiveUpRound", requests[0], deadline)
                except CoordinatorUnavailableError:
                    raise  # (told at the next call)
                except RendezvousError as exc:  # this process gone (declared dead, replaced): void anyway
                    # (unless the coordinator predates GiveUpRound: the round's peers wait out their timeout)
                    level = logging.WARNING if getattr(exc, "code", "") == "UNIMPLEMENTED" else logging.DEBUG
                    log.log(level, "could not tell the coordinator that round %d was given up: %s", requests[0].round, exc)
                if _given_up.get(self) is requests:  # (else cleared meanwhile: the job moved on)
                    del requests[0]
                    if not requests:
                        _given_up.pop(self, None)
        finally:
            _telling.release()

    def _status_while_waiting(self, deadline: float | None) -> pb.JobStatus:
        """The job's status without its participants, for a "still waiting" line (best effort:
        asked in the waiting thread, so for at most _DESCRIBE_TIMEOUT and never past the
        wait's deadline; with the coordinator unreachable, the retries of a status call would
        hold the wait long after its timeout)."""
        (job,) = self._call("Status", pb.StatusRequest(job=self.settings.job, rounds_only=True), _asked_by(deadline)).jobs
        return job

    def _describe_world(self, deadline: float | None) -> str:
        """How far the job's world is, for wait_world's "still waiting" line."""
        try:
            job = self._status_while_waiting(deadline)
        except UnknownJobError:
            return "the coordinator has no such job yet: no process registered in it (is the job name the same everywhere?)"
        except RendezvousError as exc:
            return f"(status unavailable: {exc})"
        if not job.world_size:
            return "no process registered yet"
        missing = f"; missing {job.world_missing_summary}" if job.world_missing_summary else ""
        return f"{job.registered} of {job.world_size} ordinals registered{missing}"

    def _describe_wait(self, key: tuple, deadline: float | None) -> str:
        """What the coordinator says a pending round waits for (best effort: _status_while_waiting)."""
        if deadline is not None and time.monotonic() >= deadline:
            return "its timeout passed; waiting for the coordinator's answer, which names who is missing"
        try:
            job = self._status_while_waiting(deadline)
        except RendezvousError as exc:
            return f"(status unavailable: {exc})"
        for r in job.pending_rounds:
            if (tuple(r.replicas), r.round) == key:
                return describe_round(r)
        return "the round is not pending on the coordinator (its answer is on the way)"

    # -- key-value ------------------------------------------------------------------------

    def _kv(self, method: str, request, deadline: float | None = None, *, waits: bool = False, progress=None):
        """A key-value call, naming the job's store this client saw: when the coordinator no
        longer has it (restarted without its state file), the call is refused at once
        (MismatchError), not answered from an empty store as if it were the one it used.
        Each call that saw the old store is refused; those made after one was use the new."""
        seen = request.store_id = _store_ids.get(self, "")
        try:
            response = self._call(method, request, deadline, waits=waits, progress=progress)
        except MismatchError:  # (the one FAILED_PRECONDITION of key-value calls: Core.check_store)
            if seen and _store_ids.get(self) == seen:
                _store_ids.pop(self, None)  # (another thread's refusal may have taken it already)
            raise
        if response.store_id:
            _store_ids[self] = response.store_id
        return response

    def set(self, key: str, value: bytes) -> None:
        """Sets ``key`` to ``value`` (bytes), waking every waiting get."""
        self.multi_set([key], [value])

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        """Sets each of ``keys`` to its value of ``values`` in one call (all or none)."""
        keys = _key_list(keys, text=True)
        try:
            values = list(values)  # (an iterator too)
        except TypeError:
            raise TypeError(f"values must be a sequence of bytes, got {values!r}") from None
        if len(keys) != len(values):
            raise UsageError(f"multi_set got {len(keys)} keys but {len(values)} values")
        entries = [pb.KvEntry(key=k, value=_payload_bytes(v, "value")) for k, v in zip(keys, values)]
        self._kv("KvSet", pb.KvSetRequest(job=self.settings.job, entries=entries, request_id=uuid.uuid4().hex))

    def get(self, key: str, *, wait: bool = True, timeout=DEFAULT) -> bytes | None:
        """The value of ``key``. With ``wait`` (default) blocks until it is set, up to
        ``timeout``; without, returns None when it is missing."""
        return self.multi_get([key], wait=wait, timeout=timeout)[0]

    def multi_get(self, keys: Sequence[str], *, wait: bool = True, timeout=DEFAULT) -> list[bytes | None]:
        """The values of ``keys`` in one call, as :meth:`get`: with ``wait``, once every one
        of them is set."""
        deadline = self._deadline(timeout)  # (checked, and bounding the call, without wait too)
        keys = _key_list(keys, text=True)  # (once: an iterator given is used up)
        if wait and self not in _store_ids:
            # A client's first call that waits learns the job's store first (once): a wait
            # through a restart that lost the keys would otherwise wait for nothing. (Retried
            # as any call, until connect_timeout of an outage or the call's deadline, and given
            # the grace of a wait to answer, as the wait after it is.)
            request = pb.KvGetRequest(job=self.settings.job, keys=keys)
            values = [v.value if v.found else None for v in self._kv("KvGet", request, deadline, waits=True).values]
            if all(v is not None for v in values):
                return values
        request = pb.KvGetRequest(job=self.settings.job, keys=keys, wait=wait)
        if deadline is not None and wait:
            request.timeout = max(1e-3, deadline - time.monotonic())
        progress = self._keys_progress(list(request.keys), deadline) if wait else None
        response = self._kv("KvGet", request, deadline, waits=wait, progress=progress)
        return [v.value if v.found else None for v in response.values]

    def _keys_progress(self, keys: list[str], deadline: float | None):
        """A blocked get's or wait's "still waiting" line: the keys still not set (asked
        without waiting, as _status_while_waiting asks, for at most _DESCRIBE_TIMEOUT)."""
        started, job = time.monotonic(), self.settings.job
        what = f"key {keys[0]!r}" if len(keys) == 1 else f"{len(keys)} keys"

        def progress(_: float) -> None:
            from pjrt_rendezvous.coordinator._core import _duration, keys_shown

            now = time.monotonic()
            if deadline is not None and now >= deadline:
                said = "its timeout passed; waiting for the coordinator's answer, which names the keys not set"
                log.warning("still waiting after %s s for %s of job %r: %s", _duration(now - started), what, job, said)
                return
            try:
                request = pb.KvGetRequest(job=job, keys=keys, found_only=True, store_id=_store_ids.get(self, ""))
                found = self._call("KvGet", request, _asked_by(deadline)).values
                missing = [k for k, v in zip(keys, found) if not v.found]
                if len(keys) == 1:
                    said = "not set yet" if missing else "set (its answer is on the way)"
                else:
                    said = f"{len(missing)} not set yet: {keys_shown(missing)}" if missing else "all set (the answer is on the way)"
            except RendezvousError as exc:
                said = f"(which are set is unavailable: {exc})"
            log.warning("still waiting after %s s for %s of job %r: %s", _duration(time.monotonic() - started), what, job, said)

        return progress

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key exists (no waiting; their values are not sent)."""
        request = pb.KvGetRequest(job=self.settings.job, keys=_key_list(keys, text=True), found_only=True)
        return all(v.found for v in self._kv("KvGet", request).values)

    def wait(self, keys: Sequence[str], *, timeout=DEFAULT) -> None:
        """Blocks until every key exists; RendezvousTimeout names those still missing."""
        self.multi_get(keys, wait=True, timeout=timeout)

    def add(self, key: str, delta: int = 1) -> int:
        """Adds ``delta`` to the integer at ``key`` (missing counts as 0); returns the sum.
        Applied once even when the call is retried."""
        delta = _integer(delta, "delta")
        if not -(2**63) <= delta < 2**63:
            raise UsageError(f"delta {delta} is outside the 64-bit integers the store holds")
        request = pb.KvAddRequest(job=self.settings.job, key=_text(key, "key"), delta=delta, request_id=uuid.uuid4().hex)
        return self._kv("KvAdd", request).value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Sets ``key`` to ``desired`` if it holds ``expected`` (a missing key matches b'');
        returns the value after the call, but ``expected`` for a missing key that did not
        match, which stays unset (torch.distributed.Store semantics)."""
        request = pb.KvCompareSetRequest(
            job=self.settings.job,
            key=_text(key, "key"),
            expected=_payload_bytes(expected, "expected"),
            desired=_payload_bytes(desired, "desired"),
            request_id=uuid.uuid4().hex,
        )
        return self._kv("KvCompareSet", request).value

    def append(self, key: str, value: bytes) -> None:
        """Appends ``value`` to ``key`` (creating it). Applied once even when retried."""
        request = pb.KvAppendRequest(
            job=self.settings.job, key=_text(key, "key"), value=_payload_bytes(value, "value"), request_id=uuid.uuid4().hex
        )
        self._kv("KvAppend", request)

    def delete(self, key: str) -> bool:
        """Deletes ``key``; True if it existed."""
        request = pb.KvDeleteRequest(job=self.settings.job, key=_text(key, "key"), request_id=uuid.uuid4().hex)
        return self._kv("KvDelete", request).deleted

    def list(self, prefix: str = "") -> dict[str, bytes]:
        """Every key starting with ``prefix`` and its value."""
        response = self._kv("KvList", pb.KvListRequest(job=self.settings.job, prefix=_text(prefix, "prefix")))
        return {e.key: e.value for e in response.entries}

    def count(self, prefix: str = "") -> int:
        """How many keys start with ``prefix``."""
        request = pb.KvListRequest(job=self.settings.job, prefix=_text(prefix, "prefix"), count_only=True)
        return self._kv("KvList", request).count

    # -- status ---------------------------------------------------------------------------

    def status(self, job: str | None = None) -> pb.StatusResponse:
        """The coordinator's view of ``job`` (default: this client's job; '' for all jobs)."""
        return self._call("Status", pb.StatusRequest(job=self.settings.job if job is None else _text(job, "job")))


def _key_list(keys: Sequence[str], *, text: bool = False) -> list[str]:
    """``keys`` as a list, refusing one key given alone (a str would be its letters); with
    ``text``, each checked as the wire takes it (a Store converts its bytes keys first)."""
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"keys must be a list of keys, got the single key {keys!r} (write [{keys!r}])")
    return [_text(key, "key") for key in keys] if text else list(keys)


def _copy_error(error: RendezvousError) -> RendezvousError:
    """A fresh exception of the same type and message for each waiting thread, so one
    thread's traceback does not grow from another's raise."""
    copy = type(error).__new__(type(error))
    copy.__dict__.update(error.__dict__)
    copy.args = error.args
    return copy
