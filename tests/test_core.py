"""Tests for the coordinator's pure core: rank table, rendezvous rounds, key-value data, status.

The core takes the time as an argument, so nothing here sleeps or opens a socket: a test
builds a :class:`Core`, registers a pod of ``tasks x devices`` ordinals through the helpers
below and drives arrivals by hand. The property tests at the end model every ordinal as a
blocking thread (it makes its next call only after its previous round finished) and let
hypothesis pick world shapes, replica groups, batching, retries and arrival order.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import re
from typing import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pjrt_rendezvous.coordinator._core import (
    ALL,
    DISCONNECTED_GRACE,
    Code,
    Contribution,
    Core,
    CoreError,
    Limits,
    Registration,
    ThreadRequest,
    format_ranges,
)

JOB = "job"


# --- helpers -------------------------------------------------------------------------------------


def incarnation_of(task: int) -> str:
    return f"inc-{task}"


def host_of(task: int) -> str:
    return f"host-{task // 4}"


def pid_of(task: int) -> int:
    return 1000 + task


def payload_of(ordinal: int) -> bytes:
    return f"p{ordinal}".encode()


def registration(
    task: int,
    tasks: int,
    devices: int,
    *,
    job: str = JOB,
    threads: Sequence[int] | None = None,
    runtime: dict[int, int] | None = None,
    runtime_world_size: int = 0,
    incarnation: str | None = None,
    host: str | None = None,
    pid: int | None = None,
    heartbeat_interval: float = 0.0,
    process_age: float = 0.0,
) -> Registration:
    """A registration of ``threads`` (default: all) of ``task`` in a ``tasks x devices`` job."""
    runtime = runtime or {}
    return Registration(
        job=job,
        incarnation=incarnation_of(task) if incarnation is None else incarnation,
        host=host_of(task) if host is None else host,
        pid=pid_of(task) if pid is None else pid,
        task_id=task,
        num_tasks=tasks,
        devices_per_task=devices,
        local_rank=task % 4,
        threads=tuple(
            ThreadRequest(thread_index=i, runtime_ordinal=runtime.get(i))
            for i in (range(devices) if threads is None else threads)
        ),
        runtime_world_size=runtime_world_size,
        heartbeat_interval=heartbeat_interval,
        process_age=process_age,
    )


@dataclasses.dataclass
class Pod:
    """A core plus the shape of one job in it, with shorthands for arrivals."""

    core: Core
    tasks: int
    devices: int
    job: str = JOB

    @property
    def world(self) -> int:
        return self.tasks * self.devices

    def register(self, task: int, *, now: float = 0.0, **kwargs):
        return self.core.register(now, registration(task, self.tasks, self.devices, job=self.job, **kwargs))

    def arrive(
        self,
        ordinals: int | Sequence[int],
        *,
        tag: str = "t",
        replicas: Sequence[int] = (),
        round_number: int = 0,
        now: float = 1.0,
        deadline: float | None = None,
        payloads: dict[int, bytes] | None = None,
        tags: dict[int, str] | None = None,
        incarnation: str | None = None,
    ):
        """One process's arrive() for ``ordinals`` (all of one task unless ``incarnation``);
        the round's key."""
        ordinals = [ordinals] if isinstance(ordinals, int) else list(ordinals)
        payloads = payloads or {}
        tags = tags or {}
        return self.core.arrive(
            now,
            job=self.job,
            incarnation=incarnation_of(ordinals[0] // self.devices) if incarnation is None else incarnation,
            replicas=list(replicas),
            round_number=round_number,
            contributions=[
                Contribution(ordinal=o, tag=tags.get(o, tag), payload=payloads.get(o, payload_of(o)))
                for o in ordinals
            ],
            deadline=deadline,
        ).key

    def deadline(self, key: tuple) -> float | None:
        """When the pending round ``key`` fails unless complete (None: none, or not pending)."""
        rnd = self.core.jobs[self.job].pending.get(key)
        return None if rnd is None else rnd.deadline

    def key(self, group: tuple[int, ...], number: int = 0) -> tuple:
        """The core's key of round ``number`` of ``group`` in the job's current generation."""
        return (self.core.jobs[self.job].generation, group, number)

    def round_wakeup(self, group: tuple[int, ...], number: int = 0) -> tuple:
        return ("round", self.job, *self.key(group, number))

    def outcome(self, key):
        return self.core.outcome(self.job, key)

    def result(self, key) -> list[bytes]:
        rnd = self.outcome(key)
        assert rnd is not None, f"round {key} is still pending"
        assert rnd.error is None, rnd.error
        return rnd.result

    def error(self, key) -> CoreError:
        rnd = self.outcome(key)
        assert rnd is not None, f"round {key} is still pending"
        assert rnd.error is not None, f"round {key} completed with {rnd.result}"
        return rnd.error

    def wakeups(self, kind: str) -> list[tuple]:
        return [w for w in self.core.take_wakeups() if w[0] == kind]


def make_pod(tasks: int, devices: int = 1, *, limits: Limits | None = None, register: bool = True) -> Pod:
    pod = Pod(Core(limits), tasks, devices)
    if register:
        for task in range(tasks):
            pod.register(task)
        pod.core.take_wakeups()
    return pod


def raises(code: Code, *fragments: str):
    """Context manager: a CoreError with ``code`` whose message holds every fragment."""
    return _Raises(code, fragments)


class _Raises:
    def __init__(self, code: Code, fragments: Sequence[str]) -> None:
        self.code = code
        self.fragments = fragments
        self.error: CoreError | None = None

    def __enter__(self) -> "_Raises":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        assert exc is not None, f"expected CoreError({self.code.name}), nothing was raised"
        assert isinstance(exc, CoreError), f"expected CoreError, got {exc!r}"
        assert exc.code is self.code, exc
        for fragment in self.fragments:
            assert fragment in exc.message, f"{fragment!r} not in {exc.message!r}"
        self.error = exc
        return True


def assert_message(error: CoreError, code: Code, *fragments: str) -> None:
    assert error.code is code, error
    for fragment in fragments:
        assert fragment in error.message, f"{fragment!r} not in {error.message!r}"


# --- registration --------------------------------------------------------------------------------


def test_register_assigns_ordinal_task_times_devices_plus_thread_and_local_ordinals():
    """Ordinals are task*D + thread and local ordinals local_rank*D + thread."""
    pod = make_pod(6, 2, register=False)
    for task in range(6):
        registered = pod.register(task)
        assert registered.world_size == 12
        assert [(a.thread_index, a.ordinal, a.local_ordinal) for a in registered.assignments] == [
            (t, task * 2 + t, (task % 4) * 2 + t) for t in range(2)
        ]


def test_world_is_none_until_complete_then_the_sorted_table():
    """world() stays None while any ordinal is missing and then returns every ordinal with its process."""
    pod = make_pod(3, 2, register=False)
    for task in (2, 0):
        pod.register(task)
        assert pod.core.world(JOB) is None
    assert pod.wakeups("world") == []
    pod.register(1)
    assert pod.wakeups("world") == [("world", JOB)]
    table = pod.core.world(JOB)
    assert [v.ordinal for v in table] == list(range(6))
    assert [(v.task_id, v.thread_index, v.host, v.pid, v.incarnation) for v in table] == [
        (o // 2, o % 2, host_of(o // 2), pid_of(o // 2), incarnation_of(o // 2)) for o in range(6)
    ]


def test_world_size_is_fixed_by_the_first_registration():
    """A later registration declaring another world size fails, naming both sizes."""
    pod = make_pod(2, 2, register=False)
    pod.register(0)
    with raises(Code.FAILED_PRECONDITION, "world size 4", "3 tasks x 2 devices = 6", "first registration"):
        pod.core.register(0.0, registration(1, 3, 2))
    assert pod.core.status(0.0, JOB)[0].world_size == 4


def test_declare_job_fixes_the_world_size_before_anyone_registers():
    """declare_job sets the world size; registrations must match it; declaring it again is a no-op."""
    core = Core()
    core.declare_job(JOB, 4)
    assert core.world(JOB) is None
    with raises(Code.FAILED_PRECONDITION, "world size 4", "= 6", "--world-size"):
        core.register(0.0, registration(0, 3, 2))
    core.register(0.0, registration(0, 2, 2))
    core.declare_job(JOB, 4)  # same size: a no-op
    assert core.jobs[JOB].generation == 1 and len(core.jobs[JOB].members) == 2


def test_declaring_another_world_size_starts_the_job_afresh_keeping_its_keys():
    """A coordinator restarted from its state file with another --world-size: the job is a new
    run of that size (its pending rounds fail naming the change), not a refusal to start."""
    pod = make_pod(2, 2)
    pod.core.declare_job(JOB, 4)
    pod.core.kv_set(JOB, [("k", b"v")])
    key = pod.arrive([0, 1])
    for process in pod.core.jobs[JOB].processes.values():
        process.restored = True  # (as a restore from the state file leaves them)
    pod.core.declare_job(JOB, 6)
    assert_message(pod.error(key), Code.ABORTED, "starts afresh: the coordinator was given world size 6 for it, 4 before")
    job = pod.core.jobs[JOB]
    assert (job.world_size, job.generation, job.members, job.devices_per_task) == (6, 2, {}, None)
    assert pod.core.kv_get(JOB, ["k"]) == [b"v"]
    assert not [e for e in job.events if e.kind == "PROCESS_DEAD"]  # (dropped by the operator, not dead)
    # (Not "as this process was not heard from since the coordinator restarted": it could not have been.)
    with raises(
        Code.FAILED_PRECONDITION,
        "'inc-0' of job 'job' was dropped: job 'job' started afresh (the coordinator was given world size 6 for it, "
        "4 before) while this process (host-0 pid 1000) was of the run before; it takes no part any more",
    ) as refused:
        pod.core.register(0.0, registration(0, 3, 2))  # a process of the last run
    assert refused.error.warn == (  # (serve logs it once a run: such processes may call on for ever)
        ("replaced", JOB, 2), "dead_process_called",
        "refused calls from a process dropped in job 'job', which takes no part any more (told once per generation): "
        "job 'job' started afresh "
        "(the coordinator was given world size 6 for it, 4 before) while this process (host-0 pid 1000) was of the run before",
    )
    pod.core.register(0.0, registration(0, 3, 2, incarnation="new-0"))  # 3 tasks x 2 devices now


@pytest.mark.parametrize(
    "size, code, text",
    [(0, Code.INVALID_ARGUMENT, "must be >= 1, got 0"), (5, Code.RESOURCE_EXHAUSTED, "max_world_size=4")],
)
def test_declare_job_rejects_sizes_outside_the_limit(size, code, text):
    """declare_job refuses a world size below 1 (bad input) or above max_world_size (a limit), naming it."""
    with raises(code, text):
        Core(Limits(max_world_size=4)).declare_job(JOB, size)


def test_conflicting_devices_per_task_fails_naming_both_numbers():
    """Same world size with another devices-per-task split is FAILED_PRECONDITION naming both counts."""
    core = Core()
    core.register(0.0, registration(0, 4, 2))
    with raises(Code.FAILED_PRECONDITION, "2 devices per task", "declares 1"):
        core.register(0.0, registration(1, 8, 1))


def test_reregistering_from_the_same_incarnation_is_idempotent():
    """A retried registration returns the same assignments and neither adds members nor re-announces the world."""
    pod = make_pod(2, 2)
    first = pod.core.world(JOB)
    again = pod.register(1, now=5.0)
    assert [(a.ordinal, a.local_ordinal) for a in again.assignments] == [(2, 2), (3, 3)]
    assert pod.core.world(JOB) == first
    assert pod.core.take_wakeups() == []


def test_one_process_may_register_its_threads_one_at_a_time():
    """Threads of one incarnation registering separately join the same process."""
    pod = make_pod(1, 2, register=False)
    pod.register(0, threads=[1])
    assert pod.core.world(JOB) is None
    pod.register(0, threads=[0])
    assert [v.ordinal for v in pod.core.world(JOB)] == [0, 1]


def test_another_incarnation_claiming_a_registered_task_already_exists():
    """A second process with the same task id is ALREADY_EXISTS naming both processes."""
    pod = make_pod(8, 2, register=False)
    pod.register(1)
    with raises(Code.ALREADY_EXISTS, "ordinals 2-3", "task 1", "host-0 pid 1001", "host-1 pid 2002") as caught:
        pod.register(1, incarnation="intruder", host="host-1", pid=2002)
    assert "CLOUD_TPU_TASK_ID" in caught.error.message
    # (from another host: perhaps another team's job under the same name, the default's)
    assert caught.error.message.endswith(
        "; or two jobs share the job name 'job' on this coordinator: give each its own (PJRT_RENDEZVOUS_JOB)"
    ), caught.error.message
    (view,) = pod.core.status(0.0, JOB)
    assert view.participants[0].pid == 1001
    assert view.refused == {}  # (a task its holder keeps is not shown as refused)
    with raises(Code.ALREADY_EXISTS, "task 1") as same_host:
        pod.core.register(0.0, dataclasses.replace(registration(1, 8, 2, incarnation="twin", pid=2003), local_rank=5))
    assert "two jobs share" not in same_host.error.message


def test_a_job_of_another_size_under_the_same_name_is_told_to_take_a_name_of_its_own():
    """A second job under a name in use (two teams leaving PJRT_RENDEZVOUS_JOB unset) meets
    the first's world size: the refusal suggests a job name, unless serve declared the size.
    The first job's status shows a refused task outside its world only while it forms."""
    pod = make_pod(2, 1, register=False)
    pod.register(0)
    with raises(Code.FAILED_PRECONDITION, "has world size 2 (fixed by the first registration") as caught:
        pod.core.register(0.0, registration(2, 3, 1, incarnation="other", host="team-b", pid=5))
    assert caught.error.message.endswith(
        "(if those are another job's processes, give each job a name of its own: PJRT_RENDEZVOUS_JOB)"
    )
    assert list(pod.core.status(0.0, JOB)[0].refused) == [2]  # (a task out of range: why a world may not form)
    pod.register(1)  # formed: the other job's task is none of its business
    assert pod.core.status(0.0, JOB)[0].refused == {}
    pod.core.declare_job("declared", 2)
    with raises(Code.FAILED_PRECONDITION, "fixed by the coordinator's --world-size") as declared:
        pod.core.register(0.0, registration(0, 3, 1, job="declared"))
    assert "another job's" not in declared.error.message


def test_an_incarnation_cannot_switch_tasks():
    """An incarnation that registered one task and claims another is INVALID_ARGUMENT."""
    pod = make_pod(2, 1, register=False)
    pod.register(0)
    with raises(Code.INVALID_ARGUMENT, "task 0", "task 1"):
        pod.register(1, incarnation=incarnation_of(0))


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"threads": (ThreadRequest(thread_index=2),)}, ["thread index 2", "[0, 2)"]),
        ({"threads": (ThreadRequest(thread_index=-1),)}, ["thread index -1", "[0, 2)"]),
        ({"task_id": 3}, ["task id 3", "[0, 3)", "host-0"]),
        ({"task_id": -1}, ["task id -1", "[0, 3)"]),
        ({"incarnation": ""}, ["incarnation must not be empty"]),
        (
            {"threads": (ThreadRequest(thread_index=1), ThreadRequest(thread_index=1))},
            ["thread index 1 appears twice"],
        ),
        ({"threads": ()}, ["at least one thread"]),
        ({"num_tasks": 0}, ["num_tasks (0)"]),
        ({"devices_per_task": 0}, ["devices_per_task (0)"]),
        ({"local_rank": -1}, ["local rank", "-1"]),
    ],
    ids=[
        "thread-too-high",
        "thread-negative",
        "task-too-high",
        "task-negative",
        "empty-incarnation",
        "duplicate-thread",
        "no-threads",
        "no-tasks",
        "no-devices",
        "negative-local-rank",
    ],
)
def test_malformed_registrations_are_invalid_argument_and_change_nothing(changes, fragments):
    """Each malformed registration is INVALID_ARGUMENT with the offending value and leaves no job behind."""
    core = Core()
    request = dataclasses.replace(registration(0, 3, 2), **changes)
    with raises(Code.INVALID_ARGUMENT, *fragments):
        core.register(0.0, request)
    assert core.jobs == {}


def test_world_over_max_world_size_is_resource_exhausted():
    """A world over max_world_size is RESOURCE_EXHAUSTED naming size and limit; the limit itself fits."""
    core = Core(Limits(max_world_size=4))
    with raises(Code.RESOURCE_EXHAUSTED, "= 6", "max_world_size=4"):
        core.register(0.0, registration(0, 3, 2))
    assert core.register(0.0, registration(0, 2, 2)).world_size == 4


def test_jobs_over_max_jobs_are_resource_exhausted():
    """Creating more than max_jobs jobs is RESOURCE_EXHAUSTED, while existing jobs keep working."""
    core = Core(Limits(max_jobs=2))
    core.register(0.0, registration(0, 2, 1, job="a"))
    core.kv_set("b", [("k", b"v")])
    with raises(Code.RESOURCE_EXHAUSTED, "max_jobs=2", "'c'"):
        core.register(0.0, registration(0, 2, 1, job="c"))
    with raises(Code.RESOURCE_EXHAUSTED, "max_jobs=2"):
        core.declare_job("d", 2)
    core.register(0.0, registration(1, 2, 1, job="a"))
    assert core.world("a") is not None


def test_at_max_jobs_the_finished_job_used_longest_ago_makes_room(caplog):
    """A long-lived coordinator serving a job name per run (a Kubernetes Job each) does not
    fill up: at max_jobs, a new job takes the place of the finished job (every process gone,
    no round pending) used longest ago, and the event log says so, with the metrics of the
    dropped job gone; jobs that never had a process (key-value alone) are never dropped."""
    from pjrt_rendezvous.coordinator._metrics import Metrics
    from pjrt_rendezvous.coordinator._monitor import Monitor

    core = Core(Limits(max_jobs=3), heartbeat_timeout=60.0)
    metrics = Metrics()
    monitor = Monitor(core, metrics, clock=lambda: 0.0)
    core.kv_set("store-only", [("k", b"v")])
    for name in ("run-1", "run-2"):
        core.register(0.0, registration(0, 1, 1, job=name))
        core.leave(name, incarnation_of(0))
    metrics.round_failed("run-1", "ABORTED", 0.0)
    core.status(0.0, "run-1")  # a use: run-2 is now the one used longest ago
    core.register(0.0, registration(0, 1, 1, job="run-3"))
    assert sorted(core.jobs) == ["run-1", "run-3", "store-only"]
    with caplog.at_level("INFO", logger="pjrt_rendezvous.coordinator"):
        monitor.woke(core.take_wakeups())
    (line,) = [r for r in caplog.records if getattr(r, "event", "") == "job_dropped"]
    assert (line.job, line.for_job) == ("run-2", "run-3")
    core.kv_set("run-4", [("k", b"v")])  # run-1 makes room (key-value calls create jobs too)
    monitor.woke(core.take_wakeups())
    assert sorted(core.jobs) == ["run-3", "run-4", "store-only"]
    assert "run-1" not in metrics.render(core, 0.0)
    with raises(Code.RESOURCE_EXHAUSTED, "max_jobs=3", "none can make room", "'run-5'", "(1 job with live processes: 'run-3')"):
        core.register(0.0, registration(0, 1, 1, job="run-5"))  # run-3 lives, run-4 and store-only never had a process
    core.disconnect("run-3", incarnation_of(0), 1.0)  # (killed: declared dead soon, and then run-3 makes room)
    with raises(Code.RESOURCE_EXHAUSTED, "with live processes: 'run-3'; of which 'run-3' only with processes whose connections closed, declared dead unless heard from again within 10 s"):
        core.register(1.0, registration(0, 1, 1, job="run-5"))


def test_the_declared_job_is_never_dropped_at_max_jobs():
    """The job fixed with serve --world-size stays at max_jobs after its processes leave (it
    was dropped like any finished job, and its next run took its size from whoever came
    first)."""
    core = Core(Limits(max_jobs=2))
    core.declare_job("fixed", 1)
    core.register(0.0, registration(0, 1, 1, job="fixed"))
    core.leave("fixed", incarnation_of(0))
    core.register(0.0, registration(0, 1, 1, job="a"))
    with raises(Code.RESOURCE_EXHAUSTED, "max_jobs=2", "declared with --world-size"):
        core.register(0.0, registration(0, 1, 1, job="b"))
    assert sorted(core.jobs) == ["a", "fixed"] and core.jobs["fixed"].world_size == 1


def test_reads_of_unknown_jobs_create_none_and_empty_jobs_make_room():
    """Key-value reads of a job nobody made answer as an empty store and create no job, so
    they cannot fill max_jobs; a job a change made without writing anything (a delete of a
    missing key) holds nothing and makes room; the refusal says what can and cannot."""
    core = Core(Limits(max_jobs=2))
    for i in range(5):
        name = f"probe-{i}"
        assert core.kv_get(name, ["k"]) == [None]
        assert core.kv_list(name, "") == [] and core.kv_count(name, "k") == 0
        assert_message(core.kv_timeout(name, ["k", "l"], 2.0), Code.DEADLINE_EXCEEDED, "2 keys", "'k', 'l'")
    assert core.jobs == {}
    with raises(Code.INVALID_ARGUMENT, "job name must not be empty"):
        core.kv_get("", ["k"])
    assert core.kv_delete("empty", "k") is False  # made a job holding nothing
    core.kv_set("store", [("k", b"v")])
    core.register(0.0, registration(0, 1, 1, job="run"))  # takes the empty job's place
    assert sorted(core.jobs) == ["run", "store"]
    with raises(Code.RESOURCE_EXHAUSTED, "max_jobs=2", "none can make room", "every process of it is gone",
                "holding keys without ever having a process", "'other'", "(1 job of keys alone: 'store'; deleting"):
        core.kv_set("other", [("k", b"v")])
    assert core.kv_get("store", ["k"]) == [b"v"]
    core.kv_delete("store", "k")  # (as the refusal says)
    core.kv_set("other", [("k", b"v")])
    assert sorted(core.jobs) == ["other", "run"]


@pytest.mark.parametrize(
    "name, code",
    [("", Code.INVALID_ARGUMENT), ("x" * 33, Code.RESOURCE_EXHAUSTED), ("a\rb", Code.INVALID_ARGUMENT), ("a\x7f", Code.INVALID_ARGUMENT)],
)
def test_job_names_must_be_non_empty_short_and_printable(name, code):
    """An empty job name is INVALID_ARGUMENT, one over max_name_length RESOURCE_EXHAUSTED; a
    control character is refused (a carriage return made the metrics page unparsable)."""
    with raises(code, "job name"):
        Core(Limits(max_name_length=32)).register(0.0, registration(0, 1, 1, job=name))
    if code is Code.INVALID_ARGUMENT and name:
        with raises(code, "holds a control character"):
            Core().kv_set(name, [("k", b"v")])


@pytest.mark.parametrize("field", ["host", "incarnation"])
@pytest.mark.parametrize("bad", ["h\r2026-12-03 CRITICAL forged", "h\x1b[2K", "h\x85", "h\u2028"])
def test_hosts_and_incarnations_with_control_characters_are_refused(field, bad):
    """Hosts and incarnations go into log lines and `status` as they are: a carriage return
    or an escape forged a log line on a terminal (job names were refused such characters,
    these were not). A reason an EndReplicas gives keeps one line too."""
    with raises(Code.INVALID_ARGUMENT, f"{field} {bad!r} holds a control character"):
        Core().register(0.0, registration(0, 1, 2, **{field: bad}))
    core = Core()
    core.register(0.0, registration(0, 1, 2, host="h\u00e9"))  # (printable, not ASCII: fine)
    core.end_replicas(JOB, incarnation_of(0), [1], "raised\rValueError\n: x", now=1.0)
    assert core.jobs[JOB].processes[incarnation_of(0)].ended[1] == "raised ValueError : x"


def test_a_client_version_is_kept_to_the_name_limit_and_refused_with_a_control_character():
    """A client's version is only told (status, the log): one past max_name_length (a long
    development build's) is cut there, not refused (a registration refused for it would
    stop the job); one with a control character is refused, as a host is."""
    core = Core(Limits(max_name_length=32))
    long = "0.1.1.dev123+g1a2b3c4d.d20261203.extra"
    core.register(0.0, dataclasses.replace(registration(0, 1, 2), client_version=long))
    assert [p.client_version for p in core.status(0.0, JOB)[0].participants] == [long[:32]] * 2
    with raises(Code.INVALID_ARGUMENT, "client version '0.1\\n' holds a control character"):
        Core().register(0.0, dataclasses.replace(registration(0, 1, 2), client_version="0.1\n"))


def test_the_name_limit_leaves_room_for_the_clients_incarnation_ids():
    """max_name_length bounds incarnation ids too, which clients make 32 characters long: a
    lower limit refused every registration, so it is refused at start instead."""
    with pytest.raises(ValueError, match="at least 32"):
        Limits(max_name_length=31)
    assert len(pr_incarnation()) == 32


def pr_incarnation() -> str:
    from pjrt_rendezvous.client._client import Client
    from pjrt_rendezvous.client._config import Settings
    from pjrt_rendezvous.client._topology import detect_topology

    client = Client(Settings(address="127.0.0.1:1"), detect_topology({}, address="127.0.0.1:1"))
    try:
        return client.incarnation
    finally:
        client.close()


def test_runtime_ordinal_equal_to_the_ordinal_passes_and_is_recorded():
    """With the runtime spanning our world, a runtime ordinal equal to the rank-table ordinal is accepted."""
    pod = make_pod(2, 2, register=False)
    for task in range(2):
        pod.register(task, runtime={0: task * 2, 1: task * 2 + 1}, runtime_world_size=4)
    assert [v.runtime_ordinal for v in pod.core.world(JOB)] == [0, 1, 2, 3]


def test_runtime_ordinal_different_from_the_ordinal_fails_naming_both():
    """With the runtime spanning our world, a disagreeing runtime ordinal is FAILED_PRECONDITION naming both."""
    pod = make_pod(2, 2, register=False)
    pod.register(0, runtime={0: 0, 1: 1}, runtime_world_size=4)
    with raises(Code.FAILED_PRECONDITION, "global ordinal 0", "ordinal 3", "task 1", "thread 1"):
        pod.register(1, runtime={0: 2, 1: 0}, runtime_world_size=4)
    assert len(pod.core.jobs[JOB].members) == 2


def test_a_thread_bound_again_with_or_without_its_runtime_ordinal_keeps_or_gains_it():
    """A runtime ordinal not said (bind_thread) is no disagreement with one said before
    (xla.bind_device), nor the other way round: both were refused as a mismatch of None and
    0. One said now is recorded, and checked as any; two said that differ are refused."""
    pod = make_pod(2, 2, register=False)
    pod.register(0, runtime={0: 0, 1: 1}, runtime_world_size=4)
    pod.register(0)  # the same threads bound again by bind_thread
    pod.register(1)
    pod.register(1, runtime={0: 2, 1: 3}, runtime_world_size=4)
    assert [m.runtime_ordinal for _, m in sorted(pod.core.jobs[JOB].members.items())] == [0, 1, 2, 3]
    with raises(Code.FAILED_PRECONDITION, "as global ordinal 3, which ordinal 3", "was registered with already"):
        pod.register(0, threads=[1], runtime={1: 3})  # (the runtime's world not said)
    assert [m.runtime_ordinal for _, m in sorted(pod.core.jobs[JOB].members.items())] == [0, 1, 2, 3]


def test_local_only_runtime_must_match_the_thread_index():
    """When the runtime sees only its own process, its device index must be the thread index."""
    pod = make_pod(2, 2, register=False)
    pod.register(1, runtime={0: 0, 1: 1}, runtime_world_size=2)
    again = pod.register(1, runtime={0: 0, 1: 1}, runtime_world_size=2)
    assert [a.ordinal for a in again.assignments] == [2, 3]
    with raises(Code.FAILED_PRECONDITION, "thread 0 of task 0", "local device 1"):
        pod.register(0, runtime={0: 1, 1: 0}, runtime_world_size=2)


def test_a_runtime_world_neither_ours_nor_the_process_own_fails_naming_both_sizes():
    """DESIGN "Ordinals": the runtime's numbers are the authority only where its world is ours;
    a runtime world of another size would order XLA collectives differently from the rank table."""
    pod = make_pod(2, 2, register=False)
    with raises(Code.FAILED_PRECONDITION, "has 8 devices in its world", "the job has 4 ordinals (2 tasks x 2 devices)",
                "PJRT_RENDEZVOUS_NUM_TASKS"):
        pod.register(0, runtime={0: 0, 1: 1}, runtime_world_size=8)
    with raises(Code.FAILED_PRECONDITION, "has a world of 1 device while this process drives 2", "xla.spawn",
                "call xm.set_replication before anything reads the runtime's world size"):
        pod.register(0, runtime={0: 0, 1: 0}, runtime_world_size=1)  # replication not set yet
    pod.register(0, runtime={0: 0, 1: 1}, runtime_world_size=4)  # ours
    pod.register(1, runtime={0: 0, 1: 1}, runtime_world_size=2)  # the process's own (PJRT on CPU)
    assert pod.core.world(JOB) is not None


@pytest.mark.parametrize("runtime_world_size", [0, 4])
@pytest.mark.parametrize("runtime_ordinal", [-5, 4, 99])
def test_a_runtime_ordinal_outside_the_world_is_refused_whatever_the_runtime_world(runtime_ordinal, runtime_world_size):
    """A runtime ordinal is a global ordinal of the job: outside [0, world size) it is refused,
    naming it and the range, even when the runtime's world size was not said."""
    pod = make_pod(2, 2, register=False)
    with raises(Code.INVALID_ARGUMENT, f"as global ordinal {runtime_ordinal}", "out of range [0, 4)", "task 1 thread 1"):
        pod.register(1, runtime={0: 2, 1: runtime_ordinal}, runtime_world_size=runtime_world_size)
    assert JOB not in pod.core.jobs


def test_a_runtime_ordinal_two_threads_share_is_refused_without_a_runtime_world():
    """Without a runtime world size, two threads (of one registration, of one process one at a
    time, or of two processes) naming the same runtime ordinal are refused, naming both."""
    pod = make_pod(2, 2, register=False)
    with raises(Code.FAILED_PRECONDITION, "task 0 thread 1", "global ordinal 3", "ordinal 0 (thread 0 of this registration)"):
        pod.register(0, runtime={0: 3, 1: 3})
    pod.register(0, threads=[0], runtime={0: 3})
    with raises(Code.FAILED_PRECONDITION, "thread 1", "ordinal 1", "global ordinal 3", "ordinal 0 (host-0 pid 1000, task 0)"):
        pod.register(0, threads=[1], runtime={1: 3})
    with raises(Code.FAILED_PRECONDITION, "task 1 thread 1", "global ordinal 3", "ordinal 0 (host-0 pid 1000"):
        pod.register(1, runtime={0: 2, 1: 3}, runtime_world_size=4)  # the runtime's world is ours
    pod.register(0, threads=[0], runtime={0: 3})  # a retry of the same registration: the same device
    pod.register(0, threads=[1], runtime={1: 2})
    pod.register(1, threads=[0], runtime={0: 1})
    pod.register(1, threads=[1], runtime={1: 0})
    assert [v.runtime_ordinal for v in pod.core.world(JOB)] == [3, 2, 1, 0]


def test_a_restarted_process_may_take_its_predecessors_runtime_ordinals():
    """The runtime ordinals of a replaced process go with it: its successor registers them again."""
    pod = Pod(Core(heartbeat_timeout=10), 2, 1)
    pod.register(0, runtime={0: 1})
    pod.register(1, runtime={0: 0})
    pod.register(1, now=3.0, incarnation="again-1", pid=9, runtime={0: 0})
    assert pod.core.jobs[JOB].generation == 2
    with raises(Code.FAILED_PRECONDITION, "global ordinal 1", "ordinal 0"):
        pod.register(1, now=4.0, incarnation="again-1", pid=9, threads=[0], runtime={0: 1})


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8"])
def test_a_limit_must_be_a_positive_integer(value):
    """Limits refuses what is not a positive int, naming the field (True, an int to Python,
    was taken as a limit of 1)."""
    with pytest.raises(ValueError, match=re.escape(f"limit max_payload_bytes must be a positive integer, got {value!r}")):
        Limits(max_payload_bytes=value)


def test_reregistering_with_another_runtime_ordinal_fails():
    """Re-registering an ordinal with a different runtime ordinal is FAILED_PRECONDITION
    (without one is not: see test_a_thread_bound_again_with_or_without_its_runtime_ordinal_keeps_or_gains_it)."""
    pod = make_pod(1, 2, register=False)
    pod.register(0, threads=[0], runtime={0: 0})
    with raises(Code.FAILED_PRECONDITION, "ordinal 0 was registered with runtime ordinal 0 and is registered again with 1"):
        pod.register(0, threads=[0], runtime={0: 1})


def test_rejected_first_registration_leaves_no_job_behind():
    """A first registration refused for its runtime ordinal creates no job and uses no job slot."""
    core = Core(Limits(max_jobs=1))
    with pytest.raises(CoreError):
        core.register(0.0, registration(0, 2, 1, job="a", runtime={0: 1}, runtime_world_size=2))
    assert "a" not in core.jobs
    core.register(0.0, registration(0, 1, 1, job="b"))


# --- world timeout -------------------------------------------------------------------------------


def test_world_timeout_lists_missing_ordinals_as_ranges():
    """world_timeout names every missing ordinal compressed as ranges and says they never registered."""
    pod = make_pod(4, 2, register=False)
    pod.register(0)
    pod.register(2)
    pod.register(3, threads=[0])
    error = pod.core.world_timeout(JOB, now=30.0, waited=30.0)
    assert_message(
        error,
        Code.DEADLINE_EXCEEDED,
        "5 of 8 ordinals registered",
        "missing ordinals 2-3, 7",
        "2-3 never registered",
        "7 on host-0 (pid 1003, last seen 30.0 s ago)",
        "30.0 s",
    )


def test_world_timeout_says_a_missing_ordinal_s_process_left_not_died():
    """Task 1 bound thread 0, then closed its client: the world's timeout called its process
    "(dead)" for ordinal 3, where its event, the log and `status` say it left."""
    pod = make_pod(2, 2, register=False)
    pod.register(0)
    pod.register(1, threads=[0])
    pod.core.leave(JOB, incarnation_of(1))
    message = pod.core.world_timeout(JOB, now=30.0, waited=30.0).message
    assert "missing ordinal 3 on host-0 (left) (pid 1001, last seen 30.0 s ago)" in message, message


def test_a_wait_for_the_ordinals_of_a_refused_registration_says_why_they_are_missing():
    """Task 1 was refused (another world size): the world's timeout and a round's said its
    ordinals "never registered", the reason only in task 1's own log; they name its host and
    the refusal now, until the task registers."""
    pod = make_pod(3, 2, register=False)
    pod.register(0)
    pod.register(2)
    with raises(Code.FAILED_PRECONDITION, "has world size 6"):
        pod.core.register(1.0, registration(1, 4, 2))
    assert_message(
        pod.core.world_timeout(JOB, now=30.0, waited=30.0),
        Code.DEADLINE_EXCEEDED,
        "missing ordinals 2-3 (2-3 not registered (host-0 pid 1001 was refused: job 'job' has world size 6 ",
        "but task 1 on host-0 pid 1001 declares 4 tasks x 2 devices = 8",
    )
    key = pod.arrive([0, 1], deadline=40.0)
    pod.arrive([4, 5], deadline=40.0)
    pod.core.expire(40.0)
    assert "missing ordinals 2-3 (2-3 not registered (host-0 pid 1001 was refused: job 'job' has world size 6" in pod.error(key).message
    ((ordinals, why),) = pod.core.status(40.0, JOB)[0].refused.values()  # (status lists it too)
    assert ordinals == [2, 3] and why.startswith("host-0 pid 1001 was refused: job 'job' has world size 6")
    pod.register(1, now=41.0)  # mended: nothing is left of the refusal
    assert not pod.core.jobs[JOB].refused


def test_world_timeout_of_a_job_without_a_world_says_nobody_registered():
    """A job that exists only through its key-value store times out saying no process registered."""
    core = Core()
    core.kv_set(JOB, [("k", b"v")])
    assert_message(core.world_timeout(JOB, now=5.0, waited=5.0), Code.DEADLINE_EXCEEDED, "no process registered")


def test_world_timeout_of_a_declared_job_lists_every_ordinal():
    """A declared job nobody joined times out naming its whole ordinal range as never registered."""
    core = Core()
    core.declare_job(JOB, 4)
    assert_message(
        core.world_timeout(JOB, now=5.0, waited=5.0), Code.DEADLINE_EXCEEDED, "0 of 4", "0-3 never registered"
    )


# --- rendezvous rounds ---------------------------------------------------------------------------


def test_round_completes_exactly_when_every_member_arrived():
    """An ALL round stays pending until the last ordinal arrives, then completes with one wake key."""
    pod = make_pod(3)
    for ordinal in (0, 1):
        key = pod.arrive(ordinal)
        assert pod.outcome(key) is None
        assert pod.wakeups("round") == []
    key = pod.arrive(2)
    assert key == pod.key(ALL, 0)
    assert pod.result(key) == [b"p0", b"p1", b"p2"]
    assert pod.wakeups("round") == [pod.round_wakeup(ALL, 0)]


def test_payloads_come_back_in_ordinal_order_whatever_the_arrival_order():
    """The result is ordered by ordinal even when arrivals and a batch's contributions are out of order."""
    pod = make_pod(3, 2)
    pod.arrive([5, 4])
    pod.arrive(1)
    pod.arrive([3, 2])
    key = pod.arrive(0)
    assert pod.result(key) == [payload_of(o) for o in range(6)]


def test_world_of_one_completes_at_once():
    """A single-ordinal world completes its round on the only arrival."""
    pod = make_pod(1)
    assert pod.result(pod.arrive(0)) == [b"p0"]


def test_subsets_are_independent_groups():
    """Rounds on disjoint replica subsets complete on their own and do not advance the ALL counter."""
    pod = make_pod(4)
    all_key = pod.arrive(0, tag="all")
    assert pod.arrive(2, replicas=[2, 3]) == pod.key((2, 3), 0)
    assert pod.arrive(3, replicas=[3, 2]) == pod.key((2, 3), 0)
    assert pod.result(pod.key((2, 3), 0)) == [b"p2", b"p3"]
    assert pod.outcome(all_key) is None
    for ordinal in (1, 2, 3):
        pod.arrive(ordinal, tag="all")
    assert pod.result(all_key) == [payload_of(o) for o in range(4)]
    pod.arrive(1, replicas=[0, 1], tag="sub")
    assert pod.arrive(0, replicas=[0, 1], tag="sub") == pod.key((0, 1), 0)
    assert pod.result(pod.key((0, 1), 0)) == [b"p0", b"p1"]
    assert pod.arrive(2, replicas=[2, 3], round_number=1) == pod.key((2, 3), 1)


def test_explicit_full_replicas_are_the_same_group_as_all():
    """replicas listing every ordinal (in any order) joins the same round as an empty replicas list."""
    pod = make_pod(3)
    assert pod.arrive(0) == pod.key(ALL, 0)
    assert pod.arrive(1, replicas=[2, 0, 1]) == pod.key(ALL, 0)
    key = pod.arrive(2, replicas=[0, 1, 2])
    assert key == pod.key(ALL, 0)
    assert pod.result(key) == [b"p0", b"p1", b"p2"]


def test_the_same_tag_in_consecutive_rounds_makes_separate_rounds():
    """Rounds, not tags, match calls: one tag used three times gives three rounds with their own payloads."""
    pod = make_pod(2)
    for number in range(3):
        payloads = {o: f"{o}@{number}".encode() for o in range(2)}
        pod.arrive(1, tag="same", round_number=number, payloads=payloads)
        key = pod.arrive(0, tag="same", round_number=number, payloads=payloads)
        assert key == pod.key(ALL, number)
        assert pod.result(key) == [f"0@{number}".encode(), f"1@{number}".encode()]
    assert pod.core.status(0.0, JOB)[0].rounds_completed == 3


def test_a_retried_arrival_is_idempotent():
    """Sending the same contribution twice counts it once and does not complete the round early."""
    pod = make_pod(2)
    assert pod.arrive(0) == pod.arrive(0) == pod.key(ALL, 0)
    assert pod.outcome(pod.key(ALL, 0)) is None
    key = pod.arrive(1)
    assert pod.result(key) == [b"p0", b"p1"]


def test_a_resend_of_a_finished_round_returns_the_stored_result():
    """A retry after completion gets the same result without counting a new round or waking anyone."""
    pod = make_pod(2)
    pod.arrive(0)
    key = pod.arrive(1)
    pod.core.take_wakeups()
    stored = pod.outcome(key)
    assert pod.arrive(0) == key
    assert pod.outcome(key) is stored
    assert stored.result == [b"p0", b"p1"]
    assert pod.core.status(0.0, JOB)[0].rounds_completed == 1
    assert pod.core.take_wakeups() == []


def test_a_resend_with_different_content_to_a_pending_round_is_invalid_argument():
    """A retry carrying another payload or tag is INVALID_ARGUMENT and leaves the first arrival in place."""
    pod = make_pod(2)
    pod.arrive(0)
    with raises(Code.INVALID_ARGUMENT, "ordinal 0 resent", "different tag or payload"):
        pod.arrive(0, payloads={0: b"other"})
    with raises(Code.INVALID_ARGUMENT, "ordinal 0 resent"):
        pod.arrive(0, tag="other")
    assert pod.result(pod.arrive(1)) == [b"p0", b"p1"]


def test_a_resend_with_different_content_to_a_completed_round_is_invalid_argument():
    """A call for a completed round whose tag or payload differs from what that ordinal sent is refused."""
    pod = make_pod(2)
    pod.arrive(0)
    pod.arrive(1)
    with raises(Code.INVALID_ARGUMENT, "ordinal 0", "rendezvous 't' on all ordinals (round 0)"):
        pod.arrive(0, tag="next-step", payloads={0: b"new"})
    with raises(Code.INVALID_ARGUMENT, "ordinal 1 resent"):
        pod.arrive(1, payloads={1: b"new"})  # the same tag, another payload
    assert pod.result(pod.arrive(1)) == [b"p0", b"p1"]  # the same content: the stored result


def test_a_round_long_finished_cannot_be_resent():
    """A call for a round whose result has been dropped is FAILED_PRECONDITION saying the counter fell behind."""
    pod = make_pod(2)
    for number in range(4):
        pod.result(pod.arrive(0, replicas=[0], round_number=number))
    with raises(Code.FAILED_PRECONDITION, "round 0", "fell behind", "at round 4", "a group keeps its last finished round, and when that failed, up to 16 failures in a row"):
        pod.arrive(0, replicas=[0], round_number=0)
    assert pod.result(pod.arrive(0, replicas=[0], round_number=3)) == [b"p0"]


@pytest.mark.parametrize("failed", [3, 20])
def test_a_member_late_for_many_rounds_its_peers_failed_without_it_is_told_each_ones_error(failed):
    """Ordinal 0 timed out in round after round without ordinal 1 (its peers catch the
    timeout and go on): ordinal 1, late, then comes to each in turn and is told that
    round's timeout, not that its counter fell behind (a group kept two finished rounds;
    a model-based test of the core found it). Up to _FAILED_ROUNDS_KEPT in a row."""
    from pjrt_rendezvous.coordinator._core import _FAILED_ROUNDS_KEPT

    pod = make_pod(2)
    for number in range(failed):
        pod.arrive(0, round_number=number, now=10.0 * number, deadline=10.0 * number + 1)
        pod.core.expire(10.0 * number + 2)
    forgotten = max(0, failed - _FAILED_ROUNDS_KEPT)
    if forgotten:
        with raises(Code.FAILED_PRECONDITION, f"round {forgotten - 1} of all ordinals finished long ago", f"at round {failed}"):
            pod.arrive(1, round_number=forgotten - 1, now=1000.0)
    for number in range(forgotten, failed):
        with raises(
            Code.DEADLINE_EXCEEDED,
            f"ordinal 1 called rendezvous('t') as round {number} of all ordinals, which had failed before it came",
            f"on all ordinals (round {number}) timed out after 1.0 s", "missing ordinal 1",
        ):
            pod.arrive(1, round_number=number, now=1000.0)
    key = pod.arrive(1, round_number=failed, now=1000.0)  # caught up: the next round is whole
    assert pod.result(pod.arrive(0, round_number=failed, now=1000.0)) == [b"p0", b"p1"]
    assert list(pod.core.jobs[JOB].groups[key[:2]].finished) == [failed]  # (completed: one kept)


def test_tag_mismatch_fails_the_round_for_everyone_naming_who_brought_what():
    """Two tags in one round fail it at once for all members, naming who brought which tag
    (the odd one out with its host and pid: its log is the one to read) and who is missing."""
    pod = make_pod(4)
    pod.arrive([0], tag="save")
    pod.arrive([2], tag="save")
    key = pod.arrive(1, tag="step")
    error = pod.error(key)
    assert_message(
        error,
        Code.FAILED_PRECONDITION,
        "tag mismatch in round 0 of all ordinals: ordinals 0, 2 called rendezvous('save'); "
        "ordinal 1 (host-0 pid 1001) called rendezvous('step'); ordinal 3 had not arrived",
    )
    assert pod.wakeups("round") == [pod.round_wakeup(ALL, 0)]
    assert pod.arrive(1, tag="step") == key  # a resend gets the round's error as it is
    # One coming after the failure is told so (it got the round's error alone, which names
    # it as not arrived, under a tag that may not be its own).
    with raises(Code.FAILED_PRECONDITION, "ordinal 3 called rendezvous('later') as round 0 of all ordinals, which had failed before it came "
                "(its peers called rendezvous('save'); its round counter for the group moves on with its peers'): tag mismatch"):
        pod.arrive(3, tag="later")
    assert pod.outcome(key).error is error
    assert pod.core.take_wakeups() == []


def test_tag_mismatch_between_equal_groups_places_both_and_shortens_long_tags():
    """With no majority, every side says where it runs; a tag over 40 characters is shown by its
    start (two at the limit would fill the message that has to fit in a gRPC trailer)."""
    pod = make_pod(2)
    pod.arrive(0, tag="a" * 1000)
    error = pod.error(pod.arrive(1, tag="b" * 1000))
    assert_message(
        error,
        Code.FAILED_PRECONDITION,
        f"ordinal 0 (host-0 pid 1000) called rendezvous('{'a' * 40}...'); ordinal 1 (host-0 pid 1001) called rendezvous('{'b' * 40}...')",
    )
    assert len(error.message) < 500, error.message
    # Tags that differ only past their 40th character: whole while they fit, else from just
    # before where they differ (cut at 40, they read alike).
    pod = make_pod(2)
    prefix = "model.encoder.layers.11.attention.output."
    pod.arrive(0, tag=prefix + "dense")
    error = pod.error(pod.arrive(1, tag=prefix + "norm"))
    assert f"called rendezvous('{prefix}dense')" in error.message and f"called rendezvous('{prefix}norm')" in error.message, error.message
    pod = make_pod(2)
    prefix = "p" * 400
    pod.arrive(0, tag=prefix + "dense-weights")
    error = pod.error(pod.arrive(1, tag=prefix + "norm-weights"))
    assert f"called rendezvous('...{'p' * 10}dense-weights')" in error.message and f"rendezvous('...{'p' * 10}norm-weights')" in error.message, error.message


def test_a_relays_calls_resent_per_process_after_a_failure_get_the_rounds_error():
    """A host relay's combined call that failed is resent process by process (client/_relay.py):
    after a move to a new generation, each resend gets the round's ABORTED (it was refused as
    resent "with a different tag or payload": a failed round keeps who came, not what they
    brought); after a combined call refused for a payload over the limit, each gets that
    error, not the one of a call that came late."""
    pod = Pod(Core(), 3, 1)
    for task in range(3):
        pod.register(task)
    combined = [Contribution(0, "t", payload_of(0), ""), Contribution(1, "t", payload_of(1), incarnation_of(1))]
    rnd = pod.core.arrive(1.0, job=JOB, incarnation=incarnation_of(0), replicas=[], round_number=0,
                          contributions=combined, deadline=100.0, generation=1)
    pod.register(2, now=2.0, incarnation="new-2")  # the job moves: the round is void
    for task in (0, 1):
        resent = pod.core.arrive(3.0, job=JOB, incarnation=incarnation_of(task), replicas=[], round_number=0,
                                 contributions=[Contribution(task, "t", payload_of(task))], deadline=100.0, generation=1)
        assert resent is rnd and rnd.error.code is Code.ABORTED

    pod = Pod(Core(Limits(max_payload_bytes=8)), 3, 1)
    for task in range(3):
        pod.register(task)
    pod.arrive(2, deadline=100.0)
    over = [Contribution(0, "t", b"ok", ""), Contribution(1, "t", b"x" * 20, incarnation_of(1))]
    with raises(Code.RESOURCE_EXHAUSTED, "the payload of ordinal 1 is 20 bytes"):
        pod.core.arrive(1.0, job=JOB, incarnation=incarnation_of(0), replicas=[], round_number=0,
                        contributions=over, deadline=100.0)
    key = pod.arrive(0, payloads={0: b"ok"}, deadline=100.0)
    assert pod.error(key).message.startswith("the payload of ordinal 1 is 20 bytes")


def test_a_late_call_to_a_round_whose_error_is_long_keeps_within_what_a_message_keeps():
    """The late call's error adds its words before the round's, shortened where a part ends:
    past 2,000 characters, the end of it was cut anywhere on the way (clip)."""
    from pjrt_rendezvous.client._session import clip

    pod = make_pod(1024, 1, limits=Limits(max_world_size=4096))
    for task in range(0, 1024, 2):
        key = pod.arrive(task, deadline=5.0)
    pod.core.expire(5.0)
    with raises(Code.DEADLINE_EXCEEDED, "ordinal 1 called rendezvous('late') as round 0 of all ordinals, "
                "which had failed before it came") as late:
        pod.arrive(1, tag="late")
    message = late.error.message
    assert len(message) <= 2000 and clip(message) == message and message.endswith(" ago) ..."), message[-200:]
    assert pod.error(key).message[:1000] in message


def test_a_mismatch_of_thousands_of_tags_names_eight_and_counts_the_rest():
    """One call of 3,000 ordinals, each with a tag of its own of 1,000 characters: the
    error names the first 8 groups' tags and counts the others (every pair of tags was
    compared to show them apart: 1,000 such tags held the coordinator's loop 34 s)."""
    pod = make_pod(1, 3000, limits=Limits(max_world_size=4096))
    key = pod.arrive(range(3000), tags={o: f"{o:04d}" + "x" * 996 for o in range(3000)})
    error = pod.error(key)
    assert error.code is Code.FAILED_PRECONDITION
    assert "ordinal 7 (host-0 pid 1000) called rendezvous('0007xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...'); " \
        "ordinals 8-2999 called rendezvous with 2992 other tags. Every member" in error.message, error.message
    assert error.message.count("called rendezvous(") == 8 and len(error.message) < 1500, error.message
    # The tag most members brought, the round's, is named however high their ordinals.
    pod = make_pod(2, 10)
    key = pod.arrive(range(10, 20), tag="common")
    pod.arrive(range(10), tags={o: f"odd-{o}" for o in range(10)})
    message = pod.error(key).message
    assert "ordinals 10-19 called rendezvous('common')" in message, message
    assert "ordinals 7-9 called rendezvous with 3 other tags" in message and "'odd-6'" in message, message


def test_a_round_that_finished_out_of_order_and_was_let_go_is_not_started_again():
    """Rounds 1 and 2 finish while round 0 waits (a member went on without it); once round 0
    finishes, round 1 is let go (two are kept). A call of round 1 then is told its result is
    gone: the group's next round counted past it (it stayed at 1, and round 1 started again,
    waiting for members that had long moved on)."""
    pod = make_pod(2)
    pod.arrive(0, round_number=0)
    for number in (1, 2):
        pod.arrive(0, round_number=number)
        pod.arrive(1, round_number=number)
    pod.arrive(1, round_number=0)
    with raises(Code.FAILED_PRECONDITION, "round 1 of all ordinals finished long ago", "the group is at round 3"):
        pod.arrive(0, round_number=1)
    assert pod.core.jobs[JOB].pending == {}


def test_tags_mismatching_inside_one_batched_call_fail_the_round():
    """Two threads of one process bringing different tags in one call fail the round."""
    pod = make_pod(2, 2)
    key = pod.arrive([0, 1], tags={0: "a", 1: "b"})
    assert_message(
        pod.error(key), Code.FAILED_PRECONDITION,
        "ordinal 0 (host-0 pid 1000) called rendezvous('a'); ordinal 1 (host-0 pid 1000) called rendezvous('b')",
    )


def test_duplicate_ordinals_in_replicas_fail_the_groups_round():
    """Replicas naming an ordinal twice raise INVALID_ARGUMENT and fail the group's round for its members."""
    pod = make_pod(4)
    waiting = pod.arrive(0, replicas=[0, 1, 2])
    with raises(Code.INVALID_ARGUMENT, "ordinal 1 called", "ordinal 2 more than once") as caught:
        pod.arrive(1, replicas=[0, 1, 2, 2])
    assert pod.error(waiting) is caught.error
    assert pod.wakeups("round") == [pod.round_wakeup((0, 1, 2), 0)]
    with raises(Code.INVALID_ARGUMENT, "ordinal 2 called rendezvous('t') as", f"before it came (its round counter for the group moves on with its peers'): {caught.error.message}"):
        pod.arrive(2, replicas=[0, 1, 2])
    assert pod.error(waiting) is caught.error


def test_duplicate_ordinals_fail_the_next_round_when_nobody_waits_yet():
    """With no round pending, a duplicate in replicas fails the group's next round so its members learn of it."""
    pod = make_pod(3)
    with raises(Code.INVALID_ARGUMENT, "more than once") as caught:
        pod.arrive(0, replicas=[0, 0, 1])
    assert pod.arrive(1, replicas=[0, 1]) == pod.key((0, 1), 0)
    assert pod.error(pod.key((0, 1), 0)) is caught.error


def test_a_caller_outside_its_replicas_fails_the_members_round():
    """A caller not among its replicas raises INVALID_ARGUMENT and fails the round its replicas wait in."""
    pod = make_pod(3)
    waiting = pod.arrive(0, replicas=[0, 1])
    with raises(
        Code.INVALID_ARGUMENT, "ordinal 2 called rendezvous('t') with replicas [0-1]", "not among them"
    ) as caught:
        pod.arrive(2, replicas=[1, 0])
    assert pod.error(waiting) is caught.error


def test_a_call_of_members_with_a_sibling_outside_their_replicas_fails_their_round():
    """Two threads of a process call with replicas [0, 1, 2], one of them (3) outside: the
    call was refused as an outsider's, its member (2) counted its round but was recorded
    nowhere, and the other members waited for it (named missing at their timeout, for ever
    without one). The round it counts as now fails for every member, naming the outsider."""
    pod = make_pod(2, 2)
    with raises(Code.INVALID_ARGUMENT, "ordinal 3 called", "not among them") as caught:
        pod.arrive([2, 3], replicas=[0, 1, 2])
    members = pod.arrive([0, 1], replicas=[0, 1, 2])
    assert pod.error(members) is caught.error
    with raises(Code.INVALID_ARGUMENT, "ordinal 3 called"):  # its resend: the same answer
        pod.arrive([2, 3], replicas=[0, 1, 2])
    second = pod.arrive([0, 1], replicas=[0, 1, 2], round_number=1)
    assert pod.result(pod.arrive(2, replicas=[0, 1, 2], round_number=1)) == [payload_of(o) for o in (0, 1, 2)]
    assert pod.outcome(second).result is not None


def test_a_tag_over_the_limit_with_bad_replicas_is_not_copied_into_the_members_error():
    """A tag over the limit from a caller with a bad replicas list: the members' error (kept
    with the round, journaled, in the state file) held the whole tag, 5 MB of it."""
    pod = make_pod(3, limits=Limits(max_tag_length=64))
    waiting = pod.arrive(0, replicas=[0, 1])
    with raises(Code.INVALID_ARGUMENT, "not among them"):
        pod.arrive(2, replicas=[0, 1], tag="x" * 100_000)
    assert len(pod.error(waiting).message) < 500, len(pod.error(waiting).message)


@pytest.mark.parametrize(
    "replicas, group", [([1, 0, 4], (0, 1)), ([-1, 1, 0], (0, 1)), ([0, 1, 2, 3, 4], ()), ([0, 1, 1, 7], (0, 1))]
)
def test_replicas_out_of_range_fail_the_round_the_peers_wait_in(replicas, group):
    """Replicas outside [0, world) are INVALID_ARGUMENT naming them, and, as a duplicate does,
    fail the round of the ordinals in range that the caller's peers wait in: they learn of it
    at once instead of timing out blaming the caller as missing."""
    pod = make_pod(4)
    waiting = pod.arrive(1, replicas=list(group))
    bystander = pod.arrive(2, replicas=[2, 3])
    bad = sorted(o for o in set(replicas) if not 0 <= o < 4)
    with raises(Code.INVALID_ARGUMENT, f"replicas {bad}", "[0, 4)", "ordinal 0", "'t'") as caught:
        pod.arrive(0, replicas=replicas)
    assert pod.error(waiting) is caught.error
    assert pod.outcome(bystander) is None


def test_replicas_all_out_of_range_fail_no_round():
    """Replicas naming no ordinal of the job leave every round alone: no peer waits for the caller."""
    pod = make_pod(4)
    waiting = pod.arrive(1)
    with raises(Code.INVALID_ARGUMENT, "replicas [-1, 9]", "[0, 4)"):
        pod.arrive(0, replicas=[9, -1])
    assert pod.outcome(waiting) is None
    assert pod.core.status(0.0, JOB)[0].pending_rounds[0].arrived == [1]


def test_a_caller_outside_its_replicas_spoils_no_later_round_of_theirs():
    """An outsider's round counter is not its replicas' group's: once that group's round is
    over (nobody waits in it), the outsider's call fails no round, so the members' next
    rounds complete (a call once failed the group's next round, which its members had not
    reached yet, with the outsider's stale error)."""
    pod = make_pod(4)
    # Every ordinal calls the pair's rendezvous, as if the guard around it was forgotten.
    pod.arrive(0, replicas=[0, 1], round_number=0)
    assert pod.result(pod.arrive(1, replicas=[0, 1], round_number=0)) == [b"p0", b"p1"]
    for outsider in (2, 3):
        with raises(Code.INVALID_ARGUMENT, f"ordinal {outsider} called", "not among them"):
            pod.arrive(outsider, replicas=[0, 1], round_number=0)
    for number in (1, 2):
        pod.arrive(0, replicas=[0, 1], round_number=number)
        assert pod.result(pod.arrive(1, replicas=[0, 1], round_number=number)) == [b"p0", b"p1"]


def test_a_resent_call_from_outside_its_replicas_fails_no_second_round():
    """An outsider's call fails the round its replicas wait in once: its resend (an answer
    lost, the same call again) raises the same error and leaves the members' next round
    alone (it once failed that one too); the outsider's next call fails the round then."""
    pod = make_pod(3)
    first = pod.arrive(0, replicas=[0, 1], round_number=0)
    with raises(Code.INVALID_ARGUMENT, "ordinal 2 called", "not among them"):
        pod.arrive(2, replicas=[0, 1], round_number=0)
    assert_message(pod.error(first), Code.INVALID_ARGUMENT, "ordinal 2 called")
    second = pod.arrive(0, replicas=[0, 1], round_number=1)
    with raises(Code.INVALID_ARGUMENT, "ordinal 2 called", "not among them"):
        pod.arrive(2, replicas=[0, 1], round_number=0)  # the resend
    assert pod.result(pod.arrive(1, replicas=[0, 1], round_number=1)) == [payload_of(0), payload_of(1)]
    assert pod.outcome(second).result is not None
    third = pod.arrive(0, replicas=[0, 1], round_number=2)
    with raises(Code.INVALID_ARGUMENT, "ordinal 2 called"):
        pod.arrive(2, replicas=[0, 1], round_number=1)  # its next call
    assert_message(pod.error(third), Code.INVALID_ARGUMENT, "ordinal 2 called")

    # A host relay's call for two outsiders, then resent per process (the combined one failed).
    pod = make_pod(4)
    first = pod.arrive(0, replicas=[0, 1])

    def outsiders(*ordinals):
        return pod.core.arrive(1.0, job=JOB, incarnation=incarnation_of(2), replicas=[0, 1], round_number=0,
                               deadline=None, contributions=[Contribution(o, "t", payload_of(o), incarnation_of(o)) for o in ordinals])

    with raises(Code.INVALID_ARGUMENT, "ordinals 2-3 called"):
        outsiders(2, 3)
    assert_message(pod.error(first), Code.INVALID_ARGUMENT, "ordinals 2-3 called")
    second = pod.arrive(0, replicas=[0, 1], round_number=1)
    for ordinal in (2, 3):
        with raises(Code.INVALID_ARGUMENT, f"ordinal {ordinal} called"):
            outsiders(ordinal)
    assert pod.outcome(second) is None


@pytest.mark.parametrize("replicas", [[0, 1, 2, 3, 4], [0, 0, 1, 2, 3], [3, 2, 1, 0, -1]])
def test_members_calling_with_one_malformed_list_fail_that_round_once(replicas):
    """Every member calling with the same malformed list (out of range, a repeated ordinal):
    their calls count as the round they carry, of the group their ordinals in range make, as
    the client counts them; the round fails once, for all of them, and the next round
    completes (each bad call once failed a round ahead of the members instead, so their next
    correct calls failed with the stale errors, or as fallen behind)."""
    pod = make_pod(4)
    for ordinal in range(4):
        pod.arrive(ordinal, round_number=0)
    errors = []
    for ordinal in range(4):
        with raises(Code.INVALID_ARGUMENT) as caught:
            pod.arrive(ordinal, replicas=replicas, round_number=1)
        errors.append(caught.error)
    assert pod.error(pod.key(ALL, 1)) is errors[0]
    for ordinal in range(4):
        key = pod.arrive(ordinal, round_number=2)
    assert pod.result(key) == [payload_of(o) for o in range(4)]


def test_members_that_disagree_on_replicas_fail_promptly_as_a_wait_cycle():
    """Ordinal 0 in [0,1] and ordinal 1 in [0,1,2] wait on each other: both rounds fail naming both calls."""
    pod = make_pod(4)
    first = pod.arrive(0, replicas=[0, 1], tag="a")
    second = pod.arrive(1, replicas=[0, 1, 2], tag="b")
    error = pod.error(first)
    assert pod.error(second) is error
    assert_message(
        error,
        Code.FAILED_PRECONDITION,
        "can never complete",
        "rendezvous 'a' on replicas [0-1] (round 0)",
        "rendezvous 'b' on replicas [0-2] (round 0)",
        "disagree on replicas",
    )
    assert sorted(pod.wakeups("round")) == [pod.round_wakeup((0, 1), 0), pod.round_wakeup((0, 1, 2), 0)]


def test_a_wait_cycle_through_the_all_group_is_detected():
    """Ordinal 0 in [0,1] and ordinal 1 in the ALL group of a 3-ordinal world fail as a wait cycle."""
    pod = make_pod(3)
    first = pod.arrive(0, replicas=[0, 1])
    second = pod.arrive(1, replicas=[0, 1, 2])
    assert second == pod.key(ALL, 0)
    assert_message(pod.error(first), Code.FAILED_PRECONDITION, "all ordinals", "replicas [0-1]")
    assert pod.error(second) is pod.error(first)


def test_a_three_round_wait_cycle_is_detected():
    """A cycle through three pairwise groups fails all three rounds at the arrival that closes it."""
    pod = make_pod(3)
    a = pod.arrive(0, replicas=[0, 1])
    b = pod.arrive(1, replicas=[1, 2])
    assert pod.outcome(a) is None and pod.outcome(b) is None
    c = pod.arrive(2, replicas=[0, 2])
    assert pod.error(a) is pod.error(b) is pod.error(c)


def test_a_legitimate_overlap_of_groups_does_not_fail():
    """0 waiting in [0,1] while 2 waits in [0,1,2] and 1 has not arrived is no cycle; both rounds then complete."""
    pod = make_pod(4)
    pair = pod.arrive(0, replicas=[0, 1])
    triple = pod.arrive(2, replicas=[0, 1, 2])
    assert pod.outcome(pair) is None and pod.outcome(triple) is None
    assert pod.arrive(1, replicas=[0, 1]) == pair
    assert pod.result(pair) == [b"p0", b"p1"]
    pod.arrive(0, replicas=[0, 1, 2])
    pod.arrive(1, replicas=[0, 1, 2])
    assert pod.result(triple) == [b"p0", b"p1", b"p2"]


def test_expire_fails_an_overdue_round_naming_missing_ordinals_hosts_and_ages():
    """At its deadline, not before, a round fails with DEADLINE_EXCEEDED naming missing ranges, hosts and ages."""
    pod = make_pod(8, register=False)
    for task in range(8):
        if task != 6:
            pod.register(task)
    pod.arrive(0, now=1.0, deadline=7.0)
    pod.arrive(1, now=1.0)
    pod.arrive(4, now=1.0, deadline=9.0)
    for task in (5, 7):
        pod.core.touch(JOB, incarnation_of(task), 5.0)
    assert pod.deadline(pod.key(ALL, 0)) == 7.0
    pod.core.expire(6.999)
    assert pod.outcome(pod.key(ALL, 0)) is None
    pod.core.take_wakeups()
    pod.core.expire(7.0)
    assert_message(
        pod.error(pod.key(ALL, 0)),
        Code.DEADLINE_EXCEEDED,
        "rendezvous 't' on all ordinals (round 0) timed out after 6.0 s (counted from the first call to "
        "reach the coordinator) with",
        "3 of 8 arrived",
        "missing ordinals 2-3, 5-7",
        "2-3 on host-0 (pids 1002, 1003, last seen 7.0 s ago)",
        "5, 7 on host-1 (pids 1005, 1007, last seen 2.0 s ago)",
        "6 never registered",
    )
    assert pod.wakeups("round") == [pod.round_wakeup(ALL, 0)]
    assert pod.deadline(pod.key(ALL, 0)) is None


def test_a_timeout_in_a_large_pod_names_hosts_within_what_a_client_keeps():
    """Every other host of 512 missing: the message counts the missing ordinals instead of
    listing their ranges twice, so the 2,000 characters a client keeps (clip) name hosts
    (the ranges alone filled them)."""
    from pjrt_rendezvous.client._session import clip

    pod = make_pod(2048, 1, limits=Limits(max_world_size=4096))
    for task in range(2048):
        if task // 4 % 2 == 0:
            pod.arrive(task, deadline=5.0)
    pod.core.expire(5.0)
    message = clip(pod.error(pod.key(ALL, 0)).message)
    assert "1024 of 2048 arrived; missing 1024 ordinals (4-7 on host-1 (pids 1004, 1005, 1006, 1007, last seen" in message, message[:300]
    assert re.findall(r"on host-\d+", message)[:3] == ["on host-1", "on host-3", "on host-5"]


def test_a_timeout_missing_many_hosts_names_those_that_fit_and_counts_the_rest():
    """1,024 tasks x 2 on 256 hosts, 100 tasks silent: the description by host (about 4,300
    characters) went through the 2,000 a message keeps (clip), cut anywhere, naming 40 of
    88 hosts and nothing of the rest; now it names the hosts that fit and counts the others,
    every missing ordinal accounted for. The status keeps the whole description."""
    from pjrt_rendezvous.client._session import clip

    tasks = 1024
    pod = Pod(Core(), tasks, 2)
    silent = set(random.Random(1).sample(range(tasks), 100))
    everywhere = {f"t1v-n-{task // 4:03d}" for task in silent}
    for task in range(tasks):
        pod.register(task, host=f"t1v-n-{task // 4:03d}")
    for task in sorted(set(range(tasks)) - silent):
        key = pod.arrive([task * 2, task * 2 + 1], now=1.0, deadline=10.0)
    (waiting,) = pod.core.status(5.0, JOB, participants=False)[0].pending_rounds
    assert set(re.findall(r"on (t1v-n-\d+) \(pids? [, 0-9]+, last seen", waiting.missing_summary)) == everywhere
    pod.core.expire(11.0)
    message = pod.error(key).message
    assert len(message) <= 2000 and clip(message) == message, len(message)
    named = re.findall(r"([-, 0-9]+) on (t1v-n-\d+) \(pids? [, 0-9]+, last seen", message.split("(", 1)[1])
    rest, hosts = re.search(r"; and (\d+) more ordinals on (\d+) more hosts \(`pjrt-rendezvous status` lists them all\)\)$", message).groups()
    assert {host for _, host in named} < everywhere and len(named) + int(hosts) == len(everywhere), message
    ranges = [r.split("-") for text, _ in named for r in text.strip(" ;").split(", ")]
    listed = sum(int(r[-1]) - int(r[0]) + 1 for r in ranges)
    assert listed + int(rest) == 200, (listed, rest)


def test_a_host_whose_missing_ordinals_do_not_fit_is_named_with_them_cut_short():
    """Every other ordinal of one process missing (1,000 of them, about 5,900 characters as
    ranges): the message counted them "on 1 more host" and named no ordinal, host or time,
    with most of its 2,000 characters free; now it lists those that fit, then their count,
    host and last seen."""
    pod = make_pod(2, 2000, register=False, limits=Limits(max_world_size=4096))
    for task in range(2):
        pod.register(task, host="t1v-n-0")
    pod.arrive(range(2000), now=1.0, deadline=10.0)
    key = pod.arrive(range(2000, 4000, 2), now=1.0, deadline=10.0)
    pod.core.expire(11.0)
    message = pod.error(key).message
    assert len(message) <= 2000, len(message)
    cut = re.search(r"missing 1000 ordinals \((2001, 2003, [-, 0-9]+), \.\.\. \(1000 ordinals\) on t1v-n-0 \(pid 1001, last seen 10.0 s ago\)\)$", message)
    assert cut and len(cut.group(1)) > 1500, message


def test_an_empty_tag_is_named_as_one():
    """xla_rendezvous's default tag is '' (tag=None): a round of it was told as "rendezvous ?"."""
    pod = make_pod(2)
    key = pod.arrive(0, tag="", deadline=5.0)
    pod.core.expire(6.0)
    assert pod.error(key).message.startswith("rendezvous '' on all ordinals (round 0) timed out"), pod.error(key).message


def test_a_cut_description_counts_each_host_left_out_once():
    """800 tasks of 2 on 200 hosts, each task's thread 1 not bound and one process per host
    dead: a host's missing ordinals are told in two parts, "(dead)" and not, and the count
    of the hosts left out of a message cut to fit counted parts, not hosts ("on 361 more
    hosts" of 200)."""
    pod = make_pod(800, 2, register=False, limits=Limits(max_world_size=4096))
    for task in range(800):
        pod.register(task, threads=[0])
    for task in range(0, 800, 4):
        pod.core.declare_dead(JOB, incarnation_of(task), "silent")
    message = pod.core.world_timeout(JOB, now=30.0, waited=30.0).message
    rest, hosts = re.search(r"; and (\d+) more ordinals on (\d+) more hosts \(`pjrt-rendezvous status`", message).groups()
    named = re.findall(r"on (host-\d+)", message)
    last = int(named[-1].split("-")[1])  # (the last host named may have a part left out)
    assert int(hosts) in (199 - last, 200 - last), (hosts, last, message[-300:])
    assert int(rest) + sum(len(part.split(", ")) for part in re.findall(r"([\d, ]+) on host-", message)) == 800


def test_the_round_deadline_is_the_earliest_member_deadline():
    """A later member with an earlier deadline moves the round's deadline forward; None never extends it."""
    pod = make_pod(4)
    key = pod.arrive(0, deadline=50.0)
    assert pod.deadline(key) == 50.0
    pod.arrive(1, deadline=None)
    assert pod.deadline(key) == 50.0
    pod.arrive(2, deadline=20.0)
    assert pod.deadline(key) == 20.0
    pod.core.expire(19.0)
    assert pod.outcome(key) is None
    pod.core.expire(20.0)
    assert pod.error(key).code is Code.DEADLINE_EXCEEDED


@pytest.mark.parametrize("late", [9.0, 0.0])
def test_an_arrival_after_the_deadline_fails_the_round_it_would_have_completed(late):
    """A round past its deadline that nobody expired (its waiter went away) fails when the
    next member comes, as it would have at its deadline, instead of completing late; the
    message gives the time it timed out after, not the time it was noticed. At the deadline
    itself too, as ``expire`` judges it (a deadline is when the round has failed)."""
    pod = make_pod(2)
    key = pod.arrive(0, now=0.0, deadline=1.0)
    with raises(
        Code.DEADLINE_EXCEEDED,
        "ordinal 1 called rendezvous('t') as round 0 of all ordinals, which had failed before it came (its round",
        "timed out after 1.0 s (counted from the first call to reach the coordinator) with 1 of 2 arrived; missing ordinal 1",
    ):
        pod.arrive(1, now=1.0 + late, deadline=15.0)
    assert pod.error(key).code is Code.DEADLINE_EXCEEDED
    assert pod.wakeups("round") == [pod.round_wakeup(ALL, 0)]
    pod.arrive(0, now=11.0, round_number=1)
    assert pod.result(pod.arrive(1, now=11.0, round_number=1)) == [b"p0", b"p1"]  # the next round is whole


def test_a_round_held_over_is_completed_by_an_arrival_read_after_its_deadline():
    """hold_over (the coordinator was held up as deadlines passed): each pending round whose
    deadline passed is judged at ``until`` instead, so a member whose call waited unread
    completes it; a round whose deadline is still ahead keeps it; one held over that nobody
    completes fails at ``until``."""
    pod = make_pod(3)
    held = pod.arrive(0, now=0.0, deadline=1.0, replicas=[0, 1])
    lonely = pod.arrive(0, now=0.0, deadline=2.0, replicas=[0, 2])
    ahead = pod.arrive(0, now=0.0, deadline=30.0)
    pod.core.hold_over(5.0, 6.0)
    assert (pod.deadline(held), pod.deadline(lonely), pod.deadline(ahead)) == (6.0, 6.0, 30.0)
    assert pod.result(pod.arrive(1, now=5.5, deadline=20.0, replicas=[0, 1])) == [b"p0", b"p1"]
    pod.core.expire(5.9)
    assert pod.outcome(lonely) is None
    pod.core.expire(6.0)
    assert pod.error(lonely).code is Code.DEADLINE_EXCEEDED and pod.outcome(ahead) is None


def test_rounds_without_a_deadline_never_expire():
    """expire() leaves rounds whose members all wait forever alone."""
    pod = make_pod(2)
    key = pod.arrive(0)
    pod.core.expire(1e12)
    assert pod.outcome(key) is None


def test_payload_over_the_limit_is_resource_exhausted_and_fails_the_round_for_every_member():
    """A payload over max_payload_bytes is RESOURCE_EXHAUSTED naming size and limit, and the
    round fails at once for the members already waiting (not a timeout naming the refused
    ordinal as missing); at the limit it passes."""
    pod = make_pod(2, limits=Limits(max_payload_bytes=8))
    key = pod.arrive(0)
    fragments = ("ordinal 1", "9 bytes", "limit of 8 bytes", "max_payload_bytes", "rendezvous 't' on all ordinals (round 0) fails for every member")
    with raises(Code.RESOURCE_EXHAUSTED, *fragments) as caught:
        pod.arrive(1, payloads={1: b"x" * 9})
    assert pod.error(key) is caught.error
    assert pod.core.jobs[JOB].pending == {}
    key = pod.arrive([0], round_number=1)
    pod.arrive(1, round_number=1, payloads={1: b"x" * 8})
    assert pod.result(key) == [payload_of(0), b"x" * 8]
    # The first to come over the limit: a later member is told the round's tag (it was "rendezvous ?").
    with raises(Code.RESOURCE_EXHAUSTED):
        pod.arrive(1, round_number=2, tag="big", payloads={1: b"x" * 9})
    with raises(Code.RESOURCE_EXHAUSTED, "ordinal 0 called rendezvous('big') as round 2 of all ordinals, which had failed before it came (its round"):
        pod.arrive(0, round_number=2, tag="big")


def test_a_round_whose_answer_passes_max_round_bytes_fails_for_every_member():
    """Every member's answer holds the round's payloads, in one message (at most 2 GiB):
    a round whose payloads together (6 bytes of framing each) pass max_round_bytes fails for
    every member, naming its size and the limit, where the answer could not be sent (a
    round of 64 ordinals of 40 MiB each had no check); at the limit it completes, and the
    group's next round is not spoiled."""
    pod = make_pod(3, limits=Limits(max_round_bytes=3 * 6 + 30))
    first = pod.arrive(0, payloads={0: b"x" * 10})
    second = pod.arrive(1, payloads={1: b"y" * 10})
    with raises(Code.RESOURCE_EXHAUSTED, "rendezvous 't' on all ordinals (round 0) fails for every member",
                "3 payloads", "49 bytes", "limit of 48 bytes (max_round_bytes"):
        raise pod.error(pod.arrive(2, payloads={2: b"z" * 11}))
    assert pod.error(first) is pod.error(second)
    assert pod.core.jobs[JOB].rounds_completed == 0 and pod.core.jobs[JOB].pending == {}
    keys = [pod.arrive(o, round_number=1, payloads={o: b"w" * 10}) for o in range(3)]
    assert pod.result(keys[0]) == [b"w" * 10] * 3
    with pytest.raises(ValueError, match="max_round_bytes must be at most 2130706432"):
        Limits(max_round_bytes=1 << 31)


def test_tag_over_the_limit_is_resource_exhausted_and_fails_the_round():
    """A tag longer than max_tag_length is RESOURCE_EXHAUSTED naming its length and the limit."""
    pod = make_pod(2, limits=Limits(max_tag_length=5))
    key = pod.arrive(0, tag="x" * 5)
    with raises(Code.RESOURCE_EXHAUSTED, "the tag of ordinal 1 is 6 characters", "limit of 5", "max_tag_length") as caught:
        pod.arrive(1, tag="x" * 6)
    assert pod.error(key) is caught.error
    key = pod.arrive(0, tag="x" * 5, round_number=1)
    pod.arrive(1, tag="x" * 5, round_number=1)
    assert pod.result(key) == [payload_of(0), payload_of(1)]


def test_unknown_job_is_not_found():
    """arrive, world, touch and status on a job nobody created are NOT_FOUND listing the known jobs."""
    pod = make_pod(1)
    with raises(Code.NOT_FOUND, "'nope'", "'job'"):
        dataclasses.replace(pod, job="nope").arrive(0)
    for call in (
        lambda: pod.core.world("nope"),
        lambda: pod.core.touch("nope", "x", 0.0),
        lambda: pod.core.status(0.0, "nope"),
        lambda: pod.core.outcome("nope", (1, ALL, 0)),
    ):
        with raises(Code.NOT_FOUND, "'nope'", "restarted without --state-file has forgotten its jobs"):
            call()
    # With a state file the restart is no cause: a typo, or a job dropped; past 10, jobs are counted.
    pod.core.journal = []
    for n in range(11):
        pod.core.kv_set(f"store-{n:02}", [("k", b"v")])
    with raises(Code.NOT_FOUND, "(known jobs: 'job', 'store-00', ", "'store-08' and 2 more)",
                "(check the job's name (PJRT_RENDEZVOUS_JOB); a finished job is dropped at --max-jobs)") as caught:
        pod.core.world("nope")
    assert "restarted" not in caught.error.message


def test_strangers_lists_the_processes_not_known_that_heartbeat_by_job():
    """Heartbeats of processes the core does not know (a coordinator restarted without its
    state file) are refused and remembered for status: per job the processes heard from in
    the last ten minutes and when the last was, their job known or not; `status` of an unknown
    job says so; a job made again under the name leaves its old processes strangers to it,
    until one registers again; jobs and processes are bounded."""
    core = make_pod(1).core
    for incarnation, now in (("a", 0.0), ("b", 1.0), ("a", 2.0)):
        with raises(Code.NOT_FOUND, "'gone'"):
            core.touch("gone", incarnation, now)
    (view,) = core.strangers(5.0)
    assert (view.job, view.job_known, view.processes, view.last_call_age) == ("gone", False, 2, 3.0)
    assert view.reason == "it has no --state-file, so a restart forgot its jobs, whose processes must start again"
    with raises(Code.NOT_FOUND, "job 'gone' is not known", "; 2 processes of it heartbeat this coordinator, the last 3.0 s ago"):
        core.status(5.0, "gone")
    for name in ("", "bad\nname"):  # (no job's name: refused, not kept)
        with raises(Code.NOT_FOUND):
            core.touch(name, "c", 5.0)
    assert [v.job for v in core.strangers(5.0)] == ["gone"]
    # b was last heard at 1.0, a at 2.0: each forgotten ten minutes after
    assert [v.processes for v in core.strangers(601.5)] == [1]
    assert core.strangers(602.5) == [] and core.unknown == {}

    for n in range(20):  # at most 16 jobs, the least recently heard dropped first
        with raises(Code.NOT_FOUND):
            core.touch(f"gone-{n}", "a", 700.0 + n)
    assert [v.job for v in core.strangers(720.0)] == sorted(f"gone-{n}" for n in range(4, 20))
    for n in range(4100):  # at most 4,096 processes a job
        with raises(Code.NOT_FOUND):
            core.touch("gone-19", f"p{n}", 720.0)
    assert {v.job: v.processes for v in core.strangers(720.0)}["gone-19"] == 4096

    core.register(721.0, registration(0, 2, 1, job="gone-19"))  # made again by a new process
    (view,) = [v for v in core.strangers(721.0) if v.job == "gone-19"]
    assert (view.job_known, view.processes) == (True, 4096)
    assert view.reason == (
        "it has no --state-file, so a restart forgot them, or their job was dropped at --max-jobs (made again since): "
        "they must register again"
    )
    with raises(Code.FAILED_PRECONDITION, "'p5000' is not registered in job 'gone-19'") as refused:
        core.touch("gone-19", "p5000", 722.0)
    assert refused.error.warn[:2] == (("unknown process", "gone-19", 1), "unknown_process")  # (once a run)
    assert refused.error.warn[2].startswith("refused calls from processes not registered in job 'gone-19', which")
    core.register(723.0, registration(1, 2, 1, job="gone-19", incarnation="p5000"))  # registered again
    (view,) = [v for v in core.strangers(723.0) if v.job == "gone-19"]
    assert view.processes == 4095
    core.journal = []  # (with a state file, the cause is another)
    assert [v.reason for v in core.strangers(723.0) if v.job == "gone-19"] == [
        "their job was dropped at --max-jobs and made again since, or they were started for another coordinator"
    ]


def test_an_unregistered_incarnation_cannot_arrive():
    """arrive() from an incarnation the job does not know is FAILED_PRECONDITION."""
    pod = make_pod(2)
    with raises(Code.FAILED_PRECONDITION, "'ghost' is not registered"):
        pod.arrive(0, incarnation="ghost")


def test_a_process_cannot_contribute_for_another_process_or_an_unregistered_ordinal():
    """Contributing an ordinal of another process, or of nobody, is FAILED_PRECONDITION naming the owner."""
    pod = make_pod(2, 2, register=False)
    pod.register(0)
    pod.register(1, threads=[0])
    with raises(Code.FAILED_PRECONDITION, "ordinal 2 is registered by host-0 pid 1001", "host-0 pid 1000"):
        pod.arrive([0, 2], incarnation=incarnation_of(0))
    with raises(Code.FAILED_PRECONDITION, "ordinal 3 is not registered", "after a coordinator restart without a state file"):
        pod.arrive(3, incarnation=incarnation_of(1))
    assert pod.core.jobs[JOB].pending == {}


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"ordinals": [0, 0]}, "contribute twice"),
        ({"ordinals": []}, "at least one contribution"),
        ({"ordinals": [0], "round_number": -1}, "round number must be >= 0"),
    ],
    ids=["duplicate-contribution", "no-contribution", "negative-round"],
)
def test_malformed_arrivals_are_invalid_argument(kwargs, fragment):
    """Duplicate or missing contributions and negative round numbers are INVALID_ARGUMENT."""
    pod = make_pod(1, 2)
    kwargs = dict(kwargs)
    ordinals = kwargs.pop("ordinals")
    with raises(Code.INVALID_ARGUMENT, fragment):
        pod.arrive(ordinals, incarnation=incarnation_of(0), **kwargs)


def test_too_many_pending_rounds_is_resource_exhausted():
    """Opening more than max_pending_rounds rounds in a job is RESOURCE_EXHAUSTED."""
    pod = make_pod(4, limits=Limits(max_pending_rounds=2))
    pod.arrive(0, replicas=[0, 1])
    pod.arrive(2, replicas=[1, 2])
    with raises(Code.RESOURCE_EXHAUSTED, "max_pending_rounds=2"):
        pod.arrive(3, replicas=[0, 3])


def test_a_round_far_ahead_of_its_groups_next_unfinished_round_is_refused(monkeypatch):
    """Calls abandoned by their client leave rounds ahead of their group: a round more than
    _ROUNDS_AHEAD past the group's next unfinished round is INVALID_ARGUMENT naming both; a
    group the coordinator knows nothing of (restarted without a state file) takes any number."""
    from pjrt_rendezvous.coordinator import _core

    monkeypatch.setattr(_core, "_ROUNDS_AHEAD", 5)
    pod = make_pod(2)
    for number in range(6):
        pod.arrive(0, round_number=number)
    with raises(Code.INVALID_ARGUMENT, "round 6 of all ordinals is 6 rounds ahead", "next unfinished round (0)",
                "more than the 5 allowed"):
        pod.arrive(0, round_number=6)
    with raises(Code.INVALID_ARGUMENT, "round 1000000 of all ordinals", "next unfinished round (0)"):
        pod.arrive(0, replicas=[0, 1], round_number=1_000_000)  # the same group as all ordinals
    assert len(pod.core.jobs[JOB].pending) == 6
    pod.arrive(1, round_number=0)  # round 0 finishes: one more may start
    pod.arrive(0, round_number=6)
    pod.arrive(1, round_number=1)
    assert pod.result(pod.key(ALL, 1)) == [payload_of(0), payload_of(1)]

    fresh = make_pod(2)
    key = fresh.arrive(0, replicas=[0, 1], round_number=5000)
    fresh.arrive(1, replicas=[0, 1], round_number=5000)
    assert fresh.result(key) == [payload_of(0), payload_of(1)]
    fresh.arrive(0, round_number=5005)
    fresh.arrive(0, round_number=5006)  # (5 ahead of 5001: the most allowed)
    with raises(Code.INVALID_ARGUMENT, "round 5007 of all ordinals is 6 rounds ahead", "(5001)"):
        fresh.arrive(0, round_number=5007)


def test_wake_keys_name_world_rounds_and_keys():
    """take_wakeups returns the world, round and kv wake keys queued since the last call, then nothing."""
    pod = make_pod(2, register=False)
    pod.register(0)
    pod.register(1)
    pod.arrive(0, replicas=[0])
    pod.arrive(0)
    pod.arrive(1)
    pod.core.kv_set(JOB, [("a", b"1"), ("b", b"2")])
    pod.core.kv_add(JOB, "n", 1)
    pod.core.kv_append(JOB, "log", b"x")
    pod.core.kv_compare_set(JOB, "cas", b"", b"v")
    pod.core.kv_compare_set(JOB, "cas", b"wrong", b"w")  # no write, no wake
    assert pod.core.take_wakeups() == [
        ("world", JOB),
        pod.round_wakeup((0,), 0),
        pod.round_wakeup(ALL, 0),
        ("kv", JOB, "a"),
        ("kv", JOB, "b"),
        ("kv", JOB, "n"),
        ("kv", JOB, "log"),
        ("kv", JOB, "cas"),
    ]
    assert pod.core.take_wakeups() == []


def test_jobs_are_separate_namespaces():
    """Two jobs keep separate rank tables, rounds and keys."""
    core = Core()
    a, b = Pod(core, 2, 1, job="a"), Pod(core, 1, 1, job="b")
    for pod in (a, b):
        for task in range(pod.tasks):
            pod.register(task)
    a.arrive(0)
    assert b.result(b.arrive(0)) == [b"p0"]
    assert a.outcome(a.key(ALL, 0)) is None
    core.kv_set("a", [("k", b"a")])
    assert core.kv_get("b", ["k"]) == [None]


# --- key-value -----------------------------------------------------------------------------------


def test_kv_set_and_get_single_and_multiple_keys():
    """kv_set writes every entry and kv_get returns values in request order with None for missing keys."""
    core = Core()
    core.kv_set(JOB, [("a", b"1"), ("b", b"")])
    core.kv_set(JOB, [("a", b"2")])
    assert core.kv_get(JOB, ["a"]) == [b"2"]
    assert core.kv_get(JOB, ["b", "missing", "a"]) == [b"", None, b"2"]


def test_a_key_value_call_that_saw_another_store_of_the_job_is_refused():
    """A client names the store its last answer came from: the job's keys, or (no job yet)
    the core's state. Another core (restarted without its state) or a job dropped and made
    again has another, and the call is refused before it changes anything, so no client is
    answered from an empty store as if it were the one it used."""
    core = Core(Limits(max_jobs=1))
    none_yet = core.store_id(JOB)
    assert none_yet == core.state_id and len(none_yet) == 16
    core.check_store(JOB, "")  # a client that saw nothing yet
    core.kv_set(JOB, [("a", b"1")])
    core.check_store(JOB, none_yet)  # saw no job, on this core: the job made since is fine
    seen = core.store_id(JOB)
    assert seen not in ("", none_yet)
    core.check_store(JOB, seen)
    restarted = Core()  # without its state
    core.kv_delete(JOB, "a")
    core.kv_set("other", [("b", b"2")])  # the job, holding nothing, is dropped for another
    assert JOB not in core.jobs
    core.kv_delete("other", "b")
    for other, saw in ((restarted, seen), (restarted, none_yet), (core, seen)):
        with pytest.raises(CoreError, match=rf"the keys of job '{JOB}' are not the ones this client saw") as refused:
            other.check_store(JOB, saw)
        assert refused.value.code is Code.FAILED_PRECONDITION
    core.kv_set(JOB, [("a", b"new")])  # (a client that saw the refusal starts afresh)
    assert core.store_id(JOB) not in ("", seen, none_yet)


def test_kv_add_treats_a_missing_key_as_zero_and_stores_decimal_text():
    """kv_add starts from 0, accepts negative deltas and stores the sum as ASCII digits."""
    core = Core()
    assert core.kv_add(JOB, "n", 5) == 5
    assert core.kv_add(JOB, "n", -7) == -2
    assert core.kv_get(JOB, ["n"]) == [b"-2"]
    core.kv_set(JOB, [("m", b"40")])
    assert core.kv_add(JOB, "m", 2) == 42
    # The 64-bit range, as torch's stores keep it: its ends are reached, not passed
    assert core.kv_add(JOB, "top", 2**63 - 1) == 2**63 - 1
    with raises(Code.INVALID_ARGUMENT, "adding 1 to key 'top' (value 9223372036854775807) leaves the 64-bit integer range"):
        core.kv_add(JOB, "top", 1)
    assert core.kv_add(JOB, "bottom", -(2**63)) == -(2**63)
    with raises(Code.INVALID_ARGUMENT, "leaves the 64-bit integer range"):
        core.kv_add(JOB, "bottom", -1)
    assert core.kv_get(JOB, ["top", "bottom"]) == [b"9223372036854775807", b"-9223372036854775808"]


def test_kv_add_on_a_non_integer_value_is_invalid_argument():
    """Adding to a non-integer value is INVALID_ARGUMENT naming the key and leaves the value alone."""
    core = Core()
    for value in (b"1.5", b"1_000"):  # (Python's int() takes "1_000": 1001, where other stores refuse or read 1)
        core.kv_set(JOB, [("k", value)])
        with raises(Code.INVALID_ARGUMENT, "'k'", "not an integer"):
            core.kv_add(JOB, "k", 1, request_id="r")
        assert core.kv_get(JOB, ["k"]) == [value]
    core.kv_set(JOB, [("k", b"1")])
    assert core.kv_add(JOB, "k", 1, request_id="r") == 2  # the failed attempt was not remembered


def test_kv_add_with_the_same_request_id_is_applied_once():
    """A retried add with the same request id returns the first result without adding again."""
    core = Core()
    assert core.kv_add(JOB, "n", 3, request_id="r1") == 3
    assert core.kv_add(JOB, "n", 3, request_id="r1") == 3
    assert core.kv_get(JOB, ["n"]) == [b"3"]
    assert core.kv_add(JOB, "n", 3, request_id="r2") == 6
    assert core.kv_add(JOB, "n", 3) == 9
    assert core.kv_add(JOB, "n", 3) == 12


def test_a_request_id_is_kept_with_a_long_key_s_digest_not_the_key():
    """A retried change's id is kept with its key, 100,000 of them a job: with a key of 4,000
    characters that was 400 MB (and as much in the state file) for a store of one key. A long
    key is kept as its digest; its retries are still answered once, each key apart."""
    core = Core()
    long, other = "k" * 4000, "k" * 3999 + "j"
    for n in range(1, 101):
        assert core.kv_add(JOB, long, 1, request_id=f"r{n}") == n
    assert core.kv_add(JOB, long, 1, request_id="r7") == 7  # a retry: the first answer
    assert core.kv_add(JOB, other, 1, request_id="r7") == 1  # another key's change
    assert max(map(len, core.jobs[JOB].request_results)) < 80


def test_a_retried_set_does_not_overwrite_a_newer_value():
    """A set whose answer was lost is resent with its request id after another client set the
    key: the resend is not applied again (the newer value was lost)."""
    core = Core()
    core.kv_set(JOB, [("k", b"first"), ("j", b"1")], request_id="s1")
    core.kv_set(JOB, [("k", b"newer")], request_id="s2")
    core.kv_set(JOB, [("k", b"first"), ("j", b"1")], request_id="s1")
    assert core.kv_get(JOB, ["k", "j"]) == [b"newer", b"1"]
    core.kv_set(JOB, [("k", b"again")])  # (without an id: applied each time)
    assert core.kv_get(JOB, ["k"]) == [b"again"]
    with raises(Code.INVALID_ARGUMENT, "request id of 300 characters"):
        core.kv_set(JOB, [("k", b"v")], request_id="x" * 300)


def test_a_retried_delete_says_the_key_existed():
    """A delete whose answer was lost and is resent with its request id answers True again (the
    key existed when it was deleted); another delete of the key answers False."""
    core = Core()
    core.kv_set(JOB, [("k", b"v")])
    assert core.kv_delete(JOB, "k", request_id="d1") is True
    assert core.kv_delete(JOB, "k", request_id="d1") is True
    assert core.kv_delete(JOB, "k", request_id="d2") is False
    assert core.kv_get(JOB, ["k"]) == [None]


@pytest.mark.parametrize(
    ("current", "expected", "desired", "returned", "stored"),
    [
        (None, b"", b"new", b"new", b"new"),
        (None, b"exp", b"new", b"exp", None),
        (b"old", b"old", b"new", b"new", b"new"),
        (b"old", b"exp", b"new", b"old", b"old"),
        (b"", b"", b"new", b"new", b"new"),
    ],
    ids=["missing-empty-expected", "missing-nonempty-expected", "match", "mismatch", "empty-value-match"],
)
def test_kv_compare_set_follows_torch_store(current, expected, desired, returned, stored):
    """compare_set has torch.distributed.Store semantics for missing keys, matches and mismatches."""
    core = Core()
    if current is not None:
        core.kv_set(JOB, [("k", current)])
    assert core.kv_compare_set(JOB, "k", expected, desired) == returned
    assert core.kv_get(JOB, ["k"]) == [stored]


def test_kv_compare_set_with_the_same_request_id_returns_the_first_answer():
    """A retried compare_set returns its first answer even after the value has changed since."""
    core = Core()
    assert core.kv_compare_set(JOB, "k", b"", b"mine", request_id="r") == b"mine"
    core.kv_set(JOB, [("k", b"theirs")])
    assert core.kv_compare_set(JOB, "k", b"", b"mine", request_id="r") == b"mine"
    assert core.kv_get(JOB, ["k"]) == [b"theirs"]


@pytest.mark.parametrize(
    "change",
    [
        lambda core, rid: core.kv_add(JOB, "n", 1, request_id=rid),
        lambda core, rid: core.kv_compare_set(JOB, "n", b"", b"1", request_id=rid),
        lambda core, rid: core.kv_append(JOB, "n", b"1", request_id=rid),
        lambda core, rid: core.kv_delete(JOB, "n", request_id=rid),
    ],
    ids=["add", "compare_set", "append", "delete"],
)
def test_request_ids_over_their_limit_are_refused_and_not_kept(change):
    """A request id is kept with its result for retries: one over 256 characters is
    INVALID_ARGUMENT naming its length and the limit, applies nothing and keeps nothing."""
    core = Core()
    change(core, "u" * 256)  # at the limit: applied and kept
    kept = dict(core.jobs[JOB].request_results)
    with raises(Code.INVALID_ARGUMENT, "request id of 257 characters", "limit of 256"):
        change(core, "r" * 257)
    assert core.jobs[JOB].request_results == kept
    with raises(Code.INVALID_ARGUMENT, "request id of 1048576 characters"):
        change(Core(), "r" * (1 << 20))


def test_a_request_id_reused_by_another_change_or_key_is_a_new_change():
    """A request id answers retries of its own change of its own key: another change (or
    key) reusing it is applied, not answered with the first one's result (an int for a
    compare_set, found by the fuzz test)."""
    core = Core()
    assert core.kv_add(JOB, "a", 5, request_id="r") == 5
    assert core.kv_compare_set(JOB, "a", b"5", b"x", request_id="r") == b"x"
    assert core.kv_add(JOB, "b", 2, request_id="r") == 2
    assert core.kv_add(JOB, "a", 5, request_id="r") == 5  # the first add's retry: its result again
    assert core.kv_get(JOB, ["a", "b"]) == [b"x", b"2"]


def test_kv_append_concatenates_once_per_request_id():
    """kv_append creates or extends a value, and a retried append with the same request id adds nothing."""
    core = Core()
    core.kv_append(JOB, "log", b"a")
    core.kv_append(JOB, "log", b"b", request_id="r")
    core.kv_append(JOB, "log", b"b", request_id="r")
    core.kv_append(JOB, "log", b"c")
    assert core.kv_get(JOB, ["log"]) == [b"abc"]


def test_kv_delete_returns_whether_the_key_existed():
    """kv_delete returns True for an existing key and False for a missing one."""
    core = Core()
    core.kv_set(JOB, [("k", b"")])
    assert core.kv_delete(JOB, "k") is True
    assert core.kv_delete(JOB, "k") is False
    assert core.kv_get(JOB, ["k"]) == [None]


def test_kv_list_returns_keys_with_a_prefix_sorted_and_kv_count_counts_them():
    """kv_list filters by prefix and sorts by key; kv_count counts with or without a prefix."""
    core = Core()
    core.kv_set(JOB, [("b/2", b"x"), ("a", b"y"), ("b/1", b"z"), ("c", b"w")])
    assert core.kv_list(JOB, "b/") == [("b/1", b"z"), ("b/2", b"x")]
    assert [k for k, _ in core.kv_list(JOB)] == ["a", "b/1", "b/2", "c"]
    assert core.kv_list(JOB, "zzz") == []
    assert core.kv_count(JOB) == 4
    assert core.kv_count(JOB, "b/") == 2
    assert core.kv_count(JOB, "q") == 0


def test_a_jobs_keys_and_values_stay_within_max_kv_bytes():
    """A job's keys and values together (bytes of each) stay within max_kv_bytes: a change
    that would pass it is refused whole and changes nothing; replacing, shrinking and
    deleting make room; a restored core counts what it holds."""
    from pjrt_rendezvous.coordinator import _state

    core = Core(Limits(max_kv_bytes=100))
    core.kv_set(JOB, [("a", b"x" * 40), ("b", b"y" * 40)])  # 82 bytes
    for change in (
        lambda: core.kv_set(JOB, [("c", b"z" * 20), ("a", b"x" * 40)]),  # +21
        lambda: core.kv_append(JOB, "a", b"x" * 19),
        lambda: core.kv_compare_set(JOB, "new", b"", b"v" * 20),
        lambda: core.kv_add(JOB, "counter-with-a-long-name", 1),
    ):
        with raises(Code.RESOURCE_EXHAUSTED, "holds 82 bytes", "max_kv_bytes"):
            change()
    assert core.kv_get(JOB, ["a", "b", "c", "new"]) == [b"x" * 40, b"y" * 40, None, None]
    core.kv_set(JOB, [("a", b"x" * 20), ("c", b"z" * 17)])  # 20 freed, 18 taken: 80
    core.kv_append(JOB, "c", b"z" * 20)  # 100: full
    with raises(Code.RESOURCE_EXHAUSTED, "holds 100 bytes"):
        core.kv_set(JOB, [("d", b"")])
    assert core.kv_delete(JOB, "b")  # 59
    restored = _state.restore(_state.snapshot(core), now=0.0, limits=Limits(max_kv_bytes=100))
    for c in (core, restored):
        c.kv_set(JOB, [("b", b"y" * 40)])  # 100 again
        with raises(Code.RESOURCE_EXHAUSTED, "holds 100 bytes"):
            c.kv_append(JOB, "b", b"y")


def test_kv_keys_must_be_non_empty_and_within_max_key_length():
    """An empty key is INVALID_ARGUMENT and one over max_key_length RESOURCE_EXHAUSTED, for
    every KV operation; the limit fits."""
    core = Core(Limits(max_key_length=4))
    operations = [
        lambda k: core.kv_set(JOB, [(k, b"0")]),
        lambda k: core.kv_get(JOB, [k]),
        lambda k: core.kv_add(JOB, k, 1),
        lambda k: core.kv_compare_set(JOB, k, b"", b"v"),
        lambda k: core.kv_append(JOB, k, b"v"),
        lambda k: core.kv_delete(JOB, k),
    ]
    for operation in operations:
        with raises(Code.INVALID_ARGUMENT, "must not be empty"):
            operation("")
        with raises(Code.RESOURCE_EXHAUSTED, "key 'xxxxx' of 5 characters (a torch Store's prefix included) exceeds the limit of 4"):
            operation("x" * 5)
        operation("x" * 4)


def test_kv_values_over_max_value_bytes_are_resource_exhausted():
    """Values over max_value_bytes, directly or by appending, are RESOURCE_EXHAUSTED; a batch is all or nothing."""
    core = Core(Limits(max_value_bytes=4))
    with raises(Code.RESOURCE_EXHAUSTED, "'big'", "5 bytes", "limit of 4"):
        core.kv_set(JOB, [("ok", b"1234"), ("big", b"12345")])
    assert core.kv_get(JOB, ["ok"]) == [None]
    with raises(Code.RESOURCE_EXHAUSTED, "5 bytes"):
        core.kv_compare_set(JOB, "k", b"", b"12345")
    core.kv_append(JOB, "log", b"123")
    with raises(Code.RESOURCE_EXHAUSTED, "'log'", "5 bytes"):
        core.kv_append(JOB, "log", b"45")
    assert core.kv_get(JOB, ["log"]) == [b"123"]


def test_kv_timeout_names_the_keys_still_missing():
    """kv_timeout is DEADLINE_EXCEEDED listing only the keys that are still unset."""
    core = Core()
    core.kv_set(JOB, [("here", b"")])
    assert_message(
        core.kv_timeout(JOB, ["here", "a", "b"], waited=3.0),
        Code.DEADLINE_EXCEEDED,
        "2 keys",
        "3.0 s",
        "'a', 'b'",
    )
    assert "'here'" not in core.kv_timeout(JOB, ["here", "a"], waited=3.0).message
    assert "still not set after 0.05 s" in core.kv_timeout(JOB, ["a"], waited=0.05).message  # (was "0.0 s")
    assert "after 1.0 s" in core.kv_timeout(JOB, ["a"], waited=0.9996).message
    assert "after 0.001 s" in core.kv_timeout(JOB, ["a"], waited=1e-5).message


# --- status --------------------------------------------------------------------------------------


def test_status_reports_pending_rounds_with_tags_arrivals_and_missing():
    """status() shows each pending round's tags, arrived and missing ordinals, wait time and missing summary."""
    pod = make_pod(8, register=False)
    for task in range(6):
        pod.register(task)
    pod.arrive(0, tag="save", now=2.0)
    pod.arrive(4, tag="save", now=3.0)
    pod.arrive(2, replicas=[2, 3], tag="pair", now=4.0)
    (view,) = pod.core.status(10.0, JOB)
    assert (view.job, view.world_size, view.registered, view.rounds_completed) == (JOB, 8, 6, 0)
    first, second = view.pending_rounds
    assert (first.group, first.number, first.tags) == (ALL, 0, {"save": [0, 4]})
    assert first.arrived == [0, 4]
    assert first.missing == [1, 2, 3, 5, 6, 7]
    assert first.waiting_seconds == pytest.approx(8.0)
    assert first.missing_summary == (
        "1-3 on host-0 (pids 1001, 1002, 1003, last seen 10.0 s ago); 5 on host-1 (pid 1005, last seen 10.0 s ago); "
        "6-7 never registered"
    )
    assert (second.group, second.tags, second.arrived, second.missing) == ((2, 3), {"pair": [2]}, [2], [3])
    assert second.waiting_seconds == pytest.approx(6.0)
    # What a waiting client's "still waiting" line asks: the same rounds, no participant table.
    (rounds_only,) = pod.core.status(10.0, JOB, participants=False)
    assert view.participants and not rounds_only.participants
    assert rounds_only.pending_rounds == view.pending_rounds


def test_status_reports_participants_with_host_pid_and_last_seen_age():
    """status() lists every registered ordinal with its process and how long since that process was seen."""
    pod = make_pod(5, 2, register=False)
    for task in range(5):
        pod.register(task, now=1.0)
    pod.arrive([0, 1], now=4.0, deadline=100.0)
    pod.core.touch(JOB, incarnation_of(4), 6.0)
    pod.core.kv_set(JOB, [("k", b"v")])
    (view,) = pod.core.status(10.0, JOB)
    assert view.kv_keys == 1
    assert [(p.ordinal, p.local_ordinal, p.host, p.pid, p.task_id, p.thread_index) for p in view.participants] == [
        (o, (o // 2 % 4) * 2 + o % 2, host_of(o // 2), pid_of(o // 2), o // 2, o % 2) for o in range(10)
    ]
    ages = {p.ordinal: p.last_seen_age for p in view.participants}
    assert ages == {0: 6.0, 1: 6.0, 2: 9.0, 3: 9.0, 4: 9.0, 5: 9.0, 6: 9.0, 7: 9.0, 8: 4.0, 9: 4.0}


def test_status_without_a_job_lists_every_job_sorted():
    """status() with no job name reports all jobs in name order, and counts completed rounds."""
    core = Core()
    for job in ("b", "a"):
        core.register(0.0, registration(0, 1, 1, job=job))
    Pod(core, 1, 1, job="b").arrive(0)
    views = core.status(1.0)
    assert [(v.job, v.rounds_completed, v.pending_rounds) for v in views] == [("a", 0, []), ("b", 1, [])]


# --- format_ranges ----------------------------------------------------------------------------------


def iter_ranges(text):
    """Parses format_ranges' output back (the inverse this test checks)."""
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        yield from range(int(first), int(last or first) + 1)



@pytest.mark.parametrize(
    ("ordinals", "text"),
    [
        ([], ""),
        ([3], "3"),
        ([0, 1, 2, 5, 7, 8], "0-2, 5, 7-8"),
        ([8, 7, 5, 2, 1, 0, 1], "0-2, 5, 7-8"),
        ([4, 6], "4, 6"),
    ],
)
def test_format_ranges_examples(ordinals, text):
    """format_ranges sorts, drops duplicates and compresses runs into a-b ranges."""
    assert format_ranges(ordinals) == text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=60), st.integers(1, 80))
def test_format_ranges_cut_short_shows_only_whole_members(ordinals, limit):
    """Past its limit, the text shows whole parts of the full one and the count: with a
    limit shorter than the first part, it showed ordinals not in the set ("10, 20, 3, ..."
    of 10, 20 and 30)."""
    full = format_ranges(ordinals)
    text = format_ranges(ordinals, limit)
    if len(full) <= limit:
        assert text == full
    else:
        shown, _, count = text.rpartition("... (")
        assert count == f"{len(set(ordinals))} ordinal{'s' if len(set(ordinals)) > 1 else ''})", text
        assert shown == "" or (full.startswith(shown) and shown.endswith(", ") and len(shown) - 2 <= limit), text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=60))
def test_format_ranges_round_trips_through_iter_ranges(ordinals):
    """iter_ranges(format_ranges(x)) is sorted(set(x)), and formatting that again gives the same text."""
    text = format_ranges(ordinals)
    assert list(iter_ranges(text)) == sorted(set(ordinals))
    assert format_ranges(iter_ranges(text)) == text
    assert re.fullmatch(r"(\d+(-\d+)?(, \d+(-\d+)?)*)?", text)


# --- property tests: blocking members, random groups and interleavings ----------------------------


@dataclasses.dataclass(frozen=True)
class Call:
    """One rendezvous of the program: every member makes it, in program order."""

    index: int
    group: tuple[int, ...]  # the core's group key: ALL or a sorted proper subset
    number: int  # the round number within the group
    members: tuple[int, ...]
    explicit: bool  # members pass the replica list (shuffled) rather than ()
    tag: str


def program_payload(ordinal: int, call: Call) -> bytes:
    return f"{ordinal}|{','.join(map(str, call.group)) or 'all'}|{call.number}".encode()


@st.composite
def programs(draw, *, min_world: int = 1):
    """A world shape and a sequence of rendezvous calls on ALL, explicit-ALL and random subsets."""
    devices = draw(st.integers(1, 2))
    tasks = draw(st.integers(-(-min_world // devices), 6))
    world = tasks * devices
    counters: collections.Counter = collections.Counter()
    calls = []
    for index in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["all", "explicit-all", "subset", "subset"]))
        if kind == "subset":
            members = tuple(sorted(draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world))))
        else:
            members = tuple(range(world))
        group = ALL if len(members) == world else members
        calls.append(
            Call(
                index=index,
                group=group,
                number=counters[group],
                members=members,
                explicit=kind != "all",
                tag=draw(st.sampled_from(["save", "step", "init"])),
            )
        )
        counters[group] += 1
    return tasks, devices, calls


@dataclasses.dataclass
class Outcome:
    seen: dict[tuple[int, int], object]  # (call index, ordinal) -> result list or CoreError
    wakeups: list[tuple]
    core: Core


def simulate(
    tasks: int, devices: int, calls: list[Call], rng: random.Random, tags: dict | None = None
) -> Outcome:
    """Runs the program with blocking members in a random interleaving, with batching and retries.

    Each ordinal is a thread that arrives at its next call only after fetching the outcome of
    its previous one. A step either registers a process, arrives (optionally batching other
    ready threads of the same process at the same call, optionally resending), or polls a
    waiting thread (optionally resending its pending round or the round it just finished).
    """
    tags = tags or {}
    core = Core()
    world = tasks * devices
    scripts = {o: [c for c in calls if o in c.members] for o in range(world)}
    pc = dict.fromkeys(range(world), 0)
    waiting: dict[int, tuple] = {}
    sent: dict[tuple[int, int], Contribution] = {}
    seen: dict[tuple[int, int], object] = {}
    unregistered = list(range(tasks))
    rng.shuffle(unregistered)
    wakeups: list[tuple] = []
    now = 0.0

    def contribution(ordinal: int, call: Call) -> Contribution:
        tag = tags.get((call.index, ordinal), call.tag)
        return Contribution(ordinal=ordinal, tag=tag, payload=program_payload(ordinal, call))

    def send(ordinals: list[int], call: Call) -> tuple:
        contributions = [sent.setdefault((call.index, o), contribution(o, call)) for o in ordinals]
        rng.shuffle(contributions)
        replicas = list(call.members) if call.explicit else []
        rng.shuffle(replicas)
        key = core.arrive(
            now,
            job=JOB,
            incarnation=incarnation_of(ordinals[0] // devices),
            replicas=replicas,
            round_number=call.number,
            contributions=contributions,
            deadline=now + 1000.0,
        ).key
        assert key[-2:] == (call.group, call.number)
        return key

    for _ in range(100_000):
        now += 0.01
        registered = set(range(tasks)) - set(unregistered)
        ready = [
            o
            for o in range(world)
            if o not in waiting and pc[o] < len(scripts[o]) and o // devices in registered
        ]
        if not ready and not waiting and not unregistered:
            break
        choice = rng.random()
        if unregistered and (choice < 0.15 or not (ready or waiting)):
            task = unregistered.pop()
            core.register(now, registration(task, tasks, devices))
        elif ready and (choice < 0.6 or not waiting):
            ordinal = rng.choice(ready)
            call = scripts[ordinal][pc[ordinal]]
            batch = [ordinal] + [
                o
                for o in ready
                if o != ordinal
                and o // devices == ordinal // devices
                and scripts[o][pc[o]] == call
                and rng.random() < 0.5
            ]
            try:
                key = send(batch, call)
            except CoreError as late:  # the round failed before these came (Core._too_late)
                for o in batch:
                    seen[(call.index, o)] = late
                    pc[o] += 1
                continue
            for o in batch:
                waiting[o] = key
            if rng.random() < 0.2:
                assert send(batch, call) == key
        elif waiting:
            ordinal = rng.choice(sorted(waiting))
            call = scripts[ordinal][pc[ordinal]]
            rnd = core.outcome(JOB, waiting[ordinal])
            if rnd is None:
                if rng.random() < 0.3:
                    send([ordinal], call)
                elif not (ready or unregistered) and all(core.outcome(JOB, k) is None for k in waiting.values()):
                    raise AssertionError(f"stuck: {waiting} {core.status(now, JOB)}")
                continue
            assert (call.index, ordinal) not in seen
            seen[(call.index, ordinal)] = rnd.error if rnd.error is not None else list(rnd.result)
            del waiting[ordinal]
            pc[ordinal] += 1
            if rng.random() < 0.3:
                assert send([ordinal], call) == rnd.key
                assert core.outcome(JOB, rnd.key) is rnd
        if rng.random() < 0.1:
            core.expire(now)
        wakeups.extend(core.take_wakeups())
    else:
        raise AssertionError("simulation did not finish")
    wakeups.extend(core.take_wakeups())
    return Outcome(seen=seen, wakeups=wakeups, core=core)


def round_wakeups(outcome: Outcome) -> collections.Counter:
    return collections.Counter(w[-2:] for w in outcome.wakeups if w[0] == "round")  # (group, number)


@settings(max_examples=200, deadline=None)
@given(programs(), st.integers(0, 2**32 - 1))
def test_every_round_completes_once_with_every_payload_in_ordinal_order(program, seed):
    """Whatever the interleaving, batching and retries, every round completes once, payloads in ordinal order."""
    tasks, devices, calls = program
    outcome = simulate(tasks, devices, calls, random.Random(seed))
    for call in calls:
        expected = [program_payload(o, call) for o in call.members]
        for ordinal in call.members:
            assert outcome.seen[(call.index, ordinal)] == expected, (call, ordinal)
    assert len(outcome.seen) == sum(len(c.members) for c in calls)
    assert round_wakeups(outcome) == collections.Counter((c.group, c.number) for c in calls)
    assert outcome.wakeups.count(("world", JOB)) == 1
    (view,) = outcome.core.status(1e6, JOB)
    assert view.rounds_completed == len(calls)
    assert view.pending_rounds == []
    assert outcome.core.jobs[JOB].blocked == {}


@st.composite
def deviating_programs(draw):
    """A program with at least one multi-member call, one of whose members brings another tag."""
    tasks, devices, calls = draw(programs(min_world=2))
    candidates = [c for c in calls if len(c.members) > 1]
    if not candidates:
        number = sum(c.group == ALL for c in calls)
        members = tuple(range(tasks * devices))
        calls = [*calls, Call(len(calls), ALL, number, members, explicit=False, tag="save")]
        candidates = [calls[-1]]
    call = draw(st.sampled_from(candidates))
    deviant = draw(st.sampled_from(call.members))
    return tasks, devices, calls, call, deviant


@settings(max_examples=200, deadline=None)
@given(deviating_programs(), st.integers(0, 2**32 - 1))
def test_a_single_tag_deviation_fails_that_round_for_every_member_alike(program, seed):
    """One member bringing another tag fails exactly that round, with one FAILED_PRECONDITION for every member."""
    tasks, devices, calls, bad, deviant = program
    tag = bad.tag + "-skipped"
    outcome = simulate(tasks, devices, calls, random.Random(seed), tags={(bad.index, deviant): tag})
    errors = [outcome.seen[(bad.index, o)] for o in bad.members]
    assert all(isinstance(e, CoreError) for e in errors), errors
    # The round's error, or for a member that came after it failed, the round's error said to be so.
    base = min(errors, key=lambda e: len(e.message))
    assert all(e is base or (e.code is base.code and re.search(r"had failed before it came \((its peers called rendezvous\('[^']*'\); )?its round counter "
               r"for the group moves on with its peers'\): ", e.message) and e.message.endswith(base.message)) for e in errors), errors
    assert_message(
        base,
        Code.FAILED_PRECONDITION,
        f"tag mismatch in round {bad.number}",
        f"rendezvous({bad.tag!r})",
    )
    task = deviant // devices  # (the deviant says where it runs)
    assert f"ordinal {deviant} ({host_of(task)} pid {pid_of(task)}) called rendezvous({tag!r})" in base.message, base.message
    for call in calls:
        if call is not bad:
            expected = [program_payload(o, call) for o in call.members]
            assert all(outcome.seen[(call.index, o)] == expected for o in call.members), call
    assert round_wakeups(outcome) == collections.Counter((c.group, c.number) for c in calls)
    assert outcome.core.status(1e6, JOB)[0].rounds_completed == len(calls) - 1


def test_a_run_whose_processes_are_all_gone_starts_afresh_formed_or_not():
    """When every process of a run is gone, the next registration starts a new run, whether
    its world formed or not; one gone while another of its run lives does not end it."""
    core = Core()
    core.register(0.0, registration(0, 2, 1))
    core.leave(JOB, "inc-0")
    core.register(1.0, registration(1, 2, 1))  # all gone, the world never formed: afresh all the same
    assert core.jobs[JOB].generation == 2 and set(core.jobs[JOB].members) == {1}
    core.register(2.0, registration(0, 2, 1, incarnation="new-0"))
    core.leave(JOB, "new-0")  # one gone, the other lives: the run goes on, late members join it
    core.register(3.0, registration(0, 2, 1, incarnation="newer-0"))
    assert core.jobs[JOB].generation == 3 and set(core.jobs[JOB].members) == {0, 1}  # (a restart of task 0)


def test_a_run_whose_processes_are_all_gone_keeps_its_rounds_outcomes_but_not_their_payloads():
    """The rounds a job keeps for resends (two a group, up to 4,096 groups) kept their
    payloads until max_jobs dropped the finished job: once every process is gone nobody can
    resend, so the payloads go; the outcomes stay, and the next run meets as before."""
    pod = make_pod(2)
    keys = [pod.arrive(0, round_number=n, payloads={0: b"x" * 1000}) for n in range(2)]
    for n, key in enumerate(keys):
        assert pod.arrive(1, round_number=n) == key
    failed = pod.arrive(0, round_number=2, deadline=5.0)
    pod.core.leave(JOB, incarnation_of(0))  # (its round 2 fails: a member left)
    assert pod.result(keys[1]) == [b"x" * 1000, payload_of(1)]  # (one process lives)
    pod.core.leave(JOB, incarnation_of(1))
    assert pod.result(keys[1]) == [b"", b""] and pod.outcome(failed).error is not None  # (round 0 is not kept)
    assert all(rnd.response is None and not any(rnd.arrivals.values())
               for state in pod.core.jobs[JOB].groups.values() for rnd in state.finished.values())
    for task in range(2):
        pod.register(task, now=10.0, incarnation=f"again-{task}")
    key = pod.arrive(0, incarnation="again-0", now=11.0)
    pod.arrive(1, incarnation="again-1", now=11.0)
    assert pod.result(key) == [payload_of(0), payload_of(1)]


def test_a_relaunch_after_a_run_that_never_formed_works_whichever_process_comes_first():
    """Task 0 of 2 ran alone, timed out and left; the relaunch's task 1 came first, joined the
    old run and got its failed round ("which had failed before it came"), and exited, so the
    relaunched task 0 waited for it until its timeout. Now task 1 starts a new run, waits
    for task 0 saying what became of the last run's, and the relaunch's rounds complete."""
    for first in (1, 0):
        pod = make_pod(2, register=False)
        pod.register(0, incarnation="old-0", pid=77)
        old = pod.arrive(0, incarnation="old-0", deadline=4.0)
        pod.core.expire(4.0)
        assert pod.error(old).code is Code.DEADLINE_EXCEEDED
        pod.core.leave(JOB, "old-0")
        pod.register(first, now=10.0)
        key = pod.arrive(first, now=11.0, deadline=20.0)
        assert pod.outcome(key) is None  # waits: a new run
        if first == 1:
            pod.core.expire(20.0)
            assert "missing ordinal 0 not registered since the job started afresh (the last run's was host-0 pid 77, which left)" in pod.error(key).message
            continue
        pod.register(1, now=12.0)
        pod.arrive(1, now=12.0, deadline=20.0)
        assert pod.result(key) == [payload_of(0), payload_of(1)]


@pytest.mark.parametrize("how", ["left", "died"])
def test_a_slower_process_of_the_same_launch_starts_afresh_once_its_peers_are_all_gone(how):
    """Task 1 of 2 registered, its round failed (a tag mismatch between its threads) and it
    was gone before task 0, started with it, registered: task 0 starts a new run, as a
    relaunch of task 1 would join it, and its wait names what became of the last run's."""
    pod = make_pod(2, devices=2, register=False)
    pod.register(1, now=10.0, pid=77)
    pod.arrive([2, 3], now=10.0, tags={2: "save", 3: "step"}, deadline=40.0)
    if how == "left":
        pod.core.leave(JOB, incarnation_of(1))
    else:
        pod.core.declare_dead(JOB, incarnation_of(1), "killed")
    assert pod.register(0, now=12.0, process_age=5.0).generation == 2  # (started at 7.0: of the same launch)
    key = pod.arrive([0, 1], now=12.0, tag="save", deadline=15.0)
    pod.core.expire(15.0)
    which = "left" if how == "left" else "died"
    assert f"missing ordinals 2-3 not registered since the job started afresh (the last run's was host-0 pid 77, which {which})" in pod.error(key).message


@pytest.mark.parametrize("how", ["left", "died"])
def test_a_slower_process_of_a_launch_that_says_so_joins_its_run_to_learn_its_peers_are_gone(how):
    """As above, but the launch says which it is (xla.spawn: a replica failing at once): task
    0 joins the run of its own launch and its round fails at once naming what became of task
    1 (it waited for the run's timeout, or until spawn stopped it); a process of another
    launch starts afresh."""
    pod = make_pod(2, devices=2, register=False)
    pod.core.register(10.0, dataclasses.replace(registration(1, 2, 2, pid=77), launch="spawn-1"))
    pod.core.end_replicas(JOB, incarnation_of(1), [2], "raised ValueError: bad path", 10.0)
    if how == "left":
        pod.core.leave(JOB, incarnation_of(1))
    else:
        pod.core.declare_dead(JOB, incarnation_of(1), "killed")
    registered = pod.core.register(12.0, dataclasses.replace(registration(0, 2, 2), launch="spawn-1"))
    assert registered.generation == 1
    key = pod.arrive([0, 1], now=12.0, tag="first", deadline=600.0)
    assert_message(
        pod.error(key), Code.ABORTED, "rendezvous 'first' on all ordinals (round 0) cannot complete: a member",
        f"(ordinals 2-3 on host-0 pid 77: {'its client closed' if how == 'left' else 'killed'}; ordinal 2 on host-0 "
        "pid 77: its replica raised ValueError: bad path)",
    )
    other = make_pod(2, devices=2, register=False)
    other.core.register(10.0, dataclasses.replace(registration(1, 2, 2), launch="spawn-1"))
    other.core.leave(JOB, incarnation_of(1))
    assert other.core.register(12.0, dataclasses.replace(registration(0, 2, 2), launch="spawn-2")).generation == 2


def test_a_new_task_joins_a_run_whose_connections_closed_unless_it_started_after_the_last_close():
    """Task 0 waits in round 0 of an unformed run; its connection closes (a network cut, or a
    kill), and task 1 registers before task 0 is declared dead. Started before the close, it
    joins (a cut: task 0 calls again and the round completes); started after, or not saying
    when, it is a relaunch after a kill and starts afresh."""
    for age, joins in ((5.0, True), (1.0, False), (0.0, False), (float("nan"), False)):
        pod = make_pod(2, register=False)
        pod.register(0, now=0.0)
        key = pod.arrive(0, now=1.0, deadline=30.0)
        pod.core.disconnect(JOB, incarnation_of(0), 10.0)
        registered = pod.register(1, now=12.0, process_age=age)  # (started at 7.0, or at 11.0)
        assert registered.generation == (1 if joins else 2), age
        deaths = [e.message for e in pod.core.jobs[JOB].events if e.kind == "PROCESS_DEAD"]
        if joins:
            pod.arrive(1, now=12.0, deadline=30.0)
            assert pod.result(key) == [payload_of(0), payload_of(1)]
            assert deaths == []
        else:
            assert "starts afresh" in pod.error(key).message
            # (logged and counted: a job killed and relaunched at once left no word of its processes' end)
            assert deaths == [
                "ordinal 0 (host-0 pid 1000, task 0) was dropped: its connection closed without a Leave, and a new run of job "
                "'job' registered before it was heard from again"
            ], deaths


def test_every_process_of_a_large_run_dropped_by_a_relaunch_is_told_so():
    """A run of more processes than the 1,024 replaced ones a job remembers, killed and
    relaunched: the first of them calling again was told it was not registered (and to
    register), counted as a stranger to the job; it is told it was dropped."""
    core = Core(heartbeat_timeout=60.0)
    tasks = 1100
    for task in range(tasks):
        core.register(0.0, registration(task, tasks, 1))
    for task in range(tasks):
        core.disconnect(JOB, incarnation_of(task), 1.0)
    core.register(2.0, registration(0, tasks, 1, incarnation="relaunched-0"))
    with raises(Code.FAILED_PRECONDITION, "'inc-0' of job 'job' was dropped: job 'job' started afresh"):
        core.touch(JOB, incarnation_of(0), 3.0)
    assert core.strangers(3.0) == []


def test_more_process_events_at_once_than_a_job_keeps_are_counted_in_the_log(monkeypatch, caplog):
    """A relaunch dropping more processes at once than the events a job keeps (1,000; 3
    here): the monitor logged the latest and nothing of the rest; a line says how many it
    did not log one by one (nor count)."""
    from pjrt_rendezvous.coordinator import _core
    from pjrt_rendezvous.coordinator._metrics import Metrics
    from pjrt_rendezvous.coordinator._monitor import Monitor

    monkeypatch.setattr(_core, "_EVENTS_KEPT", 3)
    core = Core(heartbeat_timeout=60.0)
    metrics = Metrics()
    monitor = Monitor(core, metrics, clock=lambda: 0.0)
    for task in range(5):
        core.register(0.0, registration(task, 5, 1))
    monitor.woke(core.take_wakeups())
    for task in range(5):
        core.disconnect(JOB, incarnation_of(task), 1.0)
    core.register(2.0, registration(0, 5, 1, incarnation="relaunched-0"))
    with caplog.at_level("INFO", logger="pjrt_rendezvous.coordinator"):
        monitor.woke(core.take_wakeups())
    events = [getattr(r, "event", "") for r in caplog.records]
    assert events.count("process_dead") == 3 and metrics.process_events == {(JOB, "dead"): 3}, events
    (line,) = [r for r in caplog.records if getattr(r, "event", "") == "events_dropped"]
    assert line.count == 2 and line.getMessage().startswith(f"2 process events in job {JOB!r} came at once"), line.getMessage()


def test_a_relaunch_of_a_task_the_run_had_starts_afresh_however_old_its_process():
    """A long-lived process (a notebook's) registering a task the run had again, with a new
    client, once the run's processes are all gone: a new run, whenever it started."""
    core = Core()
    core.register(0.0, registration(0, 2, 1))
    core.disconnect(JOB, "inc-0", 1.0)
    core.register(2.0, registration(0, 2, 1, incarnation="next", process_age=1000.0))
    assert core.jobs[JOB].generation == 2


def test_processes_whose_connections_closed_are_gone_for_a_relaunch_but_not_for_themselves():
    """A process killed (its connection closed, not yet declared dead) and relaunched at once:
    the relaunch's first process starts a new run rather than joining the killed one's (and
    completing its half-done round). A live process whose connection broke and that binds
    another thread is its own run's still."""
    core = Core()
    core.register(0.0, registration(0, 2, 1))
    core.disconnect(JOB, "inc-0", 1.0)
    core.register(2.0, registration(1, 2, 1))
    assert core.jobs[JOB].generation == 2 and set(core.jobs[JOB].processes) == {"inc-1"}
    core.register(3.0, registration(0, 2, 1, incarnation="again-0"))
    core.disconnect(JOB, "inc-1", 4.0)
    core.disconnect(JOB, "again-0", 4.0)
    core.register(5.0, registration(0, 2, 1, incarnation="again-0"))  # (its own registration again)
    assert core.jobs[JOB].generation == 2 and set(core.jobs[JOB].processes) == {"inc-1", "again-0"}


def test_a_process_declared_dead_is_refused_when_the_run_starts_afresh():
    """Every process of a formed world declared dead, one of them (frozen, then resumed)
    registers again with its incarnation: it was taken into a new run, where its peers got
    "not registered" for it instead of "declared dead". It is refused, as at any other time;
    a new process starts the new run."""
    core = Core(heartbeat_timeout=10)
    for task in (0, 1):
        core.register(0.0, registration(task, 2, 1))
    core.check_liveness(100.0)
    with raises(Code.ABORTED, "was declared dead"):
        core.register(101.0, registration(0, 2, 1))
    assert core.register(101.0, registration(0, 2, 1, incarnation="new-0")).generation == 2


def test_a_registration_whose_threads_share_a_runtime_ordinal_is_refused_before_the_run_starts_afresh():
    """Every process of the run gone, a registration that would start a new run but whose
    two threads name one global runtime ordinal is refused before it changes anything (it
    was refused after the job had started afresh: the old run's processes and rounds were
    gone, for a registration that was not taken)."""
    core = Core()
    for task in (0, 1):
        core.register(0.0, registration(task, 2, 2))
        core.leave(JOB, incarnation_of(task))
    job = core.jobs[JOB]
    before = (job.generation, dict(job.processes))
    with raises(Code.FAILED_PRECONDITION, "global ordinal 3", "thread 0 of this registration"):
        core.register(1.0, registration(0, 2, 2, incarnation="new-0", runtime={0: 3, 1: 3}))
    assert (job.generation, job.processes) == before
    assert core.register(1.0, registration(0, 2, 2, incarnation="new-0", runtime={0: 0, 1: 1})).generation == before[0] + 1


def test_a_refused_registrations_reason_told_to_others_holds_no_incarnation():
    """A refusal is told to every process waiting for the task's ordinals and to status:
    a live process that claimed a second task had its incarnation, which proves its calls,
    in it (a security review)."""
    core = Core()
    secret = "0123456789abcdef0123456789abcdef"
    core.register(0.0, registration(0, 2, 2, incarnation=secret))
    with raises(Code.INVALID_ARGUMENT, "this process (host-0 pid 1000) registered task 0 before and now claims task 1"):
        core.register(1.0, registration(1, 2, 2, incarnation=secret))
    with raises(Code.FAILED_PRECONDITION, "was replaced"):  # (a message naming the incarnation itself)
        core.register(2.0, registration(0, 2, 2, incarnation="new-0"))
        core.register(3.0, registration(0, 2, 2, incarnation=secret))
    (view,) = core.status(4.0, JOB)
    told = repr(view.refused) + view.world_missing_summary
    assert "was refused" in told and secret not in told, told


def test_a_new_call_of_the_old_generation_is_told_of_the_move_not_given_an_old_failure():
    """Round 0 failed without ordinal 2 (its timeout), then the job moved (a restart): 2's
    first call of round 0, of the old generation, got that round's timeout naming itself as
    missing, and learned of the move only at its next call. It is told of the move; a
    member that had arrived still gets the round's outcome (its answer was lost)."""
    pod = make_pod(3)
    key = pod.arrive([0], deadline=5.0)
    pod.arrive([1], deadline=5.0)
    pod.core.expire(6.0)
    assert pod.error(key).code is Code.DEADLINE_EXCEEDED
    pod.register(0, incarnation="restarted-0", now=7.0)  # task 0 restarts: generation 2

    def call(ordinal: int):
        return pod.core.arrive(8.0, job=JOB, incarnation=incarnation_of(ordinal), replicas=[], round_number=0,
                               contributions=[Contribution(ordinal, "t", payload_of(ordinal))], deadline=None, generation=1)

    with raises(Code.ABORTED, "moved from generation 1 to 2"):
        call(2)
    assert call(1).error.code is Code.DEADLINE_EXCEEDED


@pytest.mark.parametrize("tasks, devices", [(1, 2), (2, 2), (4, 1)])
def test_an_unformed_run_all_gone_is_relaunched_with_another_size_or_layout(tasks, devices):
    """A run that never formed, every process of it gone (killed: the wrong number of tasks),
    is started afresh by a registration of another size or layout (it was refused for ever,
    naming the dead process that fixed the size); while one of it lives, it is refused."""
    core = Core(heartbeat_timeout=3)
    core.register(0.0, registration(0, 2, 1))
    with raises(Code.FAILED_PRECONDITION, "has world size 2" if tasks * devices != 2 else "has 1 devices per task"):
        core.register(1.0, registration(0, tasks, devices, incarnation="early"))
    core.check_liveness(10.0)  # the first process is declared dead
    registered = core.register(10.0, registration(0, tasks, devices, incarnation="relaunched"))
    assert registered.world_size == tasks * devices and registered.generation == 2
    assert set(core.jobs[JOB].members) == set(range(devices))


# -- liveness and restarts (time passed in, nothing sleeps) ------------------------------------


def test_a_silent_process_is_declared_dead_and_every_round_needing_it_fails_naming_it():
    pod = Pod(Core(heartbeat_timeout=10), 2, 1)
    pod.register(0)
    pod.register(1)
    for task in (0, 1):
        pod.core.touch(JOB, incarnation_of(task), now=8.0)
    pod.core.check_liveness(15.0)  # 7 s of silence: alive
    assert all(p.alive for p in pod.core.status(15.0, JOB)[0].participants)
    key = pod.arrive(0, now=16.0)
    pod.core.touch(JOB, incarnation_of(0), now=17.0)
    pod.core.check_liveness(18.5)
    assert_message(pod.error(key), Code.ABORTED, "ordinal 1 on host-0 pid 1001", "no heartbeat for 10.5 s")
    assert [p.alive for p in pod.core.status(18.5, JOB)[0].participants] == [True, False]
    (event,) = pod.core.events(JOB, 0)[1]
    assert event.kind == "PROCESS_DEAD" and event.ordinals == (1,) and "died: no heartbeat" in event.message
    later = pod.arrive(0, round_number=1, now=19.0)  # a later round that needs it fails at once
    assert pod.error(later).code == Code.ABORTED
    with raises(Code.ABORTED, "was declared dead", "start a new process"):
        pod.core.touch(JOB, incarnation_of(1), now=19.0)
    with raises(Code.ABORTED, "was declared dead"):  # nor does it take part in any round
        pod.arrive(1, round_number=2, now=19.0)
    # The key-value store does not know who writes (README, Reliability): the job's keys stay
    # open to every client, a dead process's too.
    pod.core.kv_set(JOB, [("after", b"death")])
    assert pod.core.kv_get(JOB, ["after"]) == [b"death"]


def test_a_process_whose_connection_closed_is_declared_dead_after_the_grace_unless_it_calls():
    """Its event watch ended without a Leave (killed, crashed): the waiters hear of it after
    DISCONNECTED_GRACE, not after the whole heartbeat timeout; meanwhile who is missing says
    the connection closed. A touch within the grace (its client reconnected) clears it."""
    pod = Pod(Core(heartbeat_timeout=60), 3, 1)
    for task in range(3):
        pod.register(task)
    key = pod.arrive(0, replicas=[0, 1, 2], now=1.0)
    pod.core.disconnect(JOB, incarnation_of(1), now=2.0)
    pod.core.disconnect(JOB, incarnation_of(2), now=2.0)
    pod.core.disconnect(JOB, incarnation_of(2), now=5.0)  # (the first close counts)
    (view,) = pod.core.status(4.0, JOB)[0].pending_rounds
    assert view.missing_summary == (
        "1-2 on host-0, connection closed 2.0 s ago without a Leave (pids 1001, 1002, last seen 4.0 s ago)"
    )
    pod.core.touch(JOB, incarnation_of(2), now=6.0)  # back: its client opened its watch again
    pod.core.check_liveness(2.0 + DISCONNECTED_GRACE)
    assert pod.outcome(key) is None
    pod.core.check_liveness(2.5 + DISCONNECTED_GRACE)
    assert_message(
        pod.error(key), Code.ABORTED, "ordinal 1 on host-0 pid 1001",
        f"its connection closed without a Leave and it was not heard from in the {DISCONNECTED_GRACE + 0.5:.1f} s after "
        "(killed, crashed, or its host lost the network; silent 12.5 s in all)",
    )
    assert [p.alive for p in pod.core.status(12.5, JOB)[0].participants] == [True, False, True]
    pod.core.disconnect(JOB, incarnation_of(1), now=13.0)  # dead, or unknown: nothing to do
    pod.core.disconnect(JOB, "nobody", now=13.0)
    pod.core.disconnect("no-such-job", "nobody", now=13.0)
    assert pod.core.jobs[JOB].processes[incarnation_of(1)].disconnected == 2.0


def test_a_relay_passing_on_a_dead_siblings_held_call_does_not_make_it_heard_from():
    """A host relay held a sibling's call (waiting for the host's others) past the sibling's
    death: passing it on counted as the sibling heard from, clearing its closed connection,
    and the next round waited out the heartbeat timeout (65 s against 11) with "last seen"
    dated after the death; so did its own call resent by the relay after a combined one
    failed. Its contribution still counts; its liveness is its own (heartbeats, watch)."""
    pod = Pod(Core(heartbeat_timeout=60), 2, 1)
    for task in range(2):
        pod.register(task)
    pod.core.disconnect(JOB, incarnation_of(1), now=2.0)  # killed while its relay held its call
    key = relayed(pod, 0, [0, 1], now=5.0)
    assert pod.result(key) == [payload_of(0), payload_of(1)]
    process = pod.core.jobs[JOB].processes[incarnation_of(1)]
    assert (process.disconnected, process.last_seen) == (2.0, 0.0)
    assert pod.arrive(1, now=6.0) == key  # (its own call, as the relay resends each after a combined one failed)
    assert (process.disconnected, process.last_seen) == (2.0, 0.0)
    pod.core.check_liveness(2.5 + DISCONNECTED_GRACE)
    assert not process.alive and "its connection closed" in process.death
    with raises(Code.ABORTED, "the process a host relay named (host-0 pid 1001, task 1) was declared dead") as info:
        relayed(pod, 0, [0, 1], round_number=1, now=20.0)  # (a frozen relay resumed, the sibling long gone)
    assert process.last_seen == 0.0
    with raises(Code.ABORTED, "this process (host-0 pid 1001, task 1) was declared dead"):
        pod.arrive(1, round_number=1, now=21.0)  # its own call: it runs still (status shows it heard from)
    assert process.last_seen == 21.0 and not process.alive
    assert info.error.warn[2].startswith("refused calls a host relay passed on for host-0 pid 1001 (task 1)"), info.error.warn


def test_a_process_that_heartbeats_seldom_has_twice_its_interval_after_its_connection_closes():
    """heartbeat_interval=15 against a 60 s timeout is valid: a live process whose watch
    connection broke calls again only at its next heartbeat, and 10 s declared it dead (its
    interval comes with its registration; junk is ignored)."""
    pod = Pod(Core(heartbeat_timeout=60), 3, 1)
    pod.register(0, heartbeat_interval=15.0)
    pod.register(1, heartbeat_interval=float("nan"))
    pod.register(2, heartbeat_interval=-1.0)
    for task in range(3):
        pod.core.disconnect(JOB, incarnation_of(task), now=0.0)
    pod.core.check_liveness(29.0)
    assert [p.alive for p in pod.core.jobs[JOB].processes.values()] == [True, False, False]
    pod.core.check_liveness(30.5)
    assert not pod.core.jobs[JOB].processes[incarnation_of(0)].alive


def test_a_restart_that_replaces_a_process_whose_connection_closed_says_so():
    pod = Pod(Core(heartbeat_timeout=60), 2, 1)
    pod.register(0)
    pod.register(1)
    pod.core.disconnect(JOB, incarnation_of(1), now=1.0)
    pod.register(1, now=3.0, incarnation="relaunched")  # (same host and local rank: a restart)
    (event,) = [e for e in pod.core.events(JOB, 0)[1] if e.kind == "PROCESS_RESTARTED"]
    assert event.message.endswith(
        "which was last heard from 3.0 s before, its connection closed 2.0 s before without a Leave"
    ), event.message


def test_a_closed_connection_waits_no_longer_than_the_heartbeat_timeout_and_none_disables_both():
    short = Pod(Core(heartbeat_timeout=3), 2, 1)
    short.register(0)
    short.register(1)
    short.core.touch(JOB, incarnation_of(0), now=3.5)
    short.core.disconnect(JOB, incarnation_of(1), now=0.5)
    short.core.check_liveness(3.6)  # 3.1 s after the close, 3.6 s silent: the close is named
    assert "not heard from in the 3.1 s after" in short.core.jobs[JOB].processes[incarnation_of(1)].death
    # Closed within the grace but silent past the timeout: the close is named all the same
    short.register(1, now=4.0, incarnation="again-1")
    short.core.touch(JOB, incarnation_of(0), now=7.0)
    short.core.disconnect(JOB, "again-1", now=6.5)
    short.core.check_liveness(7.1)
    assert short.core.jobs[JOB].processes["again-1"].death.startswith(
        "its connection closed without a Leave and it was not heard from in the 0.6 s after"
    ), short.core.jobs[JOB].processes["again-1"].death
    off = Pod(Core(heartbeat_timeout=None), 2, 1)
    off.register(0)
    off.register(1)
    off.core.disconnect(JOB, incarnation_of(1), now=0.5)
    off.core.check_liveness(1000.0)
    assert off.core.jobs[JOB].processes[incarnation_of(1)].alive


def test_a_dead_process_takes_the_ordinals_of_its_task_it_never_bound_with_it():
    """Task 1 of 2 x 2 bound thread 0 alone, then died: the rounds needing its ordinal 3 (no
    thread of it ever arrived) fail naming it, pending ones at once and later ones as they
    come (they waited out their deadlines); its replacement brings them back."""
    pod = Pod(Core(heartbeat_timeout=5), 2, 2)
    pod.register(0)
    pod.register(1, threads=[0])
    pending = pod.arrive([0, 1], replicas=[0, 1, 3], now=1.0, deadline=100.0)
    pod.core.touch(JOB, incarnation_of(0), now=8.0)
    pod.core.check_liveness(8.0)
    assert_message(pod.error(pending), Code.ABORTED, "a member died (ordinals 2-3 on host-0 pid 1001: no heartbeat")
    (event,) = pod.core.events(JOB, 0)[1]
    assert event.kind == "PROCESS_DEAD" and event.ordinals == (2, 3), event
    later = pod.arrive(0, tag="later", replicas=[0, 3], now=9.0, deadline=100.0)
    assert_message(pod.error(later), Code.ABORTED, "ordinals 2-3 on host-0 pid 1001")
    pod.register(1, now=10.0, incarnation="new-1", threads=[0])
    assert not pod.core.jobs[JOB].dead
    assert "task 1 (ordinals 2-3) restarted" in pod.core.events(JOB, 0)[1][-1].message
    again = pod.arrive(0, tag="again", replicas=[0, 3], now=11.0, deadline=100.0)
    assert pod.outcome(again) is None  # pending: waits for ordinal 3 of the new process


def test_an_ended_replica_fails_the_rounds_that_need_it_now_and_later_and_no_others():
    """Ordinal 1's replica (task 0's second thread) ended while its process runs ordinal 0
    on: the pending rounds needing it fail at once naming how it ended, later ones as they
    come, and rounds without it go on. (They waited for it until their timeout: the process
    had not left, so nothing told the coordinator.)"""
    pod = make_pod(2, 2)
    waiting = pod.arrive([3], replicas=[1, 3], deadline=100.0)
    pair = pod.arrive([0], replicas=[0, 2], tag="pair", now=1.0, deadline=100.0)  # (without 1)
    pod.core.end_replicas(JOB, incarnation_of(0), [1], "raised ValueError: gave up", now=2.0)
    assert_message(
        pod.error(waiting), Code.ABORTED,
        "cannot complete: a member ended (ordinal 1 on host-0 pid 1000: its replica raised ValueError: gave up)",
    )
    assert pod.outcome(pair) is None
    pod.arrive([2], replicas=[0, 2], tag="pair", now=3.0)
    assert pod.result(pair) == [b"p0", b"p2"]
    later = pod.arrive([3], replicas=[1, 3], tag="later", round_number=1, now=4.0, deadline=100.0)
    assert_message(pod.error(later), Code.ABORTED, "ordinal 1 on host-0 pid 1000: its replica raised ValueError")
    participants = pod.core.status(4.0, JOB)[0].participants
    assert [p.alive for p in participants] == [True] * 4  # (its process lives)
    assert [p.ended for p in participants] == ["", "raised ValueError: gave up", "", ""]
    pod.register(0, now=5.0, threads=[1])  # bound again: it is back
    again = pod.arrive([3], replicas=[1, 3], tag="again", round_number=2, now=6.0, deadline=100.0)
    assert pod.outcome(again) is None
    pod.arrive([1], replicas=[1, 3], tag="again", round_number=2, now=7.0)
    assert pod.result(again) == [b"p1", b"p3"]


def test_a_process_with_an_ended_replica_that_dies_still_says_how_it_ended_until_replaced():
    pod = Pod(Core(heartbeat_timeout=10), 2, 2)
    pod.register(0)
    pod.register(1)
    pod.core.end_replicas(JOB, incarnation_of(0), [1], "raised ValueError: x", now=1.0)
    pod.core.touch(JOB, incarnation_of(1), now=8.0)
    pod.core.check_liveness(12.0)
    key = pod.arrive([2], replicas=[1, 2], now=12.5)
    assert_message(
        pod.error(key), Code.ABORTED,
        "a member died or ended (ordinals 0-1 on host-0 pid 1000: no heartbeat for 11.0 s (heartbeat timeout 10 s); "
        "ordinal 1 on host-0 pid 1000: its replica raised ValueError: x)",
    )
    pod.register(0, now=13.0, incarnation="new-0")  # its replacement brings both back
    again = pod.arrive([2, 3], replicas=[1, 2, 3], now=14.0, deadline=100.0)
    pod.arrive([1], replicas=[1, 2, 3], now=14.0, incarnation="new-0")
    assert pod.result(again) == [b"p1", b"p2", b"p3"]


def test_only_a_live_process_ends_and_only_its_own_replicas():
    pod = make_pod(2, 2)
    with raises(Code.INVALID_ARGUMENT, "ordinals 2-3 are not bound by this process (host-0 pid 1000, task 0), which binds 0-1"):
        pod.core.end_replicas(JOB, incarnation_of(0), [1, 2, 3], "returned", now=1.0)
    assert not pod.core.jobs[JOB].dead  # (nothing of a refused call)
    pod.core.leave(JOB, incarnation_of(1))
    with raises(Code.ABORTED, "was declared dead"):
        pod.core.end_replicas(JOB, incarnation_of(1), [2], "returned", now=1.0)
    with raises(Code.FAILED_PRECONDITION, "is not registered"):
        pod.core.end_replicas(JOB, "stranger", [0], "returned", now=1.0)
    pod.core.end_replicas(JOB, incarnation_of(0), [1], "x" * 500, now=2.0)  # a long reason is cut
    key = pod.arrive([0], now=3.0)
    message = pod.error(key).message
    assert message.startswith("rendezvous 't' on all ordinals (round 0) cannot complete: a member ended or left (ordinal 1 on host-0 pid 1000: its replica xxx")
    assert message.endswith("xxx...; ordinals 2-3 on host-0 pid 1001: its client closed)") and "x" * 120 not in message


def test_without_a_heartbeat_timeout_nobody_is_declared_dead():
    pod = make_pod(2)
    pod.core.check_liveness(1e9)
    assert all(p.alive for p in pod.core.status(1e9, JOB)[0].participants)


def test_a_dead_process_is_replaced_from_any_host_and_old_rounds_are_void():
    pod = Pod(Core(heartbeat_timeout=10), 2, 1)
    pod.register(0)
    pod.register(1)
    pod.core.declare_dead(JOB, incarnation_of(1), "killed")
    pod.register(1, now=5.0, incarnation="new-1", host="elsewhere", pid=7)
    job = pod.core.jobs[JOB]
    assert job.generation == 2 and job.members[1].incarnation == "new-1" and not job.dead
    assert "restarted: elsewhere pid 7 replaces host-0 pid 1001, which died: killed" in pod.core.events(JOB, 0)[1][-1].message
    with raises(Code.ABORTED, "moved from generation 1 to 2", "restarted"):
        pod.core.arrive(6.0, job=JOB, incarnation=incarnation_of(0), replicas=[], round_number=0,
                        contributions=[Contribution(0, "t", b"")], deadline=None, generation=1)
    key = pod.arrive(0, now=6.0)
    pod.arrive(1, now=6.0, incarnation="new-1")
    assert pod.result(key) == [payload_of(0), payload_of(1)]


def test_a_process_restarted_on_its_host_with_its_local_rank_replaces_the_live_one_at_once():
    """A crash and a relaunch, before the old process's silence is noticed: the same host and
    local rank take the task over, a new generation begins, and the old incarnation's calls
    say it was replaced; the same claim from another host is still two processes sharing a task."""
    pod = Pod(Core(heartbeat_timeout=60), 2, 1)
    pod.register(0)
    pod.register(1)
    key = pod.arrive(0, now=2.0)
    pod.register(1, now=3.0, incarnation="again-1", pid=9999)
    assert pod.core.jobs[JOB].generation == 2
    assert_message(
        pod.error(key),
        Code.ABORTED,
        "moved to generation 2: task 1 (ordinal 1) restarted: host-0 pid 9999 replaces host-0 pid 1001, "
        "which was last heard from 3.0 s before; rendezvous 't' on all ordinals (round 0) is void",
    )
    with raises(Code.FAILED_PRECONDITION, "'inc-1'", "was replaced", "host-0 pid 9999 replaces"):
        pod.core.touch(JOB, incarnation_of(1), now=4.0)
    with raises(Code.FAILED_PRECONDITION, "'inc-1'", "was replaced"):  # nor does it take the task back
        pod.register(1, now=4.0)
    assert pod.core.jobs[JOB].generation == 2 and pod.core.jobs[JOB].members[1].incarnation == "again-1"
    with raises(Code.ALREADY_EXISTS, "already registered by host-0 pid 9999", "register on host-0 with local rank 1 at once"):
        pod.register(1, now=4.0, incarnation="intruder", host="host-9", pid=5)
    key = pod.arrive(0, now=5.0)
    pod.arrive(1, now=5.0, incarnation="again-1")
    assert pod.result(key) == [payload_of(0), payload_of(1)]


def test_a_resent_call_of_a_round_finished_before_a_restart_gets_its_result():
    """A round that completed before a process restarted (its answer lost to one member: a cut
    connection, a relay that died after the round) gives that member's resend the result its
    peers got, not ABORTED: the member's next call learns of the move, as its peers' do, so
    no member's round counter falls out of step with the others' (it once did: its peers
    went on one round ahead of it). Another content is still refused, and calls of rounds
    that did not finish before the move are void."""
    pod = Pod(Core(heartbeat_timeout=60), 4, 1)
    for task in range(4):
        pod.register(task)

    def call(ordinal, number, *, replicas=(), payload=None, tag="save"):
        return pod.core.arrive(4.0, job=JOB, incarnation=incarnation_of(ordinal), replicas=list(replicas),
                               round_number=number, generation=1, deadline=None,
                               contributions=[Contribution(ordinal, tag, payload or payload_of(ordinal))])

    for ordinal in range(4):
        call(ordinal, 0)
    for ordinal in (1, 0):
        call(ordinal, 0, replicas=[1, 0])
    pod.register(3, now=3.0, incarnation="again-3", pid=9)  # restarted in place: generation 2
    assert call(0, 0).result == [payload_of(o) for o in range(4)]
    assert call(0, 0, replicas=[0, 1]).result == [payload_of(0), payload_of(1)]
    with raises(Code.INVALID_ARGUMENT, "ordinal 0 resent", "different tag or payload"):
        call(0, 0, payload=b"other")
    with raises(Code.INVALID_ARGUMENT, "ordinal 0 resent", "different tag or payload"):
        call(0, 0, tag="step")
    for number, replicas in ((1, ()), (0, (0, 2)), (0, (0, 1, 5))):  # no such round finished
        with raises(Code.ABORTED, "moved from generation 1 to 2", "rounds of the old generation are void"):
            call(0, number, replicas=replicas)
    with raises(Code.ABORTED, "moved from generation 1 to 2"):  # an outsider of the pair's round
        call(2, 0, replicas=[0, 1])
    with raises(Code.INVALID_ARGUMENT, "round number must be >= 0"):  # checked first, as in any generation
        call(0, -1)
    with raises(Code.INVALID_ARGUMENT, "needs at least one contribution"):
        pod.core.arrive(4.0, job=JOB, incarnation=incarnation_of(0), replicas=[], round_number=0,
                        generation=1, deadline=None, contributions=[])


def test_a_declared_job_run_again_may_split_its_world_anew():
    """A job whose world size the operator declared, run again once every process of its last
    run is gone, takes a new layout of the same size (4 x 2, then 8 x 1: it once kept the
    old devices per task and refused the new run); a registration refused for its size does
    not start the job afresh."""
    core = Core()
    core.declare_job(JOB, 8)
    for task in range(4):
        core.register(0.0, registration(task, 4, 2))
    for task in range(4):
        core.leave(JOB, incarnation_of(task))
    with raises(Code.FAILED_PRECONDITION, "has world size 8 (fixed by"):
        core.register(1.0, registration(0, 16, 1, incarnation="too-big"))
    assert core.jobs[JOB].generation == 1 and core.jobs[JOB].devices_per_task == 2
    registered = core.register(1.0, registration(0, 8, 1, incarnation="next-0"))
    assert registered.world_size == 8 and registered.generation == 2
    assert core.jobs[JOB].devices_per_task == 1 and set(core.jobs[JOB].members) == {0}


def test_a_replaced_process_registering_after_the_run_ended_changes_nothing():
    """A replaced incarnation's registration (or one with a runtime ordinal out of range),
    once every process of the run is gone, is refused before it starts the job afresh (it
    once moved the job to a new generation and emptied its rank table, and was then refused)."""
    pod = Pod(Core(heartbeat_timeout=60), 2, 1)
    pod.register(0)
    pod.register(1)
    pod.register(1, now=1.0, incarnation="again-1", pid=9)  # restarted in place
    for incarnation in (incarnation_of(0), "again-1"):
        pod.core.leave(JOB, incarnation)
    job = pod.core.jobs[JOB]
    generation, version = job.generation, pod.core.version
    with raises(Code.FAILED_PRECONDITION, "'inc-1'", "was replaced"):
        pod.register(1, now=2.0)
    with raises(Code.INVALID_ARGUMENT, "as global ordinal 7", "out of range [0, 2)"):  # (nor one the request alone refuses)
        pod.register(1, now=2.0, incarnation="next-1", runtime={0: 7})
    assert (job.generation, pod.core.version, len(job.processes)) == (generation, version, 2)


def test_old_generations_rounds_are_forgotten_and_their_late_calls_are_void():
    """A job name reused by run after run (or restarted again and again) keeps the finished
    rounds of its last two generations only; a late resend of a forgotten round still gets
    a clear ABORTED naming the move, never another generation's result."""
    core = Core(heartbeat_timeout=60)
    for run in range(1, 31):  # each run afresh: a new generation
        core.register(0.0, registration(0, 1, 1, incarnation=f"run-{run}"))
        for number in range(2):
            core.arrive(1.0, job=JOB, incarnation=f"run-{run}", replicas=[], round_number=number,
                        contributions=[Contribution(0, "t", b"x" * 1000)], deadline=None, generation=run)
        core.leave(JOB, f"run-{run}")
    job = core.jobs[JOB]
    assert job.generation == 30 and {key[0] for key in job.groups} == {29, 30}
    core.register(0.0, registration(0, 1, 1, incarnation="run-31"))
    assert {key[0] for key in job.groups} == {30}
    with raises(Code.ABORTED, "moved from generation 1 to 31", "rounds of the old generation are void"):
        core.arrive(2.0, job=JOB, incarnation="run-31", replicas=[], round_number=0,
                    contributions=[Contribution(0, "t", b"x" * 1000)], deadline=None, generation=1)

    pod = Pod(Core(heartbeat_timeout=60), 2, 1)
    pod.register(0)
    pod.register(1)
    for restart in range(1, 6):  # restarts in place: the rounds they fail stay one generation
        key = pod.arrive(0, now=2.0, replicas=[0, 1], round_number=0)
        pod.register(1, now=3.0, incarnation=f"again-{restart}", pid=restart)
        assert_message(pod.error(key), Code.ABORTED, f"moved to generation {restart + 1}")
    assert {key[0] for key in pod.core.jobs[JOB].groups} == {5}


def test_a_job_keeps_the_groups_that_finished_a_round_last_and_those_with_a_pending_round(monkeypatch):
    """Every replica subset is a group with its last finished rounds: past _GROUPS_KEPT
    groups without a pending round, those that finished a round longest ago are forgotten
    (down to 7/8 of it), never one with a pending round. A forgotten group starts again from
    nothing: its members' next round completes as before; only a retry of a round it
    finished misses its result."""
    from pjrt_rendezvous.coordinator import _core

    monkeypatch.setattr(_core, "_GROUPS_KEPT", 8)
    pod = make_pod(12)
    groups = pod.core.jobs[JOB].groups
    pod.arrive(10, replicas=[10, 11])  # pending all along

    def pair(a: int, b: int, number: int = 0) -> tuple:
        pod.arrive(a, replicas=[a, b], round_number=number)
        return pod.arrive(b, replicas=[a, b], round_number=number)

    for a in range(5):
        pair(a, a + 1)
    pair(0, 1, 1)  # (0, 1) finished a round last: kept over (1, 2)
    assert len(groups) == 6
    for a in range(5, 9):
        pair(a, a + 1)  # the 9th group without a pending round: down to 7 of those
    kept = [key[1] for key in groups]
    assert kept == [(10, 11), (3, 4), (4, 5), (0, 1), (5, 6), (6, 7), (7, 8), (8, 9)]
    assert pod.result(pod.key((0, 1), 1)) == [b"p0", b"p1"]
    assert pod.outcome(pod.key((1, 2), 0)) is None  # forgotten
    assert pod.result(pair(1, 2, 1)) == [b"p1", b"p2"]  # its next round, as a new group's
    assert pod.result(pod.arrive(11, replicas=[10, 11])) == [b"p10", b"p11"]
    for a in range(100):  # many more subsets: the job's groups stay bounded
        pair(a % 11, a % 11 + 1, 2 + a // 11)
    assert len(groups) <= 8


def test_only_the_latest_events_are_kept_and_indexes_stay_meaningful(monkeypatch):
    """A job keeps its latest events only, but indexes count from its first event: a stream
    that counted the events so far (as Watch does) gets exactly the next one, and one whose
    events were dropped meanwhile still moves on to the next index."""
    from pjrt_rendezvous.coordinator import _core

    monkeypatch.setattr(_core, "_EVENTS_KEPT", 3)
    pod = Pod(Core(heartbeat_timeout=60), 2, 1)
    pod.register(0)
    for restart in range(5):
        pod.register(1, incarnation=f"again-{restart}", pid=restart)
    log = pod.core.jobs[JOB].events
    assert (len(log), log.dropped) == (4, 1)
    first, events = pod.core.events(JOB, 0)  # Watch's first count
    assert (first, len(events)) == (1, 3)
    seen = first + len(events)
    pod.register(1, incarnation="again-9", pid=9)
    (event,) = pod.core.events(JOB, seen)[1]
    assert "again-9" not in event.message and "pid 9 replaces" in event.message
    assert [e.message for e in pod.core.events(JOB, 3)[1]] == [e.message for e in list(log)[-2:]]
    first, behind = pod.core.events(JOB, 1)  # event 1 is gone: the oldest kept comes first
    assert first == 2 and first + len(behind) == len(log) == 5 and behind == list(log)
    assert "pid 9 replaces" in pod.core._generation_reason(pod.core.jobs[JOB])


def test_the_core_imports_only_the_standard_library():
    """DESIGN: a pure core, no grpc and no asyncio (time passed in, decisions returned)."""
    import ast
    import pathlib
    import sys

    from pjrt_rendezvous.coordinator import _core

    tree = ast.parse(pathlib.Path(_core.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert imported and imported <= set(sys.stdlib_module_names) - {"asyncio"}, imported


# -- host relays ------------------------------------------------------------------------------


def relayed(pod: Pod, by_task: int, ordinals: Sequence[int], *, tag: str = "t", round_number: int = 0, now: float = 1.0):
    """Task ``by_task``'s relay sends ``ordinals`` of any task on the host, each naming its process."""
    return pod.core.arrive(
        now,
        job=pod.job,
        incarnation=incarnation_of(by_task),
        replicas=[],
        round_number=round_number,
        contributions=[
            Contribution(ordinal=o, tag=tag, payload=payload_of(o), incarnation=incarnation_of(o // pod.devices))
            for o in ordinals
        ],
        deadline=None,
    ).key


def test_a_host_relay_speaks_for_its_siblings_in_one_call():
    """One call carrying two processes' contributions (each naming its process) counts for both."""
    pod = make_pod(4, 2)
    key = relayed(pod, 0, [0, 1, 2, 3])
    assert pod.outcome(key) is None
    assert pod.core.status(1.0, JOB)[0].pending_rounds[0].missing == [4, 5, 6, 7]
    relayed(pod, 2, [4, 5, 6, 7])
    assert pod.result(key) == [payload_of(o) for o in range(8)]


def test_a_relayed_contribution_resent_by_its_own_process_is_the_same_arrival():
    """A sibling whose relay went away resends directly: same content, accepted once."""
    pod = make_pod(2, 1)
    key = relayed(pod, 0, [0, 1])
    assert pod.arrive(1) == key
    assert pod.result(key) == [payload_of(0), payload_of(1)]


def test_a_relay_naming_the_wrong_or_an_unknown_process_is_refused_and_changes_nothing():
    pod = make_pod(3, 1)
    wrong = Contribution(ordinal=2, tag="t", payload=b"x", incarnation=incarnation_of(1))
    with raises(Code.FAILED_PRECONDITION, "ordinal 2 is registered by", "not by the process a host relay named"):
        pod.core.arrive(1.0, job=JOB, incarnation=incarnation_of(0), replicas=[], round_number=0,
                        contributions=[wrong], deadline=None)
    unknown = Contribution(ordinal=1, tag="t", payload=b"x", incarnation="nobody")
    with raises(Code.FAILED_PRECONDITION, "'nobody' is not registered"):
        pod.core.arrive(1.0, job=JOB, incarnation=incarnation_of(0), replicas=[], round_number=0,
                        contributions=[unknown], deadline=None)
    assert not pod.core.status(1.0, JOB)[0].pending_rounds


# --- a round given up without an answer ----------------------------------------------------------


def give_up(pod: Pod, task: int, ordinals: Sequence[int], *, round_number: int = 0, replicas: Sequence[int] = (), generation=None, now: float = 2.0):
    return pod.core.give_up_round(
        JOB, incarnation_of(task), generation=pod.core.jobs[JOB].generation if generation is None else generation,
        replicas=list(replicas), round_number=round_number, ordinals=list(ordinals), tag="t",
        reason="the coordinator was out of its reach (connect_timeout 60 s)", now=now,
    )


def test_a_round_given_up_by_a_member_fails_for_the_others_and_the_next_round_meets():
    """Task 1's call of round 0 ended without an answer (the coordinator out of its reach
    for its retry budget) and its next call is of round 1: the round its peer waits in
    fails, naming who gave up and why, instead of waiting for ordinals that come to round
    1 (the two rounds then failed as waiting on each other, blaming the order of calls)."""
    pod = make_pod(2, 2)
    waiting = pod.arrive([0, 1], deadline=100.0)
    rnd = give_up(pod, 1, [2, 3])
    assert rnd is not None and rnd.key == waiting
    assert_message(
        pod.error(waiting), Code.ABORTED,
        "rendezvous 't' on all ordinals (round 0) cannot complete: ordinals 2-3 on host-0 pid 1001 gave up on it "
        "and went on to its next round: the coordinator was out of its reach (connect_timeout 60 s)",
    )
    assert ("round", JOB, *waiting) in pod.core.take_wakeups()
    assert pod.arrive([0, 1], now=3.0) == waiting  # (a resend gets the failure)
    assert pod.error(waiting).code is Code.ABORTED
    nxt = pod.arrive([2, 3], round_number=1, now=4.0)
    pod.arrive([0, 1], round_number=1, now=5.0)
    assert pod.result(nxt) == [b"p0", b"p1", b"p2", b"p3"]
    assert give_up(pod, 1, [2, 3]) is None  # (told again: failed already)


def test_a_round_given_up_before_any_member_came_fails_for_those_who_come():
    """A coordinator restarted: the round's calls are resent, and the give-up may come
    first. The round fails then, with the giver's tag, for every member that comes."""
    pod = make_pod(2, 1)
    assert give_up(pod, 1, [1], replicas=[0, 1], round_number=3) is not None
    key = pod.arrive([0], replicas=[0, 1], round_number=3, now=3.0)
    assert_message(pod.error(key), Code.ABORTED, "rendezvous 't' on all ordinals (round 3) cannot complete: ordinal 1 on")


def test_a_round_failed_ahead_of_its_group_stays_for_its_members_when_earlier_ones_finish():
    """Round 2 failed (given up) while rounds 0 and 1 were still to finish: as they did, a
    group keeping one completed round let round 2 go, and a resend of it opened a new round
    2 (a model-based test of the state file found it). It stays until its members came;
    the late member is told its failure."""
    pod = make_pod(2)
    ahead = pod.arrive(1, replicas=[0, 1], round_number=2, now=1.0)
    give_up(pod, 0, [0], replicas=[0, 1], round_number=2, now=1.0)
    assert pod.error(ahead).code is Code.ABORTED
    for number in (0, 1):
        pod.arrive(0, round_number=number, now=2.0)
        assert pod.result(pod.arrive(1, round_number=number, now=2.0)) == [b"p0", b"p1"]
        assert pod.arrive(1, replicas=[0, 1], round_number=2, now=3.0) == ahead  # (a resend: its answer)
        assert pod.error(ahead).code is Code.ABORTED and not pod.core.jobs[JOB].pending
    with raises(Code.ABORTED, "ordinal 0 called rendezvous('t') as round 2 of all ordinals, which had failed before it came",
                "ordinal 0 on host-0 pid 1000 gave up on it"):
        pod.arrive(0, round_number=2, now=4.0)
    pod.arrive(0, round_number=3, now=5.0)
    assert pod.result(pod.arrive(1, round_number=3, now=5.0)) == [b"p0", b"p1"]
    assert list(pod.core.jobs[JOB].groups[ahead[:2]].finished) == [3]


def test_a_finished_void_or_long_past_round_is_not_failed_by_a_give_up():
    pod = make_pod(2, 1)
    done = pod.arrive([0])
    pod.arrive([1])
    assert give_up(pod, 1, [1]) is None  # its answer was lost, the round completed
    assert pod.result(done) == [b"p0", b"p1"]
    for number in (1, 2):
        pod.arrive([0], round_number=number)
        pod.arrive([1], round_number=number)
    assert give_up(pod, 1, [1], round_number=0) is None  # (its result is gone: nothing waits in it)
    assert give_up(pod, 1, [1], round_number=5, generation=7) is None  # another generation's: void already
    assert give_up(pod, 1, [1], round_number=5, replicas=[9]) is None  # no member in range: no round
    assert give_up(pod, 1, [1], round_number=5, replicas=[0]) is None  # an outsider's call counts no round of the group
    stale = pod.core.give_up_round(  # a job of the name made anew since (a restart without state)
        JOB, incarnation_of(1), generation=pod.core.jobs[JOB].generation, replicas=[], round_number=3, ordinals=[1],
        tag="t", reason="", now=3.0, job_id="another job's id",
    )
    assert stale is None
    assert not pod.core.jobs[JOB].pending
    with raises(Code.INVALID_ARGUMENT, "a process gives up rounds of its own ordinals (host-0 pid 1001 binds 1), not of 0"):
        give_up(pod, 1, [0, 1], round_number=3)
    with raises(Code.INVALID_ARGUMENT, "not of none"):
        give_up(pod, 1, [], round_number=3)
    with raises(Code.FAILED_PRECONDITION, "is not registered"):
        pod.core.give_up_round(JOB, "stranger", generation=0, replicas=[], round_number=3, ordinals=[1], tag="t", reason="", now=3.0)
    assert not pod.core.jobs[JOB].pending


def test_a_job_not_created_yet_is_waited_for_and_its_world_timeout_names_the_known_jobs():
    pod = make_pod(1)
    assert pod.core.world_complete("later") is False
    with raises(Code.INVALID_ARGUMENT, "job name must not be empty"):
        pod.core.world_complete("")
    assert "later" not in pod.core.jobs  # (a wait creates nothing)
    assert_message(
        pod.core.world_timeout("later", now=5.0, waited=5.0), Code.DEADLINE_EXCEEDED,
        "after 5.0 s, job 'later' is not known to this coordinator (known jobs: 'job')",
    )


def test_a_completed_round_lets_the_group_s_round_before_go_and_a_failed_one_keeps_it():
    """Round k+1 completed had every member, each with round k's answer: k is let go (a
    round of 512 MiB kept its payloads as well), and a call of k is told it finished long
    ago. Round k+1 failed keeps k: a member whose answer to k was lost asks for it again."""
    pod = make_pod(2, limits=Limits(max_payload_bytes=8))
    for number in (0, 1):
        keys = [pod.arrive(o, round_number=number) for o in (0, 1)]
    assert pod.result(keys[0]) == [payload_of(0), payload_of(1)]
    with raises(Code.FAILED_PRECONDITION, "round 0 of all ordinals finished long ago and its result is gone"):
        pod.arrive(0, round_number=0)
    pod.arrive(0, round_number=2)
    with raises(Code.RESOURCE_EXHAUSTED):
        pod.arrive(1, round_number=2, payloads={1: b"x" * 9})
    assert pod.result(pod.arrive(1, round_number=1)) == [payload_of(0), payload_of(1)]  # (a resend: kept)
