"""The gRPC servicer: translates messages into core calls and carries out the decisions.

It owns the only I/O-side state: futures of calls waiting on a wake key (see
``_core``). Everything runs on one asyncio event loop, so the core needs no lock.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from typing import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb
from pjrt_rendezvous.protos.v1 import coordinator_pb2_grpc as pb_grpc

from ._core import ALL, Code, Contribution, Core, CoreError, Registration, ThreadRequest, format_ranges

log = logging.getLogger("pjrt_rendezvous.coordinator")

# The one place core codes become wire codes.
_STATUS = {code: getattr(grpc.StatusCode, code.name) for code in Code}
# gRPC carries the status message in a trailer and drops trailers over 8 KiB (some at
# random, all over 16 KiB): a longer message would reach the client as a bare
# RESOURCE_EXHAUSTED. Non-ASCII text can take 3 bytes a character once escaped.
_MESSAGE_CHARACTERS = 2000


def _clip(message: str) -> str:
    if len(message) <= _MESSAGE_CHARACTERS:
        return message
    return f"{message[:_MESSAGE_CHARACTERS]} ... ({len(message) - _MESSAGE_CHARACTERS} more characters)"


class _Malformed:
    """Stands in for a request body that does not parse, so the handler can refuse it."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.message = f"the request is not a valid {type_name}: {error}"


def _parser(message_class):
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return _Malformed(message_class.DESCRIPTOR.full_name, exc)

    return parse


async def _abort(context, code: Code, message: str) -> None:
    await context.abort(_STATUS[code], _clip(message))


def _translated(method):
    """Turns a CoreError raised by a handler into a gRPC status with its message."""

    @functools.wraps(method)
    async def handler(self, request, context):
        if isinstance(request, _Malformed):
            await _abort(context, Code.INVALID_ARGUMENT, request.message)
        try:
            return await method(self, request, context)
        except CoreError as exc:
            await _abort(context, exc.code, exc.message)

    return handler


def _serialize(message) -> bytes:
    # A response shared by many callers (a finished round, the world table) is serialized
    # once by the servicer and arrives here as bytes.
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_to_server(servicer: "Servicer", server) -> None:
    """Registers ``servicer`` like the generated helper does, but with request parsers that
    turn an unparsable body into INVALID_ARGUMENT instead of gRPC's UNKNOWN."""
    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    handlers = {}
    for method in service.methods:
        if method.client_streaming:
            factory = grpc.stream_stream_rpc_method_handler
        elif method.server_streaming:
            factory = grpc.unary_stream_rpc_method_handler
        else:
            factory = grpc.unary_unary_rpc_method_handler
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=_parser(getattr(pb, method.input_type.name)),
            response_serializer=_serialize,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


async def _nothing() -> None:
    return None


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(False)


def _timeout(request) -> float | None:
    """An absent timeout waits forever; zero or negative is refused (never 'forever')."""
    if not request.HasField("timeout"):
        return None
    if not request.timeout > 0:
        raise CoreError(
            Code.INVALID_ARGUMENT,
            f"timeout must be a positive number of seconds, got {request.timeout}; "
            "leave it out to wait forever",
        )
    return request.timeout


class Servicer(pb_grpc.CoordinatorServicer):
    """Implements ``pjrt_rendezvous.v1.Coordinator`` over a :class:`Core`."""

    def __init__(
        self,
        core: Core,
        *,
        clock: Callable[[], float] = time.monotonic,
        persist: Callable[[], Awaitable[None]] | None = None,
        monitor=None,
        on_call: Callable[[str, str], None] | None = None,
    ) -> None:
        self._core = core
        # Sees (method, status code name) of every call carried on a Session stream, which
        # the RPC interceptor counts only as one Session (the metrics).
        self._on_call = on_call
        # The unary methods a Session stream carries: name -> (handler, request parser).
        self._unary = {
            m.name: (getattr(type(self), m.name).__wrapped__, _parser(getattr(pb, m.input_type.name)))
            for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods
            if not m.client_streaming and not m.server_streaming
        }
        # Sees every batch of wake keys: event log lines and metrics (``_monitor``).
        self._monitor = monitor
        self._clock = clock
        # Called before answering any call that changed state, so nothing a client was
        # told is lost if the coordinator dies right after (the state file).
        self._persist = persist or _nothing
        self._waiters: dict[tuple, set[asyncio.Future]] = collections.defaultdict(set)
        self._world_tables: dict[str, tuple[int, bytes]] = {}  # job -> (core version, WaitWorldResponse)

    # -- waiting --------------------------------------------------------------------------

    def _wake(self) -> None:
        wakeups = self._core.take_wakeups()
        if self._monitor is not None and wakeups:
            try:
                self._monitor.woke(wakeups)
            except Exception:  # pragma: no cover - reporting must never break serving
                log.exception("monitoring failed on %s", wakeups)
        for key in wakeups:
            for future in self._waiters.pop(key, ()):
                if not future.done():
                    future.set_result(True)

    async def _wait(self, key: tuple, deadline: float | None) -> bool:
        """Waits until ``key`` is woken (True) or ``deadline`` passes (False)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        waiters = self._waiters[key]
        waiters.add(future)
        # One future and at most one timer per waiter (asyncio.wait added a second future,
        # callbacks and a set per call).
        timer = None
        if deadline is not None:
            timer = loop.call_later(max(0.0, deadline - self._clock()), _expire, future)
        try:
            return await future
        finally:
            if timer is not None:
                timer.cancel()
            waiters.discard(future)
            if not waiters and self._waiters.get(key) is waiters:
                del self._waiters[key]

    # -- ranks ----------------------------------------------------------------------------

    @_translated
    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        registered = self._core.register(
            self._clock(),
            Registration(
                job=request.job,
                incarnation=request.incarnation,
                host=request.host,
                pid=request.pid,
                task_id=request.task_id,
                num_tasks=request.num_tasks,
                devices_per_task=request.devices_per_task,
                local_rank=request.local_rank,
                threads=tuple(
                    ThreadRequest(
                        thread_index=t.thread_index,
                        runtime_ordinal=t.runtime_ordinal if t.HasField("runtime_ordinal") else None,
                    )
                    for t in request.threads
                ),
                runtime_world_size=request.runtime_world_size,
            ),
        )
        ordinals = format_ranges(a.ordinal for a in registered.assignments)
        job = self._core.jobs[request.job]
        log.info(
            "registered task %d (%s pid %d) in job %r: %s %s; %d of %d ordinals registered",
            request.task_id,
            request.host,
            request.pid,
            request.job,
            "ordinal" if len(registered.assignments) == 1 else "ordinals",
            ordinals,
            len(job.members),
            registered.world_size,
            extra={
                "event": "registered",
                "job": request.job,
                "task": request.task_id,
                "host": request.host,
                "pid": request.pid,
                "ordinals": ordinals,
                "registered": len(job.members),
                "world_size": registered.world_size,
                "generation": registered.generation,
            },
        )
        self._wake()
        await self._persist()
        return pb.RegisterResponse(
            world_size=registered.world_size,
            generation=registered.generation,
            heartbeat_timeout=self._core.heartbeat_timeout or 0.0,
            assignments=[
                pb.Assignment(thread_index=a.thread_index, ordinal=a.ordinal, local_ordinal=a.local_ordinal)
                for a in registered.assignments
            ],
        )

    @_translated
    async def WaitWorld(self, request: pb.WaitWorldRequest, context) -> pb.WaitWorldResponse:
        timeout = _timeout(request)
        start = self._clock()
        deadline = None if timeout is None else start + timeout
        while not self._core.world_complete(request.job):
            if not await self._wait(("world", request.job), deadline) and (
                deadline is not None and self._clock() >= deadline
            ):
                raise self._core.world_timeout(request.job, self._clock(), self._clock() - start)
        job = self._core.jobs[request.job]
        log.debug("world of job %s complete: %d ordinals", request.job, job.world_size)
        # Every process asks at the same moment for the same table: build and serialize it
        # once per state of the core (``version`` grows with every change of ranks, deaths,
        # generations), not once per caller (O(world) each).
        version = self._core.version
        cached = self._world_tables.get(request.job)
        if cached is None or cached[0] != version:
            table = self._core.world(request.job)
            response = pb.WaitWorldResponse(world_size=job.world_size, processes=_world_processes(table))
            cached = self._world_tables[request.job] = (version, response.SerializeToString())
        return cached[1]

    # -- rendezvous -----------------------------------------------------------------------

    @_translated
    async def Rendezvous(self, request: pb.RendezvousRequest, context) -> pb.RendezvousResponse:
        timeout = _timeout(request)
        now = self._clock()
        try:
            key = self._core.arrive(
                now,
                job=request.job,
                incarnation=request.incarnation,
                replicas=request.replicas,
                round_number=request.round,
                contributions=[Contribution(c.ordinal, c.tag, c.payload, c.incarnation) for c in request.contributions],
                deadline=None if timeout is None else now + timeout,
                generation=request.generation,
            )
        finally:
            self._wake()  # a refused call may have failed its peers' round: release them now
        while (rnd := self._core.outcome(request.job, key)) is None:
            if not await self._wait(("round", request.job, *key), self._core.deadline(request.job, key)):
                self._core.expire(self._clock())
                self._wake()
        await self._persist()
        if rnd.error is not None:
            raise rnd.error
        if rnd.response is None:
            # Serialized once for every member of the round (see _server._serialize).
            rnd.response = pb.RendezvousResponse(payloads=rnd.result).SerializeToString()
        return rnd.response

    # -- liveness -------------------------------------------------------------------------

    async def watch_liveness(self) -> None:
        """Runs until cancelled: declares silent processes dead, a few times per timeout."""
        timeout = self._core.heartbeat_timeout
        if timeout is None:
            return
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            self._core.check_liveness(self._clock())
            self._wake()

    @_translated
    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        generation = self._core.touch(request.job, request.incarnation, self._clock())
        return pb.HeartbeatResponse(
            generation=generation, heartbeat_timeout=self._core.heartbeat_timeout or 0.0
        )

    @_translated
    async def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveResponse:
        self._core.leave(request.job, request.incarnation)
        self._wake()
        await self._persist()
        return pb.LeaveResponse()

    async def Watch(self, request: pb.WatchRequest, context):
        """Streams the job's events (deaths, restarts) from the moment of the call on."""
        if isinstance(request, _Malformed):
            await _abort(context, Code.INVALID_ARGUMENT, request.message)
        try:
            self._core.touch(request.job, request.incarnation, self._clock())
            seen = len(self._core.events(request.job, 0))
        except CoreError as exc:
            await _abort(context, exc.code, exc.message)
        while True:
            for event in self._core.events(request.job, seen):
                seen += 1
                yield pb.WatchEvent(
                    kind=pb.WatchEvent.Kind.Value(event.kind),
                    generation=event.generation,
                    ordinals=event.ordinals,
                    host=event.host,
                    message=event.message,
                )
            await self._wait(("events", request.job), None)

    # -- sessions -------------------------------------------------------------------------

    async def Session(self, requests, context) -> None:
        """Carries a client process's unary calls on one stream (see :func:`serve_session`)."""
        await serve_session(requests, context, self._session_call)

    async def _session_call(self, call: pb.SessionCall) -> tuple[bytes, bytes]:
        """Runs one call of a Session like the unary method would; returns its answer as
        (the serialized SessionAnswer without its response, the serialized response)."""
        method = call.method
        entry = self._unary.get(method)
        if entry is None:
            method, status, text = "(unknown)", grpc.StatusCode.UNIMPLEMENTED, f"no method {call.method!r}"
        else:
            handler, parse = entry
            try:
                request = parse(call.request)
                if isinstance(request, _Malformed):
                    raise CoreError(Code.INVALID_ARGUMENT, request.message)
                result = await handler(self, request, None)
                status = grpc.StatusCode.OK
            except CoreError as exc:
                status, text = _STATUS[exc.code], exc.message
            except Exception:
                log.exception("%s failed on a session", method)
                status, text = grpc.StatusCode.UNKNOWN, f"{method} failed in the coordinator; its log has the details"
        if self._on_call is not None:
            self._on_call(method, status.name)
        if status is grpc.StatusCode.OK:
            return session_answer(call.id, response=_serialize(result))
        return session_answer(call.id, status, text)

    # -- key-value ------------------------------------------------------------------------

    @_translated
    async def KvSet(self, request: pb.KvSetRequest, context) -> pb.KvSetResponse:
        self._core.kv_set(request.job, [(e.key, e.value) for e in request.entries])
        self._wake()
        await self._persist()
        return pb.KvSetResponse()

    @_translated
    async def KvGet(self, request: pb.KvGetRequest, context) -> pb.KvGetResponse:
        timeout = _timeout(request)
        start = self._clock()
        deadline = None if timeout is None else start + timeout
        while True:
            values = self._core.kv_get(request.job, request.keys)
            missing = [k for k, v in zip(request.keys, values) if v is None]
            if not request.wait or not missing:
                break
            if not await self._wait(("kv", request.job, missing[0]), deadline) and (
                deadline is not None and self._clock() >= deadline
            ):
                raise self._core.kv_timeout(request.job, request.keys, self._clock() - start)
        return pb.KvGetResponse(
            values=[pb.KvValue(found=v is not None, value=v or b"") for v in values]
        )

    @_translated
    async def KvAdd(self, request: pb.KvAddRequest, context) -> pb.KvAddResponse:
        value = self._core.kv_add(request.job, request.key, request.delta, request.request_id)
        self._wake()
        await self._persist()
        return pb.KvAddResponse(value=value)

    @_translated
    async def KvCompareSet(self, request: pb.KvCompareSetRequest, context) -> pb.KvCompareSetResponse:
        value = self._core.kv_compare_set(
            request.job, request.key, request.expected, request.desired, request.request_id
        )
        self._wake()
        await self._persist()
        return pb.KvCompareSetResponse(value=value)

    @_translated
    async def KvAppend(self, request: pb.KvAppendRequest, context) -> pb.KvAppendResponse:
        self._core.kv_append(request.job, request.key, request.value, request.request_id)
        self._wake()
        await self._persist()
        return pb.KvAppendResponse()

    @_translated
    async def KvDelete(self, request: pb.KvDeleteRequest, context) -> pb.KvDeleteResponse:
        deleted = self._core.kv_delete(request.job, request.key)
        await self._persist()
        return pb.KvDeleteResponse(deleted=deleted)

    @_translated
    async def KvList(self, request: pb.KvListRequest, context) -> pb.KvListResponse:
        if request.count_only:
            return pb.KvListResponse(count=self._core.kv_count(request.job, request.prefix))
        entries = self._core.kv_list(request.job, request.prefix)
        return pb.KvListResponse(
            count=len(entries), entries=[pb.KvEntry(key=k, value=v) for k, v in entries]
        )

    # -- status ---------------------------------------------------------------------------

    @_translated
    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        views = self._core.status(self._clock(), request.job)
        return pb.StatusResponse(
            jobs=[
                pb.JobStatus(
                    job=v.job,
                    world_size=v.world_size,
                    registered=v.registered,
                    generation=v.generation,
                    rounds_completed=v.rounds_completed,
                    kv_keys=v.kv_keys,
                    participants=[_participant(p) for p in v.participants],
                    pending_rounds=[
                        pb.PendingRound(
                            replicas=[] if r.group == ALL else r.group,
                            round=r.number,
                            tags=[pb.TagGroup(tag=t, ordinals=o) for t, o in r.tags.items()],
                            arrived=r.arrived,
                            missing=r.missing,
                            waiting_seconds=r.waiting_seconds,
                            missing_summary=r.missing_summary,
                        )
                        for r in v.pending_rounds
                    ],
                )
                for v in views
            ]
        )


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_ANSWERS_TAG = b"\x0a"  # SessionResponse.answers: field 1, length-delimited
_RESPONSE_TAG = b"\x22"  # SessionAnswer.response: field 4, length-delimited


def _session_response(answers: list[tuple[bytes, bytes]]) -> bytes:
    """A serialized SessionResponse of (answer without response, response) pairs.

    Encoded by hand so a response shared by many callers (a finished round, the world
    table) is copied once into each caller's message, not three times through protobuf
    objects: at 4,096 ordinals every process's answer to WaitWorld is in flight at once.
    """
    parts = []
    for head, body in answers:
        tail = [_RESPONSE_TAG, _varint(len(body)), body] if body else []
        size = len(head) + sum(map(len, tail))
        parts += [_ANSWERS_TAG, _varint(size), head, *tail]
    return b"".join(parts)


def session_answer(
    call_id: int, status: grpc.StatusCode = grpc.StatusCode.OK, message: str = "", response: bytes = b""
) -> tuple[bytes, bytes]:
    """One call's answer as :func:`_session_response` takes it."""
    if status is grpc.StatusCode.OK:
        return pb.SessionAnswer(id=call_id).SerializeToString(), response
    return pb.SessionAnswer(id=call_id, code=status.value[0], message=_clip(message)).SerializeToString(), b""


def session_method_handler(serve: Callable[..., Awaitable[None]]) -> grpc.RpcMethodHandler:
    """The gRPC handler of a Session method served by ``serve(requests, context)`` (a host
    relay's; the coordinator's goes through :func:`add_to_server`)."""
    return grpc.stream_stream_rpc_method_handler(
        serve, request_deserializer=_parser(pb.SessionRequest), response_serializer=_serialize
    )


async def serve_session(requests, context, run: Callable[[pb.SessionCall], Awaitable[tuple[bytes, bytes]]]) -> None:
    """Serves one Session stream: each call runs as its own task (``run`` returns its answer
    as in :func:`_session_response`) and is answered when done, in any order (see the .proto).
    Answers that are ready while the stream is busy writing go out together in the next
    message; a cancel stops the call's task."""
    calls: dict[int, asyncio.Task] = {}  # running, cancellable by the client
    ready: list[tuple[bytes, bytes]] = []  # answers waiting for the stream
    writer: asyncio.Task | None = None

    async def write() -> None:
        try:
            while ready:
                message = _session_response(ready)
                ready.clear()
                await context.write(message)
        except Exception as exc:  # the stream is gone; the client resends on a new one
            log.debug("session answers not sent: %s", exc)

    async def answer(call: pb.SessionCall) -> None:
        nonlocal writer
        try:
            build = await run(call)
        finally:  # done: a late cancel must not stop the writer with others' answers
            calls.pop(call.id, None)
        ready.append(build)
        if writer is None or writer.done():  # else the running writer takes it along
            writer = asyncio.create_task(write())

    try:
        async for message in requests:
            if isinstance(message, _Malformed):
                await _abort(context, Code.INVALID_ARGUMENT, message.message)
            for call in message.calls:
                if call.cancel:
                    task = calls.pop(call.id, None)
                    if task is not None:
                        task.cancel()
                elif call.id not in calls:
                    calls[call.id] = asyncio.create_task(answer(call))
        # The client finished sending: answer what it asked, then end the stream.
        while calls:
            await asyncio.wait(list(calls.values()))
        while writer is not None and not writer.done():
            await writer
    finally:
        for task in calls.values():
            task.cancel()
        if writer is not None:
            writer.cancel()


def _world_processes(table) -> list[pb.WorldProcess]:
    """The rank table grouped by process, in ordinal order of each process's first thread."""
    processes: dict[str, pb.WorldProcess] = {}
    for view in table:
        process = processes.get(view.incarnation)
        if process is None:
            process = processes[view.incarnation] = pb.WorldProcess(
                task_id=view.task_id,
                host=view.host,
                pid=view.pid,
                incarnation=view.incarnation,
                last_seen_age=view.last_seen_age,
                alive=view.alive,
            )
        thread = process.threads.add(
            ordinal=view.ordinal, local_ordinal=view.local_ordinal, thread_index=view.thread_index
        )
        if view.runtime_ordinal is not None:
            thread.runtime_ordinal = view.runtime_ordinal
    return list(processes.values())


def _participant(view) -> pb.Participant:
    message = pb.Participant(
        ordinal=view.ordinal,
        local_ordinal=view.local_ordinal,
        task_id=view.task_id,
        thread_index=view.thread_index,
        host=view.host,
        pid=view.pid,
        incarnation=view.incarnation,
        last_seen_age=view.last_seen_age,
        alive=view.alive,
    )
    if view.runtime_ordinal is not None:
        message.runtime_ordinal = view.runtime_ordinal
    return message
