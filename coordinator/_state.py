"""The state file: what survives a coordinator restart (``serve --state-file PATH``).

Kept: per job the world size, rank table, generation, the latest events (and how many came
before them), finished rounds of the last two generations (so a client resending a round that
finished just before the crash gets its result), round counters, key-value data, each job's
latest 10,000 applied request ids and the incarnations replaced by restarts.
Not kept: pending rounds (their members resend them when they reconnect) and the last-seen
times of live processes (each gets a fresh heartbeat timeout from the restart; a dead one
keeps how long ago it was seen).

Format: one JSON document ``{"format", "version", "sha256", "body"}``; bytes are base64.
Writes are atomic (temporary file, fsync, rename, fsync of the folder); a torn or edited
file fails its checksum and is reported, never half-loaded.

Beside it, ``PATH.journal``: the rounds finished, the jobs made and the key-value changes
made since the state file was written, one line per write, ``<sha256 of the JSON> <JSON>``,
appended and fsynced before their callers are answered. A round or a key set costs one short line instead
of a rewrite of the whole state (every rank, key and kept round). Any other change (ranks,
events) rewrites the state file and empties the journal, as does a journal grown past
``JOURNAL_LIMIT``. Loading replays the lines newer than the state file (each carries the
core's version); a last line cut short by a crash was never acknowledged and is ignored, a
damaged line before it is reported. A journal found without its state file (moved away)
belongs to no state: it is moved aside at the start (``PATH.journal.orphaned``).

Also beside it, ``PATH.lock``: a coordinator holds an ``flock`` on it from before it reads
the state file until it stops (or its start fails; a forked child closes its copy), so a
second one started on the same file refuses to start instead of interleaving its
writes with the first's (both would journal under the same versions, and either's rewrite
drops the other's keys). The lock is on a file of its own because every rewrite replaces
the state file (a new inode). The kernel lets go of it when its holder dies, however it
dies: a lock left by a dead process never blocks. It is never deleted (a process could
lock a deleted inode while another locks its replacement). A link given as the state file
is followed once, at startup: the journal, the lock and each rewrite's temporary file are
beside the file it points at, and the rename replaces that file, not the link.
"""

from __future__ import annotations

import base64
import collections
import errno
import fcntl
import glob
import hashlib
import itertools
import json
import logging
import math
import os
import pathlib
import socket
import stat
import tempfile
import time

from ._core import ALL, Code, Core, CoreError, Event, EventLog, Job, Limits, Member, Process, Round, _Group

log = logging.getLogger("pjrt_rendezvous.coordinator")

FORMAT = "pjrt-rendezvous-state"
_CLIENT_HEARTBEAT_INTERVAL = 5.0  # the client's default (client/_config.py; not imported: no client here)
VERSION = 2  # 2: jobs' key-value store ids (journal lines naming one: version 1 readers fail on them)
READS = (1, 2)  # (a version 1 file gets new store ids: no client can hold an id from it)


class StateFileError(Exception):
    """The state file cannot be used; the message says why and what to do."""


def _b(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def _round_to_json(rnd: Round) -> dict:
    return {
        "generation": rnd.generation,
        "group": list(rnd.group),
        "number": rnd.number,
        "size": rnd.size,
        "tag": rnd.tag,
        "result": None if rnd.result is None else [_b(p) for p in rnd.result],
        "error": None if rnd.error is None else [rnd.error.code.name, rnd.error.message],
        # A failed round's callers, without their payloads: one that comes after is told it came late.
        **({"arrived": sorted(rnd.arrivals)} if rnd.error is not None else {}),
    }


def _round_from_json(d: dict) -> Round:
    group = tuple(d["group"])
    return Round(
        generation=d["generation"],
        group=group,
        number=d["number"],
        started=0.0,
        members=None if group == ALL else frozenset(group),
        size=d["size"],
        tag=d["tag"],
        result=None if d["result"] is None else [_unb(p) for p in d["result"]],
        error=None if d["error"] is None else CoreError(Code[d["error"][0]], d["error"][1]),
        arrivals=dict.fromkeys(d.get("arrived", ())),  # (not in files before it was kept)
    )


def _request_result(value):
    return {"b64": _b(value)} if isinstance(value, bytes) else value


def _request_result_back(value):
    return _unb(value["b64"]) if isinstance(value, dict) else value


# The request ids of key-value changes a state file keeps, a job's latest (the core keeps
# 100,000): a restart is seconds, and what a client resends across it is what it changed
# last. (All of them made the file 6.5 MB after 50,000 set-and-deletes, 135 ms to encode at
# every rewrite: each registration, leave or death.)
REQUESTS_SAVED = 10_000


def _latest(requests: collections.OrderedDict, n: int) -> list:
    latest = list(itertools.islice(reversed(requests.items()), n))
    latest.reverse()
    return latest


def snapshot(core: Core, now: float | None = None) -> dict:
    """The persistent part of ``core`` as JSON-able data (call on the core's thread). With
    ``now`` (the core's clock), a process no longer alive keeps how long ago it was last
    seen, which its restore counts from (the live ones count as seen at the restore)."""
    jobs = []
    for job in core.jobs.values():
        jobs.append(
            {
                "name": job.name,
                "world_size": job.world_size,
                "world_fixed_by": job.world_fixed_by,
                "devices_per_task": job.devices_per_task,
                "generation": job.generation,
                "formed": job.formed,
                "rounds_completed": job.rounds_completed,
                "processes": [
                    {
                        "incarnation": p.incarnation,
                        "host": p.host,
                        "pid": p.pid,
                        "task_id": p.task_id,
                        "local_rank": p.local_rank,
                        "ordinals": sorted(p.ordinals),
                        "alive": p.alive,
                        "left": p.left,
                        "death": p.death,
                        "ended": [[o, how] for o, how in sorted(p.ended.items())],
                        "client_version": p.client_version,
                        "heartbeat_interval": p.heartbeat_interval,
                        **({"launch": p.launch} if p.launch else {}),
                        **({"seen_ago": now - p.last_seen} if now is not None and not p.alive else {}),
                    }
                    for p in job.processes.values()
                ],
                "tasks": {str(t): i for t, i in job.tasks.items()},
                "members": [
                    [m.ordinal, m.local_ordinal, m.thread_index, m.incarnation, m.runtime_ordinal]
                    for m in job.members.values()
                ],
                "groups": [
                    {
                        "generation": generation,
                        "group": list(group),
                        "next_round": state.next_round,
                        "finished": [_round_to_json(r) for r in state.finished.values()],
                    }
                    for (generation, group), state in job.groups.items()
                ],
                "events": [
                    [e.kind, e.generation, list(e.ordinals), e.host, e.message] for e in job.events
                ],
                "events_dropped": job.events.dropped,
                "dead": sorted(job.dead),
                "replaced": list(job.replaced.items()),
                "kv": {k: _b(v) for k, v in job.kv.items()},
                "store_id": job.store_id,
                "requests": [[k, _request_result(v)] for k, v in _latest(job.request_results, REQUESTS_SAVED)],
            }
        )
    # The longest timeout the processes may heartbeat by (None: none), for the next restore.
    told = core.heartbeat_timeout
    if core.restored is not None:  # (they may not have heard of this one yet)
        told = None if told is None or core.restored[2] is None else max(told, core.restored[2])
    return {"version": core.version, "state_id": core.state_id, "heartbeat_timeout": told, "jobs": jobs}


def restore(
    body: dict, *, now: float, limits: Limits | None = None, heartbeat_timeout: float | None = None
) -> Core:
    """A core holding ``body`` (from :func:`snapshot`); every live process counts as seen ``now``.

    A process's client heartbeats every third of the timeout it was last given, at most every
    heartbeat interval it registered (5 s by default): for the shorter of the file's timeout
    and three times the longest interval (or the client's default 5 s, if longer) after the
    restore, nobody is declared dead (a coordinator restarted with a shorter timeout must not find a process
    silent at its old interval, which its next answer shortens)."""
    core = Core(limits, heartbeat_timeout=heartbeat_timeout)
    core.state_id = body.get("state_id", core.state_id)  # (not in files before it was kept)
    before = body.get("heartbeat_timeout", 0.0)  # not in files before it was kept
    for d in body["jobs"]:
        job = Job(
            name=d["name"],
            world_size=d["world_size"],
            world_fixed_by=d["world_fixed_by"],
            devices_per_task=d["devices_per_task"],
            generation=d["generation"],
            formed=d["formed"],
            rounds_completed=d["rounds_completed"],
        )
        for p in d["processes"]:
            job.processes[p["incarnation"]] = Process(
                incarnation=p["incarnation"],
                host=p["host"],
                pid=p["pid"],
                task_id=p["task_id"],
                local_rank=p["local_rank"],
                last_seen=now - p.get("seen_ago", 0.0),  # (at least that long ago: the coordinator was down since)
                ordinals=set(p["ordinals"]),
                alive=p["alive"],
                left=p["left"],
                death=p["death"],
                ended={o: how for o, how in p.get("ended", ())},  # (not in files before it was kept)
                client_version=p.get("client_version", ""),  # (nor this)
                heartbeat_interval=p.get("heartbeat_interval", 0.0),  # (nor this)
                launch=p.get("launch", ""),  # (nor this)
                restored=True,
            )
        job.tasks = {int(t): i for t, i in d["tasks"].items()}
        for ordinal, local_ordinal, thread_index, incarnation, runtime_ordinal in d["members"]:
            job.members[ordinal] = Member(
                ordinal=ordinal,
                local_ordinal=local_ordinal,
                thread_index=thread_index,
                incarnation=incarnation,
                runtime_ordinal=runtime_ordinal,
            )
        for g in d["groups"]:
            if g["generation"] < job.generation - 1:
                continue  # a file written before old generations were forgotten (Core._new_generation)
            state = _Group(next_round=g["next_round"])
            state.finished = collections.OrderedDict((r["number"], _round_from_json(r)) for r in g["finished"])
            job.groups[(g["generation"], tuple(g["group"]))] = state
        job.events = EventLog(
            [Event(kind=k, generation=gen, ordinals=tuple(o), host=h, message=m) for k, gen, o, h, m in d["events"]],
            d.get("events_dropped", 0),  # not in files before events were trimmed
        )
        job.dead = set(d["dead"])
        job.replaced = collections.OrderedDict(d.get("replaced", ()))  # not in files before it was kept
        job.kv = {k: _unb(v) for k, v in d["kv"].items()}
        job.store_id = d.get("store_id", job.store_id)  # (not in files before it was kept: a new one)
        job.request_results = collections.OrderedDict((k, _request_result_back(v)) for k, v in d["requests"])
        core.jobs[job.name] = job
    core.version = body.get("version", 0)
    interval = max((p.heartbeat_interval for j in core.jobs.values() for p in j.processes.values() if p.alive), default=0.0)
    window = 3 * max(interval, _CLIENT_HEARTBEAT_INTERVAL)
    core.restored = (now, min(math.inf if before is None else before, window), before)
    return core


JOURNAL_LIMIT = 4 << 20  # bytes of journal after which the next write is the whole state
# Out of open files (the process's or the system's: many connections, perhaps a peer's that
# opens them and sends nothing), a write is tried again for this long before it fails, and
# serve with it: that is no fault of the disk, and it passes as connections close.
OUT_OF_FILES_WAIT = 30.0


def journal_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".journal")


def journal_entry(version: int, changes: list[tuple], completed: dict[str, int]) -> bytes:
    """One journal line: ``changes`` (from ``Core.take_journal``) as of core ``version``,
    with each job's count of completed rounds."""
    rounds: dict[str, list] = {}
    kv = []
    for change in changes:
        if change[0] == "round":
            rounds.setdefault(change[1], []).append(_round_to_json(change[2]))
        elif change[0] in ("set", "append"):
            kv.append([change[0], change[1], change[2], _b(change[3])])
        elif change[0] == "request":
            kv.append(["request", change[1], change[2], _request_result(change[3])])
        else:
            kv.append(list(change))
    entry = {"version": version, "rounds": rounds, "completed": completed}
    if kv:
        entry["kv"] = kv  # in order: a key set, deleted and set again must end set
    text = json.dumps(entry, separators=(",", ":"))
    return f"{hashlib.sha256(text.encode()).hexdigest()} {text}\n".encode()


def _replay_kv(core: Core, changes: list) -> None:
    for kind, name, key, *value in changes:
        job = core.jobs.get(name)
        if job is None:  # created by a key-value call (which does not rewrite the state)
            job = core.jobs[name] = Job(name=name)
        if kind == "job":  # (key: its store id)
            job.store_id = key
        elif kind == "set":
            job.kv[key] = _unb(value[0])
        elif kind == "append":  # (lines are replayed once each, on the state file they follow)
            job.kv[key] = job.kv.get(key, b"") + _unb(value[0])
        elif kind == "delete":
            job.kv.pop(key, None)
        elif kind == "request":
            Core.record_request(job, key, _request_result_back(value[0]))
        else:
            raise ValueError(f"unknown key-value change {kind!r}")


def lock_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".lock")


def resolve(path: os.PathLike | str) -> pathlib.Path:
    """Where the state file ``path`` is: a link (to a volume, say) followed, once, at startup.
    (``os.replace`` onto the link would replace the link by a file, and the volume would
    keep the old state.)"""
    real = pathlib.Path(os.path.realpath(path))
    if real.is_dir():
        raise StateFileError(
            f"the state file {_named(path, real)} (--state-file) is a folder; give the path of a file, "
            f"such as {pathlib.Path(path) / 'coordinator.state'}"
        )
    return real


def _named(given: os.PathLike | str, real: pathlib.Path) -> str:
    """``given`` as it was given, and where it leads when that is elsewhere (a link)."""
    return str(given) if pathlib.Path(os.path.abspath(given)) == real else f"{given} (leading to {real})"


def _what_to_do(exc: OSError, folder: pathlib.Path) -> str:
    """What the user can do about ``exc``, raised writing in ``folder``."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (
            f"; the coordinator's user must be able to create and replace files in {folder}: change its owner "
            "or mode, or give another --state-file"
        )
    if exc.errno == errno.EROFS:
        return f"; {folder} is on a read-only filesystem: give a --state-file on a writable volume"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"; free space on the volume of {folder}"
    return ""


# The descriptors of the locks this process holds -> their lock files' identity (device,
# inode: one file may have two paths, a bind mount's). A forked child closes its copies: an
# flock belongs to the open file, and a child outliving its parent would keep it locked.
_held: dict[int, tuple[int, int]] = {}
# The lock files this process let go of -> when: a child forked just before holds a copy
# until it runs its at-fork handler (on a loaded machine, some time later), and a
# coordinator started again here meanwhile waits for it, for up to _CHILD_LETS_GO.
_let_go: dict[tuple[int, int], float] = {}
_CHILD_LETS_GO = 2.0


def _let_go_in_child() -> None:
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_let_go_in_child)


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _lock(real: pathlib.Path, given: os.PathLike | str) -> int:
    """Locks state file ``real`` for this coordinator: the descriptor of its lock file,
    holding an ``flock`` and naming this process; StateFileError when another coordinator
    (of this process too: each open file holds its own flock) holds it."""
    lock = lock_path(real)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        try:
            info = os.stat(lock)
        except OSError:
            info = None
        if info is not None and exc.errno in (errno.EACCES, errno.EPERM):  # (made by another user: sudo serve)
            raise StateFileError(
                f"cannot open {lock}, the lock of the state file {_named(given, real)} (--state-file): "
                f"{exc.strerror}; it belongs to uid {info.st_uid} (mode {stat.S_IMODE(info.st_mode):04o}), and this "
                f"coordinator runs as uid {os.getuid()}: change the owner of the state file, its journal and its lock"
            ) from exc
        raise StateFileError(
            f"cannot create {lock}, the lock of the state file {_named(given, real)} (--state-file): "
            f"{exc.strerror}{_what_to_do(exc, real.parent)}"
        ) from exc
    try:
        _flock(fd)
    except BlockingIOError:
        holder, identity = _holder(fd), _identity(fd)
        os.close(fd)
        raise StateFileError(_in_use(given, real, holder, identity)) from None
    except OSError as exc:  # (ENOLCK: an NFS mount whose lock service does not answer)
        os.close(fd)
        raise StateFileError(
            f"cannot lock {lock}, the lock of the state file {_named(given, real)} (--state-file): {exc.strerror}; "
            "keep the state file on a filesystem with file locks (a local disk, a block volume, NFS with locking)"
        ) from exc
    _held[fd] = _identity(fd)
    try:  # who holds it, for the message of a coordinator refused (the lock is what counts)
        os.ftruncate(fd, 0)
        os.write(fd, f"{_this_process()}\n".encode())
    except OSError:
        pass
    return fd


def _flock(fd: int) -> None:
    """Takes the lock on ``fd`` or raises BlockingIOError; tried again for up to
    _CHILD_LETS_GO from when this process let go of it, while held in its name (a forked
    child's copy: see _let_go). It sleeps meanwhile, in start_server too: only then."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            identity = _identity(fd)
            let_go = _let_go.get(identity)
            if (
                let_go is None or time.monotonic() >= let_go + _CHILD_LETS_GO
                or identity in _held.values() or _holder(fd) != _this_process()
            ):
                raise
            time.sleep(0.02)


def _this_process() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _holder(fd: int) -> str:
    """Who holds the lock on ``fd``, as its holder wrote it ("pid N on HOST"), or ""."""
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""
    return text if text.startswith("pid ") else ""


def _in_use(given: os.PathLike | str, real: pathlib.Path, holder: str, identity: tuple[int, int]) -> str:
    by = f" ({holder})" if holder else ""
    if identity in _held.values():
        by = f" ({_this_process()}: this process, another Coordinator in it)"
    elif holder == _this_process() and identity in _let_go:
        by = f" ({holder}: this process, whose lock a process forked from it still held after {_CHILD_LETS_GO:g} s)"
    return (
        f"the state file {_named(given, real)} (--state-file) is in use by another coordinator{by}: it holds "
        f"{lock_path(real)}; two coordinators on one state file would lose each other's writes. Stop it first, "
        "or give this one another --state-file"
    )


def _remove_leftovers(real: pathlib.Path) -> None:
    """Removes the temporary files of rewrites that a crash (kill -9, out of memory) cut
    short, each as large as the state: on a small volume they pile up until no rewrite
    fits, and every start (which rewrites the state) fails. Called with the lock held."""
    for name in (real.name, journal_path(real).name):
        for leftover in real.parent.glob(f".{glob.escape(name)}{_TEMPORARY}*"):
            try:
                leftover.unlink()
                log.info("removed %s, left by a write a crash cut short", leftover, extra={"event": "state_file_repaired"})
            except OSError as exc:
                log.warning("cannot remove %s, left by a write a crash cut short: %s", leftover, exc.strerror, extra={"event": "state_file_repaired"})


def _set_aside_orphaned_journal(real: pathlib.Path) -> None:
    """Moves a journal whose state file is gone (moved away, as its error says to when it
    is corrupt) to ``<journal>.orphaned``: its lines are changes to a state nobody has. Left
    there, the next start's first write (the new state file, then an empty journal) killed
    between its two renames came back replaying them onto the new state. Kept, not removed,
    beside the state file it belongs to wherever that went. Called with the lock held."""
    journal = journal_path(real)
    if os.path.lexists(real) or not os.path.lexists(journal):
        return
    aside = journal.with_name(journal.name + ".orphaned")
    try:
        os.replace(journal, aside)
        _fsync_folder(real.parent)
    except OSError as exc:
        log.warning("cannot move %s, a journal without its state file %s, aside: %s", journal, real, exc.strerror, extra={"event": "state_file_repaired"})
        return
    log.warning("moved %s to %s: a journal without its state file %s (moved away?) belongs to no state", journal, aside, real, extra={"event": "state_file_repaired"})


def _with_files(open_and_write):
    """``open_and_write()``, tried again while the process is out of open files, for up to
    ``OUT_OF_FILES_WAIT`` (in the state writer's thread: its callers wait, nothing else)."""
    end, pause, said = time.monotonic() + OUT_OF_FILES_WAIT, 0.05, False
    while True:
        try:
            return open_and_write()
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or time.monotonic() >= end:
                raise
            if not said:
                log.warning("out of open files to write the state file (%s); trying again for up to %g s", exc.strerror, OUT_OF_FILES_WAIT, extra={"event": "open_files_low"})
                said = True
        time.sleep(pause)
        pause = min(2 * pause, 1.0)


class Removed(OSError):
    """The journal or the state file was removed while the coordinator ran (by hand, or a
    cleaner of old files): what the journal held is no longer on disk, so the next write is
    a whole one."""


class Files:
    """The state file and its journal, as the state writer's thread writes them, locked
    against other coordinators (``PATH.lock``) from construction to :meth:`close`. The
    journal stays open between appends: opening and closing it cost as much CPU again as a
    round's line and its fsync."""

    def __init__(self, path: os.PathLike | str) -> None:
        self.given = path
        self.path = resolve(path)
        self._lock: int | None = _lock(self.path, path)
        self._journal: int | None = None  # the journal's descriptor, open for appends
        _remove_leftovers(self.path)
        _set_aside_orphaned_journal(self.path)

    def append(self, data: bytes) -> None:
        """Appends ``data`` to the journal, on disk when this returns."""
        try:
            if self._journal is None:
                self._journal = _with_files(
                    lambda: os.open(journal_path(self.path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                )
            view = memoryview(data)
            while view:
                view = view[os.write(self._journal, view):]
            os.fsync(self._journal)
            # (two system calls against an fsync's milliseconds)
            gone = journal_path(self.path) if os.fstat(self._journal).st_nlink == 0 else None
            if gone is None and not os.path.lexists(self.path):
                gone = self.path
        except OSError as exc:
            raise self._cannot_write(exc) from exc
        if gone is not None:
            raise Removed(errno.ENOENT, f"{gone} was removed while the coordinator ran")

    def rewrite(self, data: bytes) -> None:
        """Replaces the state file with ``data`` (from :func:`encode`) and empties its journal
        (also the way back after a failed append: a partial line goes with the old journal)."""
        try:
            self._close_journal()
            _with_files(lambda: write_atomic(self.path, data))
            _with_files(lambda: write_atomic(journal_path(self.path), b""))  # a crash between the two: the lines are older, skipped
        except OSError as exc:
            raise self._cannot_write(exc) from exc

    def _cannot_write(self, exc: OSError) -> OSError:
        """``exc`` naming the state file (not the temporary file or the journal it was
        about) and what to do; still an OSError, which the writer's callers are told of."""
        if exc.errno is None:
            return exc
        folder = self.path.parent
        named = _named(self.given, self.path)
        return OSError(exc.errno, f"cannot write the state file {named} (--state-file): {exc.strerror}{_what_to_do(exc, folder)}")

    def _close_journal(self) -> None:
        if self._journal is not None:
            fd, self._journal = self._journal, None  # (a close that fails frees the descriptor too)
            os.close(fd)

    def close(self) -> None:
        """Closes the journal and lets go of the lock: another coordinator may start on it."""
        try:
            self._close_journal()
        finally:  # (the lock goes even when closing the journal fails)
            if self._lock is not None:
                lock, self._lock = self._lock, None
                identity = _held.pop(lock, None)
                os.close(lock)  # (lets go of the flock)
                if identity is not None:
                    _let_go[identity] = time.monotonic()


def replay_journal(core: Core, path: pathlib.Path) -> None:
    """Applies the journal lines of state file ``path`` newer than ``core`` (just restored)."""
    try:
        data = journal_path(path).read_bytes()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _cannot_read(f"{journal_path(path)}, the journal of the state file {path} (--state-file)", exc) from exc
    hint = f"; move {path} and {journal_path(path).name} away to start with an empty coordinator"
    lines = data.split(b"\n")
    if lines.pop():  # b"" after the last newline, else a line cut short (never acknowledged)
        log.warning("ignored the last line of %s: it has no end (a write cut short)", journal_path(path), extra={"event": "state_file_repaired"})
    for number, line in enumerate(lines, 1):
        digest, _, text = line.partition(b" ")
        if hashlib.sha256(text).hexdigest().encode() != digest:
            if number == len(lines):  # the last write, cut short: its callers were never answered
                log.warning("ignored the last line of %s: its checksum does not match (a write cut short)", journal_path(path), extra={"event": "state_file_repaired"})
                break
            raise StateFileError(f"{journal_path(path)} is corrupt at line {number}: its checksum does not match{hint}")
        try:
            entry = json.loads(text)
            if entry["version"] <= core.version:
                continue  # already in the state file (written after this line)
            for name, rounds in entry["rounds"].items():
                job = core.jobs[name]
                for r in rounds:
                    Core.record_finished(job, _round_from_json(r))
                job.rounds_completed = max(job.rounds_completed, entry["completed"].get(name, 0))
            _replay_kv(core, entry.get("kv", []))
            core.version = entry["version"]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StateFileError(f"{journal_path(path)} line {number} is not a valid journal entry ({type(exc).__name__}: {exc}){hint}") from exc


def encode(body: dict) -> bytes:
    text = json.dumps(body, separators=(",", ":"), sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()
    return json.dumps({"format": FORMAT, "version": VERSION, "sha256": digest, "body": text}).encode()


def decode(data: bytes, *, path: str = "state file") -> dict:
    """The body of an encoded state; StateFileError for anything torn, edited or foreign."""
    hint = f"; move {path} away to start with an empty coordinator"
    if not data.strip():  # (a coordinator replaces it whole: one made empty beforehand)
        raise StateFileError(f"{path} is empty, not written by a coordinator{hint}")
    try:
        outer = json.loads(data)
        if outer.get("format") != FORMAT:
            raise StateFileError(f"{path} is not a pjrt-rendezvous state file{hint}")
        if outer.get("version") not in READS:
            raise StateFileError(
                f"{path} has state format version {outer.get('version')}, this coordinator reads "
                f"{' and '.join(map(str, READS))}{hint}"
            )
        text = outer["body"]
        if hashlib.sha256(text.encode()).hexdigest() != outer["sha256"]:
            raise StateFileError(f"{path} is corrupt: its checksum does not match its content{hint}")
        return json.loads(text)
    except StateFileError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StateFileError(f"{path} is corrupt or truncated ({type(exc).__name__}: {exc}){hint}") from exc


_TEMPORARY = ".tmp-"  # in the names of write_atomic's temporary files: .NAME.tmp-XXXXXXXX


def write_atomic(path: pathlib.Path, data: bytes) -> None:
    """Replaces ``path`` with ``data`` so that a crash leaves the old or the new file, whole
    (and perhaps a temporary file, which :class:`Files` removes at the next start)."""
    folder = path.parent
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{_TEMPORARY}", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: pathlib.Path) -> None:
    """Makes a rename in ``folder`` durable. A file system that cannot sync a folder (EINVAL:
    some network and FUSE ones) makes its renames durable by itself, or never: as PostgreSQL
    and SQLite do, that is not a failed write (every rewrite would fail, so no state file)."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(dir_fd)


def _cannot_read(what: str, exc: OSError) -> StateFileError:
    return StateFileError(
        f"cannot read {what}: {exc.strerror}; make it readable by the coordinator's user (its owner "
        "or mode), or move it away to start with an empty coordinator"
    )


def load(
    path: os.PathLike | str, *, now: float, limits: Limits | None, heartbeat_timeout: float | None,
    given: os.PathLike | str | None = None,
) -> Core | None:
    """The core saved at ``path``, or None when there is no file yet; StateFileError when it
    cannot be used. A coordinator loads it once it holds its lock (:class:`Files`), from
    the file the lock is for; ``given``: the path as the user gave it, for messages."""
    real = resolve(path)
    path = path if given is None else given
    try:
        data = real.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _cannot_read(f"the state file {_named(path, real)} (--state-file)", exc) from exc
    body = decode(data, path=str(path))
    try:
        core = restore(body, now=now, limits=limits, heartbeat_timeout=heartbeat_timeout)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StateFileError(
            f"{path} does not hold a valid coordinator state ({type(exc).__name__}: {exc}); move it away to start "
            "with an empty coordinator"
        ) from exc
    replay_journal(core, real)
    return core
