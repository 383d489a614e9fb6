"""The gRPC servicer: translates messages into core calls and carries out the decisions.

It owns the only I/O-side state: the calls waiting on a wake key and their deadlines (see
``_core``). Everything runs on one asyncio event loop, so the core needs no lock.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import heapq
import itertools
import logging
import time
from typing import Any, Awaitable, Callable

import grpc

from pjrt_rendezvous.client._config import versions_differ
from pjrt_rendezvous.client._session import Call, Malformed, Wakeup, clip, decode_session_calls, parser, serve_session, session_answer
from pjrt_rendezvous.client._version import build
from pjrt_rendezvous.client._wire import RendezvousCall, decode_rendezvous, encode_payloads
from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb
from pjrt_rendezvous.protos.v1 import coordinator_pb2_grpc as pb_grpc

from ._core import ALL, Code, Core, CoreError, Registered, Registration, ThreadRequest, _plural, format_ranges, keys_shown

log = logging.getLogger("pjrt_rendezvous.coordinator")

# The one place core codes become wire codes.
_STATUS = {code: getattr(grpc.StatusCode, code.name) for code in Code}
async def _abort(context, code: Code, message: str) -> None:
    await context.abort(_STATUS[code], clip(message))


def _translated(method):
    """Turns a CoreError raised by a handler into a gRPC status with its message."""

    @functools.wraps(method)
    async def handler(self, request, context):
        if isinstance(request, Malformed):
            await _abort(context, Code.INVALID_ARGUMENT, request.message)
        try:
            return await method(self, request, context)
        except CoreError as exc:
            error = await self._refusal(exc)
        await _abort(context, error.code, error.message)

    return handler


def _serialize(message) -> bytes:
    # A response shared by many callers (a finished round, the world table) is serialized
    # once by the servicer and arrives here as bytes.
    return message if isinstance(message, bytes) else message.SerializeToString()


# Decoded to tuples (natively where built): the messages of every round.
_DECODERS = {"Rendezvous": decode_rendezvous, "Session": decode_session_calls}
_VERSIONS_TOLD_KEPT = 1024  # (job, version) pairs, and refusals, logged once each (Servicer._tell_version, _refusal)
_REFUSALS_KEPT = 1024  # processes whose latest refused registration is remembered (Servicer.Register)
# Seconds late an alarm rings when the loop was held up (Servicer._ring), and the time then
# given to read the calls that came meanwhile before what was due is judged.
HELD_UP = 1.0


def _decoder(method) -> Callable:
    """A method's request parser: protobuf's, or one of _DECODERS."""
    return _DECODERS.get(method.name) or parser(getattr(pb, method.input_type.name))


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
            request_deserializer=_decoder(method),
            response_serializer=_serialize,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


async def _nothing() -> None:
    return None


def _timeout(request) -> float | None:
    return _checked_timeout(request.timeout) if request.HasField("timeout") else None


def _checked_timeout(timeout: float | None) -> float | None:
    """An absent timeout waits forever; zero or negative is refused (never 'forever')."""
    if timeout is not None and not timeout > 0:
        raise CoreError(
            Code.INVALID_ARGUMENT,
            f"timeout must be a positive number of seconds, got {timeout}; leave it out to wait forever",
        )
    return timeout


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
            m.name: (getattr(type(self), m.name).__wrapped__, _decoder(m))
            for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods
            if not m.client_streaming and not m.server_streaming
        }
        # Sees every batch of wake keys: event log lines and metrics (``_monitor``).
        self._monitor = monitor
        self._clock = clock
        # Called before answering any call that changed state or tells it, so nothing a
        # client was told is lost if the coordinator dies right after (the state file).
        self._persist = persist or _nothing
        # Calls waiting on a wake key: asyncio Futures (gRPC's calls run as Tasks, a Session
        # stream's too), or Wakeups (the session port's calls, resumed at once when set;
        # client/_session.py).
        self._waiters: dict[tuple, set[asyncio.Future | Wakeup]] = collections.defaultdict(set)
        # (job, incarnation) -> the latest refusal of its registration logged: each thread of a
        # refused process registers, and is refused, for the same reason (one warning, the rest DEBUG).
        self._refusals_said: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        # The earliest deadline of each key's waiters (a round's members share one), in a
        # heap that one event-loop timer watches. Most rounds finish long before their
        # deadline: their heap entries lapse, and are dropped in bulk.
        self._deadlines: dict[tuple, float] = {}
        self._deadline_heap: list[tuple[float, int, tuple]] = []  # (deadline, tie-breaker, key)
        self._deadline_order = itertools.count()
        self._alarm: asyncio.TimerHandle | None = None  # at the heap's first live deadline
        self._alarm_at = 0.0
        self._held_at = self._reading_first_until = 0.0  # (see _read_first)
        self._world_tables: dict[str, tuple[int, bytes]] = {}  # job -> (core version, WaitWorldResponse)
        # Told to clients in Register and Heartbeat answers (0: none; see _server._SessionPort).
        self.session_port = 0
        self._stopping = False  # streams end (see end_streams)
        self._gone: str | None = None  # why the coordinator stopped for good (see stop_for_good)
        self._streams: dict[asyncio.Task, Callable[[], bool]] = {}  # Session streams -> idle?
        self._ended: set[asyncio.Task] = set()  # Session streams end_streams cancelled
        # (job, incarnation) -> its Watch streams open (one, but a stream opened again may
        # start before the broken one is seen to end: only the last one's end is a close).
        self._watching: collections.Counter[tuple[str, str]] = collections.Counter()
        self._versions_told: set[tuple[str, str]] = set()  # (job, client version) logged as not ours
        # What refusals serve's log told of (CoreError.warn), each once (the oldest forgotten first).
        self._warned: collections.OrderedDict[tuple, None] = collections.OrderedDict()

    def stop_for_good(self, why: str) -> None:
        """The coordinator stops and none takes its calls up again (an embedded one without a
        state file): pending rounds fail saying ``why``, and so do the waits for keys or for a
        world, those waiting now and any that starts in the grace (their clients would look
        for a coordinator until their ``connect_timeout``). A round made in the grace fails
        when RunningServer.stop calls this again (while calls are in flight)."""
        self._gone = why
        self._core.fail_pending(why)
        self._wake()
        for key in [k for k in self._waiters if k[0] in ("kv", "world")]:
            self._release(key)

    def _gone_error(self, what: str) -> CoreError:
        return CoreError(Code.ABORTED, f"{what} fails: {self._gone}")

    def end_streams(self) -> bool:
        """On stop, called until it returns False: every Watch stream ends (UNAVAILABLE; its
        client watches again once a coordinator answers) and every idle Session stream (its
        client opens another), instead of holding the drain for its whole grace. Returns
        whether a Session stream still runs a call."""
        self._stopping = True
        for key in [k for k in self._waiters if k[0] == "events"]:
            self._release(key)
        busy = False
        for task, idle in list(self._streams.items()):
            if idle():
                del self._streams[task]
                self._ended.add(task)
                task.cancel()
            else:
                busy = True
        return busy

    # -- waiting --------------------------------------------------------------------------

    def _wake(self) -> None:
        wakeups = self._core.take_wakeups()
        if self._monitor is not None and wakeups:
            try:
                self._monitor.woke(wakeups)
            except Exception:  # pragma: no cover - reporting must never break serving
                log.exception("monitoring failed on %s", wakeups, extra={"event": "internal_error"})
        for key in wakeups:
            if key[0] == "dropped":
                self._world_tables.pop(key[1], None)
                self._release(("events", key[1]))  # (its watchers' streams end, saying so)
            self._deadlines.pop(key, None)
            self._release(key)

    async def _refusal(self, exc: CoreError) -> CoreError:
        """``exc``, to be answered once what it may rest on is on disk: a change not written
        yet, this call's or another's (a round another member failed or that expired, a
        death, a restart), which a crash would take back; the write's own error (UNAVAILABLE)
        when it cannot be written."""
        if exc.warn is not None and exc.warn[0] not in self._warned:
            self._warned[exc.warn[0]] = None
            if len(self._warned) > _VERSIONS_TOLD_KEPT:
                self._warned.popitem(last=False)
            log.warning("%s", exc.warn[2], extra={"event": exc.warn[1]})
        try:
            await self._persist()
        except CoreError as failed:
            return failed
        return exc

    def _release(self, key: tuple) -> None:
        """Wakes the calls waiting on ``key``."""
        waiters = self._waiters.pop(key, None)
        if waiters:
            for waiter in list(waiters):  # a Wakeup resumes its call here, which leaves the set
                if not waiter.done():
                    waiter.set_result(True)

    async def _wait(self, key: tuple, deadline: float | None) -> bool:
        """Waits until ``key`` is woken (True) or ``deadline`` (or an earlier waiter's on the
        same key) passes (False)."""
        # A session port's call has no Task (client/_session.py, _Call) and can be resumed at once.
        waiter = asyncio.get_running_loop().create_future() if asyncio.current_task() else Wakeup()
        waiters = self._waiters[key]
        waiters.add(waiter)
        if deadline is not None:
            self._watch_deadline(key, deadline)
        try:
            return await waiter
        finally:
            waiters.discard(waiter)
            if not waiters and self._waiters.get(key) is waiters:
                del self._waiters[key]
                if key[0] != "round":  # (a round's stays: it expires then, waited on or not)
                    self._deadlines.pop(key, None)

    def _watch_deadline(self, key: tuple, deadline: float) -> None:
        current = self._deadlines.get(key)
        if current is not None and current <= deadline:
            return
        self._deadlines[key] = deadline
        heap = self._deadline_heap
        heapq.heappush(heap, (deadline, next(self._deadline_order), key))
        if len(heap) > 2 * len(self._deadlines) + 1024:  # mostly lapsed entries
            heap[:] = [(d, next(self._deadline_order), k) for k, d in self._deadlines.items()]
            heapq.heapify(heap)
        if self._alarm is None or deadline < self._alarm_at:
            self._set_alarm(deadline)

    def _set_alarm(self, deadline: float) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
        self._alarm_at = deadline
        self._alarm = asyncio.get_running_loop().call_later(max(0.0, deadline - self._clock()), self._ring)

    def _ring(self) -> None:
        """The alarm: every key whose deadline passed is expired (all its waiters return
        False; a waiter whose own deadline is later waits again), and a round's fails, its
        members waiting or not (Core.expire; left pending, it would hold its arrivals and
        complete with a late one)."""
        self._alarm = None
        now = self._clock()
        if now - self._alarm_at > HELD_UP and self._alarm_at > self._reading_first_until:
            self._read_first(now)
            return
        due = max(self._alarm_at, now)
        heap = self._deadline_heap
        expired = []
        while heap and heap[0][0] <= due:
            deadline, _, key = heapq.heappop(heap)
            if self._deadlines.get(key) == deadline:
                del self._deadlines[key]
                expired.append(key)
        try:
            if any(key[0] == "round" for key in expired):
                # First: a waiter may resume inside set_result (a session's call) and wait again.
                self._core.expire(due)
                self._wake()
        finally:  # (whatever it raised, no popped key's waiter is left waiting)
            for key in expired:
                for waiter in list(self._waiters.get(key, ())):
                    if not waiter.done():
                        waiter.set_result(False)
        while heap and self._deadlines.get(heap[0][2]) != heap[0][0]:  # lapsed
            heapq.heappop(heap)
        if heap:
            self._set_alarm(heap[0][0])

    def _read_first(self, now: float) -> None:
        """The alarm rang late: the loop was held up (the process stopped and continued, a
        paused host or container) while deadlines passed. The calls sent meanwhile wait
        unread in the sockets, and after a stop the loop runs its overdue timers before it
        reads them: what was due is judged ``HELD_UP`` later instead, once they are read (a
        call sent in time completes its round, its member not counted missing). Once: what
        was due by the end of that time is judged then, however late the alarm rings."""
        self._held_at, until = now, now + HELD_UP
        self._reading_first_until = until
        self._core.hold_over(now, until)
        deadlines = self._deadlines
        for key, deadline in deadlines.items():
            if deadline <= now:
                deadlines[key] = until
        heap = self._deadline_heap
        heap[:] = [(d, next(self._deadline_order), k) for k, d in deadlines.items()]
        heapq.heapify(heap)
        if heap:
            self._set_alarm(heap[0][0])

    def _judged(self, deadline: float | None) -> float | None:
        """When a wait of ``deadline`` ends: later if it passed while the loop was held up
        (see _read_first; a round's own deadline is moved by Core.hold_over)."""
        return deadline if deadline is None or deadline > self._held_at else self._reading_first_until

    # -- ranks ----------------------------------------------------------------------------

    @_translated
    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        version = self._core.version
        try:
            registered = self._register(request)
        except Exception as exc:
            if isinstance(exc, CoreError):  # (the operator's only word of it otherwise: status)
                said = (request.job[:100], request.incarnation[:100])
                again = self._refusals_said.get(said) == exc.message
                self._refusals_said[said] = exc.message
                self._refusals_said.move_to_end(said)
                while len(self._refusals_said) > _REFUSALS_KEPT:
                    self._refusals_said.popitem(last=False)
                log.log(
                    logging.DEBUG if again else logging.WARNING,
                    "refused the registration of task %d (%s pid %d) in job %r: %s",
                    request.task_id, request.host[:100], request.pid, request.job[:100], exc.message,
                    extra={
                        "event": "registration_refused", "job": request.job[:100], "task": request.task_id,
                        "host": request.host[:100], "pid": request.pid, "code": exc.code.name, "reason": exc.message,
                    },
                )
                exc.warn = None  # (said: not again as the refusal's own line)
            if self._core.version != version:  # refused after it started the job afresh
                self._wake()
                await self._persist()
            raise
        ordinals = format_ranges(a.ordinal for a in registered.assignments)
        job = self._core.jobs[request.job]
        version = job.processes[request.incarnation].client_version  # (as the core keeps it: cut to a name's length)
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
                "client_version": version,
            },
        )
        self._tell_version(request, version)
        self._wake()
        await self._persist()
        return pb.RegisterResponse(
            world_size=registered.world_size,
            generation=registered.generation,
            heartbeat_timeout=self._core.heartbeat_timeout or 0.0,
            session_port=self.session_port,
            reads_process_indexes=True,
            job_id=self._core.store_id(request.job),
            assignments=[
                pb.Assignment(thread_index=a.thread_index, ordinal=a.ordinal, local_ordinal=a.local_ordinal)
                for a in registered.assignments
            ],
        )

    def _tell_version(self, request: pb.RegisterRequest, theirs: str) -> None:
        """Logs, once per job and version, a process whose client is not of this coordinator's
        version (an image and a training environment upgraded apart): what differs between
        versions is the first thing to rule out when they disagree."""
        if not versions_differ(theirs, build()) or (request.job, theirs) in self._versions_told:
            return
        if len(self._versions_told) >= _VERSIONS_TOLD_KEPT:
            self._versions_told.clear()
        self._versions_told.add((request.job, theirs))
        log.warning(
            "task %d (%s pid %d) in job %r runs pjrt-rendezvous %s, this coordinator %s: upgrade both to "
            "one version (`pjrt-rendezvous status` names each process's)",
            request.task_id, request.host, request.pid, request.job, theirs, build(),
            extra={
                "event": "version_mismatch", "job": request.job, "task": request.task_id, "host": request.host,
                "pid": request.pid, "client_version": theirs, "coordinator_version": build(),
            },
        )

    def _register(self, request: pb.RegisterRequest) -> Registered:
        return self._core.register(
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
                client_version=request.client_version,
                heartbeat_interval=request.heartbeat_interval,
                process_age=request.process_age,
                launch=request.launch,
            ),
        )

    @_translated
    async def WaitWorld(self, request: pb.WaitWorldRequest, context) -> pb.WaitWorldResponse:
        timeout = _timeout(request)
        start = self._clock()
        deadline = None if timeout is None else start + timeout
        while not self._core.world_complete(request.job):
            if self._gone is not None:
                raise self._gone_error(f"the wait for the world of job {request.job!r}")
            if not await self._wait(("world", request.job), self._judged(deadline)) and (
                deadline is not None and self._clock() >= self._judged(deadline)
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
        # Woken by the Register that completed the world, before that call's write: the
        # table told must be on disk (a restart would otherwise forget a process its peers
        # were told of, and its relaunch would join the same generation unnoticed).
        await self._persist()
        return cached[1]

    # -- rendezvous -----------------------------------------------------------------------

    @_translated
    async def Rendezvous(self, request: RendezvousCall, context) -> bytes:
        job, incarnation, replicas, round_number, timeout, generation, rows = request  # decode_rendezvous
        _checked_timeout(timeout)
        now = self._clock()
        try:
            rnd = self._core.arrive(
                now,
                job=job,
                incarnation=incarnation,
                replicas=replicas,
                round_number=round_number,
                contributions=rows,
                deadline=None if timeout is None else now + timeout,
                generation=generation,
            )
        except Exception:
            self._wake()  # a refused call may have failed its peers' round: release them now
            raise  # (on disk before anyone is told: _refusal)
        self._wake()
        while rnd.result is None and rnd.error is None:  # finished in place (Core.arrive; expired by _ring)
            if not await self._wait(("round", job, *rnd.key), rnd.deadline):
                self._core.expire(self._clock())
                self._wake()
        await self._persist()
        if rnd.error is not None:
            raise rnd.error
        if rnd.response is None:
            # Serialized once for every member of the round (see _serialize).
            rnd.response = encode_payloads(rnd.result)
        return rnd.response

    # -- liveness -------------------------------------------------------------------------

    async def watch_liveness(self) -> None:
        """Runs until cancelled: declares silent processes dead, checking every min(1 s, timeout / 4)."""
        timeout = self._core.heartbeat_timeout
        if timeout is None:
            return
        interval = min(1.0, timeout / 4)
        loop = asyncio.get_running_loop()
        while True:
            asleep = loop.time()
            await asyncio.sleep(interval)
            if loop.time() - asleep > 2 * interval:
                # Held up (the process stopped and continued, a frozen container, a starved
                # loop): the heartbeats sent meanwhile wait in the sockets, and after a stop
                # the loop runs this overdue timer before it reads them (the interrupted
                # epoll_wait returns nothing). They are read first, then judged.
                await asyncio.sleep(interval)
            version = self._core.version
            self._core.check_liveness(self._clock())
            self._wake()
            if self._core.version != version:
                try:  # a death is state like any other: on disk, even if nobody calls again
                    await self._persist()
                except CoreError as exc:  # (the writer logged why; serve stops)
                    log.error("%s", exc.message, extra={"event": "state_write_failed"})

    @_translated
    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        generation = self._core.touch(request.job, request.incarnation, self._clock())
        await self._persist()  # (the generation it tells, as WaitWorld)
        return pb.HeartbeatResponse(
            generation=generation,
            heartbeat_timeout=self._core.heartbeat_timeout or 0.0,
            session_port=self.session_port,
            reads_process_indexes=True,
        )

    @_translated
    async def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveResponse:
        self._core.leave(request.job, request.incarnation, request.reason)
        self._wake()
        await self._persist()
        return pb.LeaveResponse()

    @_translated
    async def EndReplicas(self, request: pb.EndReplicasRequest, context) -> pb.EndReplicasResponse:
        self._core.end_replicas(request.job, request.incarnation, request.ordinals, request.reason, self._clock())
        ended = sorted(request.ordinals)
        if ended:  # (before the rounds it fails: cause before effect)
            process = self._core.jobs[request.job].processes[request.incarnation]
            log.info(
                "replica%s of ordinal%s %s ended in job %r (%s): %s", "s" if len(ended) > 1 else "",
                "s" if len(ended) > 1 else "", format_ranges(ended), request.job, process.label(), process.ended[ended[0]],
                extra={
                    "event": "replicas_ended", "job": request.job, "ordinals": format_ranges(ended), "host": process.host,
                    "task": process.task_id, "pid": process.pid, "reason": process.ended[ended[0]],
                },
            )
        self._wake()
        await self._persist()
        return pb.EndReplicasResponse()

    @_translated
    async def GiveUpRound(self, request: pb.GiveUpRoundRequest, context) -> pb.GiveUpRoundResponse:
        rnd = self._core.give_up_round(
            request.job, request.incarnation, generation=request.generation, replicas=request.replicas,
            round_number=request.round, ordinals=request.ordinals, tag=request.tag, reason=request.reason,
            now=self._clock(), job_id=request.job_id,
        )
        self._wake()  # (the monitor logs the failed round; or its deadline passed, found here: Core._round)
        # Failed or not, on disk first: "not failed" may rest on a round's end (or a new
        # generation) still being written, which a crash would take back, and the process
        # forgets the round once told.
        await self._persist()
        return pb.GiveUpRoundResponse(failed=rnd is not None)

    async def Watch(self, request: pb.WatchRequest, context):
        """Streams the job's events (deaths, restarts) from ``request.after`` on (unset: from
        now on), after a marker naming the index of the next one: a client whose stream broke
        opens another where it left off, and misses nothing that happened in between."""
        if isinstance(request, Malformed):
            await _abort(context, Code.INVALID_ARGUMENT, request.message)
        # Counted before the touch that clears a closed connection's mark: the end of the
        # stream this one replaces, seen meanwhile, must not mark the process again.
        watcher = (request.job, request.incarnation)
        self._watching[watcher] += 1
        try:
            try:
                self._core.touch(request.job, request.incarnation, self._clock())
                first, events = self._core.events(request.job, 0)
                known = first + len(events)
            except CoreError as exc:  # (declared dead, replaced: on disk first, as any refusal)
                exc = await self._refusal(exc)
                await _abort(context, exc.code, exc.message)
            seen = request.after if request.HasField("after") else known
            if not 0 <= seen <= known:  # past the end: a coordinator restarted without its state
                seen = 0
            try:  # (the marker counts the events so far: on disk first, as the events)
                await self._persist()
            except CoreError as exc:
                await _abort(context, exc.code, exc.message)
            yield pb.WatchEvent(index=seen)
            while True:
                try:
                    first, events = self._core.events(request.job, seen)
                except CoreError as exc:  # the job was dropped (max_jobs): gone with its events
                    await _abort(context, exc.code, exc.message)
                if events:  # on disk before anyone hears of them (a crash cannot take one back)
                    try:
                        await self._persist()
                    except CoreError as exc:
                        await _abort(context, exc.code, exc.message)
                for index, event in enumerate(events, first):
                    yield pb.WatchEvent(
                        kind=pb.WatchEvent.Kind.Value(event.kind),
                        generation=event.generation,
                        ordinals=event.ordinals,
                        host=event.host,
                        message=event.message,
                        index=index,
                    )
                seen = first + len(events)
                if self._stopping:  # (end_streams may have run while this stream was sending)
                    break
                await self._wait(("events", request.job), None)
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away: its process closed the stream (closing its client, after
            # its Leave) or its connection closed (killed, crashed: Core.disconnect). (Cut
            # while gRPC sends an event, the stream is closed: GeneratorExit.)
            if not self._stopping and self._watching[watcher] == 1:
                self._core.disconnect(request.job, request.incarnation, self._clock())
            raise
        finally:
            self._watching[watcher] -= 1
            if not self._watching[watcher]:
                del self._watching[watcher]
        await _abort(context, Code.UNAVAILABLE, "the coordinator is stopping")

    # -- sessions -------------------------------------------------------------------------

    async def Session(self, requests, context) -> None:
        """Carries a client process's unary calls on one stream (see :func:`serve_session`)."""
        this = asyncio.current_task()
        try:
            await serve_session(requests, context, self._session_call, self._streams)
        except asyncio.CancelledError:
            # Ended idle by end_streams: the stream ends (OK), quietly. Cut by gRPC's stop, the
            # cancellation goes on, so that gRPC resets the stream and its client resends at once.
            if this not in self._ended:
                raise
        finally:
            self._ended.discard(this)

    async def _session_call(self, call: Call) -> tuple[bytes, bytes]:
        """Runs one call of a Session like the unary method would; returns its answer as
        (the serialized SessionAnswer without its response, the serialized response)."""
        call_id, method, body, _ = call
        entry = self._unary.get(method)
        if entry is None:
            status, text = grpc.StatusCode.UNIMPLEMENTED, f"no method {method!r}"
            method = "(unknown)"
        else:
            handler, parse = entry
            try:
                request = parse(body)
                if isinstance(request, Malformed):
                    raise CoreError(Code.INVALID_ARGUMENT, request.message)
                result = await handler(self, request, None)
                status = grpc.StatusCode.OK
            except asyncio.CancelledError:  # its session ended under it
                if self._on_call is not None:
                    self._on_call(method, grpc.StatusCode.CANCELLED.name)
                raise
            except CoreError as exc:
                exc = await self._refusal(exc)
                status, text = _STATUS[exc.code], exc.message
            except Exception:
                log.exception("%s failed on a session", method, extra={"event": "internal_error"})
                status, text = grpc.StatusCode.UNKNOWN, f"{method} failed in the coordinator; its log has the details"
        if self._on_call is not None:
            self._on_call(method, status.name)
        if status is grpc.StatusCode.OK:
            return session_answer(call_id, response=_serialize(result))
        return session_answer(call_id, status, text)

    # -- key-value ------------------------------------------------------------------------

    async def _kv_change(self, request, change: Callable[[], Any]) -> tuple[Any, str]:
        """Makes a key-value ``change`` in the store the caller saw; returns its result and
        the store's id once the change is on disk (and its waiters woken)."""
        core = self._core
        core.check_store(request.job, request.store_id)
        result = change()
        store_id = core.store_id(request.job)  # (the store changed: not after an await)
        self._wake()
        await self._persist()
        return result, store_id

    @_translated
    async def KvSet(self, request: pb.KvSetRequest, context) -> pb.KvSetResponse:
        entries = [(e.key, e.value) for e in request.entries]
        _, store_id = await self._kv_change(request, lambda: self._core.kv_set(request.job, entries, request.request_id))
        return pb.KvSetResponse(store_id=store_id)

    @_translated
    async def KvGet(self, request: pb.KvGetRequest, context) -> pb.KvGetResponse:
        core = self._core
        core.check_store(request.job, request.store_id)
        seen = request.store_id or core.store_id(request.job)
        timeout = _timeout(request)
        start = self._clock()
        deadline = None if timeout is None else start + timeout
        while True:
            values = core.kv_get(request.job, request.keys)
            missing = [k for k, v in zip(request.keys, values) if v is None]
            if not request.wait or not missing:
                break
            if self._gone is not None:
                raise self._gone_error(f"the wait for {_plural(len(missing), 'key')} of job {request.job!r} ({keys_shown(missing)})")
            if not await self._wait(("kv", request.job, missing[0]), self._judged(deadline)) and (
                deadline is not None and self._clock() >= self._judged(deadline)
            ):
                raise core.kv_timeout(request.job, request.keys, self._clock() - start)
            core.check_store(request.job, seen)  # (the job dropped meanwhile: its keys are gone)
            seen = core.store_id(request.job)  # (made meanwhile: its keys are the ones waited for)
        store_id = core.store_id(request.job)
        # Only what is on disk is answered: a change is seen only once its writer could be
        # answered too (else a crash could take back a value a reader acted on).
        await self._persist()
        found_only = request.found_only
        return pb.KvGetResponse(
            values=[pb.KvValue(found=v is not None, value=b"" if found_only else v or b"") for v in values],
            store_id=store_id,
        )

    @_translated
    async def KvAdd(self, request: pb.KvAddRequest, context) -> pb.KvAddResponse:
        value, store_id = await self._kv_change(request, lambda: self._core.kv_add(request.job, request.key, request.delta, request.request_id))
        return pb.KvAddResponse(value=value, store_id=store_id)

    @_translated
    async def KvCompareSet(self, request: pb.KvCompareSetRequest, context) -> pb.KvCompareSetResponse:
        value, store_id = await self._kv_change(request, lambda: self._core.kv_compare_set(
            request.job, request.key, request.expected, request.desired, request.request_id
        ))
        return pb.KvCompareSetResponse(value=value, store_id=store_id)

    @_translated
    async def KvAppend(self, request: pb.KvAppendRequest, context) -> pb.KvAppendResponse:
        _, store_id = await self._kv_change(request, lambda: self._core.kv_append(request.job, request.key, request.value, request.request_id))
        return pb.KvAppendResponse(store_id=store_id)

    @_translated
    async def KvDelete(self, request: pb.KvDeleteRequest, context) -> pb.KvDeleteResponse:
        deleted, store_id = await self._kv_change(request, lambda: self._core.kv_delete(request.job, request.key, request.request_id))
        return pb.KvDeleteResponse(deleted=deleted, store_id=store_id)

    @_translated
    async def KvList(self, request: pb.KvListRequest, context) -> pb.KvListResponse:
        core = self._core
        core.check_store(request.job, request.store_id)
        store_id = core.store_id(request.job)
        if request.count_only:
            count = core.kv_count(request.job, request.prefix)
            await self._persist()  # (as KvGet)
            return pb.KvListResponse(count=count, store_id=store_id)
        entries = core.kv_list(request.job, request.prefix)
        await self._persist()  # (as KvGet)
        return pb.KvListResponse(
            count=len(entries), entries=[pb.KvEntry(key=k, value=v) for k, v in entries], store_id=store_id
        )

    # -- status ---------------------------------------------------------------------------

    @_translated
    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        views = self._core.status(self._clock(), request.job, participants=not request.rounds_only)
        response = pb.StatusResponse(
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
                    refused=[
                        pb.RefusedTask(task_id=task, ordinals=ordinals, reason=why)
                        for task, (ordinals, why) in v.refused.items()
                    ],
                    devices_per_task=v.devices_per_task,
                    world_missing_summary=v.world_missing_summary,
                )
                for v in views
            ],
            coordinator_version=build(),
            unknown_processes=[
                pb.UnknownProcesses(
                    job=u.job, job_known=u.job_known, processes=u.processes, last_call_age=u.last_call_age, reason=u.reason
                )
                for u in ([] if request.rounds_only else self._core.strangers(self._clock()))  # (a client's wait asks)
                if not request.job or u.job == request.job
            ],
        )
        await self._persist()  # (what it tells, as WaitWorld)
        return response


@functools.lru_cache(maxsize=1 << 16)
def _process_id(incarnation: str) -> str:
    """A process's incarnation as others are told it (the world table, status): a digest.
    The incarnation itself is what the process's calls prove it is by (its contributions, its
    replicas ending, its leave): a caller that read it could act as that process."""
    return hashlib.blake2b(incarnation.encode(), digest_size=8).hexdigest()


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
                incarnation=_process_id(view.incarnation),
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
        incarnation=_process_id(view.incarnation),
        last_seen_age=view.last_seen_age,
        alive=view.alive,
        left=view.left,
        ended=view.ended,
        client_version=view.client_version,
        unheard_since_restart=view.unheard_since_restart,
    )
    if view.runtime_ordinal is not None:
        message.runtime_ordinal = view.runtime_ordinal
    if view.disconnected_age is not None:
        message.disconnected_age = view.disconnected_age
    return message
