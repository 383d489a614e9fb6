"""Per-host fan-in: the first process of a host speaks for its siblings' rendezvous rounds.

The coordinator pays per message (bench/: 100-200 µs of Python gRPC each), so in a pod of
thousands of processes its CPU per round limits scale. With ``fan_in="host"`` the process
with local rank 0 on each host runs a :class:`Relay` on a Unix socket in a folder only its
user can enter (``relay_path``). The host's processes, itself included, send their
``Rendezvous`` calls there as ``SessionRequest`` messages, length-prefixed rather than in
gRPC (``_session.SocketSession``: on one host gRPC's machinery would cost more than the relay
saves); the relay sends one call per
round for the whole host, each contribution naming its process, and hands the answer back
to every caller. The coordinator still checks every contribution's owner and accounts per
ordinal.

- The relay waits for a round's calls from the host's processes it has heard from that have
  not called in it yet (with any list of its replicas, the call perhaps still under way), at
  most ``batch_window`` and at most half the time left before the
  round's earliest deadline; a later process's contributions follow in a call of their own,
  at once when nobody else of the host is awaited. A process that called is not waited for
  again: its own client held its threads' contributions for the batch window already (and
  sends none for a replica that ended). So the coordinator knows who is missing (but for a
  contribution that reaches the relay within ``batch_window`` of another host's deadline),
  and no round waits for the relay.
- A combined call that fails is resent per process, so each process gets the answer it
  would have had alone (one process's bad call does not fail its siblings').
- A process that cannot reach the relay (not started yet, its process gone, or frozen: it
  must answer a ping within a second, ``SocketSession.local``) sends to the coordinator
  directly, which takes a resent contribution as the same arrival, and tries the relay
  again a few seconds later, longer after each failed try (``Client._session``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import os
import queue
import stat
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING

import grpc

from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

from ._errors import CoordinatorUnavailableError, RemoteError, RendezvousTimeout
from ._session import Call, FramedSession, Malformed, parser, session_answer
from ._wire import Row, contribution_rows, set_contribution_rows

if TYPE_CHECKING:
    from ._client import Client

log = logging.getLogger("pjrt_rendezvous.client")

_parse_rendezvous = parser(pb.RendezvousRequest)
_FORWARDED_KEPT = 256  # rounds whose callers a relay remembers once sent on (Relay._forwarded)

def relay_path(address: str, job: str, host: str) -> str:
    """The Unix socket of the relay for ``job`` of the coordinator at ``address`` on ``host``
    (host is part of it so simulated hosts on one machine get one each), in a folder only
    this user can enter."""
    digest = hashlib.sha256(f"{address}|{job}|{host}".encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"pjrt-rendezvous-{os.getuid()}", f"relay-{digest}.sock")


# The longest path a Unix socket takes (sun_path's 108 bytes, its last a NUL, on Linux).
_MAX_SOCKET_PATH = 107


def _private_folder(path: str) -> None:
    """Creates the socket's folder (mode 0700), or checks that an existing one is ours and
    closed to others: only this user's processes may speak through the relay. Says what it
    found otherwise, and what to change."""
    folder, size = os.path.dirname(path), len(os.fsencode(path))
    if size > _MAX_SOCKET_PATH:
        raise OSError(
            f"the relay's socket path {path} is {size} bytes, over the {_MAX_SOCKET_PATH} a "
            "Unix socket's path takes: set TMPDIR to a shorter folder in every process of the host"
        )
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except FileExistsError:  # (a file, or a link to one, in its place: said below)
        pass
    info = os.lstat(folder)
    found = (
        "a symbolic link" if stat.S_ISLNK(info.st_mode)
        else "not a folder" if not stat.S_ISDIR(info.st_mode)
        else f"owned by user {info.st_uid}" if info.st_uid != os.getuid()
        else f"open to others (mode {stat.S_IMODE(info.st_mode):04o})" if info.st_mode & 0o077
        else None
    )
    if found is not None:
        raise PermissionError(
            f"{folder} must be a folder of user {os.getuid()} closed to others (mode 0700), and it is {found}: "
            "remove it, or set TMPDIR to another folder in every process of the host"
        )


_PATH_LOCK_WAIT = 5.0  # seconds a relay waits for another's change of the socket's path


@contextlib.contextmanager
def _path_lock(path: str):
    """Held while a relay changes the socket at ``path`` (removes a stale one and binds, or
    removes its own on close): a relay that closes while a restarted process's new one
    starts at the same path must not remove the new socket between finding its own there
    and removing it. The lock file goes with the socket, removed under the lock (so a
    relay that waited for it takes it only if it is still the file at its path). Waits for
    another holder at most _PATH_LOCK_WAIT (it holds the lock for a few system calls), then
    goes on without it, saying so; yields whether it holds it."""
    lock = f"{path}.lock"
    end = time.monotonic() + _PATH_LOCK_WAIT
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= end:
                log.warning("%s has been held for %g s; changing the relay's socket without it", lock, _PATH_LOCK_WAIT)
                fd = None
                break
            time.sleep(0.01)
            continue
        if _same_file(fd, lock):
            break
        os.close(fd)  # removed by the holder before: the next file at the path is the lock
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)  # (releases the lock)


def _same_file(fd: int, path: str) -> bool:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (info.st_dev, info.st_ino)


@dataclasses.dataclass
class _HostRound:
    """The calls of the host's processes with one replicas list at one round, until they
    are sent on (calls with another list of the same group go apart: the coordinator judges
    each list)."""

    round: tuple  # Relay._round_of its calls
    requests: list[pb.RendezvousRequest] = dataclasses.field(default_factory=list)
    rows: list[Row] = dataclasses.field(default_factory=list)  # their contributions, each naming its process
    answers: list[asyncio.Future] = dataclasses.field(default_factory=list)
    deadlines: list[float | None] = dataclasses.field(default_factory=list)  # each request's own
    # The task ids of the host's processes that called in its round (with any list: the set
    # is shared by the host rounds of one round), and in it once sent on (a later process's
    # call goes at once when nobody else of the host is awaited).
    called: set[int] = dataclasses.field(default_factory=set)
    deadline: float | None = None  # the earliest of them
    timer: asyncio.TimerHandle | None = None
    send_at: float = 0.0  # the timer's time (time.monotonic())
    first_at: float = 0.0  # when its first call came
    # Once sent on: how long it was held, and the host's ordinals it was held for, whose
    # processes did not call (a timeout says so: the coordinator counts from when the call
    # reached it).
    held: float = 0.0
    absent: list[int] = dataclasses.field(default_factory=list)


class Relay:
    """A host's relay, serving in a background thread of the process with local rank 0."""

    def __init__(self, client: "Client", path: str) -> None:
        self._client = client
        self.path = path
        self._window = client.settings.batch_window
        self._devices, self._world = client.topology.devices_per_process, client.topology.world_size
        self._tasks: dict[str, int] = {}  # incarnation -> task id, of processes with an open connection
        self._rounds: dict[tuple, _HostRound] = {}
        # The callers of the latest rounds sent on (_FORWARDED_KEPT), by _round_of.
        self._forwarded: collections.OrderedDict[tuple, set[int]] = collections.OrderedDict()
        # Round (_round_of) -> the ordinals of each of its calls at the relay now: they have
        # called in it (their process may be forgotten among the rounds _forwarded keeps).
        self._inside: dict[tuple, list[list[int]]] = {}
        # Sending blocks a thread until the round ends; rounds of different groups can be
        # pending at once, so the pool must not be what bounds them.
        self._senders = _DaemonExecutor("pjrt-rendezvous-relay-send")
        self._socket_id: tuple[int, int] | None = None  # (device, inode) of our socket file
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[FramedSession] = set()  # one per connected process
        started: concurrent.futures.Future = concurrent.futures.Future()
        threading.Thread(target=self._serve, args=(started,), name="pjrt-rendezvous-relay", daemon=True).start()
        started.result(timeout=30)  # raises what went wrong (e.g. the socket's folder is not writable)

    # -- serving --------------------------------------------------------------------------

    def _serve(self, started: concurrent.futures.Future) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as exc:
            self._loop.close()
            started.set_exception(exc)
            return
        started.set_result(None)
        self._loop.run_forever()
        self._loop.close()

    async def _start(self) -> None:
        _private_folder(self.path)
        with _path_lock(self.path):
            if os.path.exists(self.path):
                os.unlink(self.path)  # left by an earlier run, or taken over from a replaced process
            # (From 3.13 asyncio removes the socket on close too, but without the lock.)
            keep = {"cleanup_socket": False} if sys.version_info >= (3, 13) else {}
            self._server = await self._loop.create_unix_server(self._connection, path=self.path, **keep)
            info = os.stat(self.path)
            self._socket_id = (info.st_dev, info.st_ino)

    def _connection(self) -> FramedSession:
        """One process's SocketSession: length-prefixed SessionRequests in, SessionResponses out."""
        heard: set[str] = set()  # the processes speaking on this connection

        def closed(connection: FramedSession) -> None:  # a process gone is no longer waited for
            for incarnation in heard:
                self._tasks.pop(incarnation, None)
            self._connections.discard(connection)

        connection = FramedSession(lambda call: self._run(call, heard), on_close=closed)
        self._connections.add(connection)
        return connection

    def close(self) -> None:
        """Stops serving and closes every connection (their processes fall back to the
        coordinator), then removes the socket."""

        async def stop() -> None:
            self._server.close()
            for connection in list(self._connections):
                if connection.transport is not None:
                    connection.transport.abort()  # the process's reader sees the end at once
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
            except Exception as exc:  # pragma: no cover - best effort on the way out
                log.debug("stopping the host relay: %s", exc)
            try:
                self._loop.call_soon_threadsafe(self._loop.stop)
            except RuntimeError:  # it stopped and closed meanwhile (closed twice)
                pass
        self._senders.shutdown(wait=False, cancel_futures=True)
        try:  # ours only: a restarted process's new relay may have taken the path since
            with _path_lock(self.path) as held:
                try:
                    info = os.stat(self.path)
                except FileNotFoundError:  # (the new relay closed first, and removed both)
                    info = None
                ours = info is not None and (info.st_dev, info.st_ino) == self._socket_id
                if ours:
                    os.unlink(self.path)
                if held and (ours or info is None):  # (else it is the new socket's; or another holds it)
                    os.unlink(f"{self.path}.lock")  # (made again by this lock, it was left behind)
        except OSError:
            pass

    # -- combining ------------------------------------------------------------------------

    async def _run(self, call: Call, heard: set[str]) -> tuple[bytes, bytes]:
        call_id, method, body, _ = call
        if method != "Rendezvous":
            message = f"a host relay carries only Rendezvous calls, not {method!r}"
            return session_answer(call_id, grpc.StatusCode.UNIMPLEMENTED, message)
        request = _parse_rendezvous(body)
        if isinstance(request, Malformed):
            return session_answer(call_id, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            rows = contribution_rows(request)
        except ValueError:
            rows = []
        if not rows:  # malformed: the coordinator refuses it, with its own message
            return _answer(call_id, await self._loop.run_in_executor(self._senders, self._send_one, request, None))
        heard.add(request.incarnation)
        task = self._tasks[request.incarnation] = rows[0][0] // self._devices
        key = (request.job, request.generation, tuple(request.replicas), request.round)
        host_round = self._rounds.get(key)
        now = time.monotonic()
        if host_round is None:
            its_round = self._round_of(request)
            called = next((r.called for r in self._rounds.values() if r.round == its_round), None)
            if called is None:
                called = self._forwarded.get(its_round) or set()
            host_round = self._rounds[key] = _HostRound(round=its_round, called=called, first_at=now)
        its_round, ordinals = host_round.round, [row[0] for row in rows]
        calls = self._inside.setdefault(its_round, [])
        calls.append(ordinals)
        try:
            return _answer(call_id, await self._hold(key, host_round, request, rows, task, now))
        finally:
            calls.remove(ordinals)
            if not calls:
                del self._inside[its_round]

    def _hold(self, key: tuple, host_round: _HostRound, request: pb.RendezvousRequest, rows, task: int, now: float):
        """Adds a call to its host round, which is sent on once nobody else of the host is
        awaited, or held (its timer); so is a held call of the round with another list that
        awaited this call's process. Returns the future of the call's outcome."""
        answer = self._loop.create_future()
        deadline = now + request.timeout if request.HasField("timeout") else None
        host_round.requests.append(request)
        host_round.deadlines.append(deadline)
        host_round.rows += ((o, tag, payload, incarnation or request.incarnation) for o, tag, payload, incarnation in rows)
        host_round.answers.append(answer)
        host_round.called.add(task)
        if deadline is not None:
            host_round.deadline = deadline if host_round.deadline is None else min(host_round.deadline, deadline)
        its_round = host_round.round
        for other in [k for k, r in self._rounds.items() if k != key and r.round == its_round and not self._awaited(r)]:
            self._send_on(other)
        if not self._awaited(host_round) or request.generation < self._client.generation:
            self._send_on(key)  # (a call of an older generation: no sibling joins it, see Client._moved)
        else:
            # Held at most the window, and at most half the time left before its deadline
            # (held past it, a round would name arrivals missing; past its callers' patience,
            # its coordinator as frozen).
            send_at = now + self._window if host_round.timer is None else host_round.send_at
            if host_round.deadline is not None:
                send_at = min(send_at, now + (host_round.deadline - now) / 2)
            if host_round.timer is None or send_at < host_round.send_at:
                if host_round.timer is not None:
                    host_round.timer.cancel()
                host_round.send_at = send_at
                host_round.timer = self._loop.call_later(max(0.0, send_at - now), self._send_on, key)
        return answer

    def generation_moved(self, generation: int) -> None:
        """(Any thread) The job moved to ``generation``: the rounds held for an older one are
        sent now, not after the batch window (no sibling's call joins them: ``Client._moved``;
        the coordinator refuses them as void, and their callers learn of the move at once)."""

        def send_older() -> None:
            for key in [key for key in self._rounds if key[1] < generation]:
                self._send_on(key)

        try:
            self._loop.call_soon_threadsafe(send_older)
        except RuntimeError:  # closed
            pass

    def _round_of(self, request: pb.RendezvousRequest) -> tuple:
        """The coordinator's round a call is in: its group as the client's round counters
        count it (a list in another order or with repeats, or naming every ordinal, is the
        same group as another; ordinals out of range are not counted)."""
        replicas, world = request.replicas, self._world
        members = sorted({r for r in replicas if 0 <= r < world}) if replicas else []
        group = () if not replicas or len(members) == world else tuple(members)
        return (request.job, request.generation, group, request.round)

    def _awaited(self, host_round: _HostRound) -> list[int]:
        """The round's ordinals of the host's processes heard from that have not called in
        it (with any list, the call perhaps still under way)."""
        waiting = set(self._tasks.values()) - host_round.called
        if not waiting:
            return []
        members = set(host_round.round[2])
        called = {o for call in self._inside.get(host_round.round, ()) for o in call}
        return sorted(
            o for t in waiting for o in range(t * self._devices, (t + 1) * self._devices)
            if (not members or o in members) and o not in called
        )

    def _send_on(self, key: tuple) -> None:
        host_round = self._rounds.pop(key, None)
        if host_round is None:
            return
        if host_round.timer is not None:
            host_round.timer.cancel()
        host_round.held = time.monotonic() - host_round.first_at
        host_round.absent = self._awaited(host_round)
        self._forwarded[host_round.round] = host_round.called
        self._forwarded.move_to_end(host_round.round)
        if len(self._forwarded) > _FORWARDED_KEPT:
            self._forwarded.popitem(last=False)

        def hand_out(outcomes: list) -> None:
            for answer, outcome in zip(host_round.answers, outcomes):
                if not answer.done():  # else its caller gave up
                    answer.set_result(outcome)

        try:
            sent = self._loop.run_in_executor(self._senders, self._send, host_round)
        except RuntimeError as exc:  # closing
            hand_out([exc] * len(host_round.answers))
            return
        sent.add_done_callback(lambda done: hand_out(done.result()))

    def _send(self, host_round: _HostRound) -> list:
        """In a sender thread: one call for every request; each one's outcome (a timeout
        saying how long the relay held the call, and for whom)."""
        outcomes = self._send_all(host_round)
        if host_round.held < 0.01:
            return outcomes
        from pjrt_rendezvous.coordinator._core import format_ranges

        absent = host_round.absent
        waited_for = f"ordinal{'s' if len(absent) > 1 else ''} {format_ranges(absent)} of this host" if absent else "this host's processes"
        note = (
            f" (this host's relay sent the call {host_round.held:.2g} s after the first of its processes' "
            f"came: it waited for {waited_for} for up to the batch window)"
        )
        return [RendezvousTimeout(f"{o}{note}") if isinstance(o, RendezvousTimeout) else o for o in outcomes]

    def _send_all(self, host_round: _HostRound) -> list:
        requests, deadline = host_round.requests, host_round.deadline
        first = requests[0]
        combined = pb.RendezvousRequest(
            job=first.job,
            incarnation=self._client.incarnation,
            replicas=first.replicas,
            round=first.round,
            generation=first.generation,
        )
        set_contribution_rows(combined, host_round.rows, index_processes=self._client.reads_process_indexes)
        outcome = self._send_one(combined, deadline)
        if (
            isinstance(outcome, (bytes, CoordinatorUnavailableError))  # (as unreachable for each of them)
            or (len(requests) == 1 and first.incarnation == combined.incarnation)
            or (deadline is not None and time.monotonic() >= deadline)  # (a resend would have no time)
        ):
            return [outcome] * len(requests)
        # Each process gets the answer it would have had alone: a failed round's error again
        # (the coordinator keeps it), a refusal of one process's call for that one only (as
        # of the relay's own process, should a restart have replaced it while it lives on).
        log.debug("a call for %d processes failed (%s); sending each its own", len(requests), outcome)
        # At once: a round that needs two of them would wait for ever for the second.
        sends = [self._senders.submit(self._send_one, r, d) for r, d in zip(requests, host_round.deadlines)]
        return [send.result() for send in sends]

    def _send_one(self, request: pb.RendezvousRequest, deadline: float | None) -> bytes | Exception:
        """The serialized response, or the exception the call ended with."""
        if deadline is not None:
            request.timeout = max(1e-3, deadline - time.monotonic())
        try:
            return self._client._call("Rendezvous", request, deadline, waits=True, raw=True)
        except Exception as exc:
            return exc


class _DaemonExecutor(concurrent.futures.Executor):
    """A thread pool of daemon threads, one more whenever none is idle. ThreadPoolExecutor's
    threads are joined before ``atexit`` runs: a process whose relay still carried a
    sibling's waiting round could not exit (nor leave the job, so the round's members waited
    out their timeout instead of learning at once that it left)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = self._idle = 0
        self._closed = False

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the host relay is closed")
            self._work.put((future, fn, args, kwargs))
            if self._idle:
                self._idle -= 1
                return future
            self._threads += 1
        threading.Thread(target=self._serve, name=f"{self._name}-{self._threads}", daemon=True).start()
        return future

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 -- handed to the caller
                    future.set_exception(exc)
            del item, future, fn, args, kwargs
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads = self._threads
        if cancel_futures:
            try:
                while True:
                    item = self._work.get_nowait()
                    if item is not None:
                        item[0].cancel()
            except queue.Empty:
                pass
        for _ in range(threads):
            self._work.put(None)


def _answer(call_id: int, outcome: bytes | Exception) -> tuple[bytes, bytes]:
    if isinstance(outcome, bytes):
        return session_answer(call_id, response=outcome)
    if (
        isinstance(outcome, RemoteError)
        and outcome.code in grpc.StatusCode.__members__
        and outcome.code not in ("UNAVAILABLE", "CANCELLED")
    ):
        return session_answer(call_id, grpc.StatusCode[outcome.code], str(outcome))
    # The relay could not send it (its process closing, the coordinator unreachable): the
    # caller retries on the coordinator directly. (An unreachable coordinator's error says
    # where it is and what to check: the caller says so again, with the cause.)
    details = getattr(outcome, "_rpc_details", None)  # (Client._call's)
    if isinstance(outcome, CoordinatorUnavailableError) and details is not None:
        why = f"the host relay could not reach the coordinator: {details}"
    else:
        why = f"the host relay could not send the call: {outcome}"
    return session_answer(call_id, grpc.StatusCode.UNAVAILABLE, why)
