"""What an operator sees of the coordinator's decisions: one log line per significant
event, and the metric observations that go with it.

The core queues a wake key for everything a waiter may be blocked on (see ``_core``); the
servicer hands each batch to :meth:`Monitor.woke`, so every finished round, formed world
and job event is seen exactly once, whichever code path caused it (an arrival, a timeout,
the liveness watch, a re-registration). Rounds that wait too long are found by
:meth:`Monitor.check_late`, which the server runs periodically.

Events (the ``event`` field of JSON log lines; registration is logged by the servicer):

=======================  =======  ================================================
``registered``           INFO     a process registered threads (task, host, pid)
``world_formed``         INFO     every ordinal of a job (generation) registered
``round_late``           WARNING  a round waited ``late_after`` s (and again each time
                                  its wait doubles): who is missing
``world_late``           WARNING  a job's world still incomplete ``late_after`` s
                                  after it was first seen so: who is missing
``round_failed``         WARNING  a round failed (timeout, mismatch, death, restart)
``rounds_failed_again``  WARNING  at most once a minute: how many more rounds failed
                                  for a cause told ten times (a member died, left or
                                  ended), each a ``round_failed`` line at DEBUG
``process_dead``         WARNING  a process missed its heartbeat deadline, or did
                                  not call again after its connection closed
``process_restarted``    WARNING  a new process took over a dead one's task
``process_left``         INFO     a process closed its client (its ordinals are gone)
``replicas_ended``       INFO     a process's replicas ended (``xla.spawn``; logged
                                  by the servicer)
``events_dropped``       WARNING  more process events came at once than a job keeps
                                  (_EVENTS_KEPT): how many were not logged one by one
=======================  =======  ================================================

(``unknown_job`` and ``dead_process_called``, once per job or process, are logged by the
servicer as it refuses their calls: ``CoreError.warn``.)

Thread safety: none needed; everything runs on the coordinator's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable

from pjrt_rendezvous.client._session import clip

from ._core import _EVENTS_KEPT, ALL, Core, CoreError, Round, _plural, describe_group, format_ranges
from ._metrics import Metrics

log = logging.getLogger("pjrt_rendezvous.coordinator")

DEFAULT_LATE_AFTER = 60.0


# A log line's list of ordinals is cut short past this many characters: a line of a large
# world must stay one line for the log pipeline (Docker's splits lines over 16 KiB).
_RANGES_LOGGED = 1000


def group_label(group: tuple[int, ...]) -> str:
    return "all" if group == ALL else format_ranges(group, _RANGES_LOGGED)


class Monitor:
    """Logs significant events of ``core`` and feeds ``metrics``.

    Args:
        core: the coordinator's core (read only).
        metrics: where round outcomes are counted; None counts nothing.
        clock: the same clock the servicer passes to the core.
        late_after: log a round still pending after this many seconds, and again each time
            its wait doubles; None never.
    """

    LATE_PER_CHECK = 16
    LATE_KEPT = 4096  # rounds reported late, remembered; past this, those gone are forgotten
    REPEATS_TOLD = 10  # rounds failed for one cause (a member gone) told in full; the rest counted
    REPEATS_EVERY = 60.0  # seconds between counts of rounds failed again for a cause told

    def __init__(
        self,
        core: Core,
        metrics: Metrics | None,
        *,
        clock: Callable[[], float],
        late_after: float | None = DEFAULT_LATE_AFTER,
    ) -> None:
        self._core = core
        self._metrics = metrics
        self._clock = clock
        if late_after is not None and not late_after > 0:  # (check_late doubles it)
            raise ValueError(f"late_after must be > 0 seconds or None, got {late_after!r}")
        self.late_after = late_after
        # Events restored from a state file were logged by the previous coordinator.
        self._events_seen = {name: len(job.events) for name, job in core.jobs.items()}
        # (job, round key) reported late -> the wait at which it is reported again (twice the
        # last: at 60, 120, 240 and 480 s by default, and not only at 60 of a 600 s timeout)
        self._late: dict[tuple[str, tuple], float] = {}
        self._formed: dict[str, int] = {}  # job -> the generation whose world formed last
        # (job, generation) whose world is incomplete -> [first seen so, reported late]
        self._worlds: dict[tuple[str, int], list] = {}
        # (job, why a member is gone) -> [when last counted, rounds failed for it since, told]
        self._causes: dict[tuple[str, str], list] = {}
        core.finished = []  # the core keeps the rounds it finishes for us from now on

    def woke(self, keys: Iterable[tuple]) -> None:
        """Observes one batch of wake keys from :meth:`Core.take_wakeups`: job events (a
        death, a restart) before the rounds they failed, causes before effects."""
        now = self._clock()
        for key in keys:
            try:
                if key[0] == "world":
                    self._world(key[1])
                elif key[0] == "events":
                    self._events(key[1], now)
                elif key[0] == "dropped":
                    self._dropped(key[1], key[2])
            except CoreError:  # the job was dropped since (max_jobs): nothing to report
                continue
        for job, rnd in self._core.take_finished():
            self._round(job, rnd, now)

    def _round(self, job: str, rnd: Round, now: float) -> None:
        self._late.pop((job, rnd.key), None)
        if rnd.error is None:
            if self._metrics is not None:
                self._metrics.round_completed(job, now - rnd.started)
            return
        if self._metrics is not None:
            self._metrics.round_failed(job, rnd.error.code.name, now)
        level = logging.WARNING
        cause = rnd.error.message.partition(" cannot complete: ")[2]  # a member died, left or ended
        if cause:
            # A program that goes on calling after a death fails every round at once, for
            # the same cause: the first few are told in full, the rest in a count once a
            # minute (a loop that catches the error wrote thousands of lines a second).
            said = self._causes.get((job, cause))
            if said is None:
                if len(self._causes) >= self.LATE_KEPT:
                    self._say_repeats(now, every=0.0)
                    self._causes.clear()
                said = self._causes[(job, cause)] = [now, 0, 0]
            if said[2] < self.REPEATS_TOLD:
                said[2] += 1
            else:
                level = logging.DEBUG
                said[1] += 1
                self._say_repeats(now)
        if not log.isEnabledFor(level):
            return
        log.log(
            level,
            "round failed in job %r: %s",
            job,
            clip(rnd.error.message),  # (as its members are told it)
            extra={
                "event": "round_failed",
                "job": job,
                "generation": rnd.generation,
                "group": group_label(rnd.group),
                "round": rnd.number,
                "tag": rnd.tag,
                "code": rnd.error.code.name,
                "arrived": len(rnd.arrivals),
                "expected": rnd.size,
                **_missing_fields(self._core, job, rnd.missing()),
                "waited": round(now - rnd.started, 3),
            },
        )

    def _say_repeats(self, now: float, every: float | None = None) -> None:
        """Counts the rounds failed again for each cause told, not counted for ``every``
        (default ``REPEATS_EVERY``) seconds."""
        every = self.REPEATS_EVERY if every is None else every
        for (job, cause), said in self._causes.items():
            if said[1] and now - said[0] >= every:
                log.warning(
                    "%d more round(s) failed in job %r for the same cause as before: %s",
                    said[1], job, cause, extra={"event": "rounds_failed_again", "job": job, "rounds": said[1]},
                )
                said[:2] = [now, 0]

    def _dropped(self, job_name: str, for_name: str) -> None:
        """A finished job dropped to make room for a new one (``Limits.max_jobs``)."""
        self._events_seen.pop(job_name, None)
        self._causes = {key: said for key, said in self._causes.items() if key[0] != job_name}
        self._formed.pop(job_name, None)
        if self._metrics is not None:
            self._metrics.forget(job_name)
        log.info(
            "job %r dropped to make room for job %r: it had finished (every process gone) and "
            "was the one used longest ago, with max_jobs=%d jobs",
            job_name,
            for_name,
            self._core.limits.max_jobs,
            extra={"event": "job_dropped", "job": job_name, "for_job": for_name},
        )

    def _world(self, job_name: str) -> None:
        job = self._core.jobs.get(job_name)  # None: dropped since (max_jobs)
        if job is None or not job.complete or self._formed.get(job_name) == job.generation:
            return
        self._formed[job_name] = job.generation  # (one a job: a set of each run's grew for ever)
        hosts = {p.host for p in job.processes.values()}
        log.info(
            "world formed in job %r: %s, %s on %s, generation %d",
            job_name,
            _plural(job.world_size, "ordinal"),
            _plural(len(job.processes), "process"),
            _plural(len(hosts), "host"),
            job.generation,
            extra={
                "event": "world_formed",
                "job": job_name,
                "world_size": job.world_size,
                "processes": len(job.processes),
                "hosts": len(hosts),
                "generation": job.generation,
            },
        )

    def _events(self, job_name: str, now: float) -> None:
        seen = self._events_seen.get(job_name, 0)
        first, events = self._core.events(job_name, seen)
        self._events_seen[job_name] = first + len(events)
        if first > seen:  # (a relaunch dropping thousands of processes at once)
            log.warning(
                "%d process events in job %r came at once beyond the %d a job keeps: not logged one by one "
                "nor counted in process_events_total; the %d latest follow", first - seen, job_name,
                _EVENTS_KEPT, len(events), extra={"event": "events_dropped", "job": job_name, "count": first - seen},
            )
        for event in events:
            name = event.kind.lower()  # process_dead, process_left, process_restarted
            if self._metrics is not None:
                self._metrics.process_event(job_name, name.removeprefix("process_"), now)
            log.log(
                logging.INFO if event.kind == "PROCESS_LEFT" else logging.WARNING,
                "%s in job %r: %s",
                name.replace("_", " "),
                job_name,
                event.message,
                extra={
                    "event": name,
                    "job": job_name,
                    "generation": event.generation,
                    "ordinals": format_ranges(event.ordinals, _RANGES_LOGGED),
                    "host": event.host,
                    "task": event.task,
                    "pid": event.pid,
                },
            )

    async def watch(self) -> None:
        """Runs :meth:`check_late` a few times per ``late_after`` (and counts rounds failed
        again, ``_say_repeats``) until cancelled."""
        interval = 1.0 if self.late_after is None else min(1.0, self.late_after / 4)
        loop = asyncio.get_running_loop()
        while True:
            asleep = loop.time()
            await asyncio.sleep(interval)
            if loop.time() - asleep > 2 * interval:
                # Held up (stopped and continued, a starved loop): the calls that came
                # meanwhile, which may finish the rounds, are read first (as watch_liveness).
                await asyncio.sleep(interval)
            self.check_late()
            self._say_repeats(self._clock())

    def check_late(self) -> None:
        """Logs every pending round older than ``late_after``, and again each time its wait
        doubles: at most ``LATE_PER_CHECK`` per call (naming who is missing costs the size of
        the round's group: many late rounds of a large world would hold up the loop), the
        rest at the next calls. (Rounds that finished are dropped in _round, the rest once
        LATE_KEPT are remembered.)"""
        if self.late_after is None:
            return
        now = self._clock()
        jobs = self._core.jobs
        self._check_worlds(now)
        if len(self._late) > self.LATE_KEPT:  # forget the rounds that are no longer pending
            self._late = {(name, key): at for (name, key), at in self._late.items() if name in jobs and key in jobs[name].pending}
        budget = self.LATE_PER_CHECK
        for name, job in jobs.items():
            for key, rnd in job.pending.items():
                waited = now - rnd.started
                late = self._late.get((name, key), self.late_after)
                if waited < late:
                    continue
                if not budget:
                    return
                budget -= 1
                # (doubling the wait seen, up to a check's interval past the last, drifted:
                # 60.3, 121.3, 243.3, 487.3 s)
                while late <= waited:
                    late *= 2
                self._late[(name, key)] = late
                missing = rnd.missing()
                log.warning(
                    "round late in job %r: %s on %s (round %d) has waited %.1f s with %d of %d "
                    "arrived; missing %s",
                    name,
                    repr(rnd.tag) if rnd.tag else "?",
                    describe_group(rnd.group, _RANGES_LOGGED),
                    rnd.number,
                    waited,
                    len(rnd.arrivals),
                    rnd.size,
                    self._core.with_missing(job, "", missing, now),
                    extra={
                        "event": "round_late",
                        "job": name,
                        "generation": rnd.generation,
                        "group": group_label(rnd.group),
                        "round": rnd.number,
                        "tag": rnd.tag,  # one tag: two would have failed the round
                        "arrived": len(rnd.arrivals),
                        "expected": rnd.size,
                        **_missing_fields(self._core, name, missing),
                        "waited": round(waited, 3),
                    },
                )

    def _check_worlds(self, now: float) -> None:
        """Logs, once, every job whose world (of a known size, with a live process) has been
        incomplete for ``late_after`` since a check first found it so: a world that does not
        form left nothing in the log but the registrations that came."""
        incomplete = set()
        for name, job in self._core.jobs.items():
            if job.world_size is None or job.complete or not any(p.alive for p in job.processes.values()):
                continue
            key = (name, job.generation)
            incomplete.add(key)
            seen = self._worlds.setdefault(key, [now, False])
            if seen[1] or now - seen[0] < self.late_after:
                continue
            seen[1] = True
            missing = job.unregistered()
            log.warning(
                "world late in job %r: %d of %d ordinals registered after %.1f s; missing %s",
                name,
                len(job.members),
                job.world_size,
                now - seen[0],
                self._core._world_missing(job, now),
                extra={
                    "event": "world_late",
                    "job": name,
                    "generation": job.generation,
                    "registered": len(job.members),
                    "expected": job.world_size,
                    **_missing_fields(self._core, name, missing),
                    "waited": round(now - seen[0], 3),
                },
            )
        if self._worlds.keys() - incomplete:  # formed, or gone: forgotten
            self._worlds = {key: seen for key, seen in self._worlds.items() if key in incomplete}


_HOSTS_LOGGED = 16


def _missing_fields(core: Core, job: str, missing: list[int]) -> dict:
    """A log line's ``missing`` (ranges, cut short past _RANGES_LOGGED), ``missing_count`` and
    ``missing_hosts`` (the first _HOSTS_LOGGED, with ``missing_hosts_count``)."""
    hosts = core.hosts_of(job, missing)
    return {
        "missing": format_ranges(missing, _RANGES_LOGGED), "missing_count": len(missing),
        "missing_hosts": hosts[:_HOSTS_LOGGED], "missing_hosts_count": len(hosts),
    }
