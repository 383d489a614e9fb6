"""Model-based test of the coordinator's pure core against a small reference model.

A hypothesis state machine drives a real :class:`Core` through random interleavings of
registrations (restarts, a pod starting afresh, a wrong world size), rendezvous arrivals on
all ordinals, explicit and subset groups (batched threads, tags, payloads, timeouts), resends
(of this generation and the one before), callers outside their replicas, bad replica lists,
given-up rounds, time, heartbeats, liveness checks, expiry, disconnects, leaves,
``end_replicas``, calls of stale incarnations, and key-value changes with their retries.

The model, written from the README (Semantics and Reliability), predicts after every call:
which rounds finish (each exactly once, with the wakeups the core reports), their results or
error codes and the gist of their messages (timeouts name the missing ordinals, deaths the
dead process, a late member is told the round's own error), the pending rounds with their
arrivals, deadlines and blocked ordinals, that no pending round is left on a wait cycle (the
core fails one), the rank table, dead ordinals and generation, and the key-value data. It
also checks that a job's memory stays bounded (finished rounds per group, failures in a row
up to ``_FAILED_ROUNDS_KEPT``, groups, events, replaced incarnations, outsider calls, request
ids). ``PJRT_RENDEZVOUS_FUZZ_EXAMPLES`` scales the example count.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from pjrt_rendezvous.coordinator import _core
from pjrt_rendezvous.coordinator._core import (
    ALL,
    DISCONNECTED_GRACE,
    Code,
    Contribution,
    Core,
    CoreError,
    Registration,
    ThreadRequest,
    format_ranges,
)

SCALE = float(os.environ.get("PJRT_RENDEZVOUS_FUZZ_EXAMPLES", "1"))
EXAMPLES = max(1, int(300 * SCALE))
STEPS = 60

JOB = "job"
HEARTBEAT_TIMEOUT = 10.0
GRACE = min(DISCONNECTED_GRACE, HEARTBEAT_TIMEOUT)


def ordinals_words(ordinals) -> str:
    """How an error message names ordinals: ``ordinal 3``, ``ordinals 0-2``."""
    ordinals = sorted(ordinals)
    return f"ordinal{'s' if len(ordinals) != 1 else ''} {format_ranges(ordinals)}"


@dataclasses.dataclass
class ModelProcess:
    incarnation: str
    task: int
    alive: bool = True
    last_seen: float = 0.0
    disconnected: float | None = None
    threads: set = dataclasses.field(default_factory=set)  # ordinals bound
    ended: set = dataclasses.field(default_factory=set)  # ordinals ended by end_replicas

    @property
    def label(self) -> str:
        return f"host-{self.task} pid {1000 + self.task}"


@dataclasses.dataclass
class ModelRound:
    key: tuple  # (generation, group, number)
    members: tuple
    arrivals: dict = dataclasses.field(default_factory=dict)
    tag: str | None = None
    deadline: float | None = None
    state: str = "pending"  # pending | done | failed
    result: list | None = None
    code: Code | None = None
    why: str = ""  # what failed it: timeout, death, mismatch, replaced, afresh, outsider, ...
    missing_at_fail: list | None = None
    dead_at_fail: list | None = None


class CoreModel(RuleBasedStateMachine):
    @initialize(tasks=st.integers(2, 3), devices=st.integers(1, 2))
    def init(self, tasks, devices):
        self.T, self.D = tasks, devices
        self.W = tasks * devices
        self.core = Core(heartbeat_timeout=HEARTBEAT_TIMEOUT)
        self.core.finished = []  # (as the servicer does: take_finished reports finished rounds)
        self.now = 0.0
        self.gen = 1
        self.procs: dict[int, ModelProcess] = {}
        self.stale: list[str] = []  # incarnations replaced or dropped
        self.incarnations = 0
        self.rounds: dict[tuple, ModelRound] = {}
        self.counters = collections.defaultdict(dict)  # ordinal -> group -> its next round
        self.waiting: dict[int, tuple] = {}  # ordinal -> key of the round it waits in
        self.seen_finished: set = set()
        self.expect_finished: set = set()  # keys the model finished in this step
        self.cycle_ok: set = set()  # keys the core may fail as a wait cycle in this step
        self.outsider_calls: set = set()
        self.history: dict[int, list] = collections.defaultdict(list)  # ordinal -> [(key, contributions, replicas, inc)]
        self.kv: dict[str, bytes] = {}
        self.kv_requests: list = []  # (method, args, answer) of changes with a request id
        self.rid = 0

    # --- model helpers ---------------------------------------------------------------------------

    def task_of(self, ordinal):
        return ordinal // self.D

    def dead_set(self):
        """A dead process's ordinals (its task's, and any it bound), and ended replicas."""
        dead = set()
        for t, p in self.procs.items():
            if not p.alive:
                dead |= set(range(t * self.D, (t + 1) * self.D)) | p.threads
            else:
                dead |= p.ended
        return dead

    def finish(self, r: ModelRound, state, code=None, why=""):
        assert r.state == "pending", r
        r.state, r.code, r.why = state, code, why
        if state == "done":
            r.result = [r.arrivals[o] for o in r.members]
        else:
            r.missing_at_fail = [o for o in r.members if o not in r.arrivals]
            r.dead_at_fail = sorted(set(r.members) & self.dead_set())
        for o in [o for o, key in self.waiting.items() if key == r.key]:
            del self.waiting[o]
        self.expect_finished.add(r.key)

    def pending(self):
        return {k: r for k, r in self.rounds.items() if r.state == "pending"}

    def fail_rounds_of_the_dead(self):
        """Every pending round that needs a dead ordinal fails at once (README Reliability)."""
        dead = self.dead_set()
        for r in list(self.pending().values()):
            if set(r.members) & dead:
                self.finish(r, "failed", Code.ABORTED, "death")

    def new_generation(self, why):
        """A restart moves the job on: its pending rounds fail, round numbers start again."""
        for r in list(self.pending().values()):
            self.finish(r, "failed", Code.ABORTED, why)
        self.gen += 1
        self.counters = collections.defaultdict(dict)
        self.waiting.clear()

    def waits_for(self, r: ModelRound):
        """The other pending rounds that members of r, not yet arrived in it, wait in."""
        pending = self.pending()
        return {
            self.waiting[o] for o in r.members
            if o not in r.arrivals and self.waiting.get(o) in pending and self.waiting[o] != r.key
        }

    def reach(self, start):
        seen, stack = set(), [start]
        while stack:
            for q in self.waits_for(self.rounds[stack.pop()]):
                if q not in seen:
                    seen.add(q)
                    stack.append(q)
        return seen

    def on_cycle_through(self, start):
        """The pending rounds on some wait cycle through start (start included), if any."""
        forward = self.reach(start)
        if start not in forward:
            return set()
        return {k for k in forward if start in self.reach(k)} | {start}

    def live_procs(self):
        return [p for p in self.procs.values() if p.alive]

    def later_finished(self, key):
        """How many rounds after key's in its group have finished."""
        return sum(1 for k, q in self.rounds.items() if k[:2] == key[:2] and k[2] > key[2] and q.state != "pending")

    # --- after every call --------------------------------------------------------------------------

    def sync(self):
        """The rounds the core finished in this step are the model's, each once and woken; the
        pending rounds, their arrivals and deadlines and the blocked ordinals are the model's."""
        wake_keys = [tuple(w[2:]) for w in self.core.take_wakeups() if w[0] == "round"]
        finished = self.core.take_finished()
        fin_keys = [r.key for _, r in finished]
        assert len(set(fin_keys)) == len(fin_keys), f"a round finished twice in one step: {fin_keys}"
        assert sorted(map(repr, wake_keys)) == sorted(map(repr, fin_keys)), (wake_keys, fin_keys)
        again = set(fin_keys) & self.seen_finished
        assert not again, f"rounds finished a second time: {again}"
        self.seen_finished |= set(fin_keys)
        # Members waiting on each other in different groups: the core fails a round on the cycle.
        for _, rnd in finished:
            r = self.rounds.get(rnd.key)
            assert r is not None, f"the core finished a round the model never started: {rnd}"
            if rnd.key not in self.expect_finished:
                assert r.state == "pending", (rnd.key, r)
                assert rnd.error is not None and "wait on each other" in rnd.error.message, (
                    f"the core finished {rnd.key} unexpectedly: {rnd.error or rnd.result}; model {r}")
                assert rnd.key in self.cycle_ok, f"{rnd.key} failed as a wait cycle but is on none: {rnd.error}"
                self.finish(r, "failed", Code.FAILED_PRECONDITION, "cycle")
        missing = self.expect_finished - set(fin_keys)
        assert not missing, f"the model finished {missing} but the core did not: {[self.rounds[k] for k in missing]}"
        for _, rnd in finished:
            self.check_outcome(self.rounds[rnd.key], rnd)
        self.expect_finished = set()
        self.cycle_ok = set()
        job = self.core.jobs.get(JOB)
        if job is None:
            assert not self.pending()
            return
        assert job.generation == self.gen, (job.generation, self.gen)
        pending = self.pending()
        assert set(job.pending) == set(pending), set(job.pending) ^ set(pending)
        for k, rnd in job.pending.items():
            assert set(rnd.arrivals) == set(pending[k].arrivals), (k, rnd.arrivals, pending[k].arrivals)
            assert rnd.deadline == pending[k].deadline, (k, rnd.deadline, pending[k].deadline)
        assert dict(job.blocked) == self.waiting, (job.blocked, self.waiting)
        for k in pending:
            assert k not in self.reach(k), f"pending round {k} is on a wait cycle: it would hang"

    def check_outcome(self, r: ModelRound, rnd):
        if r.state == "done":
            assert rnd.error is None, (r, rnd.error)
            assert rnd.result == r.result, (r.key, rnd.result, r.result)
            return
        assert rnd.result is None and rnd.error is not None, (r, rnd.result)
        assert rnd.error.code is r.code, (r.key, r.why, rnd.error)
        message = rnd.error.message
        if r.why == "timeout":
            # README: every timeout names all missing ordinals.
            missing = r.missing_at_fail
            assert f"with {len(r.members) - len(missing)} of {len(r.members)} arrived" in message, (message, r)
            assert f"missing {ordinals_words(missing)}" in message, (message, missing)
        elif r.why == "death":
            # README: fails for all other members naming the dead ordinals, host and pid.
            assert "cannot complete: a member" in message, message
            named = [p for p in self.procs.values() if p.label in message]
            assert named, message
            for p in named:
                assert not p.alive or p.ended & set(r.members), f"{p.label} named but alive: {message}"
            ranges = [(int(a), int(b or a)) for a, b in re.findall(r"(\d+)(?:-(\d+))?", message)]
            for o in r.dead_at_fail:
                assert any(lo <= o <= hi for lo, hi in ranges), (o, message)
        elif r.why == "mismatch":
            assert f"tag mismatch in round {r.key[2]}" in message, message
        elif r.why == "replaced":
            assert "moved to generation" in message, message
        elif r.why == "afresh":
            assert "starts afresh" in message, message
        elif r.why == "outsider":
            assert "not among them" in message, message

    # --- registration -----------------------------------------------------------------------------

    def registration(self, task, incarnation, threads, num_tasks=None):
        return Registration(
            job=JOB, incarnation=incarnation, host=f"host-{task}", pid=1000 + task, task_id=task,
            num_tasks=num_tasks or self.T, devices_per_task=self.D, local_rank=0,
            threads=tuple(ThreadRequest(thread_index=i) for i in sorted(threads)),
        )

    @rule()
    def register_all(self):
        """Every task not registered yet registers all its threads: keeps worlds forming."""
        for task in range(self.T):
            if task not in self.procs:
                self._register(task, set(range(self.D)), restart=True)
        self.sync()

    @rule(data=st.data())
    def register(self, data):
        task = data.draw(st.integers(0, self.T - 1), "task")
        threads = data.draw(st.sets(st.integers(0, self.D - 1), min_size=1), "threads")
        p = self.procs.get(task)
        restart = p is None or not p.alive or data.draw(st.sampled_from([False, False, False, True]), "restart")
        self._register(task, threads, restart)
        self.sync()

    def _register(self, task, threads, restart):
        p = self.procs.get(task)
        ordinals = {task * self.D + i for i in threads}
        if not restart:
            # The same incarnation binds (more) threads, binding ended ones again.
            res = self.core.register(self.now, self.registration(task, p.incarnation, threads))
            p.last_seen, p.disconnected = self.now, None
            p.threads |= ordinals
            p.ended -= ordinals
        else:
            self.incarnations += 1
            incarnation = f"inc-{task}-{self.incarnations}".ljust(32, "x")
            # With no process left live and connected, the pod starts afresh; else a task
            # registered again is a restart: the job moves to a new generation.
            afresh = bool(self.procs) and not any(q.alive and q.disconnected is None for q in self.procs.values())
            res = self.core.register(self.now, self.registration(task, incarnation, threads))
            if afresh:
                self.stale += [q.incarnation for q in self.procs.values()]
                self.new_generation("afresh")
                self.procs = {}
            elif p is not None:
                self.stale.append(p.incarnation)
                self.new_generation("replaced")
            self.procs[task] = ModelProcess(incarnation=incarnation, task=task, last_seen=self.now, threads=ordinals)
        assert res.world_size == self.W
        assert res.generation == self.gen
        assert sorted((a.thread_index, a.ordinal, a.local_ordinal) for a in res.assignments) == sorted(
            (i, task * self.D + i, i) for i in threads)

    def register_wrong_world(self, data):
        live = [p for p in self.procs.values() if p.alive and p.disconnected is None]
        if not live:
            return
        p = data.draw(st.sampled_from(live), "proc")
        with pytest.raises(CoreError) as e:
            self.core.register(self.now, self.registration(p.task, p.incarnation, {0}, num_tasks=self.T + 1))
        assert e.value.code is Code.FAILED_PRECONDITION, e.value
        assert f"world size {self.W}" in e.value.message
        self.sync()

    # --- rendezvous --------------------------------------------------------------------------------

    def idle_threads(self, p: ModelProcess):
        return sorted(o for o in p.threads if o not in self.waiting and o not in p.ended)

    def idle_caller(self, data):
        """A live process with a thread not waiting in a round, and that thread (or None)."""
        procs = [p for p in self.live_procs() if self.idle_threads(p)]
        if not procs:
            return None
        p = data.draw(st.sampled_from(procs), "proc")
        return p, data.draw(st.sampled_from(self.idle_threads(p)), "ordinal")

    @rule(data=st.data())
    def arrive(self, data):
        """A thread (with others of its process, batched) calls its next round on a group."""
        caller = self.idle_caller(data)
        if caller is None:
            return
        p, o = caller
        kind = data.draw(st.sampled_from(["all", "explicit-all", "subset", "subset", "subset"]), "kind")
        if kind == "subset":
            members = sorted(data.draw(st.sets(st.integers(0, self.W - 1), max_size=2), "members") | {o})
        else:
            members = list(range(self.W))
        group = ALL if len(members) == self.W else tuple(members)
        replicas = [] if kind == "all" else data.draw(st.permutations(members), "perm")
        n = self.counters[o].get(group, 0)
        batch = [o] + [q for q in self.idle_threads(p) if q != o and q in members
                       and self.counters[q].get(group, 0) == n and data.draw(st.booleans(), f"b{q}")]
        tag = data.draw(st.sampled_from(["t", "t", "t", "t", "u"]), "tag")
        timeout = data.draw(st.sampled_from([None, 1.0, 2.0, 2.0, 5.0, 20.0]), "timeout")
        salt = data.draw(st.integers(0, 3), "salt")
        key = (self.gen, group, n)
        deadline = None if timeout is None else self.now + timeout
        odd = data.draw(st.sampled_from([None] * 9 + batch[1:]), "odd") if len(batch) > 1 else None
        contributions = [Contribution(q, "v" if q == odd else tag, f"{q}|{key}|{salt}".encode()) for q in batch]
        # The model.
        r = self.rounds.get(key)
        if r is None:
            r = self.rounds[key] = ModelRound(key=key, members=tuple(members))
        caller_error = None
        if r.state != "pending":
            # A round cannot complete without these members: it failed before they came.
            assert r.state == "failed", ("a round completed without these members", r, batch)
            caller_error = r.code
        elif r.deadline is not None and r.deadline <= self.now:
            self.finish(r, "failed", Code.DEADLINE_EXCEEDED, "timeout")
            caller_error = Code.DEADLINE_EXCEEDED
        else:
            if not r.arrivals:
                r.tag = tag
            r.arrivals.update({c.ordinal: c.payload for c in contributions})
            if set(members) & self.dead_set():
                self.finish(r, "failed", Code.ABORTED, "death")
                caller_error = Code.ABORTED
            else:
                for q in batch:
                    self.waiting[q] = key
                if deadline is not None and (r.deadline is None or deadline < r.deadline):
                    r.deadline = deadline  # (the earliest deadline of its calls)
                if any(c.tag != r.tag for c in contributions):
                    self.finish(r, "failed", Code.FAILED_PRECONDITION, "mismatch")
                    caller_error = Code.FAILED_PRECONDITION
                elif len(r.arrivals) == len(r.members):
                    self.finish(r, "done")
                else:
                    self.cycle_ok = self.on_cycle_through(key)
        if p.disconnected is None:
            p.last_seen = self.now
        for q in batch:
            self.counters[q][group] = n + 1
            self.history[q].append((key, contributions, replicas, p.incarnation))
        # The core.
        try:
            rnd = self.core.arrive(self.now, job=JOB, incarnation=p.incarnation, replicas=replicas, round_number=n,
                                   contributions=contributions, deadline=deadline, generation=self.gen)
        except CoreError as exc:
            assert caller_error is not None, f"arrive raised {exc!r}; the model expected success, round {r}"
            if r.key not in self.expect_finished and self.later_finished(key) >= _core._FAILED_ROUNDS_KEPT:
                # README: of more than 16 failures in a row, the older are FAILED_PRECONDITION.
                assert exc.code is Code.FAILED_PRECONDITION and "finished long ago" in exc.message, exc
            else:
                # README: a call that comes to a round after it failed gets the round's error,
                # said to be that round's (a member late for several rounds: each one's in turn).
                assert exc.code is caller_error, (exc, caller_error)
                assert r.key in self.expect_finished or "failed before it came" in exc.message, exc
        else:
            assert rnd.key == key
            if key in self.cycle_ok:
                pass  # the core may have failed it as a wait cycle: checked in sync
            elif caller_error is not None:
                assert rnd.error is not None and rnd.error.code is caller_error, (rnd, caller_error)
            elif r.state == "done":
                assert rnd.result == r.result
            else:
                assert not rnd.finished, (rnd.error, r)
        if self.cycle_ok:
            assert key not in self.core.jobs[JOB].pending, f"an arrival closed a wait cycle through {key}; it stays pending"
        self.sync()

    @rule(data=st.data())
    def arrive2(self, data):
        self.arrive(data)

    @rule(data=st.data())
    def arrive3(self, data):
        self.arrive(data)

    @rule(data=st.data())
    def resend(self, data):
        """A thread resends its latest call: the same round, the same outcome."""
        call = self.latest_call(data, self.gen)
        if call is None:
            return
        p, o, key, replicas, mine = call
        r = self.rounds[key]
        if r.state == "pending" and r.deadline is not None and r.deadline <= self.now:
            self.finish(r, "failed", Code.DEADLINE_EXCEEDED, "timeout")
        try:
            rnd = self.core.arrive(self.now, job=JOB, incarnation=p.incarnation, replicas=replicas, round_number=key[2],
                                   contributions=mine, deadline=None, generation=self.gen)
        except CoreError as exc:
            # Allowed: the round failed without o (it had not come), or its result is gone: a
            # group keeps its last finished rounds, and failures in a row up to 16 (README).
            kept = _core._FINISHED_ROUNDS_KEPT if r.state == "done" else _core._FAILED_ROUNDS_KEPT
            assert (r.state == "failed" and o not in r.arrivals and exc.code is r.code) or (
                self.later_finished(key) >= kept and "finished long ago" in exc.message), (exc, r)
        else:
            assert rnd.key == key
            if r.state == "pending":
                assert not rnd.finished
            else:
                self.check_resent(rnd, r)
        self.sync()

    def latest_call(self, data, generation):
        """A live thread whose latest call was of ``generation``, drawn: (its process, its
        ordinal, the call's round key and replicas, its contributions), or None."""
        candidates = [o for p in self.live_procs() for o in p.threads if self.history[o]
                      and self.history[o][-1][0][0] == generation and self.history[o][-1][3] == p.incarnation]
        if not candidates:
            return None
        o = data.draw(st.sampled_from(sorted(candidates)), "ordinal")
        p = self.procs[self.task_of(o)]
        key, contributions, replicas, _ = self.history[o][-1]
        if p.disconnected is None:
            p.last_seen = self.now
        return p, o, key, replicas, [c for c in contributions if c.ordinal == o]

    @staticmethod
    def check_resent(rnd, r: ModelRound) -> None:
        """A resent call of a finished round gets its result, or its error."""
        if r.state == "done":
            assert rnd.result == r.result, (rnd.result, r.result)
        else:
            assert rnd.error is not None and rnd.error.code is r.code, (rnd.error, r)

    @rule(data=st.data())
    def resend_old_generation(self, data):
        """A live thread resends its latest call of the generation before: README, a resent call
        of a round that finished before the move gets that round's result (or it is void)."""
        call = self.latest_call(data, self.gen - 1)
        if call is None:
            return
        p, _, key, replicas, mine = call
        try:
            rnd = self.core.arrive(self.now, job=JOB, incarnation=p.incarnation, replicas=replicas, round_number=key[2],
                                   contributions=mine, deadline=None, generation=key[0])
        except CoreError as exc:
            assert exc.code is Code.ABORTED and "void" in exc.message, exc
        else:
            assert rnd.key == key and rnd.finished, rnd
            self.check_resent(rnd, self.rounds[key])
        self.sync()

    @rule(data=st.data())
    def outsider_call(self, data):
        """README: a caller outside replicas is refused, and fails the round its members wait in."""
        caller = self.idle_caller(data)
        if caller is None:
            return
        p, o = caller
        members = sorted(data.draw(st.sets(st.sampled_from([q for q in range(self.W) if q != o]), min_size=1), "members"))
        group = ALL if len(members) == self.W else tuple(members)
        n = data.draw(st.integers(0, 2), "n")
        call = (self.gen, group, o, n)
        if call not in self.outsider_calls:  # (a repeated outsider call fails nothing more)
            self.outsider_calls.add(call)
            pending = [r for k, r in self.pending().items() if k[:2] == (self.gen, group)]
            if pending:
                self.finish(min(pending, key=lambda r: r.key[2]), "failed", Code.INVALID_ARGUMENT, "outsider")
        if p.disconnected is None:
            p.last_seen = self.now
        with pytest.raises(CoreError) as e:
            self.core.arrive(self.now, job=JOB, incarnation=p.incarnation, replicas=members, round_number=n,
                             contributions=[Contribution(o, "t", b"x")], deadline=None, generation=self.gen)
        assert e.value.code is Code.INVALID_ARGUMENT and "not among them" in e.value.message, e.value
        self.sync()

    def bad_replicas(self, data):
        """README: a replica list repeating an ordinal or naming one out of range fails the round
        the call counts as (on the group of its ordinals in range) for every member."""
        caller = self.idle_caller(data)
        if caller is None:
            return
        p, o = caller
        members = sorted(data.draw(st.sets(st.integers(0, self.W - 1), max_size=2), "members") | {o})
        group = ALL if len(members) == self.W else tuple(members)
        bad = data.draw(st.sampled_from(["dup", "range"]), "bad")
        replicas = members + ([o] if bad == "dup" else [self.W + 3])
        n = self.counters[o].get(group, 0)
        key = (self.gen, group, n)
        r = self.rounds.get(key)
        if r is None:
            r = self.rounds[key] = ModelRound(key=key, members=tuple(members), tag="t")
        if r.state == "pending":
            if r.deadline is not None and r.deadline <= self.now:
                self.finish(r, "failed", Code.DEADLINE_EXCEEDED, "timeout")
            else:
                self.finish(r, "failed", Code.INVALID_ARGUMENT, "bad replicas")
        self.counters[o][group] = n + 1
        if p.disconnected is None:
            p.last_seen = self.now
        with pytest.raises(CoreError) as e:
            self.core.arrive(self.now, job=JOB, incarnation=p.incarnation, replicas=replicas, round_number=n,
                             contributions=[Contribution(o, "t", b"x")], deadline=None, generation=self.gen)
        assert e.value.code is Code.INVALID_ARGUMENT, e.value
        self.sync()

    def give_up(self, data):
        """A process gives up a round one of its threads waits in: it fails for every member."""
        waiting = sorted(o for o in self.waiting if self.procs[self.task_of(o)].alive)
        if not waiting:
            return
        o = data.draw(st.sampled_from(waiting), "ordinal")
        p = self.procs[self.task_of(o)]
        key = self.waiting[o]
        r = self.rounds[key]
        replicas = self.history[o][-1][2]
        if r.deadline is not None and r.deadline <= self.now:
            self.finish(r, "failed", Code.DEADLINE_EXCEEDED, "timeout")
            expect = None  # (it had timed out already: nothing is given up)
        else:
            self.finish(r, "failed", Code.ABORTED, "gave up")
            expect = key
        p.last_seen, p.disconnected = self.now, None
        got = self.core.give_up_round(JOB, p.incarnation, generation=self.gen, replicas=replicas, round_number=key[2],
                                      ordinals=[o], tag=r.tag, reason="outage", now=self.now)
        assert (None if got is None else got.key) == expect, (got, expect)
        self.sync()

    def stale_call(self, data):
        """A dead, left, replaced or dropped process is refused and changes nothing."""
        incarnations = [p.incarnation for p in self.procs.values() if not p.alive] + self.stale
        if not incarnations:
            return
        incarnation = data.draw(st.sampled_from(incarnations), "inc")
        with pytest.raises(CoreError) as e:
            if data.draw(st.booleans(), "arrive"):
                task = int(incarnation.split("-")[1])
                self.core.arrive(self.now, job=JOB, incarnation=incarnation, replicas=[], round_number=0,
                                 contributions=[Contribution(task * self.D, "t", b"x")], deadline=None)
            else:
                self.core.touch(JOB, incarnation, self.now)
        assert e.value.code in (Code.ABORTED, Code.FAILED_PRECONDITION), e.value
        self.sync()

    # --- time and liveness ------------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.5, 0.5, 1.0, 1.0, 1.5, 3.0, 6.0, 11.0]))
    def advance(self, dt):
        self.now += dt
        self.sync()

    @rule(data=st.data())
    def heartbeat(self, data):
        live = self.live_procs()
        if not live:
            return
        p = data.draw(st.sampled_from(live), "proc")
        assert self.core.touch(JOB, p.incarnation, self.now) == self.gen
        p.last_seen, p.disconnected = self.now, None
        self.sync()

    @rule()
    def check_liveness(self):
        """README: silent for the heartbeat timeout, or its connection closed and not heard
        from within the grace, a process is dead. (In the order the core checks them.)"""
        job = self.core.jobs.get(JOB)
        order = list(job.processes) if job is not None else []
        for p in sorted(self.procs.values(), key=lambda p: order.index(p.incarnation)):
            if not p.alive:
                continue
            silent = self.now - p.last_seen
            closed = None if p.disconnected is None else self.now - p.disconnected
            if silent > HEARTBEAT_TIMEOUT or (closed is not None and closed > GRACE):
                p.alive = False
                self.fail_rounds_of_the_dead()
        self.core.check_liveness(self.now)
        self.sync()
        for t, p in self.procs.items():
            assert self.core.jobs[JOB].processes[p.incarnation].alive == p.alive, (t, p)

    @rule()
    def expire(self):
        for r in list(self.pending().values()):
            if r.deadline is not None and r.deadline <= self.now:
                self.finish(r, "failed", Code.DEADLINE_EXCEEDED, "timeout")
        self.core.expire(self.now)
        self.sync()

    def disconnect(self, data):
        live = self.live_procs()
        if not live:
            return
        p = data.draw(st.sampled_from(live), "proc")
        if p.disconnected is None:
            p.disconnected = self.now
        self.core.disconnect(JOB, p.incarnation, self.now)
        self.sync()

    def leave(self, data):
        live = self.live_procs()
        if not live:
            return
        p = data.draw(st.sampled_from(live), "proc")
        p.alive = False
        self.fail_rounds_of_the_dead()
        self.core.leave(JOB, p.incarnation, "done")
        self.sync()

    def end_replicas(self, data):
        """README: every round that needs an ended ordinal, waiting or later, fails at once."""
        live = [p for p in self.live_procs() if p.threads]
        if not live:
            return
        p = data.draw(st.sampled_from(live), "proc")
        ordinals = data.draw(st.sets(st.sampled_from(sorted(p.threads)), min_size=1), "ords")
        p.ended |= ordinals
        p.last_seen, p.disconnected = self.now, None
        self.fail_rounds_of_the_dead()
        self.core.end_replicas(JOB, p.incarnation, sorted(ordinals), "raised", self.now)
        self.sync()

    @rule(data=st.data())
    def trouble(self, data):
        """One of the rarer calls (one rule, so that they do not crowd out arrivals)."""
        what = data.draw(st.sampled_from([
            self.disconnect, self.leave, self.end_replicas, self.register_wrong_world, self.stale_call,
            self.bad_replicas, self.give_up, self.give_up,
        ]), "trouble")
        what(data)

    # --- key-value ------------------------------------------------------------------------------

    @rule(data=st.data())
    def kv(self, data):
        """Key-value changes carry request ids: a retry is answered as the first call was."""
        op = data.draw(st.sampled_from(["set", "get", "add", "delete", "append", "cas", "resend"]), "op")
        key = data.draw(st.sampled_from(["a", "b", "c"]), "key")
        value = data.draw(st.sampled_from([b"", b"1", b"x", b"7"]), "val")
        self.rid += 1
        rid = f"r{self.rid}"
        if op == "resend":
            if not self.kv_requests:
                return
            method, args, answer = data.draw(st.sampled_from(self.kv_requests), "req")
            assert getattr(self.core, method)(*args) == answer, (method, args, answer)
        elif op == "set":
            self.core.kv_set(JOB, [(key, value)], rid)
            self.kv[key] = value
            self.kv_requests.append(("kv_set", (JOB, [(key, value)], rid), None))
        elif op == "get":
            assert self.core.kv_get(JOB, [key]) == [self.kv.get(key)]
        elif op == "add":
            try:
                expect = int(self.kv.get(key, b"0")) + 3
            except ValueError:
                expect = None
            if expect is None:
                with pytest.raises(CoreError) as e:
                    self.core.kv_add(JOB, key, 3, rid)
                assert e.value.code is Code.INVALID_ARGUMENT
            else:
                assert self.core.kv_add(JOB, key, 3, rid) == expect
                self.kv[key] = str(expect).encode()
                self.kv_requests.append(("kv_add", (JOB, key, 3, rid), expect))
        elif op == "delete":
            existed = key in self.kv
            self.kv.pop(key, None)
            assert self.core.kv_delete(JOB, key, rid) == existed
            self.kv_requests.append(("kv_delete", (JOB, key, rid), existed))
        elif op == "append":
            self.core.kv_append(JOB, key, value, rid)
            self.kv[key] = self.kv.get(key, b"") + value
            self.kv_requests.append(("kv_append", (JOB, key, value, rid), None))
        elif op == "cas":
            current = self.kv.get(key)
            if (current or b"") == b"1":  # (a missing key compares as empty)
                self.kv[key] = expect = value
            else:
                expect = b"1" if current is None else current
            assert self.core.kv_compare_set(JOB, key, b"1", value, rid) == expect
            self.kv_requests.append(("kv_compare_set", (JOB, key, b"1", value, rid), expect))
        if JOB in self.core.jobs:
            assert dict(self.core.kv_list(JOB)) == self.kv
        else:
            assert not self.kv
        self.sync()

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def rank_table(self):
        """The members, their processes, completeness and the dead ordinals are the model's."""
        job = self.core.jobs.get(JOB)
        if job is None:
            return
        assert job.world_size in (None, self.W)
        want = {o: p.incarnation for p in self.procs.values() for o in p.threads}
        assert {o: m.incarnation for o, m in job.members.items()} == want
        for o, m in job.members.items():
            assert 0 <= o < self.W and m.ordinal == o
            assert o == job.processes[m.incarnation].task_id * self.D + m.thread_index
        assert job.complete == (len(want) == self.W)
        assert (self.core.world(JOB) is not None) == (len(want) == self.W)
        assert job.dead == self.dead_set(), (job.dead, self.dead_set())

    @invariant()
    def bounded(self):
        """A job's memory stays bounded (README Reliability: what a job keeps)."""
        job = self.core.jobs.get(JOB)
        if job is None:
            return
        for (generation, _), state in job.groups.items():
            assert generation >= job.generation - 1, (generation, job.generation)
            kept = len([n for n in state.finished if n < state.next_round])
            assert kept <= max(_core._FINISHED_ROUNDS_KEPT, _core._FAILED_ROUNDS_KEPT), state.finished
            if state.finished:
                last = max(state.finished)
                # A round completed with every member: none will ask for an earlier one again.
                if state.finished[last].result is not None and last == state.next_round - 1:
                    assert len(state.finished) == 1, state.finished
        busy = {k[:2] for k in job.pending}
        assert len(set(job.groups) - busy) <= _core._GROUPS_KEPT, len(job.groups)
        assert len(list(job.events)) <= _core._EVENTS_KEPT
        assert len(job.replaced) <= max(_core._REPLACED_KEPT, len(job.processes))
        assert len(job.outsider_calls) <= _core._OUTSIDER_CALLS_KEPT
        assert len(job.request_results) <= _core._REQUEST_IDS_KEPT
        assert set(job.blocked) <= {o for r in job.pending.values() for o in r.arrivals}


def test_core_against_its_model():
    """Random interleavings of every kind of call leave the core where the model says."""
    run_state_machine_as_test(CoreModel, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
        suppress_health_check=list(HealthCheck),
    ))
