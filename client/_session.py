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
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Callable

import grpc

from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

log = logging.getLogger("pjrt_rendezvous.client")

_CODES = {status.value[0]: status for status in grpc.StatusCode}


class StatusError(grpc.RpcError):
    """A call's failure as a status, shaped like the error a unary call raises."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Pending:
    __slots__ = ("done", "response", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.response: pb.SessionAnswer | None = None
        self.error: grpc.RpcError | None = None


class Session:
    """A ``Session`` stream and the calls waiting on it. Thread-safe."""

    def __init__(self, stub, metadata) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.broken: grpc.RpcError | None = None
        self._responses = stub.Session(self._requests(), metadata=metadata)
        threading.Thread(target=self._read, name="pjrt-rendezvous-session", daemon=True).start()

    def _requests(self):
        """What gRPC's sending thread sends: every call queued while it sent the last."""
        while (call := self._outbox.get()) is not None:
            calls = [call]
            while True:
                try:
                    call = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if call is None:
                    yield pb.SessionRequest(calls=calls)
                    return
                calls.append(call)
            yield pb.SessionRequest(calls=calls)

    def _read(self) -> None:
        try:
            for response in self._responses:
                with self._lock:
                    answered = [(self._pending.pop(a.id, None), a) for a in response.answers]
                for pending, answer in answered:
                    if pending is not None:  # else the caller gave up on it
                        pending.response = answer
                        pending.done.set()
            error: grpc.RpcError = StatusError(grpc.StatusCode.UNAVAILABLE, "the coordinator ended the session")
        except grpc.RpcError as exc:
            error = exc
        with self._lock:
            self.broken = error
            pending_calls = list(self._pending.values())
            self._pending.clear()
        self._outbox.put(None)  # lets gRPC's sending thread finish
        for pending in pending_calls:
            pending.error = error
            pending.done.set()

    def close(self) -> None:
        """Ends the stream from this side (calls still waiting fail)."""
        self._outbox.put(None)
        self._responses.cancel()

    def call(
        self,
        method: str,
        request,
        timeout: float | None,
        progress: Callable[[float], None] | None = None,
        interval: float | None = None,
    ) -> bytes:
        """Sends ``request`` to ``method``; returns the serialized response.

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
        self._outbox.put(pb.SessionCall(id=call_id, method=method, request=request.SerializeToString()))
        started = time.monotonic()
        end = None if timeout is None else started + timeout
        reports = 0
        try:
            while True:
                wake = [t for t in (end, None if progress is None else started + interval * (reports + 1)) if t is not None]
                if pending.done.wait(None if not wake else max(0.0, min(wake) - time.monotonic())):
                    break
                now = time.monotonic()
                if end is not None and now >= end:
                    raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer to {method} within {timeout:.3g} s")
                if progress is not None and now >= started + interval * (reports + 1):
                    reports += 1
                    progress(now - started)
        except BaseException:  # our deadline, an interrupt: the coordinator may stop the call
            with self._lock:
                abandoned = self._pending.pop(call_id, None) is not None and self.broken is None
            if abandoned:
                self._outbox.put(pb.SessionCall(id=call_id, cancel=True))
            raise
        if pending.error is not None:
            raise pending.error
        response = pending.response
        if response.code:
            raise StatusError(_CODES.get(response.code, grpc.StatusCode.UNKNOWN), response.message)
        return response.response
