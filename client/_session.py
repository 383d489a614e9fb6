"""One long-lived stream per process that carries its calls (the ``Session`` RPC).

A unary gRPC call costs the Python coordinator 220-250 µs of CPU; a message on an open
stream about a third of that (``bench/grpc_floor.py``). So each :class:`~._client.Client`
sends its calls as messages on one bidirectional stream: any thread puts a request in the
outbox (gRPC's own thread sends it, together with whatever else queued up meanwhile), and a
reader thread hands each answer, matched by id, to the thread waiting for it. Answers come
back in any order, so a rendezvous that waits does not hold up a heartbeat or a key-value
call behind it.

A broken stream fails every call on it with the stream's error (UNAVAILABLE when the
coordinator went away); the client's retry opens a new session and resends, which is safe
for every call (see ``Client._call``).

:class:`SocketSession` carries the same messages length-prefixed on a plain socket: to the
coordinator's session port when it offers one (cheaper than gRPC's stream), and over a Unix
socket to the host's relay (fan-in, ``_relay.py``). It has no reader thread: the callers
waiting for answers take turns reading the socket. The serving ends are
:func:`serve_session` (the coordinator's gRPC Session stream) and :class:`FramedSession`
(sockets: the coordinator's session port and the host relay).

Both ends decode and encode these messages natively when ``_native.c`` was built (each
function here has its Python twin: ``*_in_python``, and ``session_request`` for
``encode_call``); a call on the serving end is an
``(id, method, request, cancel)`` tuple, an answer on the calling end ``(id, code, message,
response)``.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import functools
import itertools
import logging
import os
import queue
import select
import socket
import struct
import threading
import time
from _thread import allocate_lock as _allocate_lock
from typing import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

from ._topology import host_port

log = logging.getLogger("pjrt_rendezvous.client")
served_log = logging.getLogger("pjrt_rendezvous.coordinator")  # (what only the coordinator serves says)

_native = None  # the native path (_native.c): built when a C compiler was at hand
NATIVE_INTERFACE = 2  # _native.c's INTERFACE this code calls


def native_if_current(module):
    """``module`` (the built ``_native``) if it was built from the ``_native.c`` this code
    calls, else None with a warning: an editable install keeps the module built before a
    checkout changed the file, and every round would fail on its arguments."""
    built = getattr(module, "INTERFACE", 1)
    if built == NATIVE_INTERFACE:
        return module
    log.warning(
        "%s was built from another version of client/_native.c (interface %s, this code calls %s): "
        "the Python path is used instead, slower; reinstall the package (pip install -e .) to build it again",
        module.__file__, built, NATIVE_INTERFACE,
    )
    return None

_switch = os.environ.get("PJRT_RENDEZVOUS_NATIVE", "").strip().lower()
if _switch not in ("0", "false", "off", "no"):  # (those: the Python path alone)
    if _switch not in ("", "1", "true", "on", "yes"):
        log.warning(
            "PJRT_RENDEZVOUS_NATIVE=%r is neither on (1, true, on, yes) nor off (0, false, off, no): "
            "the native path is used where it is built", os.environ["PJRT_RENDEZVOUS_NATIVE"],
        )
    try:
        from . import _native
    except ImportError:
        pass
    else:
        _native = native_if_current(_native)

_CODES = {status.value[0]: status for status in grpc.StatusCode}

# gRPC carries the status message in a trailer and drops trailers over 8 KiB (some at
# random, all over 16 KiB): a longer message would reach the client as a bare
# RESOURCE_EXHAUSTED. Non-ASCII text can take 3 bytes a character once escaped.
_MESSAGE_CHARACTERS = 2000
_BATCH_BYTES = 8 << 20  # a gRPC Session message's requests or answers, at most (one bigger alone)
# An answer this large on a gRPC stream makes the freed memory worth giving back (trim_if_due).
_TRIM_AFTER = 16 << 20


def give_freed_memory_back() -> None:
    """Has glibc give the free memory in the middle of its heaps back to the system
    (``malloc_trim``; elsewhere, nothing). Big blocks come from a heap once glibc's own
    threshold for mapping them apart has risen (as big ones are freed), and one freed below
    a block still in use stays: after a job of 16 MiB payloads had left, serve held 660 MB,
    48 MB once trimmed; a client that had taken three rounds of 192 MiB on gRPC held 350-470
    MB, 45-50 once trimmed at its next heartbeat. (Mapping every block of 1 MiB or more
    apart instead, ``mallopt``, made allocating one 35-45 times slower.)"""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # (not glibc)
        pass


def trim_if_due() -> None:
    """Gives freed memory back (:func:`give_freed_memory_back`) if a gRPC stream of this
    process took an answer of _TRIM_AFTER bytes or more since the last time. Called by the
    client's heartbeat: its call on the stream is what lets gRPC drop the last big message,
    which gRPC's threads hold until the next. (A SocketSession's big answers are blocks
    mapped apart, given back when freed.) The trim holds each of glibc's heaps while it
    walks it: 80 ms for a fragmented heap of 2 GB, 7 ms the next time."""
    global _trimmed_after
    seen = big_answers  # (read once: one counted meanwhile is trimmed for next time)
    if seen != _trimmed_after:
        _trimmed_after = seen
        give_freed_memory_back()


big_answers = 0  # answers of _TRIM_AFTER bytes or more a gRPC stream took (Session._read)
_trimmed_after = 0  # big_answers at the last trim


def clip(message: str) -> str:
    if len(message) <= _MESSAGE_CHARACTERS:
        return message
    return f"{message[:_MESSAGE_CHARACTERS]} ... ({len(message) - _MESSAGE_CHARACTERS} more characters)"


class Malformed:
    """Stands in for a request body that does not parse, so the handler can refuse it."""

    def __init__(self, message: str) -> None:
        self.message = message


def parser(message_class):
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return Malformed(f"the request is not a valid {message_class.DESCRIPTOR.full_name}: {exc}")

    return parse


class StatusError(grpc.RpcError):
    """A call's failure as a status, shaped like the error a unary call raises; ``answered``:
    the peer's answer to the call (else the connection's end, or a cut-off here); ``late``:
    for a cut-off, how long after it this process ran again when that was over _LATE s
    (stopped, or starved of CPU), else 0."""

    late = 0.0

    def __init__(self, code: grpc.StatusCode, details: str, *, answered: bool = False) -> None:
        super().__init__(details)
        self._code = code
        self._details = details
        self.answered = answered

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_READER_JOIN = 5.0  # seconds close() waits for the session's reader thread


class _NotSent(StatusError):
    """A call not sent: the connection was busy sending another's message for longer than
    the call may wait (``SocketSession._write_bytes``). The session goes on."""


class _Pending:
    __slots__ = ("done", "response", "error", "woken")

    def __init__(self) -> None:
        # Held until the answer (or the error) is in: one release wakes the caller, cheaper
        # than an Event. Released by whoever pops the call from ``_pending`` (a SocketSession
        # also releases it to make the caller read: ``woken`` says it is released).
        self.done = _allocate_lock()
        self.done.acquire()
        self.response: Answer | None = None
        self.error: grpc.RpcError | None = None
        self.woken = False


class Session:
    """A ``Session`` stream to the coordinator and the calls waiting on it. Thread-safe."""

    def __init__(self, stub, metadata) -> None:
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._responses = stub.Session(self._requests(), metadata=metadata)
        self._init_calls()
        self._reader = threading.Thread(target=self._read, name="pjrt-rendezvous-session", daemon=True)
        self._reader.start()

    def _init_calls(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self.broken: grpc.RpcError | None = None
        self.heard = time.monotonic()  # when the last answer came

    # -- transport: gRPC (SocketSession overrides these) --------------------------------------

    def _send(
        self, call_id: int, method: str = "", request: bytes = b"", cancel: bool = False, within: float | None = None
    ) -> None:
        """Sends a call (``within``: seconds it may wait for the connection, None: no limit;
        gRPC's stream queues it at once)."""
        with self._lock:  # never after retire()'s end of the stream, where nothing is sent
            if self.broken is not None:
                if cancel:
                    return
                raise self.broken
            self._outbox.put(pb.SessionCall(id=call_id, method=method, request=request, cancel=cancel))

    def _wait(self, pending: _Pending, timeout: float) -> bool:
        """Until ``pending`` is answered or failed (True) or ``timeout`` seconds pass (False;
        -1: no limit). The reader thread hands each answer to its caller."""
        return pending.done.acquire(True, timeout)

    def _finished(self) -> None:
        self._outbox.put(None)  # lets gRPC's sending thread finish

    def close(self) -> None:
        """Ends the stream from this side (calls still waiting fail)."""
        self._outbox.put(None)
        self._responses.cancel()
        if threading.current_thread() is not self._reader:  # it sees the end of the stream
            self._reader.join(_READER_JOIN)
        self._responses = None  # the call is finalized now, while gRPC's threads run (see _read)

    def retire(self) -> None:
        """Ends the stream once the calls on it are answered; a later call fails with
        UNAVAILABLE, so it is resent on the session that replaced this one."""
        with self._lock:  # (against a call between its check of ``broken`` and its _send)
            if self.broken is None:
                self.broken = StatusError(grpc.StatusCode.UNAVAILABLE, "the session was replaced")
            self._finished()

    def _requests(self):
        """What gRPC's sending thread sends: the calls queued while it sent the last, up to
        _BATCH_BYTES of requests (a bigger call alone): the coordinator caps one message at
        16 MiB beyond the largest call its limits allow, and a message over it fails every
        call on the stream."""
        held = None  # the call that did not fit in the last message
        while (call := held if held is not None else self._outbox.get()) is not None:
            held = None
            calls, size = [call], len(call.request)
            while size < _BATCH_BYTES:
                try:
                    call = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if call is None:
                    yield pb.SessionRequest(calls=calls)
                    return
                if size + len(call.request) > _BATCH_BYTES:
                    held = call
                    break
                calls.append(call)
                size += len(call.request)
            yield pb.SessionRequest(calls=calls)

    # -- calls ---------------------------------------------------------------------------------

    def _read(self) -> None:
        global big_answers
        try:
            for response in self._responses:
                self.heard = time.monotonic()
                with self._lock:
                    answered = [(self._pending.pop(a.id, None), (a.id, a.code, a.message, a.response)) for a in response.answers]
                for pending, answer in answered:
                    if pending is not None:  # else the caller gave up on it
                        pending.response = answer
                        pending.done.release()
                    if len(answer[3]) >= _TRIM_AFTER:
                        big_answers += 1
            error: grpc.RpcError = StatusError(grpc.StatusCode.UNAVAILABLE, "the coordinator ended the session")
        except grpc.RpcError as exc:
            # The exception a gRPC stream raises is its call object, and its traceback's frames
            # hold it again: a cycle only the garbage collector frees, perhaps at interpreter
            # exit, where the call's finalizer waits for a lock a frozen daemon thread may
            # hold (`pjrt-rendezvous status` hung at exit about once in 150 runs). Break the
            # cycle and keep our own error, so the call is freed by close().
            exc.__traceback__ = None
            error = exc if isinstance(exc, StatusError) else StatusError(exc.code(), exc.details() or str(exc))
        with self._lock:
            self.broken = error
            pending_calls = list(self._pending.values())
            self._pending.clear()
        self._finished()
        for pending in pending_calls:
            pending.error = error
            pending.done.release()

    def call(
        self,
        method: str,
        request: bytes,
        timeout: float | None,
        progress: Callable[[float], None] | None = None,
        interval: float | None = None,
    ) -> bytes:
        """Sends ``request`` (serialized) to ``method``; returns the serialized response.

        Raises a :class:`grpc.RpcError` (the call's status, the stream's error, or
        DEADLINE_EXCEEDED after ``timeout``) like the unary call would. While waiting,
        ``progress(seconds waited)`` runs every ``interval``.
        """
        pending = _Pending()
        with self._lock:
            if self.broken is not None:
                raise self.broken
            call_id = next(self._ids)
            self._pending[call_id] = pending
        started = time.monotonic()
        end = None if timeout is None else started + timeout
        try:
            self._send(call_id, method, request, within=timeout)
        except BaseException:
            with self._lock:
                self._pending.pop(call_id, None)
            raise
        reports = 0
        try:
            while True:
                wake = end
                if progress is not None:
                    report = started + interval * (reports + 1)
                    wake = report if wake is None else min(wake, report)
                if self._wait(pending, -1 if wake is None else max(0.0, wake - time.monotonic())):
                    break
                now = time.monotonic()
                if end is not None and now >= end:
                    # Woken long after it asked to be, this process did not run meanwhile (it was
                    # stopped, or starved of CPU): its answer may have come then, not read yet.
                    late = now - end if now - end > _LATE else 0.0
                    if self._wait(pending, _LAST_LOOK if late else 0.0):
                        break
                    error = StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer to {method} within {timeout:.3g} s")
                    error.late = late
                    raise error
                if progress is not None and now >= started + interval * (reports + 1):
                    reports += 1
                    progress(now - started)
        except BaseException:  # our deadline, an interrupt: the coordinator may stop the call
            with self._lock:
                abandoned = self._pending.pop(call_id, None) is not None and self.broken is None
            if abandoned:
                try:
                    self._send(call_id, cancel=True, within=0.0)
                except grpc.RpcError:
                    pass  # broke meanwhile (nothing left to stop), or busy sending: its answer is dropped
            raise
        if pending.error is not None:
            raise pending.error
        _, code, message, response = pending.response
        if code:
            raise StatusError(_CODES.get(code, grpc.StatusCode.UNKNOWN), message, answered=True)
        return response


FRAME = struct.Struct(">I")  # the length of the serialized message that follows
# Bytes of a response from which an answer goes to a session port's peer in pieces of this
# size, as the peer takes them (FramedSession._feed).
_PIECE = 1 << 20
# A call woken this many seconds after it asked to be (its process stopped, or starved of
# CPU) looks for its answer for _LAST_LOOK s more before it gives up: it may have come meanwhile.
_LATE = 1.0
_LAST_LOOK = 0.25
PING_EVERY = 10.0  # seconds without an answer before a SocketSession pings
PING_TIMEOUT = 5.0
# The host's relay is on this host, its answers in microseconds: a frozen relay process (a
# debugger attached, SIGSTOP) is found sooner, and checked for at connect. A wrong guess (its
# process busy) costs only calls resent to the coordinator, which counts them once.
RELAY_PING_EVERY = 2.0
RELAY_PING_TIMEOUT = 1.0
_PING = b""  # a ping's request is empty
# A SocketSession reads into a buffer of its own, at first this large, grown to hold the
# largest message it received, so that a message comes in one read without a buffer
# allocated for it and copied out again. Past _RECEIVE_MAX (kept for the session's life),
# a message comes in several reads, joined: a few copies matter less at that size.
_SEND_PIECE = 1 << 16  # a larger message is sent in pieces of this (SocketSession._send_all)
_RECEIVE = 1 << 16
_RECEIVE_MAX = 4 << 20
# The largest message a serving end (FramedSession) takes: protobuf's own limit. The
# coordinator's session port takes less (coordinator/_server.py, max_message_bytes).
MAX_MESSAGE = (1 << 31) - 1
# The first message on a connection with a hello (a SessionHello, the token: tens of bytes)
# is read before the peer is known, so it is capped far lower: as gRPC's default cap on a
# call's headers (a longer token would not pass there either).
MAX_HELLO = 8 << 10


def one_whole_message(data: bytes | bytearray | memoryview) -> bool:
    """Whether length-prefixed ``data`` holds exactly one whole message."""
    return len(data) >= FRAME.size and FRAME.unpack_from(data)[0] == len(data) - FRAME.size


def take_frames(buffer: bytearray) -> list[bytes]:
    """Removes the complete messages at the start of a length-prefixed byte ``buffer`` and
    returns them; the start of an incomplete one stays for the bytes still to come."""
    if one_whole_message(buffer):  # the common case: exactly one whole message
        with memoryview(buffer) as view:
            message = bytes(view[FRAME.size :])
        buffer.clear()
        return [message]
    messages, start = [], 0
    while len(buffer) - start >= FRAME.size:
        end = start + FRAME.size + FRAME.unpack_from(buffer, start)[0]
        if len(buffer) < end:
            break
        messages.append(bytes(buffer[start + FRAME.size : end]))
        start = end
    del buffer[:start]
    return messages


def frame(message: bytes) -> bytes:
    return FRAME.pack(len(message)) + message


_FOREIGN_RELAYS: set[str] = set()  # relay sockets served by another user, warned of once


class SocketSession(Session):
    """The same calls and answers as length-prefixed messages on a stream socket: to the
    coordinator's session port (:meth:`tcp`) or to the host's relay (:meth:`local`).

    The calling thread writes its own message, and the callers waiting for answers take
    turns reading the socket: the one holding ``_reading`` reads for all and hands each
    answer to its caller (and its turn to another waiting caller when its own answer is in).
    gRPC's stream costs each message two hand-offs between threads and HTTP/2 framing, and
    a reader thread would cost one more wake per answer: at one message per round and
    process, that is most of a process's CPU (``bench/``).
    """

    def __init__(self, sock: socket.socket, peer: str, ping: tuple[float, float] = (PING_EVERY, PING_TIMEOUT)) -> None:
        self._socket = sock
        self._peer = peer
        self._ping = ping  # (every, timeout): see _keepalive
        self._send_lock = threading.Lock()
        self._sending = 0.0  # when the send under way last got bytes out (_send_all)
        self._receiving = 0.0  # when a read last got part of a message (_read_until)
        self._init_calls()
        # Held by the caller reading answers for all: an RLock for its _is_owned (_left).
        self._reading = threading.RLock()
        self._parked: set[_Pending] = set()  # callers blocked for their answer, who may read next
        self._buffer = bytearray()  # received bytes not yet taken as messages
        self._received = bytearray(_RECEIVE)  # where a read lands (see _RECEIVE)
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._over = threading.Event()  # set when broken: the keepalive ends at once (it slept on up to 10 s)
        try:
            threading.Thread(target=self._keepalive, name="pjrt-rendezvous-keepalive", daemon=True).start()
        except RuntimeError as exc:  # (CPython 3.12.0-3.12.1 start no thread in the interpreter's exit: a
            if "shutdown" not in str(exc):  # replica ended then is told without the pings, within its call's
                sock.close()                # deadline; out of threads, the call fails as any would)
                raise

    def _keepalive(self) -> None:
        """A connection that silently stops passing bytes (a dead host, a dropped NAT entry,
        a frozen peer) must fail within seconds so its calls are resent, as gRPC's keepalive
        does for its stream: after ``every`` seconds without an answer, a ping (a call
        without a method) must be answered within ``timeout`` (``self._ping``). A send
        that holds the connection meanwhile must have got bytes out within ``timeout``
        (a large one to a frozen peer blocks for ever, and the ping behind it)."""
        every, timeout = self._ping
        while self.broken is None:
            self._over.wait(max(0.0, max(self.heard, self._receiving) + every - time.monotonic()))
            if self.broken is not None or time.monotonic() - max(self.heard, self._receiving) < every:
                continue  # (a large answer coming in is a peer alive: the ping's waits behind it)
            if not self._send_lock.acquire(True, timeout):
                if time.monotonic() - self._sending >= timeout:
                    log.warning("%s took no bytes for %g s; closing the connection", self._peer, timeout)
                    self.close(f"{self._peer} took no bytes for {timeout:g} s")
                    return
                continue  # a large send going out: no ping needed to see it alive
            self._send_lock.release()
            try:
                self.call("", _PING, timeout)
            except _NotSent:
                continue  # a large send started meanwhile: bytes going out (checked above)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - self._receiving < timeout:
                    continue  # its answer is behind a large one still coming in
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    log.warning("%s did not answer a ping within %g s; closing the connection", self._peer, timeout)
                    # The calls waiting on it fail with UNAVAILABLE, saying why, and are resent.
                    self.close(f"{self._peer} did not answer a ping within {timeout:g} s")
                return

    @classmethod
    def local(cls, path: str) -> "SocketSession":
        """A session with the host's relay at Unix socket ``path``, once it answers a ping
        (a stopped process's socket still takes connections)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # A frozen relay's full backlog would block a connect for ever (with a timeout,
            # it fails at once: EAGAIN).
            sock.settimeout(RELAY_PING_TIMEOUT)
            sock.connect(path)
            sock.settimeout(None)
            # Only a relay of this user: another could have made the folder and the socket first.
            _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        except OSError as exc:
            sock.close()
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"no host relay at {path}: {exc}") from exc
        if uid != os.getuid():
            sock.close()
            if path not in _FOREIGN_RELAYS:  # (asked again every few seconds: said once)
                _FOREIGN_RELAYS.add(path)
                log.warning("the host relay socket %s is served by user %d, not this process's user; not using it", path, uid)
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"the host relay at {path} runs as user {uid}")
        session = cls(sock, "the host relay", (RELAY_PING_EVERY, RELAY_PING_TIMEOUT))
        try:
            session.call("", _PING, RELAY_PING_TIMEOUT)
        except grpc.RpcError as exc:
            session.close()
            why = f"within {RELAY_PING_TIMEOUT:g} s" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else f"({exc.details()})"
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"the host relay at {path} did not answer a ping {why}") from exc
        return session

    @classmethod
    def tcp(cls, host: str, port: int, authorization: str, connect_timeout: float) -> "SocketSession":
        """A session on the coordinator's session port; ``authorization`` as in gRPC's metadata."""
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError as exc:
            raise StatusError(
                grpc.StatusCode.UNAVAILABLE, f"cannot connect to the session port {host_port(host, port)}: {exc}"
            ) from exc
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        session = cls(sock, f"the coordinator's session port {host_port(host, port)}", (PING_EVERY, PING_TIMEOUT))
        session._write(pb.SessionHello(authorization=authorization))
        return session

    def _write(self, message) -> None:
        self._write_bytes(frame(message.SerializeToString()))

    def _write_bytes(self, data: bytes, within: float | None = None) -> None:
        """Sends ``data``, waiting at most ``within`` seconds (None: no limit) for another
        call's message to have gone out (a large one, to a slow peer, takes a while)."""
        if not self._send_lock.acquire(True, -1 if within is None else within):
            raise _NotSent(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"not sent within {within:.3g} s: another call's message to {self._peer} was still going out",
            )
        try:
            try:
                self._send_all(data)
            finally:
                self._send_lock.release()
        except OSError as exc:
            self._break(StatusError(grpc.StatusCode.UNAVAILABLE, f"{self._peer} went away: {exc}"))
            self._close_unless_read()  # (the next call opens a new session)
            raise self.broken from exc  # the first reason: the keepalive's, if it broke the send
        except BaseException as exc:  # interrupted (Ctrl-C): part of a message may be out
            self._interrupted(exc)
            self._close_unless_read()
            raise
        if self.broken is not None:  # broken while it sent: not closed under its feet, so here
            self._close_unless_read()

    def _send_all(self, data: bytes) -> None:
        """With ``_send_lock`` held: ``data``, a large one in pieces, each noted in
        ``_sending`` as it starts (the keepalive's sign that bytes still go out)."""
        self._sending = time.monotonic()
        if len(data) <= _SEND_PIECE:
            self._socket.sendall(data)
            return
        view = memoryview(data)
        while view:
            self._sending = time.monotonic()
            view = view[self._socket.send(view[:_SEND_PIECE]) :]

    def _send(
        self, call_id: int, method: str = "", request: bytes = b"", cancel: bool = False, within: float | None = None
    ) -> None:
        self._write_bytes(encode_call(call_id, method, request, cancel, True), within)

    # -- reading, by the waiting callers in turn ------------------------------------------------

    def _wait(self, pending: _Pending, timeout: float) -> bool:
        end = None if timeout < 0 else time.monotonic() + timeout
        try:
            while pending.response is None and pending.error is None:
                if self._take_turn(pending):
                    self._read_until(pending, end)
                    self._reading.release()
                    self._hand_over()
                    return pending.response is not None or pending.error is not None
                # Parked: the reader hands over our answer, or its turn when it leaves.
                woke = pending.done.acquire(True, -1 if end is None else max(0.0, end - time.monotonic()))
                with self._lock:
                    self._parked.discard(pending)
                    turn = pending.woken and pending.response is None and pending.error is None
                    if pending.woken:
                        pending.woken = False
                        if not woke:  # released as we gave up: held again, as it must be
                            pending.done.acquire()
                if not woke:
                    if turn:  # handed to us as we gave up: it must not be lost
                        self._hand_over()
                    return pending.response is not None or pending.error is not None
            return True
        except BaseException as exc:  # interrupted (Ctrl-C), even as it took or left its turn
            self._left(pending, exc)
            raise

    def _left(self, pending: _Pending, exc: BaseException) -> None:
        """A caller interrupted anywhere in ``_wait`` (a signal is raised as a C call returns:
        right after the turn was taken, or given up before it was handed on): the turn is
        not kept, nor lost. One that held it read for every caller, and what it read for
        others may be lost: the session ends (``_interrupted``). Another parked caller
        reads next (one more wake than needed does no harm)."""
        if self._reading._is_owned():
            self._interrupted(exc)
            self._reading.release()
        with self._lock:
            self._parked.discard(pending)
        self._hand_over()

    def _take_turn(self, pending: _Pending) -> bool:
        """Whether the caller of ``pending`` reads now (it holds ``_reading``); else it is
        parked, to be handed the turn by the reader when it leaves."""
        if self._reading.acquire(False):
            return True
        with self._lock:
            self._parked.add(pending)
        if not self._reading.acquire(False):
            return False
        # The reader left before we were parked, so it handed its turn to nobody: ours.
        with self._lock:
            self._parked.discard(pending)
            if pending.woken:  # an answer or a turn came meanwhile: the lock is held again
                pending.woken = False
                pending.done.acquire()
        return True

    def _wake(self, pending: _Pending) -> None:
        """With ``_lock`` held: releases the caller of ``pending`` unless it is released already."""
        if not pending.woken:
            pending.woken = True
            pending.done.release()

    def _hand_over(self) -> None:
        """A reader left: a parked caller (one blocked waiting for its answer, not one that
        gave up or is busy elsewhere) reads next."""
        with self._lock:
            for pending in self._parked:
                if not pending.woken:
                    self._wake(pending)
                    return

    def _read_until(self, pending: _Pending, end: float | None) -> None:
        """Reads answers, handing each to its caller, until ``pending``'s is in, the session
        breaks, or ``end`` passes."""
        while True:
            if self._buffer:  # received bytes not yet taken as messages (by this or an earlier turn)
                for message in take_frames(self._buffer):
                    self._dispatch(message)
            if self.broken is not None:  # over, here or in another thread: the reader closes
                if self._send_lock.acquire(False):  # (else the sender does, _write_bytes)
                    try:
                        self._socket.close()
                    finally:
                        self._send_lock.release()
                return
            if pending.response is not None or pending.error is not None:
                return
            if end is not None and not self._poll.poll(max(0.0, end - time.monotonic()) * 1000):
                return
            try:
                received = self._socket.recv_into(self._received)
            except OSError as exc:
                self._break(StatusError(grpc.StatusCode.UNAVAILABLE, f"{self._peer} went away: {exc}"))
                continue
            if not received:
                self._break(StatusError(grpc.StatusCode.UNAVAILABLE, f"{self._peer} closed the connection"))
                continue
            data = memoryview(self._received)[:received]
            if not self._buffer and one_whole_message(data):  # nearly every read: taken as it came
                self._dispatch(data[FRAME.size :])  # decoded into objects of their own
                continue
            self._buffer += data
            self._receiving = time.monotonic()
            if len(self._buffer) >= FRAME.size:  # a message longer than one read: next time one will do
                size = FRAME.size + FRAME.unpack_from(self._buffer)[0]
                if len(self._received) < size <= _RECEIVE_MAX:
                    self._received = bytearray(size)

    def _dispatch(self, message: bytes | memoryview) -> None:
        try:
            answers = decode_answers(message)
        except DecodeError as exc:
            return self._break(StatusError(grpc.StatusCode.UNAVAILABLE, f"{self._peer} sent a malformed answer: {exc}"))
        if answers and answers[0][0] == 0:  # the end, with its status
            _, code, text, _ = answers[0]
            return self._break(StatusError(_CODES.get(code, grpc.StatusCode.UNKNOWN), text))
        self.heard = time.monotonic()
        with self._lock:
            for answer in answers:
                pending = self._pending.pop(answer[0], None)
                if pending is not None:  # else the caller gave up on it
                    pending.response = answer
                    self._wake(pending)

    def _interrupted(self, exc: BaseException) -> None:
        """A caller was interrupted (KeyboardInterrupt in the main thread) while it read or
        wrote for every caller of the session: an answer read for another, or half a message
        sent, would be lost and stall them. The session ends, and its calls are resent on a
        new one (every call is safe to resend)."""
        self._break(StatusError(
            grpc.StatusCode.UNAVAILABLE,
            f"a call on the connection to {self._peer} was interrupted ({type(exc).__name__}) while it read or "
            "wrote for every call: the connection was closed, and its calls are sent again",
        ))

    def _break(self, error: grpc.RpcError) -> None:
        """The connection is over: every waiting call fails with ``error``, later ones with
        the first error. The socket is shut down, so a caller reading sees the end at once;
        it is closed by whoever holds ``_reading`` (never under a reader's feet)."""
        with self._lock:
            if self.broken is None:
                self.broken = error
            pending_calls = list(self._pending.values())
            self._pending.clear()
            for pending in pending_calls:
                pending.error = error
                self._wake(pending)
        self._over.set()
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self, why: str | None = None) -> None:
        """Ends the session: the calls waiting on it fail with UNAVAILABLE, saying ``why``."""
        self._break(StatusError(grpc.StatusCode.UNAVAILABLE, why or f"the session with {self._peer} was closed"))
        self._close_unless_read()

    def retire(self) -> None:
        """As :meth:`close`: the calls waiting fail with UNAVAILABLE and are resent on the
        session that replaced this one (every call is safe to resend). ``broken`` is set
        only by breaking, which fails every waiting call: what a reader relies on."""
        self.close()

    def _close_unless_read(self) -> None:
        """Closes the (broken) socket now unless a caller reads or writes it: that one closes
        it (a descriptor closed under a thread's feet could be another socket's by then)."""
        try:
            if self._reading.acquire(False) and self._send_lock.acquire(False):
                try:
                    self._socket.close()
                finally:
                    self._send_lock.release()
        finally:
            if self._reading._is_owned():  # (an interrupt right after the acquire too)
                self._reading.release()


# -- serving (the coordinator's Session, and a host relay's) ---------------------------------


_SMALL_VARINTS = [bytes((i,)) for i in range(0x80)]


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL_VARINTS[value]
    if value < 0x4000:  # call ids and lengths, most of the rest
        return bytes((value & 0x7F | 0x80, value >> 7))
    if value < 0x200000:
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14))
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_ANSWERS_TAG = b"\x0a"  # SessionResponse.answers: field 1, length-delimited
_ID_TAG = b"\x08"  # SessionAnswer.id: field 1, varint
_RESPONSE_TAG = b"\x22"  # SessionAnswer.response: field 4, length-delimited


def encode_answers_in_python(answers: list[tuple[bytes, bytes]], framed: bool) -> bytes:
    """A serialized SessionResponse of (answer without response, response) pairs; with
    ``framed``, behind its length prefix (:func:`frame`) in the same copy.

    Encoded by hand so a response shared by many callers (a finished round, the world
    table) is copied once into each caller's message, not three times through protobuf
    objects: at 4,096 ordinals every process's answer to WaitWorld is in flight at once.
    """
    parts = [b""] if framed else []  # the frame's length prefix goes first
    for head, body in answers:
        if body:
            length = _varint(len(body))
            size = len(head) + 1 + len(length) + len(body)
            parts += (_ANSWERS_TAG, _varint(size), head, _RESPONSE_TAG, length, body)
        else:
            parts += (_ANSWERS_TAG, _varint(len(head)), head)
    if framed:
        parts[0] = FRAME.pack(sum(map(len, parts)))
    return b"".join(parts)


encode_answers = _native.encode_answers if _native is not None else encode_answers_in_python


def _held_apart(bodies) -> int:
    """Bytes of the distinct objects among ``bodies``: the answers of one round to a
    process's threads that sent apart share the round's one encoded response."""
    return sum(len(body) for body in {id(body): body for body in bodies}.values())


def answer_prefix(head: bytes, length: int) -> bytes:
    """What :func:`encode_answers` puts before a single answer's response of ``length`` (> 0)
    bytes, framed: ``answer_prefix(head, len(body)) + body`` is ``encode_answers([(head,
    body)], True)``, without copying ``body``."""
    length_prefix = _varint(length)
    prefix = b"".join((_ANSWERS_TAG, _varint(len(head) + 1 + len(length_prefix) + length), head, _RESPONSE_TAG, length_prefix))
    return FRAME.pack(len(prefix) + length) + prefix


# A SessionCall as the serving end takes it: (id, method, request, cancel).
Call = tuple[int, str, bytes, bool]
# A SessionAnswer as a caller takes it: (id, code, message, response).
Answer = tuple[int, int, str, bytes]


def decode_answers_in_python(message: bytes) -> list[Answer]:
    """:func:`decode_answers` without the native path."""
    return [(a.id, a.code, a.message, a.response) for a in pb.SessionResponse.FromString(message).answers]


def decode_session_calls_in_python(message: bytes) -> list[Call] | Malformed:
    """:func:`decode_session_calls` without the native path."""
    request = _parse_request(message)
    if isinstance(request, Malformed):
        return request
    return [(call.id, call.method, call.request, call.cancel) for call in request.calls]


def natively_or(name: str, in_python: Callable[[bytes], object]) -> Callable[[bytes], object]:
    """A decoder: the native one called ``name`` where it was built, and ``in_python`` for
    what it does not take (it gives None: protobuf then decodes it or names what is wrong)."""
    if _native is None:
        return in_python
    natively = getattr(_native, name)

    def decode(data: bytes):
        decoded = natively(data)
        return in_python(data) if decoded is None else decoded

    return decode


# A serialized SessionRequest's calls, or what is malformed in it.
decode_session_calls: Callable[[bytes], list[Call] | Malformed] = natively_or("decode_session_calls", decode_session_calls_in_python)
# A serialized SessionResponse's answers; DecodeError if it is malformed.
decode_answers: Callable[[bytes], list[Answer]] = natively_or("decode_answers", decode_answers_in_python)


_CALLS_TAG = b"\x0a"  # SessionRequest.calls: field 1, length-delimited
_METHOD_TAG = b"\x12"  # SessionCall.method: field 2, length-delimited
_REQUEST_TAG = b"\x1a"  # SessionCall.request: field 3, length-delimited
_CANCEL = b"\x20\x01"  # SessionCall.cancel: field 4, varint, true


@functools.lru_cache(maxsize=64)
def _method_field(method: str) -> bytes:
    encoded = method.encode()
    return _METHOD_TAG + _varint(len(encoded)) + encoded if encoded else b""


def session_request(call_id: int, method: str, request: bytes, cancel: bool = False, framed: bool = False) -> bytes:
    """A serialized SessionRequest of one SessionCall (with ``framed``, behind its length
    prefix), encoded by hand as protobuf would: every call of a process goes through here."""
    parts = [_ID_TAG, _varint(call_id), _method_field(method)] if call_id else [_method_field(method)]
    if request:
        parts += (_REQUEST_TAG, _varint(len(request)), request)
    if cancel:
        parts.append(_CANCEL)
    call = b"".join(parts)
    message = _CALLS_TAG + _varint(len(call)) + call
    return FRAME.pack(len(message)) + message if framed else message


encode_call = _native.encode_call if _native is not None else session_request  # (id, method, request, cancel, framed)


def session_answer(
    call_id: int, status: grpc.StatusCode = grpc.StatusCode.OK, message: str = "", response: bytes = b""
) -> tuple[bytes, bytes]:
    """One call's answer as :func:`encode_answers` takes it."""
    if status is grpc.StatusCode.OK:  # encoded by hand: the answer to nearly every call
        return (_ID_TAG + _varint(call_id) if call_id else b""), response
    return pb.SessionAnswer(id=call_id, code=status.value[0], message=clip(message)).SerializeToString(), b""


async def serve_session(
    requests,
    context,
    run: Callable[[Call], Awaitable[tuple[bytes, bytes]]],
    streams: dict[asyncio.Task, Callable[[], bool]] | None = None,
) -> None:
    """Serves one Session stream of decoded requests (:func:`decode_session_calls`): each
    call runs as its own task (``run`` returns its answer as in :func:`encode_answers`) and
    is answered when done, in any order (see the .proto).
    Answers that are ready while the stream is busy writing go out together in the next
    message, up to ``_BATCH_BYTES`` (a bigger one alone: two answers of a round near its
    limit would pass what a message carries); a cancel stops the call's task. While it
    serves, ``streams`` maps its task to a test whether it is idle (no call running, every
    answer written). A peer that does not read its answers ends its stream once those
    waiting behind a write hold more than ``FramedSession.MAX_UNSENT`` bytes before another
    is added and the write has not ended for ``FramedSession.STALLED`` s, or hold more than
    ``FramedSession.MAX_HELD``, as on the session port (an answer of any size may go, and a
    few to a peer that reads)."""
    calls: dict[int, asyncio.Task] = {}  # running, cancellable by the client
    ready: list[tuple[bytes, bytes]] = []  # answers waiting for the stream
    writer: asyncio.Task | None = None
    queued = 0  # bytes of the answers in ``ready`` (not yet taken by the writer)
    writing = (False, 0.0)  # whether a write is under way, and since when
    overflowed = False
    this = asyncio.current_task()
    if streams is not None:
        streams[this] = lambda: not calls and not ready and (writer is None or writer.done())

    async def write() -> None:
        nonlocal queued, writing
        try:
            while ready:
                taken, size = 0, 0
                for head, body in ready:
                    if taken and size + len(head) + len(body) > _BATCH_BYTES:
                        break
                    taken, size = taken + 1, size + len(head) + len(body)
                message = encode_answers(ready[:taken], False)
                del ready[:taken]
                queued -= size
                writing = (True, time.monotonic())
                await context.write(message)
                writing = (False, 0.0)
        except Exception as exc:  # the stream is gone; the client resends on a new one
            served_log.debug("session answers not sent: %s", exc)

    async def answer(call: Call) -> None:
        nonlocal writer, queued, overflowed
        try:
            reply = await run(call)
        finally:  # done: a late cancel must not stop the writer with others' answers
            calls.pop(call[0], None)
        waiting = queued  # (before this one: an answer of any size may go)
        queued += len(reply[0]) + len(reply[1])
        ready.append(reply)
        if writer is None or writer.done():
            writer = asyncio.create_task(write())
        elif not overflowed and waiting > FramedSession.MAX_UNSENT:  # (else the running writer takes it along)
            held = _held_apart(body for _, body in ready) if waiting > FramedSession.MAX_HELD else 0
            stalled = writing[0] and time.monotonic() - writing[1] >= FramedSession.STALLED
            if held > FramedSession.MAX_HELD or stalled:
                overflowed = True
                served_log.warning(
                    "a Session stream's peer does not read its answers (%d bytes of them wait: %s); ending the stream",
                    waiting, f"over {FramedSession.MAX_HELD}" if not stalled else
                    f"behind one it has not taken for {FramedSession.STALLED:g} s", extra={"event": "session_ended"},
                )
                this.cancel()  # (the stream's task waits for its next request)

    try:
        async for message in requests:
            if isinstance(message, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, clip(message.message))
            for call in message:
                call_id, _, _, cancel = call
                if cancel:
                    task = calls.pop(call_id, None)
                    if task is not None:
                        task.cancel()
                elif call_id not in calls:
                    calls[call_id] = asyncio.create_task(answer(call))
        # The client finished sending: answer what it asked, then end the stream.
        while calls:
            await asyncio.wait(list(calls.values()))
        while writer is not None and not writer.done():
            await writer
    except asyncio.CancelledError:
        if not overflowed:
            raise
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"more than {FramedSession.MAX_UNSENT} bytes of answers wait behind one not taken for "
            f"{FramedSession.STALLED:g} s (or more than {FramedSession.MAX_HELD} in all): the stream ends",
        )
    finally:
        if streams is not None:
            streams.pop(this, None)
        for task in calls.values():
            task.cancel()
        if writer is not None:
            writer.cancel()


class Wakeup:
    """What a call run by :class:`_Call` may wait on instead of a Future: set, it resumes
    the call at once, on the setter's stack. A Future's callbacks wait for the event loop's
    next turn, so a round's last arrival would answer its waiting peers one turn late."""

    __slots__ = ("_value", "resume")

    def __init__(self) -> None:
        self._value = None
        self.resume: Callable[["Wakeup"], None] | None = None  # set by the _Call awaiting it

    def done(self) -> bool:
        return self._value is not None

    def set_result(self, value) -> None:
        self._value = value
        if self.resume is not None:
            self.resume(self)

    def __await__(self):
        if self._value is None:
            yield self
        return self._value


class _Call:
    """A call's coroutine run without a Task: at once, on the stack of the message that
    brought it, then each time the future it awaits is done. Most calls finish without
    waiting (a round's last arrival, key-value calls), and a Task would cost each of them a
    trip through the event loop's queue before it starts (``FramedSession``)."""

    __slots__ = ("_coroutine", "_awaiting", "_done")

    def __init__(self, coroutine) -> None:
        self._coroutine = coroutine
        self._awaiting: object = None  # the future it waits on (or a token for a bare yield)
        self._done = False

    def start(self) -> None:
        self._resume(None)

    def _woken(self, awaited) -> None:
        if awaited is self._awaiting and not self._done:  # else stale: cancelled meanwhile
            self._resume(None)

    def _resume(self, error: BaseException | None) -> None:
        self._awaiting = None
        try:
            if error is None:
                awaited = self._coroutine.send(None)
            else:
                awaited = self._coroutine.throw(error)
        except (StopIteration, asyncio.CancelledError):
            self._done = True
            return
        except Exception:
            self._done = True
            log.exception("a session call failed", extra={"event": "internal_error"})
            return
        if awaited is None:  # a bare yield (asyncio.sleep(0)): go on after what else is ready
            self._awaiting = object()
            asyncio.get_running_loop().call_soon(self._woken, self._awaiting)
            return
        self._awaiting = awaited
        if type(awaited) is Wakeup:
            awaited.resume = self._woken
            return
        awaited._asyncio_future_blocking = False  # what a Task does with what it awaits
        awaited.add_done_callback(self._woken)

    def cancel(self) -> None:
        """Raises CancelledError where the coroutine waits, as Task.cancel does."""
        if self._done:
            return
        if isinstance(self._awaiting, asyncio.Future):
            self._awaiting.remove_done_callback(self._woken)
        elif type(self._awaiting) is Wakeup:
            self._awaiting.resume = None
        self._resume(asyncio.CancelledError())


class FramedSession(asyncio.Protocol):
    """The serving end of one :class:`SocketSession` connection (the coordinator's session
    port, a host's relay): each call starts at once (``run`` returns its answer as in
    :func:`encode_answers`, see :class:`_Call`) and is answered when done, in any order;
    a ping at once; a cancel stops the call. Frames are parsed in ``data_received`` and
    answers written straight to the transport: no stream reader or writer task per message.

    With ``hello``, the first message is a SessionHello that ``hello`` accepts (None) or
    refuses with a status. A refusal, or a message that does not parse, is answered with id
    0 and that status, and the connection closed. ``on_close`` runs when it ends.

    A message is refused from its length prefix, before its bytes are held: a hello over
    ``MAX_HELLO`` bytes closes the connection (an unauthenticated peer must not make us
    hold gigabytes); a later message over ``max_message`` bytes is answered with
    RESOURCE_EXHAUSTED (naming ``max_message_rule``) for its call, and its bytes are read
    and dropped, so that its sender, still writing it, gets the answer.
    """

    # A peer that stops reading its answers must not grow our memory without bound: past
    # MAX_UNSENT bytes of answers not yet taken by a peer that has taken none for STALLED s,
    # or past MAX_HELD whatever it takes, its connection is closed. (A peer that reads was cut
    # for two answers of a round of 300 MiB, to two threads that sent apart, or one and a
    # ping's. MAX_HELD counts the answers that share one round's encoded response once, and
    # holds two of the largest the limits allow.)
    MAX_UNSENT = 256 << 20
    STALLED = 60.0
    MAX_HELD = 4 << 30
    _log = log  # (the coordinator's connections log as the coordinator)

    def __init__(
        self,
        run: Callable[[Call], Awaitable[tuple[bytes, bytes]]],
        hello: Callable[[pb.SessionHello], tuple[grpc.StatusCode, str] | None] | None = None,
        on_close: Callable[["FramedSession"], None] | None = None,
        *,
        max_message: int = MAX_MESSAGE,
        max_message_rule: str = "protobuf's limit",
    ) -> None:
        self._run = run
        self._hello = hello
        self._on_close = on_close
        self._max_message = max_message
        self._max_message_rule = max_message_rule
        self._skip = 0  # bytes still to drop of a message refused as too big
        self._buffer = bytearray()
        self._calls: dict[int, _Call] = {}
        self.transport: asyncio.Transport | None = None
        self._written = 0  # bytes of answers sent or waiting to be (in the transport, or in _later)
        self._taken = (0, 0.0)  # bytes of them the peer had taken when last looked, and since when
        self._later: collections.deque[memoryview] = collections.deque()  # not yet handed to the transport (_feed)
        self._later_bytes = 0
        self._paused = False  # the transport has more to send than its high-water mark
        self._close_when_fed = False  # refused: closed once what waits in _later is handed over

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._taken = (0, time.monotonic())

    def busy(self) -> bool:
        """Whether a call is running."""
        return bool(self._calls)

    def data_received(self, data: bytes) -> None:
        if self._skip:  # the rest of a message refused as too big
            if len(data) <= self._skip:
                self._skip -= len(data)
                return
            data, self._skip = memoryview(data)[self._skip :], 0
        limit = self._max_message if self._hello is None else MAX_HELLO
        if not self._buffer and one_whole_message(data) and len(data) - FRAME.size <= limit:
            self._message(memoryview(data)[FRAME.size :])  # nearly every read: taken as it came
            return
        buffer = self._buffer
        buffer += data
        start = 0
        try:
            while len(buffer) - start >= FRAME.size:
                size = FRAME.unpack_from(buffer, start)[0]
                end = start + FRAME.size + size
                if size > (self._max_message if self._hello is None else MAX_HELLO):
                    taken = self._too_big(size, memoryview(buffer)[start + FRAME.size : end])
                    if taken is None:  # closed, or the start of the message is still to come
                        return
                    start += FRAME.size + taken
                    continue
                if len(buffer) < end:
                    break
                with memoryview(buffer) as view:  # (one copy, not two)
                    message = bytes(view[start + FRAME.size : end])
                start = end
                if not self._message(message):
                    return
        finally:
            if self.transport.is_closing():
                buffer.clear()
            else:
                del buffer[:start]

    def _too_big(self, size: int, received: memoryview) -> int | None:
        """A message of ``size`` bytes, more than may come now, of which ``received`` came.
        Refuses it, and returns how much of it was received (to be dropped; the rest will
        be, as it comes); None when the connection was closed, or (nothing refused yet)
        until the start of the message names its call."""
        with received:
            if self._hello is not None:
                if size == _HTTP2_PREFACE:
                    global _http2_said
                    now = time.monotonic()
                    if now - _http2_said >= 60:  # (anyone can connect: once a minute at most)
                        _http2_said = now
                        served_log.warning(
                            "a gRPC (HTTP/2) client connected to the session port from %s: gRPC clients, "
                            "`status` and `health` dial the gRPC port (7481 by default)",
                            self.transport.get_extra_info("peername"),
                            extra={"event": "wrong_port"},
                        )
                self._refuse(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the first message of a session must be a SessionHello of at most {MAX_HELLO} bytes; "
                    f"this one announced {size} bytes (is the peer a pjrt-rendezvous client?)",
                )
                return None
            call_id = _call_id(received)
            if call_id is None and len(received) < _CALL_ID_BYTES:
                return None  # the call id may be in the bytes still to come
            refusal = (
                f"a message of {size} bytes is over the limit of {self._max_message} bytes a session takes "
                f"({self._max_message_rule}); send less in one call"
            )
            if not call_id:  # not a call we could answer alone: the session ends
                self._refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
                return None
            global _refused_said
            now = time.monotonic()
            loud = now - _refused_said >= 60  # (a peer sending nothing but these must not flood the log)
            if loud:
                _refused_said = now
            self._log.log(logging.WARNING if loud else logging.DEBUG, "refused a call on a session: %s", refusal, extra={"event": "call_refused"})
            self._send(session_answer(call_id, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal))
            taken = min(size, len(received))
            self._skip = size - taken
            return taken

    def _message(self, message: bytes | memoryview) -> bool:
        if self._hello is not None:
            greeting = _parse_hello(message)
            if isinstance(greeting, Malformed):
                return self._refuse(grpc.StatusCode.INVALID_ARGUMENT, greeting.message)
            refusal = self._hello(greeting)
            if refusal is not None:
                return self._refuse(*refusal)
            self._hello = None
            return True
        calls = decode_session_calls(message)
        if isinstance(calls, Malformed):
            return self._refuse(grpc.StatusCode.INVALID_ARGUMENT, calls.message)
        for call in calls:
            call_id, method, _, cancel = call
            if cancel:
                running = self._calls.pop(call_id, None)
                if running is not None:
                    running.cancel()
            elif not method:  # a ping
                self._send(session_answer(call_id))
            elif call_id not in self._calls:
                running = self._calls[call_id] = _Call(self._answer(call))
                running.start()  # once listed: a call done at once unlists itself
        return True

    async def _answer(self, call: Call) -> None:
        try:
            reply = await self._run(call)
        finally:  # done: a late cancel finds nothing to stop
            self._calls.pop(call[0], None)
        self._send(reply)

    def _send(self, answer: tuple[bytes, bytes]) -> None:
        if self.transport.is_closing():
            return  # the peer resends on a new connection
        unsent = self.transport.get_write_buffer_size() + self._later_bytes
        if unsent > self.MAX_UNSENT:
            held = self.transport.get_write_buffer_size() + _held_apart(p.obj for p in self._later) if unsent > self.MAX_HELD else 0
            stalled = self._not_reading(unsent)
            if held > self.MAX_HELD or stalled:
                self._log.warning(
                    "a session peer does not read its answers (%d bytes of them wait: %s); closing its connection",
                    unsent, f"over {self.MAX_HELD}" if not stalled else f"it has taken none for {self.STALLED:g} s",
                    extra={"event": "session_ended"},
                )
                self.transport.abort()
                return
        head, body = answer
        if len(body) < _PIECE and not self._later:  # nearly every answer: written at once
            message = encode_answers([answer], True)
            self.transport.write(message)
            self._written += len(message)
            return
        # A big answer goes in pieces as the peer takes them, its response not copied: the
        # transport copies what the socket does not take at once, and each member's answer to
        # a round of 512 MiB was two copies of it (joined, then buffered): 5.4 GB at 4 members.
        if len(body) < _PIECE:
            parts = [memoryview(encode_answers([answer], True))]
        else:
            parts = [memoryview(answer_prefix(head, len(body))), memoryview(body)]
        for part in parts:
            self._later.append(part)
            self._later_bytes += len(part)
            self._written += len(part)
        self._feed()

    def _feed(self) -> None:
        """Hands the transport what waits in ``_later``, a _PIECE at a time, until it has
        more than its high-water mark to send (``pause_writing``)."""
        later = self._later
        while later and not self._paused and not self.transport.is_closing():
            part = later[0]
            if len(part) > _PIECE:
                later[0], part = part[_PIECE:], part[:_PIECE]
            else:
                later.popleft()
            self._later_bytes -= len(part)
            self.transport.write(part)
        if self._close_when_fed and not later:
            self.transport.close()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._feed()

    def _not_reading(self, unsent: int) -> bool:
        """Whether the peer, ``unsent`` bytes of its answers still to take, has taken none of
        them for STALLED s (as far as the looks at each answer sent over MAX_UNSENT tell)."""
        now = time.monotonic()
        taken = self._written - unsent
        if taken != self._taken[0]:
            self._taken = (taken, now)
        return now - self._taken[1] >= self.STALLED

    def _refuse(self, code: grpc.StatusCode, message: str) -> bool:
        self._log.debug("refused a session: %s: %s", code.name, message)
        self._send(session_answer(0, code, message))
        if not self.transport.is_closing():
            self.transport.pause_reading()  # (nothing more is taken from it)
            self._close_when_fed = True  # (after what waits in _later: the transport sends what it has, then closes)
            self._feed()
        return False

    def connection_lost(self, exc) -> None:
        for running in list(self._calls.values()):
            running.cancel()
        self._calls.clear()
        self._later.clear()
        if self._on_close is not None:
            self._on_close(self)


_refused_said = float("-inf")  # when a call too big was last refused with a warning (FramedSession._too_big)
_http2_said = float("-inf")  # when a gRPC client on a session port was last warned of
_HTTP2_PREFACE = int.from_bytes(b"PRI ", "big")  # the start of HTTP/2's preface, read as a message's length
_parse_hello = parser(pb.SessionHello)
_parse_request = parser(pb.SessionRequest)

# The start of a SessionRequest that names its first call's id: its tag, its length (a
# varint), the id's tag and the id (a varint).
_CALL_ID_BYTES = 1 + 10 + 1 + 10


def _read_varint(data: memoryview, at: int) -> tuple[int, int] | None:
    """The varint at ``at`` in ``data`` and where it ends; None if it does not end there."""
    value = shift = 0
    for position in range(at, min(len(data), at + 10)):
        value |= (data[position] & 0x7F) << shift
        if data[position] < 0x80:
            return value, position + 1
        shift += 7
    return None


def _call_id(start: memoryview) -> int | None:
    """The id of the first call in a serialized SessionRequest that begins with ``start``
    (as :func:`session_request` encodes it: the id first), or None."""
    if len(start) < 2 or start[0] != _CALLS_TAG[0]:
        return None
    length = _read_varint(start, 1)
    if length is None or length[1] >= len(start) or start[length[1]] != _ID_TAG[0]:
        return None
    call_id = _read_varint(start, length[1] + 1)
    return None if call_id is None or call_id[0] >= 1 << 64 else call_id[0]  # (protobuf's ids are 64-bit)
