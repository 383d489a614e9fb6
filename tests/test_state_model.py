"""Model-based test of the state file: a core persisted by the real writer, killed and restored.

A hypothesis state machine drives a real :class:`Core` persisted as ``serve`` persists it (a
``_StateWriter`` over ``_state.Files``: every call's changes flushed before it is answered,
a journal append or a full rewrite as the writer chooses), through registrations, full and
subset rounds (joined in any order, resent, given up, timed out), heartbeats, disconnects,
leaves, ``end_replicas`` and key-value changes with request ids, and kills it at random
points: cleanly, with its journal cut anywhere, or with its state file gone. Each restart
loads the files with ``_state.load`` and checks, as the README (Reliability: the state file)
and the ``_state`` docstring say:

- the restored core is the core as of the last write the files hold (the last acknowledged
  one), with only the documented restart resets applied (pending rounds, last-seen times of
  the live, closed connections, bookkeeping the file does not keep);
- a journal without its state file is not replayed (it is set aside as ``.orphaned``);
- from then on the restored core and a never-killed twin (that acknowledged state, reset the
  same way) answer every call alike and stay alike, the members resending their unanswered
  calls;
- a resent call of an answered round gets that answer while its round is kept (a group keeps
  rounds finished out of order ahead of its next unfinished one), and a resent key-value
  change is answered as first and not applied twice.

``PJRT_RENDEZVOUS_FUZZ_EXAMPLES`` scales the example count.
"""

from __future__ import annotations

import asyncio
import copy
import copyreg
import os
import pathlib
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from pjrt_rendezvous.coordinator import Core, _core, _state
from pjrt_rendezvous.coordinator._core import ALL, Contribution, CoreError, Registration, Round, ThreadRequest
from pjrt_rendezvous.coordinator._server import _StateWriter

SCALE = float(os.environ.get("PJRT_RENDEZVOUS_FUZZ_EXAMPLES", "1"))
EXAMPLES = max(1, int(60 * SCALE))
STEPS = 40

HEARTBEAT_TIMEOUT = 60.0
TASKS, DPT = 2, 2
WORLD = TASKS * DPT
KVJOBS = ("j", "s")
INCS = [f"t{t}i{k}" for t in range(TASKS) for k in range(3)]  # three incarnations per task


class _Ids:
    """A deterministic ``secrets`` for the core (store ids, state ids), so that the restored
    core and its twin, given the same calls, name their new stores alike."""

    def __init__(self) -> None:
        self.n = 0

    def token_hex(self, nbytes: int = 8) -> str:
        self.n += 1
        return f"{self.n:0{2 * nbytes}x}"


def _core_error(code, message, warn):
    return CoreError(code, message, warn=warn)


def _reduce_core_error(e: CoreError):
    """(A CoreError's arguments are not its ``args``: so that a core deep-copies.)"""
    return _core_error, (e.code, e.message, e.warn)


def task_of(inc: str) -> int:
    return int(inc[1])


# --- normalisation ---------------------------------------------------------------------------------


def _err(e):
    return None if e is None else (e.code.name, e.message)


def norm_round(r: Round, pending: bool = False):
    """A round as comparable values (with its arrivals, deadline and start when pending)."""
    d = (r.generation, r.group, r.number, r.size, r.tag, None if r.result is None else tuple(r.result), _err(r.error))
    if r.error is not None:
        d += (tuple(sorted(r.arrivals)),)
    if pending:
        d += (tuple(sorted(r.arrivals.items())), r.deadline, r.started)
    return d


def norm(core: Core, pending: bool = True):
    """A core's state, as comparable values (what the state file keeps, and the pending rounds)."""
    jobs = {}
    for name, job in core.jobs.items():
        jobs[name] = dict(
            world_size=job.world_size, world_fixed_by=job.world_fixed_by, dpt=job.devices_per_task,
            generation=job.generation, formed=job.formed, rounds_completed=job.rounds_completed,
            processes={
                i: (p.host, p.pid, p.task_id, p.local_rank, tuple(sorted(p.ordinals)), p.alive, p.left, p.death,
                    tuple(sorted(p.ended.items())), p.client_version, p.heartbeat_interval, p.launch,
                    # liveness: compared only for the live (a dead one's last-seen is documented as reset)
                    (p.last_seen, p.restored, p.disconnected) if p.alive else None)
                for i, p in job.processes.items()
            },
            tasks=dict(job.tasks),
            members=sorted((m.ordinal, m.local_ordinal, m.thread_index, m.incarnation, m.runtime_ordinal) for m in job.members.values()),
            groups=[(k, st_.next_round, [norm_round(r) for r in st_.finished.values()]) for k, st_ in job.groups.items()
                    if st_.next_round or st_.finished],  # (an empty group made by a pending round: not state)
            events=[(e.kind, e.generation, e.ordinals, e.host, e.message) for e in job.events],
            events_dropped=job.events.dropped,
            dead=sorted(job.dead),
            replaced=list(job.replaced.items()),
            kv=dict(job.kv),
            store_id=job.store_id,
            requests=list(job.request_results.items()),
            pending=sorted((k, norm_round(r, True)) for k, r in job.pending.items()) if pending else None,
            blocked=dict(job.blocked) if pending else None,
        )
    return dict(version=core.version, state_id=core.state_id, restored=core.restored, jobs=jobs)


def outcome(fn):
    """A call's observable result: its return value (a Round normalised) or its CoreError."""
    try:
        v = fn()
    except CoreError as e:
        return ("raise", e.code.name, e.message)
    if isinstance(v, Round):
        return ("round", norm_round(v, pending=not v.finished))
    if hasattr(v, "assignments"):
        return ("registered", v)
    return ("ok", v)


def documented_reset(core: Core, now: float, restored: Core) -> Core:
    """What README/_state docstring say a restart resets: pending rounds (resent by their
    members), last-seen of live processes (seen at the restore), connection-closed marks,
    plus bookkeeping the state file does not hold (refused tasks, last run, outsider calls)."""
    twin = copy.deepcopy(core)
    twin.journal = []
    twin.finished = None
    twin._wakeups = []
    twin.unknown = {}
    twin.restored = restored.restored
    twin.heartbeat_timeout = restored.heartbeat_timeout
    twin.state_version = 0
    for job in twin.jobs.values():
        job.pending.clear()
        job.blocked.clear()
        job.outsider_calls.clear()
        job.refused.clear()
        job.last_run.clear()
        job.kv_bytes = None
        job.runtime_owners = None
        for p in job.processes.values():
            p.restored = True
            p.disconnected = None
            if p.alive:
                p.last_seen = now
    return twin


class StateModel(RuleBasedStateMachine):
    base: pathlib.Path  # (set by the test: a folder under its tmp_path)
    ids: _Ids  # (set by the test: the core's secrets)

    def __init__(self):
        super().__init__()
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="state-", dir=self.base))
        self.path = self.dir / "state.json"
        self.now = 1000.0
        self.loop = None
        self.writer = None
        self.core = None
        self.twin = None  # never killed (None until the first restart: identical to core)
        self.rid = 0
        self.calls = []  # arrive calls: dicts with their arguments, "rnd" (the core's Round) and "answer"
        self.kv_inflight = []  # key-value changes with request ids not yet answered (not flushed)
        self.kv_acked = {}  # (job, request id) -> (change, answer)
        self.acked = []  # since the last full rewrite: (journal size after a flush, copy of the core, answers)
        self._start(Core(heartbeat_timeout=HEARTBEAT_TIMEOUT))

    # --- plumbing --------------------------------------------------------------------------------

    def _start(self, core: Core | None):
        """Loads the files (a restart) or takes core, and serves it as serve does."""
        files = _state.Files(self.path)
        loaded = _state.load(self.path, now=self.now, limits=None, heartbeat_timeout=HEARTBEAT_TIMEOUT)
        if core is None:
            core = loaded or Core(heartbeat_timeout=HEARTBEAT_TIMEOUT)
        self.loop = asyncio.new_event_loop()
        self.writer = _StateWriter(core, files)
        self.core = core
        self._flush()  # a new state file exists from the start
        core.serving_from(self.now)
        return loaded

    def _flush(self):
        """Writes what changed: the calls it finished, and key-value changes, are answered."""
        self.loop.run_until_complete(self.writer.flush())
        journal = _state.journal_path(self.path)
        size = journal.stat().st_size if journal.exists() else 0
        for c in self.calls:
            if c["answer"] is None and c["rnd"] is not None and c["rnd"].finished:
                r = c["rnd"]
                c["answer"] = ("ok", tuple(r.result)) if r.result is not None else ("err", r.error.code.name)
        for op in self.kv_inflight:
            self.kv_acked[(op["job"], op["rid"])] = (op, op["answer"])
        self.kv_inflight = []
        if size == 0:  # (a full rewrite: earlier writes are no longer on disk)
            self.acked = []
        answers = (copy.deepcopy({c["id"]: c["answer"] for c in self.calls}), dict(self.kv_acked))
        core_copy = copy.deepcopy(self.core)
        core_copy.journal = []
        self.acked.append((size, core_copy, answers))

    def _kill(self):
        self.writer.close()
        self.loop.close()
        self.writer = self.loop = None

    def both(self, fn, flush=True):
        """Applies fn(core) to the core and (if any) the twin: the outcomes must agree."""
        n0 = self.ids.n
        a = outcome(lambda: fn(self.core))
        if self.twin is not None:
            n1, self.ids.n = self.ids.n, n0
            b = outcome(lambda: fn(self.twin))
            assert self.ids.n == n1
            self.twin.take_journal()
            self.twin.take_wakeups()
            assert a == b, f"the restored core and its never-killed twin disagree:\n{a}\n{b}"
        self.core.take_wakeups()
        if flush:
            self._flush()
        return a

    # --- the world ------------------------------------------------------------------------------

    @rule(data=st.data(), flush=st.sampled_from([True, True, True, False]))
    def register(self, data, flush):
        inc = data.draw(st.sampled_from(INCS), label="inc")
        t = task_of(inc)
        other_host = data.draw(st.sampled_from([False, False, False, True]), label="other_host")
        threads = data.draw(st.sets(st.integers(0, DPT - 1), min_size=1), label="threads")
        num_tasks = data.draw(st.sampled_from([TASKS] * 9 + [2]), label="num_tasks")
        if t >= num_tasks:
            num_tasks = TASKS
        interval = data.draw(st.sampled_from([0.0, 5.0, 20.0]), label="interval")
        age = data.draw(st.sampled_from([0.0, 5.0]), label="age")
        launch = data.draw(st.sampled_from(["", "", "L1"]), label="launch")
        req = Registration(
            job="j", incarnation=inc, host=f"h{t}{'x' if other_host else ''}", pid=100 + INCS.index(inc),
            task_id=t, num_tasks=num_tasks, devices_per_task=DPT, local_rank=t,
            threads=tuple(ThreadRequest(thread_index=i) for i in sorted(threads)),
            heartbeat_interval=interval, process_age=age, launch=launch,
        )
        self.both(lambda c: c.register(self.now, req), flush)

    @rule(data=st.data(), flush=st.sampled_from([True, True, True, False]))
    def register_world(self, data, flush):
        """Every task's current (latest live, else next) incarnation binds all its threads."""
        for t in range(TASKS):
            job = self.core.jobs.get("j")
            live = [i for i in INCS if task_of(i) == t and job is not None and i in job.processes and job.processes[i].alive]
            inc = live[0] if live else data.draw(st.sampled_from([i for i in INCS if task_of(i) == t]), label=f"inc{t}")
            req = Registration(
                job="j", incarnation=inc, host=f"h{t}", pid=100 + INCS.index(inc), task_id=t, num_tasks=TASKS,
                devices_per_task=DPT, local_rank=t, threads=tuple(ThreadRequest(thread_index=i) for i in range(DPT)),
                heartbeat_interval=5.0,
            )
            self.both(lambda c: c.register(self.now, req), flush)

    @rule(data=st.data())
    def collective(self, data):
        """Every member of a group calls its next round (in random order, each call flushed
        or not, group commit): how rounds usually complete."""
        job = self.core.jobs.get("j")
        if job is None or job.world_size is None:
            return
        full = data.draw(st.booleans(), label="full")
        live = [o for o, m in job.members.items() if job.processes[m.incarnation].alive and o not in job.dead]
        if full or not live:
            replicas, members = [], list(range(job.world_size))
        else:
            members = sorted(data.draw(st.sets(st.sampled_from(sorted(live)), min_size=1), label="members"))
            replicas = members
        group = ALL if not replicas or replicas == list(range(job.world_size)) else tuple(replicas)
        gstate = job.groups.get((job.generation, group))
        number = 0 if gstate is None else gstate.next_round
        pending = [k[2] for k in job.pending if k[:2] == (job.generation, group)]
        if pending and data.draw(st.booleans(), label="join pending"):
            number = min(pending)
        by_inc = {}
        for o in members:
            m = job.members.get(o)
            if m is not None:
                by_inc.setdefault(m.incarnation, []).append(o)
        order = data.draw(st.permutations(sorted(by_inc)), label="order")
        tag = data.draw(st.sampled_from(["a"] * 9 + ["b"]), label="tag")
        dl = data.draw(st.sampled_from([None, 5.0]), label="deadline")
        for inc in order:
            if data.draw(st.sampled_from([False] * 9 + [True]), label="skip"):
                continue
            flush = data.draw(st.sampled_from([True, True, False]), label="flush")
            contribs = tuple(Contribution(ordinal=o, tag=tag, payload=f"{o}:{number}".encode()) for o in by_inc[inc])
            self._arrive(inc, replicas, number, contribs, None if dl is None else self.now + dl, job.generation, flush)

    @rule(data=st.data())
    def collective_again(self, data):
        """(Twice as likely as the other rules.)"""
        self.collective(data)

    @rule()
    def heartbeat_all(self):
        job = self.core.jobs.get("j")
        for inc in sorted(job.processes) if job else ():
            self.both(lambda c: c.touch("j", inc, self.now), True)

    def _arrive(self, inc, replicas, number, contribs, deadline, generation, flush):
        self.rid += 1
        call = dict(id=self.rid, inc=inc, replicas=replicas, number=number, contributions=contribs, deadline=deadline,
                    generation=generation, rnd=None, answer=None)
        holder = {}

        def go(c):
            r = c.arrive(self.now, job="j", incarnation=inc, replicas=replicas, round_number=number,
                         contributions=contribs, deadline=deadline, generation=generation)
            if c is self.core:
                holder["rnd"] = r
            return r

        res = self.both(go, flush=False)
        if res[0] == "round":
            call["rnd"] = holder["rnd"]
            self.calls.append(call)
        if flush:
            self._flush()

    @rule(data=st.data(), flush=st.sampled_from([True, True, True, False]))
    def arrive(self, data, flush):
        """One process's call, perhaps ahead of its group's next round, perhaps outside it."""
        job = self.core.jobs.get("j")
        if job is None or job.world_size is None:
            return
        incs = [i for i, p in job.processes.items()] or INCS
        inc = data.draw(st.sampled_from(sorted(set(incs) | {INCS[0]})), label="inc")
        p = job.processes.get(inc)
        own = sorted(p.ordinals) if p is not None and p.ordinals else [task_of(inc) * DPT]
        ordinals = sorted(data.draw(st.sets(st.sampled_from(own), min_size=1), label="ordinals"))
        full = data.draw(st.booleans(), label="full")
        if full:
            replicas = []
        else:
            extra = data.draw(st.sets(st.integers(0, WORLD - 1), max_size=3), label="extra")
            replicas = sorted(set(ordinals) | extra)
        group = ALL if not replicas or replicas == list(range(job.world_size)) else tuple(replicas)
        gstate = job.groups.get((job.generation, group))
        base = 0 if gstate is None else gstate.next_round
        number = base + data.draw(st.sampled_from([0, 0, 0, 1, 2]), label="ahead")
        tag = data.draw(st.sampled_from(["a", "a", "a", "b"]), label="tag")
        pay = data.draw(st.sampled_from(["", "", "x"]), label="pay")
        contribs = tuple(Contribution(ordinal=o, tag=tag, payload=f"{o}:{number}{pay}".encode()) for o in ordinals)
        dl = data.draw(st.sampled_from([None, None, 2.0, 20.0]), label="deadline")
        deadline = None if dl is None else self.now + dl
        self._arrive(inc, replicas, number, contribs, deadline, job.generation, flush)

    @rule(data=st.data())
    def resend_answered_round(self, data):
        """A resend of an answered call gets the same answer (README: rounds carry (group,
        round); 'A resent call of a round that finished ... gets that round's result')."""
        answered = [c for c in self.calls if c["answer"] is not None]
        if not answered:
            return
        c = data.draw(st.sampled_from(answered), label="answered call")
        job = self.core.jobs.get("j")
        res = self.both(lambda core: core.arrive(
            self.now, job="j", incarnation=c["inc"], replicas=c["replicas"], round_number=c["number"],
            contributions=c["contributions"], deadline=None, generation=c["generation"]))
        if res[0] == "round":
            r = res[1]
            result, err = r[5], r[6]
            # (A group keeps a round finished out of order, ahead of its next unfinished one.)
            assert result is not None or err is not None, (
                f"resend of an answered round {c['number']} created a new pending round: {res}; answer was {c['answer']}")
            if c["answer"][0] == "ok":
                assert result == c["answer"][1] or (result is not None and all(x == b"" for x in result)), (c["answer"], res)
            else:
                assert err is not None and err[0] == c["answer"][1], (c["answer"], res)
        else:
            # allowed refusals: caller gone/replaced, generation moved, round forgotten
            assert res[1] in ("ABORTED", "FAILED_PRECONDITION", "NOT_FOUND", "INVALID_ARGUMENT"), res
            p = job.processes.get(c["inc"]) if job else None
            kept = None
            if job is not None:
                g = job.groups.get((c["generation"], ALL if not c["replicas"] or c["replicas"] == list(range(job.world_size or 0)) else tuple(c["replicas"])))
                kept = None if g is None else g.finished.get(c["number"])
            same = kept is not None and (("ok", tuple(kept.result)) if kept.result is not None else ("err", kept.error.code.name)) == c["answer"]
            if p is not None and p.alive and same and c["generation"] == job.generation:
                raise AssertionError(f"resend of answered, still-kept round refused: {res}")

    # --- liveness and failures ---------------------------------------------------------------

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, 11.0, 30.0, 70.0]))
    def advance(self, dt):
        self.now += dt

        def tick(core):
            core.expire(self.now)
            core.check_liveness(self.now)

        self.both(tick)

    @rule(inc=st.sampled_from(INCS), flush=st.sampled_from([True, True, False]))
    def heartbeat(self, inc, flush):
        self.both(lambda c: c.touch("j", inc, self.now), flush)

    @rule(inc=st.sampled_from(INCS))
    def disconnect(self, inc):
        self.both(lambda c: c.disconnect("j", inc, self.now))

    @rule(inc=st.sampled_from(INCS), flush=st.sampled_from([True, True, False]))
    def leave(self, inc, flush):
        self.both(lambda c: c.leave("j", inc, "done"), flush)

    @rule(data=st.data())
    def end_replicas(self, data):
        inc = data.draw(st.sampled_from(INCS))
        t = task_of(inc)
        ords = data.draw(st.sets(st.sampled_from([t * DPT, t * DPT + 1]), min_size=1))
        self.both(lambda c: c.end_replicas("j", inc, sorted(ords), "raised ValueError", self.now))

    @rule(data=st.data())
    def give_up(self, data):
        pend = [c for c in self.calls if c["answer"] is None and c["rnd"] is not None and not c["rnd"].finished]
        if not pend:
            return
        c = data.draw(st.sampled_from(pend))
        self._give_up(c)

    def _give_up(self, c, flush=True):
        self.both(lambda core: core.give_up_round(
            "j", c["inc"], generation=c["generation"], replicas=c["replicas"], round_number=c["number"],
            ordinals=[x.ordinal for x in c["contributions"]], tag=c["contributions"][0].tag, reason="outage",
            now=self.now), flush)

    # --- key-value ------------------------------------------------------------------------------

    def _kv(self, op, flush):
        def go(c):
            j, k, rid = op["job"], op.get("key"), op["rid"]
            if op["op"] == "set":
                return c.kv_set(j, op["entries"], rid)
            if op["op"] == "add":
                return c.kv_add(j, k, op["delta"], rid)
            if op["op"] == "delete":
                return c.kv_delete(j, k, rid)
            if op["op"] == "append":
                return c.kv_append(j, k, op["value"], rid)
            if op["op"] == "cas":
                return c.kv_compare_set(j, k, op["expected"], op["desired"], rid)
            raise AssertionError(op)

        res = self.both(go, flush=False)
        op["answer"] = res
        if op["rid"] and res[0] == "ok":
            self.kv_inflight.append(op)
        if flush:
            self._flush()
        return res

    @rule(data=st.data(), flush=st.sampled_from([True, True, True, False]))
    def kv_change(self, data, flush):
        kind = data.draw(st.sampled_from(["set", "add", "add", "delete", "append", "cas"]))
        job = data.draw(st.sampled_from(KVJOBS))
        key = data.draw(st.sampled_from(["a", "b", "n"]))
        self.rid += 1
        rid = data.draw(st.sampled_from([f"r{self.rid}"] * 5 + [""]))
        op = dict(op=kind, job=job, key=key, rid=rid)
        if kind == "set":
            op["entries"] = [(key, data.draw(st.sampled_from([b"1", b"v", b""])))] + (
                [("b", b"w")] if data.draw(st.booleans()) else [])
        elif kind == "add":
            op["delta"] = data.draw(st.integers(-2, 5))
        elif kind == "append":
            op["value"] = data.draw(st.sampled_from([b"x", b"yz"]))
        elif kind == "cas":
            cur = self.core.kv_get(job, [key])[0]
            op["expected"] = data.draw(st.sampled_from([b"", b"1", cur or b"?"]))
            op["desired"] = data.draw(st.sampled_from([b"1", b"2"]))
        self._kv(op, flush)

    @rule(data=st.data())
    def kv_resend_acked(self, data):
        """README: set/add/compare_set/append/delete carry request ids, 'so nothing is applied
        twice'; a retried delete still says whether the key existed."""
        if not self.kv_acked:
            return
        key = data.draw(st.sampled_from(sorted(self.kv_acked)))
        op, answer = self.kv_acked[key]
        before = {n: dict(j.kv) for n, j in self.core.jobs.items()}
        res = self._kv(dict(op), True)
        assert res == answer, f"resent {op['op']} {key} answered {res}, first answer was {answer}"
        after = {n: dict(j.kv) for n, j in self.core.jobs.items()}
        assert before == after, f"resent {op['op']} {key} was applied again: {before} -> {after}"

    @rule()
    def flush(self):
        self._flush()

    # --- the crash ----------------------------------------------------------------------------

    @rule(data=st.data())
    def kill_and_restart(self, data):
        """Kills the coordinator (its journal perhaps cut, or its state file gone) and starts it
        again from the files; its members resend the calls it had not answered."""
        self._kill()
        journal = _state.journal_path(self.path)
        mode = data.draw(st.sampled_from(["clean", "clean", "truncate", "nostate"]), label="mode")
        acked = self.acked[-1]
        if mode == "truncate" and journal.exists() and journal.stat().st_size > 0:
            cut = data.draw(st.integers(0, journal.stat().st_size), label="cut")
            with open(journal, "r+b") as f:
                f.truncate(cut)
            # What the files now hold: the last write whose journal fits in the cut.
            acked = max((a for a in self.acked if a[0] <= cut), key=lambda a: a[0])
        if mode == "nostate":
            self.path.unlink()
            journal_existed = journal.exists()
        self.now += data.draw(st.sampled_from([0.0, 2.0, 30.0]), label="downtime")
        if mode == "nostate":
            self.twin = None
            self.calls, self.kv_inflight, self.kv_acked = [], [], {}
            loaded = self._start(None)
            assert loaded is None, "a journal without its state file must not be replayed"
            assert not journal.exists() or journal.stat().st_size == 0
            if journal_existed:
                assert pathlib.Path(f"{journal}.orphaned").exists()
            return
        # What the clients were told as of the write the restart finds on disk.
        answers, kv_acked = acked[2]
        for c in self.calls:
            c["answer"] = answers.get(c["id"])
            if c["answer"] is None:
                c["rnd"] = None
        self.kv_acked = dict(kv_acked)
        inflight = [c for c in self.calls if c["answer"] is None]
        self.calls = [c for c in self.calls if c["answer"] is not None]
        kv_inflight, self.kv_inflight = self.kv_inflight, []  # (not answered: resent below)
        loaded = self._start(None)
        assert loaded is self.core
        # The restored core is the acknowledged one with only the documented resets.
        twin = documented_reset(acked[1], self.now, self.core)
        self._compare_states(norm(twin), norm(self.core), "restored state differs from the last acknowledged state")
        self.twin = twin
        # Members resend their unanswered calls (in order, with what is left of their timeout).
        for c in inflight:
            if c["deadline"] is not None and c["deadline"] <= self.now:
                self._give_up(c, flush=False)
                continue
            holder = {}

            def go(core, c=c):
                r = core.arrive(self.now, job="j", incarnation=c["inc"], replicas=c["replicas"], round_number=c["number"],
                                contributions=c["contributions"], deadline=c["deadline"], generation=c["generation"])
                if core is self.core:
                    holder["rnd"] = r
                return r

            res = self.both(go, flush=False)
            if res[0] == "round":
                self.calls.append(dict(c, rnd=holder["rnd"], answer=None))
        for op in kv_inflight:
            self._kv(dict(op), flush=False)
        self._flush()

    def _compare_states(self, want, got, what):
        if want == got:
            return
        diffs = [(k, want.get(k), got.get(k)) for k in set(want) | set(got) if k != "jobs" and want.get(k) != got.get(k)]
        for name in set(want["jobs"]) | set(got["jobs"]):
            a, b = want["jobs"].get(name), got["jobs"].get(name)
            if a is None or b is None:
                diffs.append((name, a, b))
            else:
                diffs += [(name, f, a[f], b[f]) for f in a if a[f] != b[f]]
        raise AssertionError(what + ":\n" + "\n".join(map(repr, diffs)))

    @invariant()
    def twin_matches(self):
        if self.twin is not None:
            self._compare_states(norm(self.twin), norm(self.core), "the restored core and its twin diverged")

    @invariant()
    def rounds_ahead_kept(self):
        """A group keeps a round that finished ahead of its next unfinished one (given up, or
        failed, out of order): its members are still to come to it."""
        job = self.core.jobs.get("j")
        if job is None:
            return
        for c in self.calls:
            if c["answer"] is not None and c["rnd"] is not None:
                group = job.groups.get(c["rnd"].key[:2])
                if group is not None and c["number"] >= group.next_round:
                    assert c["number"] in group.finished, (c["rnd"].key, group.next_round, list(group.finished))

    def teardown(self):
        if self.writer is not None:
            self._kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def test_state_file_restores_the_acknowledged_core(tmp_path, monkeypatch):
    """Killed anywhere, a coordinator restored from its state file is the one its clients
    were last answered by, up to the documented resets, and goes on as if never killed."""
    monkeypatch.setattr(_core, "secrets", _Ids())
    monkeypatch.setitem(copyreg.dispatch_table, CoreError, _reduce_core_error)
    monkeypatch.setattr(StateModel, "base", tmp_path, raising=False)
    monkeypatch.setattr(StateModel, "ids", _core.secrets, raising=False)
    run_state_machine_as_test(StateModel, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
        suppress_health_check=list(HealthCheck),
    ))
