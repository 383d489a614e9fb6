"""Applies the proposed coordinator/client optimizations to a source tree (for measuring them).

    python bench/_apply_opt.py TREE [--only NAME,...]     # edit the source tree TREE in place
    python bench/_apply_opt.py . --diff > patch          # the edits as a patch against this checkout

Each edit is an exact text replacement in the current product files; if any edit's text is
not found (the product moved on), nothing is written and the edits that failed are listed.
``bench/proposed.patch`` is ``diff -ru`` of the product before and after these edits.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

EDITS: dict[str, list[tuple[str, str, str]]] = {}
# Tried, measured, not proposed: applied only when named in --only.
REJECTED = {
    "client-call": "a blocking call instead of future + polling in the client: no gain at 2x1 / 8x1 "
    "(p50 0.87-0.97x, 6 alternating runs)",
}


def edit(name: str, path: str, old: str, new: str) -> None:
    EDITS.setdefault(name, []).append((path, old, new))


# -- 1. gRPC's pending-request backlog ----------------------------------------------------------
edit(
    "backlog",
    "coordinator/_server.py",
    '''    ("grpc.so_reuseport", 0),
''',
    '''    ("grpc.so_reuseport", 0),
    # gRPC cancels calls beyond 1,000 not yet picked up by the (Python) server, at random up
    # to 3,000 and all of them above. World formation is a burst of one Register per thread:
    # at 512 processes x 8 threads, 5-25 % of them came back CANCELLED (bench/RESULTS.md,
    # scale run). Allow a whole world of them.
    ("grpc.server.max_pending_requests", 65_536),
    ("grpc.server.max_pending_requests_hard_limit", 131_072),
''',
)

# -- 2. responses built once, serialized once, shared as bytes -----------------------------------
edit(
    "shared-bytes",
    "coordinator/_servicer.py",
    '''            response_serializer=getattr(pb, method.output_type.name).SerializeToString,''',
    '''            response_serializer=_serialize,''',
)
edit(
    "shared-bytes",
    "coordinator/_servicer.py",
    '''def add_to_server(servicer: "Servicer", server) -> None:''',
    '''def _serialize(message) -> bytes:
    # A response shared by many callers (a finished round, the world table) is serialized
    # once by the servicer and arrives here as bytes.
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_to_server(servicer: "Servicer", server) -> None:''',
)
edit(
    "shared-bytes",
    "coordinator/_servicer.py",
    '''        if rnd.response is None:
            rnd.response = pb.RendezvousResponse(payloads=rnd.result)
        return rnd.response''',
    '''        if rnd.response is None:
            # Serialized once for every member of the round (see _server._serialize).
            rnd.response = pb.RendezvousResponse(payloads=rnd.result).SerializeToString()
        return rnd.response''',
)
edit(
    "shared-bytes",
    "coordinator/_servicer.py",
    '''        world_size = self._core.jobs[request.job].world_size
        log.debug("world of job %s complete: %d ordinals", request.job, world_size)
        return pb.WaitWorldResponse(world_size=world_size, participants=[_participant(p) for p in table])''',
    '''        job = self._core.jobs[request.job]
        log.debug("world of job %s complete: %d ordinals", request.job, job.world_size)
        # Every process asks at the same moment for the same table: build and serialize it
        # once per state of the core (``version`` grows with every change of ranks, deaths,
        # generations), not once per caller (O(world) each).
        version = self._core.version
        cached = self._world_tables.get(request.job)
        if cached is None or cached[0] != version:
            response = pb.WaitWorldResponse(world_size=job.world_size, participants=[_participant(p) for p in table])
            cached = self._world_tables[request.job] = (version, response.SerializeToString())
        return cached[1]''',
)
edit(
    "shared-bytes",
    "coordinator/_servicer.py",
    '''        while (table := self._core.world(request.job)) is None:''',
    '''        while not self._core.world_complete(request.job):''',
)
edit(
    "shared-bytes",
    "coordinator/_servicer.py",
    '''        self._waiters: dict[tuple, set[asyncio.Future]] = collections.defaultdict(set)''',
    '''        self._waiters: dict[tuple, set[asyncio.Future]] = collections.defaultdict(set)
        self._world_tables: dict[str, tuple[int, bytes]] = {}  # job -> (core version, WaitWorldResponse)''',
)
# world(): the table is built lazily, only when the cache misses
edit(
    "shared-bytes",
    "coordinator/_servicer.py",
    '''        if cached is None or cached[0] != version:
            response = pb.WaitWorldResponse(world_size=job.world_size, participants=[_participant(p) for p in table])''',
    '''        if cached is None or cached[0] != version:
            table = self._core.world(request.job)
            response = pb.WaitWorldResponse(world_size=job.world_size, participants=[_participant(p) for p in table])''',
)
edit(
    "shared-bytes",
    "coordinator/_core.py",
    '''    def world(self, job_name: str) -> list[ParticipantView] | None:''',
    '''    def world_complete(self, job_name: str) -> bool:
        """Whether every ordinal of the job is registered (cheap: no table is built)."""
        return self._job(job_name).complete

    def world(self, job_name: str) -> list[ParticipantView] | None:''',
)

# -- 3. per-arrival bookkeeping: O(contributions of the call), not O(arrivals so far) ------------
edit(
    "arrive",
    "coordinator/_core.py",
    '''        for c in contributions:
            rnd.arrivals[c.ordinal] = c
            state.blocked[c.ordinal] = rnd.key
        if deadline is not None and (rnd.deadline is None or deadline < rnd.deadline):
            rnd.deadline = deadline

        tags: dict[str, list[int]] = collections.defaultdict(list)
        for c in rnd.arrivals.values():
            tags[c.tag].append(c.ordinal)
        if len(tags) > 1:''',
    '''        # A pending round holds one tag (a second one fails it at once), so a mismatch is a
        # contribution of this call that differs from any earlier arrival: checking the call
        # alone keeps an arrival O(its contributions) instead of O(the round's arrivals).
        tag = next(iter(rnd.arrivals.values())).tag if rnd.arrivals else contributions[0].tag
        for c in contributions:
            rnd.arrivals[c.ordinal] = c
            state.blocked[c.ordinal] = rnd.key
        if deadline is not None and (rnd.deadline is None or deadline < rnd.deadline):
            rnd.deadline = deadline

        tags: dict[str, list[int]] = collections.defaultdict(list)
        if any(c.tag != tag for c in contributions):
            for c in rnd.arrivals.values():
                tags[c.tag].append(c.ordinal)
        if len(tags) > 1:''',
)

# -- 4. waiting: no asyncio.wait per waiter ---------------------------------------------------------
edit(
    "wait",
    "coordinator/_servicer.py",
    '''        future = asyncio.get_running_loop().create_future()
        waiters = self._waiters[key]
        waiters.add(future)
        try:
            timeout = None if deadline is None else max(0.0, deadline - self._clock())
            done, _ = await asyncio.wait((future,), timeout=timeout)
            return bool(done)
        finally:''',
    '''        loop = asyncio.get_running_loop()
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
                timer.cancel()''',
)
edit(
    "wait",
    "coordinator/_servicer.py",
    '''            for future in self._waiters.pop(key, ()):
                if not future.done():
                    future.set_result(None)''',
    '''            for future in self._waiters.pop(key, ()):
                if not future.done():
                    future.set_result(True)''',
)
edit(
    "wait",
    "coordinator/_servicer.py",
    '''async def _nothing() -> None:
    return None''',
    '''async def _nothing() -> None:
    return None


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(False)''',
)

# -- rejected (see REJECTED): client, a blocking call instead of a future polled by the caller -----
edit(
    "client-call",
    "client/_client.py",
    '''            interval = self.settings.progress_interval
            if progress is None or interval is None:
                return rpc(request, timeout=transport, metadata=self._metadata)
            call = rpc.future(request, timeout=transport, metadata=self._metadata)
            started = time.monotonic()
            try:
                while True:
                    try:
                        return call.result(timeout=interval)
                    except grpc.FutureTimeoutError:
                        progress(time.monotonic() - started)
            finally:
                call.cancel()  # a no-op once finished; stops the call if we leave early''',
    '''            interval = self.settings.progress_interval
            if progress is None or interval is None:
                return rpc(request, timeout=transport, metadata=self._metadata)
            # A blocking call completes on this thread; a future completes on gRPC's thread
            # and wakes this one (a thread hop per call). The "still waiting" lines come from
            # the client's progress thread instead, which looks at calls in flight.
            token = self._progress.begin(progress)
            try:
                return rpc(request, timeout=transport, metadata=self._metadata)
            finally:
                self._progress.end(token)''',
)
edit(
    "client-call",
    "client/_client.py",
    '''        self._closed = False
''',
    '''        self._closed = False
        self._progress = _ProgressWatch(lambda: self.settings.progress_interval, self._stopped)
''',
)
edit(
    "client-call",
    "client/_client.py",
    '''def _copy_error(error: RendezvousError) -> RendezvousError:''',
    '''class _ProgressWatch:
    """Calls ``progress(seconds waited)`` every ``interval`` for each call still in flight,
    from one daemon thread per client (started by the first watched call)."""

    def __init__(self, interval: Callable[[], float | None], stopped: threading.Event) -> None:
        self._interval = interval
        self._stopped = stopped
        self._lock = threading.Lock()
        self._calls: dict[int, tuple[Callable[[float], None], float, list]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None

    def begin(self, progress: Callable[[float], None]) -> int:
        now = time.monotonic()
        with self._lock:
            self._next += 1
            self._calls[self._next] = (progress, now, [now])
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pjrt-rendezvous-progress", daemon=True)
                self._thread.start()
            return self._next

    def end(self, token: int) -> None:
        with self._lock:
            self._calls.pop(token, None)

    def _run(self) -> None:
        while True:
            interval = self._interval()
            if interval is None or self._stopped.wait(min(interval, 1.0)):
                return
            now = time.monotonic()
            with self._lock:
                due = [(p, s, last) for p, s, last in self._calls.values() if now - last[0] >= interval]
                for _, _, last in due:
                    last[0] = now
            for progress, started, _ in due:
                try:
                    progress(now - started)
                except Exception:  # a report must never break the call it reports on
                    log.debug("progress report failed", exc_info=True)


def _copy_error(error: RendezvousError) -> RendezvousError:''',
)


def apply(tree: pathlib.Path, only: set[str] | None = None) -> list[str]:
    """Applies the edits in memory and writes the files only if every edit applied."""
    problems = []
    texts: dict[pathlib.Path, str] = {}
    for name, edits in EDITS.items():
        if (only and name not in only) or (not only and name in REJECTED):
            continue
        for path, old, new in edits:
            file = tree / path
            text = texts.get(file, file.read_text())
            if text.count(old) != 1:
                problems.append(f"{name}: {path}: text not found exactly once ({text.count(old)} times)")
                continue
            texts[file] = text.replace(old, new)
    if not problems:
        for file, text in texts.items():
            file.write_text(text)
    return problems


def diff(repo: pathlib.Path, only: set[str] | None = None) -> tuple[str, list[str]]:
    """The edits as a unified diff against the files of ``repo`` (paths a/... b/..., for
    ``git apply`` from the repository root)."""
    import difflib
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tree = pathlib.Path(tmp)
        for folder in ("coordinator", "client"):
            shutil.copytree(repo / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__"))
        problems = apply(tree, only)
        if problems:
            return "", problems
        out = []
        touched = {p for name, edits in EDITS.items() for p, _, _ in edits
                   if ((name in only) if only else (name not in REJECTED))}
        for path in sorted(touched):
            before = (repo / path).read_text().splitlines(keepends=True)
            after = (tree / path).read_text().splitlines(keepends=True)
            out += difflib.unified_diff(before, after, f"a/{path}", f"b/{path}")
        return "".join(out), []


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("tree", help="the source tree to edit in place, or with --diff the repository")
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join(EDITS)}")
    parser.add_argument("--diff", action="store_true", help="print the edits as a patch; change nothing")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    if args.diff:
        text, problems = diff(pathlib.Path(args.tree), only)
        sys.stdout.write(text)
    else:
        problems = apply(pathlib.Path(args.tree), only)
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
