"""The coordinator's pure core: rank tables, rendezvous rounds and key-value data per job.

No grpc, no asyncio, no clock: every call that depends on time takes ``now`` (seconds on
any monotonic scale) and every decision is returned or raised as :class:`CoreError`. The
servicer translates requests into these calls, and waits on the *wake keys* the core
queues whenever something a waiter may be blocked on changes (see :meth:`Core.take_wakeups`):

- ``("world", job)``               the job's world became complete
- ``("round", job, generation, group, number)`` a rendezvous round finished
- ``("kv", job, key)``             a key was written
- ``("events", job)``              a job event (a process died, left or restarted) was recorded
- ``("dropped", job, for_job)``    a finished job was dropped at max_jobs for a new one

Rounds, not tags, match calls (README "The client API"): a participant's k-th call
on a replica group is round k of that group. A group is the sorted tuple of its ordinals,
or ``ALL`` (the empty tuple) for every ordinal of the job.

Liveness: with a heartbeat timeout, :meth:`Core.check_liveness` declares processes dead
that were not heard from in time; every pending and later round needing their ordinals
fails with ABORTED. A dead process's task may be registered again by a new incarnation:
the job then moves to a new *generation*, failing every pending round, and round numbers
start again from 0, so old and new rounds never mix.

Thread safety: none. The servicer calls the core from one event loop thread.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import enum
import hashlib
import itertools
import math
import os
import secrets
from typing import Iterable, Mapping, NamedTuple, Sequence

ALL: tuple[int, ...] = ()
"""The group key of a rendezvous over every ordinal of the job."""

GroupKey = tuple[int, ...]
RoundKey = tuple[int, GroupKey, int]  # (generation, group, number)

# A finished round is kept so a retried call can fetch its result. A member can be at
# most one round behind the others of its group (they cannot finish round k+1 without
# it), so two finished rounds per group are enough, and once round k+1 completed (every
# member came to it, so had round k's answer), one. Failures are the exception: the others
# may fail round after round without a member that is late (each times out without it),
# which then comes to each in turn and is told each one's error. A group keeps its failures
# in a row, up to _FAILED_ROUNDS_KEPT (a failed round keeps who came and its error, no
# payloads).
_FINISHED_ROUNDS_KEPT = 2
_FAILED_ROUNDS_KEPT = 16
# Groups (replica subsets) a job keeps, with their finished rounds: past that, those that
# finished a round longest ago and have none pending are forgotten (Core.record_finished).
# A forgotten group starts again as a new one, as after a coordinator restart without its
# state: only a call retried after its group was forgotten misses its result.
_GROUPS_KEPT = 4096
# How far ahead of its group's next unfinished round a call may start a round. A member
# calls round k+1 only once round k finished, so only calls abandoned by their client (an
# interrupt, a cancelled call) leave rounds ahead; each holds its arrivals until its deadline
# (the servicer's alarm expires it then, waited on or not).
_ROUNDS_AHEAD = 1000
_REQUEST_IDS_KEPT = 100_000
# A request id (a client's uuid4().hex: 32 characters) is kept with its result for retries,
# in memory and in the state file; longer ones are refused, not kept.
MAX_REQUEST_ID_LENGTH = 256
_REPLACED_KEPT = 1024  # replaced incarnations remembered per job, for their late calls' errors
MIN_HEARTBEAT_TIMEOUT = 1.0  # seconds
# Seconds a process whose connection closed without a Leave (Core.disconnect) has to call
# again before it is declared dead (or twice its heartbeat interval, if longer; at most the
# heartbeat timeout). A live client opens its event watch again within a second or five and
# heartbeats every five: a killed process is told apart from a broken connection well
# before the heartbeat timeout, 60 s by default.
DISCONNECTED_GRACE = 10.0
_REFUSED_KEPT = 1024  # tasks whose registration was refused, remembered per job (Core.register)
_OUTSIDER_CALLS_KEPT = 1024  # ordinals' calls from outside their replicas remembered per job (Core._replicas_group)
_EVENTS_KEPT = 1000  # the latest events of a job (EventLog)
# Processes this coordinator does not know that heartbeat it (Core.strangers): of how many
# jobs, how many processes each, and for how long after their last heartbeat.
_UNKNOWN_JOBS_KEPT = 16
_UNKNOWN_PROCESSES_KEPT = 4096
_UNKNOWN_KEPT_FOR = 600.0  # seconds
_DECLARED = "the coordinator's --world-size"


class Code(enum.Enum):
    """Status codes of core decisions; the servicer maps them 1:1 onto gRPC codes."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    NOT_FOUND = "NOT_FOUND"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    ABORTED = "ABORTED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"  # the coordinator is stopping, or cannot write its state file


class CoreError(Exception):
    """A request the core refuses, or a round that failed: a code and a full message, and
    for a refusal the operator should hear of, ``warn``: (what it is about, event name,
    the log line), logged once per subject by the servicer (the client is told every time)."""

    def __init__(self, code: Code, message: str, *, warn: tuple[tuple, str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.warn = warn

    def __repr__(self) -> str:
        return f"CoreError({self.code.name}, {self.message!r})"


MIN_NAME_LENGTH = 32  # a client's incarnation id: uuid4().hex


MAX_ROUND_BYTES = (1 << 31) - (16 << 20)
# Bytes a payload takes in an answer beyond its own: its field's tag and length.
_PAYLOAD_FRAMING = 6


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """Size and count limits; breaching one is RESOURCE_EXHAUSTED, naming the limit and the value."""

    max_payload_bytes: int = 64 * 1024 * 1024
    max_tag_length: int = 1024
    max_key_length: int = 4096
    max_value_bytes: int = 64 * 1024 * 1024
    max_name_length: int = 256  # job names, hosts, incarnations (a client's is 32 characters)
    max_world_size: int = 65_536
    max_jobs: int = 1024
    max_pending_rounds: int = 65_536
    max_kv_bytes: int = 1 << 30  # a job's keys and values together
    # A round's payloads together (with their framing): every member's answer holds them
    # all, in one message of at most 2 GiB (protobuf's and gRPC's limit), less room for the rest.
    max_round_bytes: int = MAX_ROUND_BYTES

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"limit {field.name} must be a positive integer, got {value!r}")
        if self.max_round_bytes > MAX_ROUND_BYTES:
            raise ValueError(
                f"limit max_round_bytes must be at most {MAX_ROUND_BYTES} (a round's answer is one message "
                f"of at most 2 GiB), got {self.max_round_bytes}"
            )
        if self.max_name_length < MIN_NAME_LENGTH:
            raise ValueError(
                f"limit max_name_length must be at least {MIN_NAME_LENGTH} (it also bounds the "
                f"incarnation ids clients register with), got {self.max_name_length}"
            )


def _duration(seconds: float) -> str:
    """Seconds for a message: tenths from about 1 s, else two figures, at least a millisecond
    (a wait of 50 ms is not "0.0 s")."""
    return f"{seconds:.1f}" if seconds >= 0.95 else f"{max(seconds, 0.001):.2g}"


def _control(text: str) -> bool:
    """Whether ``text`` holds a control character (C0, DEL, C1, or a Unicode line or
    paragraph separator): names that go into log lines and ``status`` must not."""
    return not text.isprintable() and any(
        c < " " or "\x7f" <= c <= "\x9f" or c in "\u2028\u2029" for c in text
    )


def _shown_tag(tag: str) -> str:
    """A tag over the limit as an error names it: its start (it would be copied whole into
    the members' stored error, the journal and the state file)."""
    return tag if len(tag) <= 40 else tag[:40] + "..."


_TAGS_NAMED = 8  # a tag mismatch names the tags of the first few groups, then counts the rest


def _distinct_tags(tags: Iterable[str]) -> dict[str, str]:
    """Tags as an error that names them side by side shows each: whole while all of them take
    600 characters at most, else 40 characters of each from just before where it first
    differs from another (cut at 40 from the start, tags that differ after it read alike)."""
    tags = list(dict.fromkeys(tags))
    if sum(map(len, tags)) <= 600:
        return {t: t for t in tags}
    shown = {}
    for tag in tags:  # (a few: every pair is compared)
        common = max((len(os.path.commonprefix([tag, other])) for other in tags if other != tag), default=0)
        start = common - 10 if common > 30 else 0
        shown[tag] = ("..." if start else "") + tag[start : start + 40] + ("..." if start + 40 < len(tag) else "")
    return shown


def format_ranges(ordinals: Iterable[int], limit: int | None = None) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"`` (sorted, duplicates dropped); past ``limit``
    characters cut short with the count: ``"0, 2, 4, ... (2048 ordinals)"`` (a strided group,
    every other ordinal of 4,096, is as long as its members are many)."""
    values = sorted(set(ordinals))
    parts = []
    for _, run in itertools.groupby(enumerate(values), lambda p: p[1] - p[0]):
        found = [v for _, v in run]
        parts.append(str(found[0]) if len(found) == 1 else f"{found[0]}-{found[-1]}")
    text = ", ".join(parts)
    if limit is None or len(text) <= limit:
        return text
    cut = text.rfind(", ", 0, limit)  # (-1: not even the first fits; text[:-1] showed ordinals not there)
    return f"{text[:cut]}, ... ({_plural(len(values), 'ordinal')})" if cut > 0 else f"... ({_plural(len(values), 'ordinal')})"


def describe_group(group: GroupKey, limit: int | None = None) -> str:
    return "all ordinals" if group == ALL else f"replicas [{format_ranges(group, limit)}]"


def _one_line(reason: str) -> str:
    """A reason a client gives, for errors and the log: one line, of _REST_CHARACTERS at most
    (told by the client: its error's first line)."""
    reason = "".join(c if c.isprintable() else " " for c in reason)
    return reason if len(reason) <= _REST_CHARACTERS else reason[: _REST_CHARACTERS - 3] + "..."


def _names(names: Sequence[str]) -> str:
    """The first 5 of ``names``, quoted: ``'a', 'b' and 4 more``."""
    return ", ".join(map(repr, names[:5])) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def keys_shown(keys: Sequence[str]) -> str:
    """The first 20 of ``keys``, quoted: ``'a', 'b' ...``."""
    return ", ".join(repr(k) for k in keys[:20]) + (" ..." if len(keys) > 20 else "")


def _plural(count: int, word: str) -> str:
    """``_plural(2, "process")`` -> ``"2 processes"``."""
    return f"{count} {word}" if count == 1 else f"{count} {word}{'es' if word.endswith('s') else 's'}"


def _ordinals_word(ordinals: Sequence[int]) -> str:
    return f"ordinal{'s' if len(ordinals) != 1 else ''} {format_ranges(ordinals)}"


# What an error's message may take: what the servicer sends of it (client/_session.py's
# clip, for gRPC's trailer); of that, what describe_missing keeps to count what it leaves out.
_MESSAGE_CHARACTERS = 2000
_REST_CHARACTERS = 120


# How a call to a round that failed before it came is told so (Core._too_late; the client
# reads it: such a round waited for others, not for this process's unbound threads).
FAILED_BEFORE_IT_CAME = "which had failed before it came"


def _missing_word(ordinals: Sequence[int]) -> str:
    """The missing ordinals before their description by host (describe_missing): as ranges
    when short, else their count. (Listed twice, long ranges would fill the 2,000
    characters a client's error keeps before any host is named.)"""
    text = _ordinals_word(ordinals)
    return text if len(text) <= 80 else f"{len(ordinals)} ordinals"


@dataclasses.dataclass(kw_only=True)
class Process:
    incarnation: str
    host: str
    pid: int
    task_id: int
    local_rank: int
    last_seen: float
    ordinals: set[int] = dataclasses.field(default_factory=set)
    alive: bool = True
    left: bool = False  # gone by its own Leave rather than declared dead
    death: str = ""
    # Ordinals of its threads whose replicas ended (Core.end_replicas) -> how.
    ended: dict[int, str] = dataclasses.field(default_factory=dict)
    client_version: str = ""  # its client's package version, as it registered
    restored: bool = False  # restored from a state file and not heard from since
    # When its connection to the coordinator closed without a Leave (its Watch stream
    # ended: the process was killed or crashed, or its network broke), if not heard from
    # since; declared dead DISCONNECTED_GRACE later unless heard from again (or twice its
    # heartbeat interval, as it registered: a live one heartbeats within it; a Rendezvous
    # call does not count, its host relay may resend it past its death).
    disconnected: float | None = None
    heartbeat_interval: float = 0.0
    launch: str = ""  # the launch that started it, when one said (Registration.launch)

    def label(self) -> str:
        return f"{self.host} pid {self.pid}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
    """Something every process of a job should hear about (streamed by Watch)."""

    kind: str  # "PROCESS_DEAD", "PROCESS_LEFT" or "PROCESS_RESTARTED"
    generation: int
    ordinals: tuple[int, ...]
    host: str
    message: str
    # The process's task and pid, for the log's fields: not kept in the state file (the
    # format's readers take five fields), so -1 and 0 once restored, and not compared.
    task: int = dataclasses.field(default=-1, compare=False)
    pid: int = dataclasses.field(default=0, compare=False)


class EventLog:
    """A job's events, of which the latest ``_EVENTS_KEPT`` are kept: each keeps the index
    it was given, counted from the job's first event (Watch streams ask for the events after
    the ones they sent), so ``len`` counts the dropped ones too and iterating gives the kept."""

    __slots__ = ("dropped", "_kept")

    def __init__(self, events: Sequence[Event] = (), dropped: int = 0) -> None:
        self._kept: collections.deque[Event] = collections.deque(events, maxlen=_EVENTS_KEPT)
        self.dropped = dropped + len(events) - len(self._kept)  # the oldest, first

    def append(self, event: Event) -> None:
        if len(self._kept) == self._kept.maxlen:
            self.dropped += 1  # the deque drops its oldest
        self._kept.append(event)

    def __len__(self) -> int:
        return self.dropped + len(self._kept)

    def __iter__(self):
        return iter(self._kept)

    def __reversed__(self):
        return reversed(self._kept)

    def since(self, index: int) -> list[Event]:
        """The kept events from index ``index`` on (those dropped before it are gone)."""
        wanted = len(self._kept) - max(0, index - self.dropped)
        if wanted <= 16:  # a Watch's usual ask, the latest few: from the end, not the whole deque
            return [self._kept[i] for i in range(-wanted, 0)]
        return list(itertools.islice(self._kept, len(self._kept) - wanted, None))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Member:
    ordinal: int
    local_ordinal: int
    thread_index: int
    incarnation: str
    runtime_ordinal: int | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ThreadRequest:
    thread_index: int
    runtime_ordinal: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Registration:
    """What a process asks for when it registers threads."""

    job: str
    incarnation: str
    host: str
    pid: int
    task_id: int
    num_tasks: int
    devices_per_task: int
    local_rank: int
    threads: tuple[ThreadRequest, ...]
    runtime_world_size: int = 0
    client_version: str = ""
    heartbeat_interval: float = 0.0  # seconds between its heartbeats (0: not told)
    # Seconds since the process started, as it registered (0: not told): see Core._register.
    process_age: float = 0.0
    launch: str = ""  # the launch that started it, when one says (xla.spawn's): see Core._register


@dataclasses.dataclass(frozen=True, kw_only=True)
class Assignment:
    thread_index: int
    ordinal: int
    local_ordinal: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Registered:
    world_size: int
    assignments: tuple[Assignment, ...]
    generation: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParticipantView:
    ordinal: int
    local_ordinal: int
    task_id: int
    thread_index: int
    host: str
    pid: int
    incarnation: str
    last_seen_age: float
    runtime_ordinal: int | None
    alive: bool
    left: bool = False  # not alive: it closed its client
    ended: str = ""  # how its replica ended (end_replicas); empty while it runs
    client_version: str = ""
    disconnected_age: float | None = None  # its connection closed this long ago (Core.disconnect)
    unheard_since_restart: bool = False  # restored, not heard from since: last seen counts from the restart


@dataclasses.dataclass(frozen=True, kw_only=True)
class PendingRoundView:
    group: GroupKey
    number: int
    tags: dict[str, list[int]]
    arrived: list[int]
    missing: list[int]
    waiting_seconds: float
    missing_summary: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobView:
    job: str
    world_size: int
    registered: int
    generation: int
    participants: list[ParticipantView]
    pending_rounds: list[PendingRoundView]
    rounds_completed: int
    kv_keys: int
    # Task id -> (its ordinals, why its latest registration was refused), while it has none.
    refused: dict[int, tuple[list[int], str]] = dataclasses.field(default_factory=dict)
    devices_per_task: int = 0  # 0 until known
    # While the world is incomplete: its missing ordinals and where they are (world_timeout).
    world_missing_summary: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StrangersView:
    """Processes of a job that heartbeat this coordinator, which does not know them (nor,
    unless ``job_known``, their job), for status."""

    job: str
    job_known: bool
    processes: int  # heard from in the last _UNKNOWN_KEPT_FOR seconds (at most _UNKNOWN_PROCESSES_KEPT)
    last_call_age: float
    reason: str  # why the coordinator may not know them


class Contribution(NamedTuple):
    """One ordinal's part of a round. :meth:`Core.arrive` takes any tuple of these fields in
    this order: the rows a request's lists make (``client/_wire.py``) are used as they are,
    since thousands arrive per call with host fan-in."""

    ordinal: int
    tag: str
    payload: bytes
    # Whose ordinal it is when a host relay sends it for another process ("": the caller's).
    # Not part of the content: a resend of the same contribution by its own process matches.
    incarnation: str = ""


ContributionRow = tuple[int, str, bytes, str]  # a Contribution's fields, or Contribution itself


@dataclasses.dataclass(kw_only=True)
class Round:
    generation: int
    group: GroupKey
    number: int
    started: float
    members: frozenset[int] | None  # None: every ordinal of the job
    size: int
    deadline: float | None = None
    arrivals: dict[int, bytes] = dataclasses.field(default_factory=dict)  # ordinal -> payload
    result: list[bytes] | None = None  # payloads in ordinal order, once completed
    # The members' tag, from the first arrival: a pending round holds one (a second one
    # fails it at once, see Core.arrive).
    tag: str = ""
    error: CoreError | None = None
    # The servicer's response message, built once and shared by every waiter.
    response: object = None
    key: RoundKey = dataclasses.field(init=False, repr=False)  # (generation, group, number)

    def __post_init__(self) -> None:
        self.key = (self.generation, self.group, self.number)  # none of them ever changes

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None

    def position(self, ordinal: int) -> int:
        """Index of ``ordinal``'s payload in ``result``."""
        return ordinal if self.members is None else bisect.bisect_left(self.group, ordinal)

    def has_member(self, ordinal: int) -> bool:
        return ordinal < self.size if self.members is None else ordinal in self.members

    def missing(self) -> list[int]:
        candidates: Iterable[int] = range(self.size) if self.members is None else sorted(self.members)
        return [o for o in candidates if o not in self.arrivals]

    def describe(self) -> str:
        return f"rendezvous {self.tag!r} on {describe_group(self.group)} (round {self.number})"


@dataclasses.dataclass(kw_only=True)
class _Group:
    next_round: int = 0  # the lowest round number not yet finished
    finished: collections.OrderedDict[int, Round] = dataclasses.field(
        default_factory=collections.OrderedDict
    )


@dataclasses.dataclass(kw_only=True)
class Job:
    name: str
    world_size: int | None = None
    world_fixed_by: str = ""
    devices_per_task: int | None = None
    generation: int = 1  # 0 on the wire means "not said"
    formed: bool = False  # the world was complete in this run (since the job last started afresh)
    processes: dict[str, Process] = dataclasses.field(default_factory=dict)
    tasks: dict[int, str] = dataclasses.field(default_factory=dict)  # task id -> incarnation
    members: dict[int, Member] = dataclasses.field(default_factory=dict)
    groups: dict[tuple[int, GroupKey], _Group] = dataclasses.field(default_factory=dict)
    pending: dict[RoundKey, Round] = dataclasses.field(default_factory=dict)
    blocked: dict[int, RoundKey] = dataclasses.field(default_factory=dict)  # ordinal -> its pending round
    rounds_completed: int = 0
    events: EventLog = dataclasses.field(default_factory=EventLog)
    # Ordinals of dead or departed processes, and of replicas ended (Core.end_replicas).
    dead: set[int] = dataclasses.field(default_factory=set)
    kv: dict[str, bytes] = dataclasses.field(default_factory=dict)
    # Names kv's life: a client that saw another (the coordinator restarted without its state
    # file, or dropped the job) is refused, not handed an empty store (Core.check_store).
    store_id: str = dataclasses.field(default_factory=lambda: secrets.token_hex(8))
    # The bytes of kv's keys and values (Core._kv_room); None: not counted yet (restored).
    kv_bytes: int | None = dataclasses.field(default=None, repr=False)
    request_results: collections.OrderedDict[str, object] = dataclasses.field(
        default_factory=collections.OrderedDict
    )
    # Incarnations replaced by a restart -> why: their later calls say so, and they cannot
    # register again (two live processes would take the task from each other). The latest
    # _REPLACED_KEPT.
    replaced: collections.OrderedDict[str, str] = dataclasses.field(default_factory=collections.OrderedDict)
    # Task id -> why its latest registration was refused, while it has none (Core.register):
    # the latest _REFUSED_KEPT.
    refused: collections.OrderedDict[int, str] = dataclasses.field(
        default_factory=collections.OrderedDict, repr=False
    )
    # Task id -> its process in the run before the job started afresh, and how it went, while
    # the task has none since: a wait for its ordinals says so (not kept in the state file).
    last_run: dict[int, str] = dataclasses.field(default_factory=dict, repr=False)
    # (generation, group, ordinal, round number) of the latest calls from outside their
    # replicas, per ordinal (_OUTSIDER_CALLS_KEPT): a resend of one fails no second round.
    outsider_calls: collections.OrderedDict[tuple, None] = dataclasses.field(
        default_factory=collections.OrderedDict, repr=False
    )
    # Core._uses when a call last named the job: at max_jobs, the finished job used longest
    # ago makes room for a new one (Core._droppable).
    used: int = 0
    # Runtime ordinal -> the ordinal registered with it, of the members whose runtime ordinal
    # is global (Core._check_runtime_unique): built when a registration first needs it, kept up
    # as members join, None again when any leave the rank table.
    runtime_owners: dict[int, int] | None = dataclasses.field(default=None, repr=False)

    @property
    def complete(self) -> bool:
        return self.world_size is not None and len(self.members) == self.world_size

    def unregistered(self) -> list[int]:
        """The ordinals of its world not registered (none while its size is not known)."""
        return [o for o in range(self.world_size or 0) if o not in self.members]


class Core:
    """All jobs of one coordinator. See the module docstring for the contract."""

    def __init__(self, limits: Limits | None = None, *, heartbeat_timeout: float | None = None) -> None:
        if heartbeat_timeout is not None and not heartbeat_timeout >= MIN_HEARTBEAT_TIMEOUT:
            raise ValueError(
                f"heartbeat_timeout must be at least {MIN_HEARTBEAT_TIMEOUT:g} s or None, got {heartbeat_timeout!r} "
                "(clients heartbeat at a third of it: shorter, a process is declared dead as it registers)"
            )
        self.limits = limits or Limits()
        self.heartbeat_timeout = heartbeat_timeout
        self.jobs: dict[str, Job] = {}
        # Names this core's state (kept in the state file): a key-value client that saw no job
        # here is told apart from one that saw none on a coordinator since restarted without it.
        self.state_id = secrets.token_hex(8)
        self._wakeups: list[tuple] = []
        # Grows with every change worth persisting (ranks, finished rounds, events, keys);
        # the state-file writer compares it with the version it last wrote.
        self.version = 0
        self._uses = 0  # calls that named a job (Job.used)
        # Grows with the same changes but those the state file's journal takes: finished
        # rounds and key-value changes are appended to it (``journal``), every other
        # change (ranks, events) rewrites the state file.
        self.state_version = 0
        # Journaled changes since the state-file writer last took them (``take_journal``),
        # in order: ("round", job name, Round), ("set", job name, key, value), ("append",
        # job name, key, value appended), ("delete", job name, key), ("request", job name,
        # request id, result), ("job", job name, store id) for a job made. None: none kept
        # (no state file).
        self.journal: list[tuple] | None = None
        # Rounds finished since an observer (the monitor) last took them (take_finished), as
        # (job name, Round): the core keeps only a group's last one or two, and one batch of
        # changes (a death, a restart) may fail more. None: none kept (nobody observes).
        self.finished: list[tuple[str, Round]] | None = None
        # Restored from a state file: (when, for how long after that nobody is judged silent,
        # the longest timeout the processes may still heartbeat by: they may not have been
        # told this one yet), see ``_state.restore``; None again once that time has passed.
        self.restored: tuple[float, float, float | None] | None = None
        # Processes not known here that heartbeat (a coordinator restarted without its state
        # file, say), by job: name -> {incarnation: when last heard}, least recently heard
        # first, for status (strangers).
        self.unknown: dict[str, dict[str, float]] = {}

    # -- plumbing -------------------------------------------------------------------------

    def take_wakeups(self) -> list[tuple]:
        """Returns and clears the wake keys queued since the last call."""
        wakeups, self._wakeups = self._wakeups, []
        return wakeups

    def _changed(self) -> None:
        self.version += 1
        self.state_version += 1

    def _journaled(self, change: tuple) -> None:
        """A change the state file's journal takes (see ``journal``) was made."""
        self.version += 1
        if self.journal is not None:
            self.journal.append(change)

    def take_finished(self) -> list[tuple[str, "Round"]]:
        """Returns and clears the rounds finished since the last call (kept only once an
        observer has set ``finished``, or called this)."""
        finished, self.finished = self.finished or [], []
        return finished

    def take_journal(self) -> list[tuple]:
        """Returns and clears the journaled changes made since the last call (kept only once
        a state-file writer has set ``journal``, or called this)."""
        changes, self.journal = self.journal or [], []
        return changes

    @staticmethod
    def record_finished(job: Job, rnd: Round) -> None:
        """Files a finished round with its group (also how a state file's journal is replayed)."""
        groups = job.groups
        key = (rnd.generation, rnd.group)
        # Re-inserted: groups stay in the order they last finished a round.
        state = groups[key] = groups.pop(key, None) or _Group()
        finished = state.finished
        for older in finished.values():  # its members came to this one: it is answered (else rebuilt)
            older.response = None  # (a round of 512 MiB kept a copy of each of its last two)
        finished[rnd.number] = rnd
        while state.next_round in finished:  # (before any is let go: one may finish out of order)
            state.next_round += 1
        # Completed, it had every member: none will ask for an earlier one again (a round of
        # 512 MiB kept the payloads of the one before as well); else the failures in a row it
        # ends (a late member comes to each in turn).
        if rnd.result is not None and rnd.number == state.next_round - 1:
            kept = 1
        else:
            failures = 0
            for older in reversed(finished.values()):
                if older.error is None or failures == _FAILED_ROUNDS_KEPT:
                    break
                failures += 1
            kept = max(_FINISHED_ROUNDS_KEPT, failures)
        if len(finished) > kept:
            # Let go in the order they finished, but neither the group's latest round nor one
            # ahead of its next unfinished round (given up, or failed, out of order): its
            # members are still to come to them.
            latest = max(finished)
            ahead = sum(number >= state.next_round for number in finished)
            for number in [n for n in finished if n < state.next_round and n != latest]:
                if len(finished) - ahead <= kept:
                    break
                del finished[number]
        if len(groups) - len(job.pending) > _GROUPS_KEPT:  # (more than that many have none pending)
            Core._forget_groups(job)

    @staticmethod
    def _forget_groups(job: Job) -> None:
        """Forgets the groups that finished a round longest ago and have none pending, down
        to seven eighths of ``_GROUPS_KEPT`` of those: the scan runs once per eighth of it
        of rounds at most, however many groups have a round pending."""
        busy = {key[:2] for key in job.pending}
        # The last is the group that just finished a round: kept, and counted.
        idle = [k for k in itertools.islice(job.groups, len(job.groups) - 1) if k not in busy]
        for key in idle[: len(idle) + 1 - _GROUPS_KEPT * 7 // 8]:
            del job.groups[key]

    @staticmethod
    def record_request(job: Job, request_id: str, result) -> None:
        """Keeps the result of a non-idempotent change for its retries (also how a state
        file's journal is replayed)."""
        job.request_results[request_id] = result
        while len(job.request_results) > _REQUEST_IDS_KEPT:
            job.request_results.popitem(last=False)

    def _job(self, name: str) -> Job:
        job = self.jobs.get(name)
        if job is not None:
            self._uses = job.used = self._uses + 1
            return job
        raise self._unknown_job(name)

    def _unknown_job(self, name: str) -> CoreError:
        known = (", ".join(repr(j) for j in sorted(self.jobs)[:10]) or "none") + (
            f" and {len(self.jobs) - 10} more" if len(self.jobs) > 10 else ""
        )
        shown = repr(name) if len(name) <= 80 else repr(name[:80]) + "..."
        return CoreError(
            Code.NOT_FOUND,
            f"job {shown} is not known to this coordinator (known jobs: {known}); "
            "processes create a job by registering, or start the coordinator with --world-size ("
            + ("a coordinator restarted without --state-file has forgotten its jobs: start the job again, and give "
               "serve a --state-file)" if self.journal is None else
               "check the job's name (PJRT_RENDEZVOUS_JOB); a finished job is dropped at --max-jobs)"),
        )

    def _check_job_name(self, name: str) -> None:
        if not name:
            raise CoreError(Code.INVALID_ARGUMENT, "job name must not be empty")
        if _control(name):  # (a line end in a log line or a metrics label)
            raise CoreError(Code.INVALID_ARGUMENT, f"job name {name!r} holds a control character")
        if len(name) > self.limits.max_name_length:
            raise CoreError(
                Code.RESOURCE_EXHAUSTED,
                f"job name of {len(name)} characters exceeds the limit of "
                f"{self.limits.max_name_length} (max_name_length)",
            )

    def _new_job(self, name: str, *, insert: bool = True) -> Job:
        self._check_job_name(name)
        if len(self.jobs) >= self.limits.max_jobs and not self._droppable():
            # (which ones stay for their keys: a torch URL's ?job= a run fills max_jobs so)
            stores = sorted(j.name for j in self.jobs.values() if not j.processes and j.kv)
            live = sorted(j.name for j in self.jobs.values() if any(p.alive for p in j.processes.values()))
            # (killed: declared dead after DISCONNECTED_GRACE, and their jobs make room)
            closing = [
                n for n in live if all(p.disconnected is not None for p in self.jobs[n].processes.values() if p.alive)
            ] if self.heartbeat_timeout else []
            error = CoreError(
                Code.RESOURCE_EXHAUSTED,
                f"this coordinator already serves {_plural(len(self.jobs), 'job')}, the limit "
                f"(max_jobs={self.limits.max_jobs}), and none can make room: a job is dropped "
                "once every process of it is gone, or while it holds nothing (no process, key or "
                "pending round); one holding keys without ever having a process, or declared "
                f"with --world-size, stays; job {name!r} cannot be created"
                + (f" ({_plural(len(live), 'job')} with live processes: {_names(live)}"
                   + (f"; of which {_names(closing)} only with processes whose connections closed, "
                      f"declared dead unless heard from again within {DISCONNECTED_GRACE:g} s (or twice their "
                      "heartbeat interval)" if closing else "")
                   + ")" if live else "")
                + (f" ({_plural(len(stores), 'job')} of keys alone: {_names(stores)}; deleting a job's keys "
                   "lets it be dropped)" if stores else ""),
            )
            error.warn = (("max_jobs", name), "job_refused", f"refused to create a job: {error.message}")
            raise error
        job = Job(name=name)
        if insert:
            self._insert_job(job)
        return job

    def _droppable(self) -> list[Job]:
        """The finished jobs, the one used longest ago first: registered processes that are
        all gone, no round pending; or an empty one (no process, no key, not declared: made
        by a change that wrote nothing, such as a delete of a missing key). Jobs of keys
        alone (a torch Store), or declared (``serve --world-size``), stay."""
        finished = [
            job for job in self.jobs.values()
            if not job.pending and job.world_fixed_by != _DECLARED and (
                not any(p.alive for p in job.processes.values()) if job.processes else not job.kv
            )
        ]
        return sorted(finished, key=lambda job: job.used)

    def _insert_job(self, job: Job) -> None:
        """Adds a new job; at max_jobs the finished job used longest ago is dropped for it
        (a long-lived coordinator serving a job name per run would otherwise fill up), and
        over it (a limit lowered at a restart) every finished job down to it, as they go."""
        self._uses = job.used = self._uses + 1
        excess = len(self.jobs) + 1 - self.limits.max_jobs
        for dropped in self._droppable()[:excess] if excess > 0 else ():  # (_new_job made sure of one)
            del self.jobs[dropped.name]
            self._changed()
            self._wakeups.append(("dropped", dropped.name, job.name))
        self.jobs[job.name] = job
        self._journaled(("job", job.name, job.store_id))  # (a job of keys alone is in the journal only)

    def _job_or_create(self, name: str) -> Job:
        job = self.jobs.get(name)
        if job is None:
            return self._new_job(name)
        self._uses = job.used = self._uses + 1
        return job

    def _job_if_any(self, name: str) -> Job | None:
        """The job named, if there is one: a read creates none (a blocking get on a job not
        made yet waits on its key's wake key, which the set that makes the job queues)."""
        job = self.jobs.get(name)
        if job is None:
            self._check_job_name(name)
            return None
        self._uses = job.used = self._uses + 1
        return job

    def _process(self, job: Job, incarnation: str, now: float | None, *, closed_stays: bool = False) -> Process:
        """The live process ``incarnation`` of ``job``, heard from at ``now``. None: a host
        relay speaks for it, which proves nothing of the process itself (the relay may have
        held its call past its death, which only the heartbeat timeout found then); and with
        ``closed_stays``, a call of a process whose connection closed is not word from it
        either (a Rendezvous call: its relay resends each process's own call, under its
        incarnation, after a combined one failed): its heartbeat or watch says it is back."""
        process = job.processes.get(incarnation)
        if process is None:
            if incarnation in job.replaced:
                said = job.replaced[incarnation]
                dropped = said.startswith(f"job {job.name!r} started afresh")  # (Core._start_afresh)
                raise CoreError(
                    Code.FAILED_PRECONDITION,
                    f"process incarnation {incarnation!r} of job {job.name!r} was "
                    f"{'dropped' if dropped else 'replaced'}: {said}; it takes no part any more"
                    + ("" if dropped else " (if this process did not restart, two processes on one host share "
                       "one task id and local rank: check PJRT_RENDEZVOUS_TASK_ID, CLOUD_TPU_TASK_ID, "
                       "TPU_WORKER_ID and PJRT_LOCAL_PROCESS_RANK)"),
                    warn=(  # (once per run of the job: a run of thousands dropped may call on)
                        ("replaced", job.name, job.generation), "dead_process_called",
                        f"refused calls from a process {'dropped' if dropped else 'replaced'} in job {job.name!r}, "
                        f"which takes no part any more (told once per generation): {said}",
                    ),
                )
            raise self._not_registered(job, incarnation)
        if not process.alive:
            # (a relay held up, a frozen one resumed, passes on calls of processes long gone)
            relayed = now is None
            if not relayed:  # still calling: status shows it heard from (a process to stop)
                process.last_seen = now
            raise CoreError(
                Code.ABORTED,
                f"{'the process a host relay named' if relayed else 'this process'} ({process.label()}, task "
                f"{process.task_id}) was declared dead: {process.death}; its ordinals are lost to job {job.name!r}; "
                "start a new process",
                warn=(
                    ("dead", job.name, incarnation), "dead_process_called",
                    f"refused calls {'a host relay passed on for' if relayed else 'from'} {process.label()} "
                    f"(task {process.task_id}) in job {job.name!r}, which "
                    + ("closed its client earlier" if process.left else f"was declared dead earlier ({process.death})")
                    + ": it takes no part any more"
                    + ("" if process.left or not process.death.startswith("no heartbeat") else
                       " (a process stopped longer than the heartbeat timeout comes back so: start it again)"),
                ),
            )
        if now is not None and not (closed_stays and process.disconnected is not None):
            process.last_seen, process.restored, process.disconnected = now, False, None
        return process

    @staticmethod
    def _not_registered(job: Job, incarnation: str) -> CoreError:
        return CoreError(
            Code.FAILED_PRECONDITION,
            f"process incarnation {incarnation!r} is not registered in job {job.name!r}; "
            "register its threads first (after a coordinator restart without a state file, "
            "processes must register again)",
        )

    # -- world ----------------------------------------------------------------------------

    def declare_job(self, name: str, world_size: int) -> None:
        """Creates a job whose world size is fixed up front (``serve --world-size``)."""
        if world_size < 1:
            raise CoreError(Code.INVALID_ARGUMENT, f"world size must be >= 1, got {world_size}")
        if world_size > self.limits.max_world_size:
            raise CoreError(
                Code.RESOURCE_EXHAUSTED,
                f"world size {world_size} exceeds the limit (max_world_size={self.limits.max_world_size})",
            )
        job = self._job_or_create(name)
        if job.world_size is not None and job.world_size != world_size:
            # Restored from a state file: the operator changed the size, so the job is a new
            # run of that size (a coordinator that refused to start would restart in a loop).
            self._start_afresh(job, f"the coordinator was given world size {world_size} for it, {job.world_size} before")
        job.world_size = world_size
        job.world_fixed_by = _DECLARED
        self._changed()

    def undeclare_jobs(self, keep: str | None) -> list[str]:
        """Lifts the world size that ``serve --world-size`` declared before a restart from
        every job but ``keep`` (the one declared now, if any): it holds for the run under
        way, as a first registration's does, and a new run may have another. Returns the
        names of those jobs."""
        lifted = [job for job in self.jobs.values() if job.world_fixed_by == _DECLARED and job.name != keep]
        for job in lifted:
            if job.processes:
                job.world_fixed_by = f"{_DECLARED} before the coordinator restarted"
            else:
                job.world_size, job.world_fixed_by = None, ""
        if lifted:
            self._changed()
        return [job.name for job in lifted]

    def register(self, now: float, request: Registration) -> Registered:
        """Registers threads of one process and assigns their ordinals (see _register). A
        refused registration is remembered for its task, so that a wait for its ordinals
        says why they are missing instead of "never registered" (describe_missing)."""
        try:
            registered = self._register(now, request)
        except CoreError as exc:
            job = self.jobs.get(request.job)
            if job is not None and exc.code is not Code.RESOURCE_EXHAUSTED and request.task_id >= 0:
                # (told to every process and status: without the incarnation, which proves the
                # process's calls; one of a few characters proves nothing, and would cut up the text)
                incarnation = request.incarnation
                message = exc.message.replace(incarnation, "...") if len(incarnation) >= 8 else exc.message
                job.refused[request.task_id] = (
                    f"{request.host} pid {request.pid} was refused: {message[:300]}"
                    + ("..." if len(message) > 300 else "")
                )
                job.refused.move_to_end(request.task_id)
                while len(job.refused) > _REFUSED_KEPT:
                    job.refused.popitem(last=False)
            raise
        job = self.jobs[request.job]
        job.refused.pop(request.task_id, None)
        job.last_run.pop(request.task_id, None)
        return registered

    def _register(self, now: float, request: Registration) -> Registered:
        """Registers threads of one process and assigns their ordinals.

        ``ordinal = task_id * devices_per_task + thread_index`` and
        ``local_ordinal = local_rank * devices_per_task + thread_index``. Registering the
        same threads again from the same incarnation is a no-op (idempotent retry).
        """
        r = request
        if not r.incarnation:
            raise CoreError(Code.INVALID_ARGUMENT, "incarnation must not be empty")
        if r.num_tasks < 1 or r.devices_per_task < 1:
            raise CoreError(
                Code.INVALID_ARGUMENT,
                f"num_tasks ({r.num_tasks}) and devices_per_task ({r.devices_per_task}) must be >= 1",
            )
        if not 0 <= r.task_id < r.num_tasks:
            raise CoreError(
                Code.INVALID_ARGUMENT,
                f"task id {r.task_id} is out of range [0, {r.num_tasks}) for {r.num_tasks} tasks "
                f"(host {r.host}, pid {r.pid}); check CLOUD_TPU_TASK_ID / PJRT_RENDEZVOUS_TASK_ID",
            )
        if not 0 <= r.local_rank < r.num_tasks:
            raise CoreError(
                Code.INVALID_ARGUMENT,
                f"local rank {r.local_rank} is out of range [0, {r.num_tasks}) for {r.num_tasks} tasks; "
                "check PJRT_LOCAL_PROCESS_RANK / PJRT_RENDEZVOUS_LOCAL_RANK",
            )
        if _control(r.client_version):  # (shown by status, logged: kept to its first characters below)
            raise CoreError(Code.INVALID_ARGUMENT, f"client version {r.client_version[:40]!r} holds a control character")
        for name, value in (("incarnation", r.incarnation), ("host", r.host)):
            if _control(value):  # (logged and shown by status: a line end or an escape forges lines)
                raise CoreError(Code.INVALID_ARGUMENT, f"{name} {value!r} holds a control character")
            if len(value) > self.limits.max_name_length:
                raise CoreError(
                    Code.RESOURCE_EXHAUSTED,
                    f"{name} of {len(value)} characters exceeds the limit of {self.limits.max_name_length} "
                    "(max_name_length)",
                )
        if not r.threads:
            raise CoreError(Code.INVALID_ARGUMENT, "a registration must name at least one thread")
        world_size = r.num_tasks * r.devices_per_task
        if world_size > self.limits.max_world_size:
            raise CoreError(
                Code.RESOURCE_EXHAUSTED,
                f"world size {r.num_tasks} tasks x {r.devices_per_task} devices = {world_size} "
                f"exceeds the limit (max_world_size={self.limits.max_world_size})",
            )
        seen_threads: set[int] = set()
        for thread in r.threads:
            if not 0 <= thread.thread_index < r.devices_per_task:
                raise CoreError(
                    Code.INVALID_ARGUMENT,
                    f"thread index {thread.thread_index} is out of range [0, {r.devices_per_task}) "
                    f"for {r.devices_per_task} devices per task: its ordinal "
                    f"{r.task_id * r.devices_per_task + thread.thread_index} would fall outside "
                    f"task {r.task_id}",
                )
            if thread.thread_index in seen_threads:
                raise CoreError(
                    Code.INVALID_ARGUMENT,
                    f"thread index {thread.thread_index} appears twice in one registration",
                )
            seen_threads.add(thread.thread_index)

        # A refused first registration must not leave an empty job behind.
        job = self.jobs.get(r.job) or self._new_job(r.job, insert=False)
        self._uses = job.used = self._uses + 1
        # Every process of the run is gone (left, died, or its connection closed without a
        # Leave): this is a new run, started only once the registration is taken, formed or
        # not. (A process that fails or leaves while others of its run live does not end the
        # run: late members still join it, and learn at once that a member is gone. With all
        # gone, a relaunch's first process would otherwise join the old run and fail on its
        # failed rounds and gone members.)
        # But a connection closed is not yet a process gone: a network cut may have closed
        # every one at once. A new task of an unformed run joins it unless the process
        # started after the last of those closes (a relaunch after a kill). A process
        # restored from the state file and not heard from since counts as one whose
        # connection closed as the coordinator came back, for a formed run or a task
        # registered again: a job killed while it restarted (a slice's maintenance restarts
        # both) is relaunched afresh, not task by task into the old run (each taking its
        # task over and voiding the rounds of those before). A new task of an unformed run
        # joins it: its live processes may not have called again yet.
        mine = job.processes.get(r.incarnation)  # (a live one binding more threads is its run's)
        launch = r.launch[: self.limits.max_name_length]  # (as its processes keep it)
        unheard = job.formed or r.task_id in job.tasks
        closed = [
            p.last_seen if p.disconnected is None else p.disconnected
            for p in job.processes.values() if p.alive and (p.disconnected is not None or (unheard and p.restored))
        ]
        afresh = (
            bool(job.processes)
            and (mine is None or not mine.alive)
            # (a process of the run's own launch, slower to start than its peers that failed at once: it
            # joins, to learn that they are gone, not to wait for a relaunch of theirs)
            and not (launch and not job.formed and any(p.launch == launch for p in job.processes.values()))
            and not any(p.alive and p.disconnected is None and not (unheard and p.restored) for p in job.processes.values())
            and (job.formed or r.task_id in job.tasks or not closed or not self._started_before(r, max(closed), now))
        )
        # (a new run may have another world size, unless declared, and another layout)
        fixed_size = job.world_size if not afresh or job.world_fixed_by == _DECLARED else None
        declared = f"{r.num_tasks} tasks x {r.devices_per_task} devices = {world_size}"
        if fixed_size is not None and fixed_size != world_size:
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"job {job.name!r} has world size {job.world_size} (fixed by {job.world_fixed_by}), "
                f"but task {r.task_id} on {r.host} pid {r.pid} declares {declared}; every process "
                "of a job must agree on the number of tasks and devices per task"
                + ("" if job.world_fixed_by == _DECLARED else
                   " (if those are another job's processes, give each job a name of its own: PJRT_RENDEZVOUS_JOB)"),
            )
        if not afresh and job.devices_per_task is not None and job.devices_per_task != r.devices_per_task:
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"job {job.name!r} has {job.devices_per_task} devices per task, but task "
                f"{r.task_id} on {r.host} pid {r.pid} declares {r.devices_per_task}; check "
                "PJRT_RENDEZVOUS_CORES_PER_CHIP and TPU_ACCELERATOR_TYPE on every host",
            )
        # A runtime that sees only this process numbers its devices as every other process
        # does (PJRT on CPU); any other numbering is global: one number, one device of the job.
        global_numbers = r.runtime_world_size != r.devices_per_task or r.devices_per_task == world_size
        if afresh:  # refused before it changes anything, where the request alone decides
            if r.incarnation in job.replaced or r.incarnation in job.processes:
                self._process(job, r.incarnation, now)  # (declared dead, or gone: refused)
            seen: dict[int, int] = {}
            for thread in r.threads:
                ordinal = r.task_id * r.devices_per_task + thread.thread_index
                self._check_runtime_ordinal(r, thread, ordinal, world_size)
                ro = thread.runtime_ordinal
                if global_numbers and ro is not None and seen.setdefault(ro, ordinal) != ordinal:
                    self._check_runtime_unique(job, r, thread, ordinal, seen, None)  # (two of its threads share one: raises)
            self._start_afresh(job)

        owner = job.tasks.get(r.task_id)
        process = job.processes.get(r.incarnation)
        if process is not None or r.incarnation in job.replaced:
            self._process(job, r.incarnation, now)  # a dead or replaced process cannot add threads
        replaced = None
        if owner is not None and owner != r.incarnation:
            holder = job.processes[owner]
            # A process started again on its host with its local rank (a crash and a
            # relaunch, before its silence is noticed) takes over its task at once; a claim
            # from anywhere else is two processes sharing one task id.
            if holder.alive and (holder.host, holder.local_rank) != (r.host, r.local_rank):
                first = r.task_id * r.devices_per_task
                hint = (
                    f"; if that process exited, a replacement can register on {holder.host} with "
                    f"local rank {holder.local_rank} at once, elsewhere once it is declared dead "
                    f"({self.heartbeat_timeout:g} s without heartbeat)"
                    if self.heartbeat_timeout
                    else f"; if that process exited, a replacement can register on {holder.host} "
                    f"with local rank {holder.local_rank}"
                )
                raise CoreError(
                    Code.ALREADY_EXISTS,
                    f"{_ordinals_word(range(first, first + r.devices_per_task))} (task {r.task_id}) are "
                    f"already registered by {holder.label()} (local rank {holder.local_rank}); "
                    f"{r.host} pid {r.pid} (local rank {r.local_rank}) claims the same task: two "
                    "processes share one task id; check PJRT_RENDEZVOUS_TASK_ID, CLOUD_TPU_TASK_ID, TPU_WORKER_ID and "
                    f"PJRT_LOCAL_PROCESS_RANK{hint}"
                    + (f"; or two jobs share the job name {job.name!r} on this coordinator: give each its own "
                       "(PJRT_RENDEZVOUS_JOB)" if holder.host != r.host else ""),
                )
            replaced = holder
        if process is not None and process.task_id != r.task_id:
            raise CoreError(
                Code.INVALID_ARGUMENT,
                f"this process ({process.label()}) registered task {process.task_id} before and now "
                f"claims task {r.task_id}; one process is one task",
            )

        assignments = []
        new_members = []
        said = []  # members registered before without a runtime ordinal, now with one
        numbered: dict[int, int] = {}  # runtime ordinal -> ordinal, in this registration
        for thread in r.threads:
            ordinal = r.task_id * r.devices_per_task + thread.thread_index
            local_ordinal = r.local_rank * r.devices_per_task + thread.thread_index
            self._check_runtime_ordinal(r, thread, ordinal, world_size)
            if global_numbers and thread.runtime_ordinal is not None:
                self._check_runtime_unique(job, r, thread, ordinal, numbered, replaced)
            existing = job.members.get(ordinal)
            if existing is not None and replaced is not None and existing.incarnation == replaced.incarnation:
                existing = None  # the dead predecessor's entry is replaced below
            # (None: not said. A thread bound by xla.bind_device says it, one bound by
            # bind_thread does not: the same index bound either way is no disagreement.)
            if (
                existing is not None
                and existing.runtime_ordinal is not None
                and thread.runtime_ordinal is not None
                and existing.runtime_ordinal != thread.runtime_ordinal
            ):
                raise CoreError(
                    Code.FAILED_PRECONDITION,
                    f"ordinal {ordinal} was registered with runtime ordinal "
                    f"{existing.runtime_ordinal} and is registered again with "
                    f"{thread.runtime_ordinal}",
                )
            if existing is None:
                new_members.append(
                    Member(
                        ordinal=ordinal,
                        local_ordinal=local_ordinal,
                        thread_index=thread.thread_index,
                        incarnation=r.incarnation,
                        runtime_ordinal=thread.runtime_ordinal,
                    )
                )
            elif existing.runtime_ordinal is None and thread.runtime_ordinal is not None:
                said.append(dataclasses.replace(existing, runtime_ordinal=thread.runtime_ordinal))
            assignments.append(
                Assignment(thread_index=thread.thread_index, ordinal=ordinal, local_ordinal=local_ordinal)
            )

        # Every check passed: apply.
        if job.name not in self.jobs:
            self._insert_job(job)
        if replaced is not None:
            self._replace(job, replaced, f"{r.host} pid {r.pid}", now)
        if job.world_size is None:
            job.world_size = world_size
            job.world_fixed_by = f"the first registration (task {r.task_id} on {r.host} pid {r.pid})"
        job.devices_per_task = r.devices_per_task
        if process is None:
            process = job.processes[r.incarnation] = Process(
                incarnation=r.incarnation,
                host=r.host,
                pid=r.pid,
                task_id=r.task_id,
                local_rank=r.local_rank,
                last_seen=now,
                client_version=r.client_version[: self.limits.max_name_length],  # (told only: a long one is cut, not refused)
                launch=launch,
            )
            job.tasks[r.task_id] = r.incarnation
            strangers = self.unknown.get(job.name)
            if strangers is not None and strangers.pop(r.incarnation, None) is not None and not strangers:
                del self.unknown[job.name]  # (a process forgotten, registered again)
        process.last_seen, process.restored, process.disconnected = now, False, None
        if math.isfinite(r.heartbeat_interval) and r.heartbeat_interval > 0:
            process.heartbeat_interval = r.heartbeat_interval
        self._changed()
        owners = job.runtime_owners
        for a in assignments:  # a thread bound again after its replica ended is back
            if process.ended.pop(a.ordinal, None) is not None:
                job.dead.discard(a.ordinal)
        for member in new_members + said:
            job.members[member.ordinal] = member
            process.ordinals.add(member.ordinal)
            if owners is not None and self._global_runtime_ordinal(member):
                owners[member.runtime_ordinal] = member.ordinal
        if new_members and job.complete:
            job.formed = True
            self._wakeups.append(("world", job.name))
        return Registered(world_size=world_size, assignments=tuple(assignments), generation=job.generation)

    @staticmethod
    def _check_runtime_ordinal(r: Registration, thread: ThreadRequest, ordinal: int, world_size: int) -> None:
        # Where the runtime's world is ours, its ordinal is the authority
        # and must equal the rank table's; where it only sees this process (PJRT on CPU),
        # its device index is the thread index.
        if thread.runtime_ordinal is None:
            return
        if r.runtime_world_size == 1 < r.devices_per_task:  # (torch_xla keeps the first world size it reads)
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"the XLA runtime of task {r.task_id} ({r.host} pid {r.pid}) has a world of 1 device "
                f"while this process drives {r.devices_per_task} of a job of {world_size}: its "
                "replication was not set before the device was bound, and every XLA all_reduce "
                "would be a silent no-op; run under xla.spawn, or call xm.set_replication before "
                "anything reads the runtime's world size (torch_xla keeps the first answer: in a "
                "new process)",
            )
        if r.runtime_world_size not in (0, world_size, r.devices_per_task):  # 0: not said
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"the XLA runtime of task {r.task_id} ({r.host} pid {r.pid}) has {r.runtime_world_size} "
                f"devices in its world, but the job has {world_size} ordinals ({r.num_tasks} tasks x "
                f"{r.devices_per_task} devices) and this process drives {r.devices_per_task}: the "
                "runtime's global ordinals and world size, which XLA collectives use, would not be "
                "ours; check PJRT_RENDEZVOUS_NUM_TASKS, TPU_PROCESS_BOUNDS and TPU_ACCELERATOR_TYPE",
            )
        if not 0 <= thread.runtime_ordinal < world_size:
            raise CoreError(
                Code.INVALID_ARGUMENT,
                f"the XLA runtime numbers the device of task {r.task_id} thread {thread.thread_index} "
                f"({r.host} pid {r.pid}) as global ordinal {thread.runtime_ordinal}, out of range "
                f"[0, {world_size}) for the job's {world_size} ordinals ({r.num_tasks} tasks x "
                f"{r.devices_per_task} devices); pass the runtime's own global ordinal of the "
                "thread's device (torch_xla.runtime.global_ordinal())",
            )
        if r.runtime_world_size == world_size and thread.runtime_ordinal != ordinal:
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"the XLA runtime numbers the device of task {r.task_id} thread "
                f"{thread.thread_index} as global ordinal {thread.runtime_ordinal}, but the rank "
                f"table gives ordinal {ordinal} (task {r.task_id} x {r.devices_per_task} + thread "
                f"{thread.thread_index}); collectives would order by {thread.runtime_ordinal}: fix "
                "CLOUD_TPU_TASK_ID / TPU_WORKER_ID so both agree",
            )
        if (
            r.runtime_world_size == r.devices_per_task
            and r.runtime_world_size != world_size
            and thread.runtime_ordinal != thread.thread_index
        ):
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"thread {thread.thread_index} of task {r.task_id} is bound to local device "
                f"{thread.runtime_ordinal}; a thread must drive the device of its own index",
            )

    @staticmethod
    def _global_runtime_ordinal(member: Member) -> bool:
        """Whether ``member``'s runtime ordinal may be global: a thread numbered by its own
        index outside task 0 is a runtime that sees only its process (PJRT on CPU), whose
        numbers every task shares."""
        ro = member.runtime_ordinal
        return ro is not None and (ro != member.thread_index or ro == member.ordinal)

    def _check_runtime_unique(
        self,
        job: Job,
        r: Registration,
        thread: ThreadRequest,
        ordinal: int,
        numbered: dict[int, int],
        replaced: Process | None,
    ) -> None:
        """Refuses a global runtime ordinal that another ordinal of the job (of this
        registration, or registered before) already has: two devices would share it."""
        ro = thread.runtime_ordinal
        other = numbered.setdefault(ro, ordinal)
        if other != ordinal:
            by = f"thread {other - r.task_id * r.devices_per_task} of this registration"
        else:
            owners = job.runtime_owners
            if owners is None:
                owners = job.runtime_owners = {
                    m.runtime_ordinal: m.ordinal for m in job.members.values() if self._global_runtime_ordinal(m)
                }
            other = owners.get(ro, ordinal)
            if other == ordinal:
                return
            holder = job.processes[job.members[other].incarnation]
            if holder is replaced:
                return  # the predecessor's entry goes with it
            by = f"{holder.label()}, task {holder.task_id}"
        raise CoreError(
            Code.FAILED_PRECONDITION,
            f"the XLA runtime numbers the device of task {r.task_id} thread {thread.thread_index} "
            f"({r.host} pid {r.pid}, ordinal {ordinal}) as global ordinal {ro}, which ordinal {other} "
            f"({by}) was registered with already: two devices cannot share one global ordinal; "
            "check that each thread binds its own device and CLOUD_TPU_TASK_ID / TPU_WORKER_ID",
        )

    def world_complete(self, job_name: str) -> bool:
        """Whether every ordinal of the job is registered (cheap: no table is built). A job
        not created yet is not: its processes may not have registered yet."""
        if job_name not in self.jobs:
            self._check_job_name(job_name)
            return False
        return self._job(job_name).complete

    def world(self, job_name: str) -> list[ParticipantView] | None:
        """The full rank table once every ordinal is registered, else None."""
        job = self._job(job_name)
        return self._participants(job, now=None) if job.complete else None

    @staticmethod
    def _owner(job: Job, ordinal: int) -> Process | None:
        """The process of ``ordinal``: its thread's, else its task's (a thread not bound yet)."""
        member = job.members.get(ordinal)
        owner = member.incarnation if member else job.tasks.get(ordinal // job.devices_per_task) if job.devices_per_task else None
        return None if owner is None else job.processes[owner]

    def hosts_of(self, job_name: str, ordinals: Sequence[int]) -> list[str]:
        """The hosts of the processes of ``ordinals`` (those of no process left out), sorted."""
        job = self.jobs.get(job_name)
        if job is None:
            return []
        return sorted({p.host for p in (self._owner(job, o) for o in ordinals) if p is not None})

    def describe_missing(self, job: Job, ordinals: Sequence[int], now: float, *, budget: int | None = None) -> str:
        """Missing ordinals as ranges with their hosts, pids and how long ago each was seen. With
        ``budget`` (characters), the hosts that fit, then a count of the rest: an error's
        message has to fit in a gRPC trailer (client/_session.py, clip), which cut it
        anywhere and named nobody past the cut."""
        # (where, how it is known): a host's processes told apart as dead, left, connection
        # closed (Core.disconnect) or restored from the state file and not heard from since
        # (its last seen is the restart's: it may have been gone long before)
        by_where: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
        ages: dict[tuple[str, str], float] = {}
        hosts_of: dict[tuple[str, str], str] = {}
        closed_ages: dict[tuple[str, str], float] = {}
        pids: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
        for ordinal in ordinals:
            process = self._owner(job, ordinal)
            if process is None:
                task = ordinal // job.devices_per_task if job.devices_per_task else None
                refused, last = job.refused.get(task), job.last_run.get(task)
                where = (
                    f"not registered ({refused})" if refused is not None
                    else f"not registered since the job started afresh (the last run's was {last})" if last is not None
                    else "never registered"
                )
                by_where[(where, "")].append(ordinal)
                continue
            closed = process.disconnected if process.alive else None
            where = f"on {process.host or 'an unnamed host'}" + (
                "" if process.alive else " (left)" if process.left else " (dead)"
            )
            key = (where, "closed" if closed is not None else "unheard" if process.restored and process.alive else "seen")
            by_where[key].append(ordinal)
            ages[key] = max(ages.get(key, 0.0), now - process.last_seen)
            hosts_of[key] = process.host
            if process.pid:  # (0: not given, by a caller of the gRPC API of its own)
                pids[key].add(process.pid)
            if closed is not None:
                closed_ages[key] = max(closed_ages.get(key, 0.0), now - closed)
        parts = []
        for key, group in sorted(by_where.items(), key=lambda item: min(item[1])):
            where, how = key
            tail = f" {where}"
            pid = f"pid{'s' if len(pids[key]) > 1 else ''} {', '.join(map(str, sorted(pids[key])))}, " if pids[key] else ""
            if how == "closed":
                tail += f", connection closed {_duration(closed_ages[key])} s ago without a Leave ({pid}last seen {_duration(ages[key])} s ago)"
            elif how == "unheard":
                tail += f" ({pid}not heard from since the coordinator restarted {_duration(ages[key])} s ago)"
            elif how == "seen":
                tail += f" ({pid}last seen {_duration(ages[key])} s ago)"
            parts.append((group, tail, hosts_of.get(key)))
        described = "; ".join(format_ranges(group) + tail for group, tail, _ in parts)
        if budget is None or len(described) <= budget:
            return described
        shown, used = [], 0
        for group, tail, _ in parts:
            text, room = format_ranges(group) + tail, budget - _REST_CHARACTERS - used - 2
            if len(text) > room:
                # the first that does not fit, its ordinals cut short where that leaves room to
                # say where they are (a host of 2,000 scattered ordinals was only counted)
                ranges_room = room - len(tail) - len(f", ... ({_plural(len(group), 'ordinal')})")
                if ranges_room >= 40:
                    shown.append(format_ranges(group, limit=ranges_room) + tail)
                break
            shown.append(text)
            used += len(text) + 2
        rest = parts[len(shown):]
        if not rest:
            return "; ".join(shown)
        hosts = len({host for _, _, host in rest if host is not None})  # (each once)
        where = " or ".join(
            ([f"on {hosts} more {'host' if hosts == 1 else 'hosts'}"] if hosts else [])
            + (["not registered"] if any(host is None for _, _, host in rest) else [])
        )
        count = sum(len(group) for group, _, _ in rest)
        return "; ".join(shown + [f"and {_plural(count, 'more ordinal')} {where} (`pjrt-rendezvous status` lists them all)"])

    def with_missing(self, job: Job, head: str, missing: Sequence[int], now: float) -> str:
        """``head``, then the missing ordinals and where they are, within _MESSAGE_CHARACTERS."""
        word = _missing_word(missing)
        budget = max(_MESSAGE_CHARACTERS - len(head) - len(word) - 3, 2 * _REST_CHARACTERS)
        described, ranges = self.describe_missing(job, missing, now, budget=budget), format_ranges(missing)
        if word.endswith(ranges) and described.startswith(ranges + " ") and "; " not in described:
            # all in one place: "missing ordinal 7 on HOST (...)", not "missing ordinal 7 (7 on HOST (...))"
            return f"{head}{word}{described[len(ranges):]}"
        return f"{head}{word} ({described})"

    def _world_missing(self, job: Job, now: float) -> str:
        """The ordinals a job's incomplete world lacks and where they are, within
        _MESSAGE_CHARACTERS ("" when complete or of no known size)."""
        if job.world_size is None or job.complete:
            return ""
        return self.with_missing(job, "", job.unregistered(), now)

    def world_timeout(self, job_name: str, now: float, waited: float) -> CoreError:
        if job_name not in self.jobs:
            return CoreError(Code.DEADLINE_EXCEEDED, f"after {_duration(waited)} s, {self._unknown_job(job_name).message}")
        job = self._job(job_name)
        if job.world_size is None:
            return CoreError(
                Code.DEADLINE_EXCEEDED,
                f"job {job_name!r} was still empty after {_duration(waited)} s: no process registered",
            )
        return CoreError(
            Code.DEADLINE_EXCEEDED,
            self.with_missing(
                job,
                f"job {job_name!r} world incomplete after {_duration(waited)} s: "
                f"{len(job.members)} of {job.world_size} ordinals registered; missing ",
                job.unregistered(),
                now,
            ),
        )

    # -- rendezvous -----------------------------------------------------------------------

    def arrive(
        self,
        now: float,
        *,
        job: str,
        incarnation: str,
        replicas: Sequence[int],
        round_number: int,
        contributions: Sequence[ContributionRow],
        deadline: float | None,
        generation: int = 0,
    ) -> Round:
        """Adds one process's contributions to a round; returns the round, which is
        finished (``result`` or ``error`` set) in place, never replaced.

        Request-level errors raise :class:`CoreError` and leave the round untouched, except
        for bad replica lists and a tag or payload over its limit, which fail the round for
        every member and raise; a tag mismatch fails the round, which is returned.
        """
        state = self._job(job)
        process = self._process(state, incarnation, now, closed_stays=True)
        if round_number < 0:
            raise CoreError(Code.INVALID_ARGUMENT, f"round number must be >= 0, got {round_number}")
        if not contributions:
            raise CoreError(Code.INVALID_ARGUMENT, "a rendezvous call needs at least one contribution")
        if generation and generation != state.generation:
            # A resent call of a round that finished before the move gets what its peers got
            # (its answer was lost: a cut connection, a relay that died after the round).
            old = self._finished_before(state, generation, replicas, round_number, contributions)
            if old is None:
                raise CoreError(
                    Code.ABORTED,
                    f"job {job!r} moved from generation {generation} to {state.generation} "
                    f"({self._generation_reason(state)}); rounds of the old generation are void",
                )
            self._check_resent(old, contributions)
            return old
        assert state.world_size is not None  # a registered process fixed it
        ordinals, tags, payloads, named = zip(*contributions)  # columns, in C
        unique = set(ordinals)
        if len(unique) != len(ordinals):
            raise CoreError(
                Code.INVALID_ARGUMENT, f"ordinals {format_ranges(ordinals)} contribute twice in one call"
            )
        # The common case checked in C: the caller's own ordinals (``Process.ordinals`` is
        # exactly the members it registered), within the limits. Otherwise (a relay's call,
        # or something wrong) one loop checks each contribution and names what is wrong.
        limits = self.limits
        if (
            any(named)
            or not unique <= process.ordinals
            or max(map(len, tags)) > limits.max_tag_length
            or max(map(len, payloads)) > limits.max_payload_bytes
        ):
            over = self._check_contributions(state, process, incarnation, contributions, now)
        else:
            over = None
        group: GroupKey = ALL
        if replicas:  # (a tag over the limit is not copied whole into the members' error)
            tag = tags[0] if over is None else _shown_tag(tags[0])
            group = self._replicas_group(state, replicas, ordinals, tag, round_number, now)
        rnd = self._round(state, group, round_number, now)
        if over is not None:
            # The members would otherwise wait for an arrival that was refused, and time out
            # naming it as missing: the round fails for every member, as for bad replicas.
            error = CoreError(
                Code.RESOURCE_EXHAUSTED,
                f"{over}; rendezvous {_one_line(_shown_tag(tags[0]))!r} on {describe_group(group)} (round "
                f"{round_number}) fails for every member",
            )
            if not rnd.finished:
                if not rnd.arrivals:  # (a later caller is told the round's tag: it was '?')
                    rnd.tag = _one_line(_shown_tag(tags[0]))
                rnd.arrivals.update(dict.fromkeys(ordinals))  # (it came: a resend of part of it is not late)
                self._fail(state, rnd, error)
            raise error
        if rnd.result is not None or (rnd.arrivals and not rnd.arrivals.keys().isdisjoint(ordinals)):
            self._check_resent(rnd, contributions)  # (the common case: nothing to compare)
        if rnd.finished:
            if rnd.error is not None and rnd.arrivals and rnd.arrivals.keys().isdisjoint(ordinals):
                raise self._too_late(rnd, ordinals, tags[0])
            return rnd
        dead = self._dead_members(state, rnd)
        if not rnd.arrivals:
            rnd.tag = tags[0]
        if dead:
            rnd.arrivals.update(zip(ordinals, payloads))
            self._fail(state, rnd, self._death_error(state, rnd, dead))
            return rnd
        rnd.arrivals.update(zip(ordinals, payloads))
        state.blocked.update(dict.fromkeys(ordinals, rnd.key))
        if deadline is not None and (rnd.deadline is None or deadline < rnd.deadline):
            rnd.deadline = deadline

        # A pending round holds one tag (a second one fails it at once), so a mismatch is a
        # contribution of this call that differs from any earlier arrival: checking the call
        # alone keeps an arrival O(its contributions) instead of O(the round's arrivals).
        by_tag: dict[str, list[int]] = {}
        if tags.count(rnd.tag) != len(tags):
            called = dict(zip(ordinals, tags))
            for o in rnd.arrivals:
                by_tag.setdefault(called.get(o, rnd.tag), []).append(o)
        if by_tag:
            # The odd ones out (all but a group larger than every other) say where they run:
            # one process that skipped or added a call is the one whose log to read.
            largest = sorted(map(len, by_tag.values()))
            common = largest[-1] if len(largest) == 1 or largest[-1] > largest[-2] else None
            # The round's own tag (the first to arrive) always named, the others by lowest ordinal.
            named = sorted(by_tag.items(), key=lambda item: (item[0] != rnd.tag, min(item[1])))
            rest = [o for _, ordinals in named[_TAGS_NAMED:] for o in ordinals]
            named = sorted(named[:_TAGS_NAMED], key=lambda item: min(item[1]))
            shown = _distinct_tags(t for t, _ in named)
            described = "; ".join(
                f"{_ordinals_word(o)}{'' if len(o) == common else self._where_called(state, o)} "
                f"called rendezvous({shown[t]!r})"
                for t, o in named
            )
            if rest:
                described += f"; {_missing_word(sorted(rest))} called rendezvous with {_plural(len(by_tag) - _TAGS_NAMED, 'other tag')}"
            missing = rnd.missing()
            if missing:
                described += f"; {_ordinals_word(missing)} had not arrived"
            self._fail(
                state,
                rnd,
                CoreError(
                    Code.FAILED_PRECONDITION,
                    f"tag mismatch in round {rnd.number} of {describe_group(group)}: {described}. "
                    "Every member must make the same sequence of rendezvous calls; one of them "
                    "skipped or added a call",
                ),
            )
        elif len(rnd.arrivals) == rnd.size:
            self._complete(state, rnd)
        elif len(state.pending) > 1:
            self._fail_if_deadlocked(state, rnd)
        return rnd

    def _where_called(self, job: Job, ordinals: Sequence[int]) -> str:
        """" (HOST pid N)" for the processes of ``ordinals`` when there are at most two ("" if more)."""
        processes = {p.incarnation: p for p in (self._owner(job, o) for o in ordinals) if p is not None}
        if not processes or len(processes) > 2:
            return ""
        return f" ({', '.join(p.label() for p in sorted(processes.values(), key=lambda p: (p.host, p.pid)))})"

    def _check_contributions(
        self, state: Job, process: Process, incarnation: str, contributions: Sequence[ContributionRow], now: float
    ) -> str | None:
        """Checks each contribution in turn and raises at the first ordinal that its process
        (the caller, or the live process a host relay named) does not own; returns what the
        first tag or payload over its limit is (None: none is)."""
        owners, max_tag, max_payload = state.members, self.limits.max_tag_length, self.limits.max_payload_bytes
        relayed = {incarnation}
        over = None
        for ordinal, tag, payload, named in contributions:
            if named and named not in relayed:
                self._process(state, named, None)  # a relay speaks for live, registered processes only
                relayed.add(named)
            member = owners.get(ordinal)
            if member is None or member.incarnation != (named or incarnation):
                owner = "not registered" if member is None else (
                    f"registered by {state.processes[member.incarnation].label()}"
                )
                claimed = state.processes[named] if named else process
                raise CoreError(
                    Code.FAILED_PRECONDITION,
                    f"ordinal {ordinal} is {owner}, not by the "
                    f"{'calling process' if claimed is process else 'process a host relay named'} "
                    f"({claimed.label()}); bind the thread first"
                    + (" (after a coordinator restart without a state file, every thread binds again)" if member is None else ""),
                )
            if over is not None:
                continue
            if len(tag) > max_tag:
                over = (
                    f"the tag of ordinal {ordinal} is {len(tag)} characters, over the limit of "
                    f"{max_tag} (max_tag_length)"
                )
            elif len(payload) > max_payload:
                over = (
                    f"the payload of ordinal {ordinal} is {len(payload)} bytes, over the limit of "
                    f"{max_payload} bytes (max_payload_bytes)"
                )
        return over

    @staticmethod
    def _check_resent(rnd: Round, contributions: Sequence[ContributionRow]) -> None:
        """Refuses a call that brings a contribution ``rnd`` already has with other content."""
        if rnd.error is not None:
            return  # a failed round keeps who came, not what they brought (_fail)
        for ordinal, tag, payload, _ in contributions:
            if rnd.result is not None:
                previous = rnd.result[rnd.position(ordinal)]
            elif ordinal in rnd.arrivals:
                previous = rnd.arrivals[ordinal]
            else:
                continue
            if tag != rnd.tag or payload != previous:
                raise CoreError(
                    Code.INVALID_ARGUMENT,
                    f"ordinal {ordinal} resent {rnd.describe()} with a different tag or payload; "
                    "a retried call must carry the same content (or this caller's round counter "
                    "fell behind its peers)",
                )

    @staticmethod
    def _finished_before(
        job: Job, generation: int, replicas: Sequence[int], number: int, contributions: Sequence[ContributionRow]
    ) -> Round | None:
        """Round ``number`` of the group ``replicas`` names in an earlier ``generation`` of
        ``job``, if it finished and is still kept (the generation before the job's own), every
        contribution is a member's, and the call is a resend: the round completed, or its
        callers had arrived before it failed (a new call is told of the move instead)."""
        members = sorted(set(replicas))
        group: GroupKey = ALL if not members or members == list(range(job.world_size or 0)) else tuple(members)
        kept = job.groups.get((generation, group))
        rnd = None if kept is None else kept.finished.get(number)
        if rnd is None or not all(rnd.has_member(c[0]) for c in contributions):
            return None
        if rnd.result is None and not all(c[0] in rnd.arrivals for c in contributions):
            return None
        return rnd

    def _replicas_group(
        self, state: Job, replicas: Sequence[int], ordinals: Sequence[int], tag: str, round_number: int, now: float
    ) -> GroupKey:
        """The group a replicas list names. A malformed list fails the round its members are
        in, so they learn of the mistake at once instead of waiting for a caller that will
        never come: for callers among the members (a repeated ordinal, one out of range),
        the round the call counts as, ``round_number`` of the group its ordinals in range
        make (as the client counts it); for callers outside them, whose round counter is not
        the group's, the round its members wait in, if any (none: nobody to tell, and no
        later round to spoil), once per call (not again for its resends)."""
        world = state.world_size
        members = sorted(set(replicas))
        out_of_range = None
        if members[0] < 0 or members[-1] >= world:
            # The peers' round is that of the ordinals in range (none: no peer to tell).
            out_of_range = [o for o in members if not 0 <= o < world]
            members = [o for o in members if 0 <= o < world]
        group: GroupKey = ALL if len(members) == world else tuple(members)
        if out_of_range:
            # (a client sends a value past the wire's 32 bits as the nearest 32-bit one)
            shown = ", ".join(
                f"{o} or more" if o == 2**31 - 1 else f"{o} or less" if o == -(2**31) else str(o) for o in out_of_range
            )
            problem = CoreError(
                Code.INVALID_ARGUMENT,
                f"replicas [{shown}] are out of range [0, {world}) for job {state.name!r} "
                f"(called by {_ordinals_word(ordinals)} with tag {tag!r})",
            )
            if not members:
                raise problem
        elif len(members) != len(replicas):
            dupes = sorted(o for o, n in collections.Counter(replicas).items() if n > 1)
            problem = CoreError(
                Code.INVALID_ARGUMENT,
                f"{_ordinals_word(ordinals)} called rendezvous({tag!r}) with "
                f"replicas listing {_ordinals_word(dupes)} more than once",
            )
        else:
            member_set = set(members)
            outsiders = [o for o in ordinals if o not in member_set]
            if not outsiders:
                return group
            problem = CoreError(
                Code.INVALID_ARGUMENT,
                f"{_ordinals_word(outsiders)} called rendezvous({tag!r}) with "
                f"{describe_group(group)} but {'is' if len(outsiders) == 1 else 'are'} not "
                "among them",
            )
        if not set(ordinals).isdisjoint(members):
            # Callers among the members (with a repeated ordinal, one out of range, or a
            # sibling thread outside the list in the same call): their round is known.
            try:
                target: Round | None = self._round(state, group, round_number, now)
            except CoreError:  # the round is gone or out of reach: only the caller to tell
                target = None
        else:
            # One entry per ordinal: a host relay resends a combined call per process.
            calls = [(state.generation, group, ordinal, round_number) for ordinal in ordinals]
            if all(call in state.outsider_calls for call in calls):
                raise problem  # a resend: its round failed already
            state.outsider_calls.update(dict.fromkeys(calls))
            while len(state.outsider_calls) > _OUTSIDER_CALLS_KEPT:
                state.outsider_calls.popitem(last=False)
            pending = [r for k, r in state.pending.items() if k[:2] == (state.generation, group)]
            target = min(pending, key=lambda r: r.number) if pending else None
        if target is not None and not target.finished:
            self._fail(state, target, problem)
        raise problem

    def outcome(self, job_name: str, key: RoundKey) -> Round | None:
        """The round if it has finished (``result`` or ``error`` set), else None."""
        job = self._job(job_name)
        generation, group, number = key
        if key in job.pending:
            return None
        state = job.groups.get((generation, group))
        return None if state is None else state.finished.get(number)

    def _round(self, job: Job, group: GroupKey, number: int, now: float) -> Round:
        state = job.groups.get((job.generation, group))
        if state is None:
            state = job.groups[(job.generation, group)] = _Group()
        finished = state.finished.get(number)
        if finished is not None:
            return finished
        if number < state.next_round and (job.generation, group, number) not in job.pending:
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"round {number} of {describe_group(group)} finished long ago and its result "
                f"is gone (the group is at round {state.next_round}); this caller's round "
                "counter fell behind its peers (or its answer was lost while its peers' next "
                f"rounds failed without it: a group keeps its last finished round, and when that failed, up to "
                f"{_FAILED_ROUNDS_KEPT} failures in a row)",
            )
        rnd = job.pending.get((job.generation, group, number))
        if rnd is not None and rnd.deadline is not None and rnd.deadline <= now:
            # Past its deadline, unnoticed (nobody was waiting on it when it passed, or not
            # yet): it fails now, as it would have then, and does not complete late.
            self._fail(job, rnd, self._timeout_error(job, rnd, now))
        elif rnd is None:
            if number > state.next_round + _ROUNDS_AHEAD:
                self._check_ahead(job, state, group, number)
            if len(job.pending) >= self.limits.max_pending_rounds:
                raise CoreError(
                    Code.RESOURCE_EXHAUSTED,
                    f"job {job.name!r} has {len(job.pending)} pending rounds, the limit "
                    f"(max_pending_rounds={self.limits.max_pending_rounds})",
                )
            assert job.world_size is not None
            rnd = Round(
                generation=job.generation,
                group=group,
                number=number,
                started=now,
                members=None if group == ALL else frozenset(group),
                size=job.world_size if group == ALL else len(group),
            )
            job.pending[rnd.key] = rnd
        return rnd

    @staticmethod
    def _check_ahead(job: Job, state: _Group, group: GroupKey, number: int) -> None:
        """Refuses to start round ``number`` far ahead of the group's next unfinished round.
        A group this coordinator knows nothing of yet (restarted without a state file, its
        clients' round counters went on) takes any number."""
        if state.finished or state.next_round:
            base = max(state.next_round, max(state.finished) + 1 if state.finished else 0)
        else:  # none finished yet: its lowest pending round is where its members are
            pending = [k[2] for k in job.pending if k[0] == job.generation and k[1] == group]
            if not pending:
                return
            base = min(pending)
        if number > base + _ROUNDS_AHEAD:
            raise CoreError(
                Code.INVALID_ARGUMENT,
                f"round {number} of {describe_group(group)} is {number - base} rounds ahead of the "
                f"group's next unfinished round ({base}), more than the {_ROUNDS_AHEAD} allowed: a "
                "member calls a round only after its previous one finished, so this caller's round "
                "counter ran ahead of its peers'",
            )

    def _finish(self, job: Job, rnd: Round) -> None:
        del job.pending[rnd.key]
        blocked = job.blocked
        # Usually the round's members are all that is blocked (thousands at scale): checked in
        # C (each blocked entry holds its round's key object, so count compares identities).
        if blocked.keys() == rnd.arrivals.keys() and list(blocked.values()).count(rnd.key) == len(blocked):
            blocked.clear()
        else:
            for ordinal in rnd.arrivals:
                if blocked.get(ordinal) == rnd.key:
                    del blocked[ordinal]
        self.record_finished(job, rnd)
        self._journaled(("round", job.name, rnd))
        self._wakeups.append(("round", job.name, *rnd.key))
        if self.finished is not None:
            self.finished.append((job.name, rnd))

    def _complete(self, job: Job, rnd: Round) -> None:
        # The XRT mesh service returned payloads sorted by ordinal; torch_xla's docstring
        # promises index == ordinal for the full group. Complete, the arrivals are exactly
        # the members, so the members' order needs no sorting.
        result = list(map(rnd.arrivals.__getitem__, range(rnd.size) if rnd.members is None else rnd.group))
        size = sum(map(len, result)) + _PAYLOAD_FRAMING * len(result)
        if size > self.limits.max_round_bytes:
            self._fail(job, rnd, CoreError(
                Code.RESOURCE_EXHAUSTED,
                f"{rnd.describe()} fails for every member: its answer, the {len(result)} payloads every member "
                f"receives, would be {size} bytes, over the limit of {self.limits.max_round_bytes} bytes "
                "(max_round_bytes; a message carries at most 2 GiB): exchange less in one round",
            ))
            return
        rnd.result = result
        job.rounds_completed += 1
        self._finish(job, rnd)
        rnd.arrivals = {}  # the result holds the payloads

    def _fail(self, job: Job, rnd: Round, error: CoreError) -> None:
        rnd.error = error
        self._finish(job, rnd)
        # The payloads are no longer needed (the message names the tags); who arrived is, to
        # tell a resent call from one that comes after the failure (_too_late).
        rnd.arrivals = dict.fromkeys(rnd.arrivals)

    @staticmethod
    def _too_late(rnd: Round, ordinals: Sequence[int], tag: str) -> CoreError:
        """The error of a call that comes to ``rnd`` after it failed: the round's own, which
        names the caller as missing, under the tag the others brought, said to be that (the
        round's message shortened at a "; " to keep the whole within _MESSAGE_CHARACTERS)."""
        shown = _distinct_tags([tag, rnd.tag])
        peers = f"its peers called rendezvous({shown[rnd.tag]!r}); " if rnd.tag not in ("", tag, _shown_tag(tag)) else ""
        head = (
            f"{_missing_word(sorted(ordinals))} called rendezvous({shown[tag]!r}) as round {rnd.number} of "
            f"{describe_group(rnd.group)}, {FAILED_BEFORE_IT_CAME} ({peers}its round counter for the group "
            "moves on with its peers'): "
        )
        message = rnd.error.message
        if len(head) + len(message) > _MESSAGE_CHARACTERS:
            cut = message.rfind("; ", 0, max(0, _MESSAGE_CHARACTERS - len(head) - 4))
            message = f"{message[:cut] if cut > 0 else message[: max(0, _MESSAGE_CHARACTERS - len(head) - 4)]} ..."
        return CoreError(rnd.error.code, head + message)

    def _fail_if_deadlocked(self, job: Job, start: Round) -> None:
        """Fails every round of a wait cycle through ``start``.

        Each member blocks in one round at a time, so round R waits for round Q when a
        member R still lacks is blocked in Q. A cycle can never finish: members disagree
        on replicas or on the order of their calls.
        """

        def waits_for(rnd: Round) -> dict[RoundKey, list[int]]:
            edges: dict[RoundKey, list[int]] = collections.defaultdict(list)
            for ordinal, key in job.blocked.items():
                if key != rnd.key and rnd.has_member(ordinal) and ordinal not in rnd.arrivals:
                    edges[key].append(ordinal)
            return edges

        # Breadth-first (no recursion: chains can be thousands of rounds long), remembering
        # how each round was reached so the cycle back to `start` can be spelled out.
        reached: dict[RoundKey, tuple[Round, list[int]] | None] = {start.key: None}
        queue = collections.deque([start])
        cycle: list[tuple[Round, list[int]]] = []
        while queue and not cycle:
            rnd = queue.popleft()
            for key, blockers in waits_for(rnd).items():
                if key == start.key:
                    cycle.append((rnd, blockers))
                    while (step := reached[cycle[-1][0].key]) is not None:
                        cycle.append(step)
                    cycle.reverse()
                    break
                if key not in reached:
                    reached[key] = (rnd, blockers)
                    queue.append(job.pending[key])
        if not cycle:
            return
        steps = "; ".join(
            f"{_ordinals_word(sorted(rnd.arrivals))} wait{'s' if len(rnd.arrivals) == 1 else ''} "
            f"in {rnd.describe()} for "
            f"{_ordinals_word(blockers)}"
            for rnd, blockers in cycle
        )
        error = CoreError(
            Code.FAILED_PRECONDITION,
            f"rendezvous calls wait on each other and can never complete: {steps}. Members "
            "disagree on replicas or on the order of their calls",
        )
        for rnd, _ in cycle:
            self._fail(job, rnd, error)

    def expire(self, now: float) -> None:
        """Fails every pending round whose earliest member deadline has passed."""
        for job in self.jobs.values():
            overdue = [r for r in job.pending.values() if r.deadline is not None and r.deadline <= now]
            for rnd in overdue:
                self._fail(job, rnd, self._timeout_error(job, rnd, now))

    def fail_pending(self, why: str) -> None:
        """Every pending round fails (ABORTED) saying ``why``: the coordinator stops for good
        (an embedded one, without a state file), and nothing would answer their members."""
        for job in self.jobs.values():
            for rnd in list(job.pending.values()):
                self._fail(job, rnd, CoreError(Code.ABORTED, f"{rnd.describe()} fails: {why}"))

    def hold_over(self, now: float, until: float) -> None:
        """The coordinator was held up (stopped, paused) as the deadlines of pending rounds
        passed: each round whose deadline passed is judged at ``until`` instead, once the
        calls that came meanwhile are read (they may complete it; see Servicer._read_first)."""
        for job in self.jobs.values():
            for rnd in job.pending.values():
                if rnd.deadline is not None and rnd.deadline <= now:
                    rnd.deadline = until

    def _timeout_error(self, job: Job, rnd: Round, now: float) -> CoreError:
        timed_out = now if rnd.deadline is None else min(now, rnd.deadline)  # (noticed late: when it passed)
        return CoreError(
            Code.DEADLINE_EXCEEDED,
            self.with_missing(
                job,
                f"{rnd.describe()} timed out after {_duration(timed_out - rnd.started)} s (counted from "
                f"the first call to reach the coordinator) with {len(rnd.arrivals)} of {rnd.size} "
                "arrived; missing ",
                rnd.missing(),
                now,
            ),
        )

    # -- liveness and generations --------------------------------------------------------

    def serving_from(self, now: float) -> None:
        """A restored core starts serving at ``now``: the restore's window, and the silence
        of every process not heard from since, count from here, not from when the state
        file was read (reading, replaying and rewriting a large one takes seconds, during
        which no process can heartbeat)."""
        if self.restored is None or now <= self.restored[0]:
            return
        read_at, window, before = self.restored
        self.restored = (now, window, before)
        for job in self.jobs.values():
            for process in job.processes.values():
                if process.last_seen <= read_at:
                    process.last_seen += now - read_at

    def check_liveness(self, now: float) -> None:
        """Declares dead every process not heard from within the heartbeat timeout, and
        every one whose connection closed without a Leave longer than its grace ago
        (DISCONNECTED_GRACE); nobody in the window after a restore, nor without a heartbeat
        timeout."""
        if self.heartbeat_timeout is None:
            return
        if self.restored is not None:
            if now - self.restored[0] <= self.restored[1]:
                return  # just restored: its processes may not have been told the timeout yet
            self.restored = None
        for job in self.jobs.values():
            for process in list(job.processes.values()):
                if not process.alive:
                    continue
                silent = now - process.last_seen
                closed = None if process.disconnected is None else now - process.disconnected
                grace = min(max(DISCONNECTED_GRACE, 2 * process.heartbeat_interval), self.heartbeat_timeout)
                if closed is not None and (closed > grace or silent > self.heartbeat_timeout):
                    self.declare_dead(
                        job.name, process.incarnation,
                        # (durations, not "N s ago": the reason is quoted again later, in the
                        # rounds it fails and a restart's message)
                        f"its connection closed without a Leave and it was not heard from in the {closed:.1f} s after "
                        f"(killed, crashed, or its host lost the network; silent {silent:.1f} s in all)",
                    )
                elif silent > self.heartbeat_timeout:
                    # (one silent since a restore may have ended while the coordinator was
                    # down, or be stalled: the restart closed its connection, which says
                    # nothing of the process, and a stall is given the timeout)
                    silence = (
                        f"not heard from since the coordinator restarted from its state file {silent:.1f} s ago"
                        if process.restored else f"no heartbeat for {silent:.1f} s"
                    )
                    self.declare_dead(
                        job.name, process.incarnation, f"{silence} (heartbeat timeout {self.heartbeat_timeout:g} s)"
                    )

    def disconnect(self, job_name: str, incarnation: str, now: float) -> None:
        """A process's connection closed without a Leave (its event watch ended): unless
        it is heard from again within DISCONNECTED_GRACE (or twice its heartbeat interval;
        a heartbeat, its watch or a registration: not a Rendezvous call),
        ``check_liveness`` declares it dead (with a heartbeat timeout)."""
        job = self.jobs.get(job_name)
        process = job.processes.get(incarnation) if job is not None else None
        if process is not None and process.alive and process.disconnected is None:
            process.disconnected = now

    def declare_dead(
        self, job_name: str, incarnation: str, reason: str, *, left: bool = False, dropped: bool = False
    ) -> None:
        """Marks a process dead (or gone, ``left``; ``dropped``, from a run that ended without
        word of it) and fails every pending round that needs its ordinals."""
        job = self._job(job_name)
        process = job.processes[incarnation]
        if not process.alive:
            return
        process.alive = False
        process.left = left
        process.death = reason
        ordinals = self._task_ordinals(job, process)
        job.dead |= ordinals
        message = (
            f"{_ordinals_word(sorted(ordinals))} ({process.label()}, task "
            f"{process.task_id}) {'left' if left else 'was dropped' if dropped else 'died'}: {reason}"
        )
        self._event(job, "PROCESS_LEFT" if left else "PROCESS_DEAD", process, message, ordinals)
        if dropped:  # (its run ends: _start_afresh fails its rounds, and drops their payloads once)
            return
        self._fail_rounds_of_the_dead(job)
        if not any(p.alive for p in job.processes.values()):
            self._drop_payloads(job)

    @staticmethod
    def _drop_payloads(job: Job) -> None:
        """Every process of the job is gone: none can ask for a finished round again (a
        process gone is refused, a new run is a new generation), so the rounds kept for
        resends keep their outcome but not their payloads. (A finished job held them until
        max_jobs dropped it: 4,096 groups of 4 KiB payloads kept 276 MB.)"""
        for state in job.groups.values():
            for rnd in state.finished.values():
                if rnd.result is not None:
                    rnd.result = [b""] * len(rnd.result)
                rnd.arrivals = dict.fromkeys(rnd.arrivals, b"")
                rnd.response = None

    def _fail_rounds_of_the_dead(self, job: Job) -> None:
        for rnd in list(job.pending.values()):
            dead = self._dead_members(job, rnd)
            if dead:
                self._fail(job, rnd, self._death_error(job, rnd, dead))

    def end_replicas(self, job_name: str, incarnation: str, ordinals: Sequence[int], reason: str, now: float) -> None:
        """Threads of a live process are done (their replicas, ``xla.spawn``'s fn, ended):
        every pending round that needs one of their ordinals fails now, and every later one
        at once, naming ``reason`` (the process may go on running others: until it leaves,
        nothing else tells, and those rounds would wait for them until their timeout)."""
        job = self._job(job_name)
        process = self._process(job, incarnation, now)
        strangers = sorted(set(ordinals) - process.ordinals)
        if strangers:
            raise CoreError(
                Code.INVALID_ARGUMENT,
                f"{_ordinals_word(strangers)} {'is' if len(strangers) == 1 else 'are'} not bound by "
                f"this process ({process.label()}, task {process.task_id}), which binds "
                f"{format_ranges(sorted(process.ordinals)) or 'none'}: it can end only its own",
            )
        reason = _one_line(reason or "ended")
        for ordinal in ordinals:
            process.ended[ordinal] = reason
        job.dead.update(ordinals)
        self._changed()
        self._fail_rounds_of_the_dead(job)

    def give_up_round(
        self,
        job_name: str,
        incarnation: str,
        *,
        generation: int,
        replicas: Sequence[int],
        round_number: int,
        ordinals: Sequence[int],
        tag: str,
        reason: str,
        now: float,
        job_id: str = "",
    ) -> Round | None:
        """A process's call of a round ended without an answer (the coordinator out of its
        reach for its whole retry budget), so its user code saw the round fail and goes on
        to its next: unless the round finished, it fails now for every member, naming
        ``reason``. (Else its peers, having resent their calls to a coordinator back in
        time, would wait there for ordinals that come to the next round instead, and the
        two rounds fail as waiting on each other, which blames the order of their calls.)
        Returns the round it failed, None when there was nothing to fail: finished, of
        another generation or another job of the name (``job_id``, void already), never to
        be started (long past), or of a group the ordinals are not members of (their call
        was refused)."""
        job = self._job(job_name)
        process = self._process(job, incarnation, now)
        strangers = sorted(set(ordinals) - process.ordinals)
        if strangers or not ordinals:
            raise CoreError(
                Code.INVALID_ARGUMENT,
                f"a process gives up rounds of its own ordinals ({process.label()} binds "
                f"{format_ranges(sorted(process.ordinals)) or 'none'}), not of {format_ranges(strangers) or 'none'}",
            )
        if generation != job.generation or (job_id and job_id != job.store_id) or job.world_size is None:
            return None
        members = sorted({r for r in replicas if 0 <= r < job.world_size})
        if replicas and not set(ordinals) <= set(members):
            return None  # (refused when called: an outsider's call counts no round of the group)
        group: GroupKey = ALL if not replicas or members == list(range(job.world_size)) else tuple(members)
        try:
            rnd = self._round(job, group, round_number, now)
        except CoreError:  # long past, too far ahead or too many pending: nothing waits in it
            return None
        if rnd.finished:
            return None
        if not rnd.arrivals:
            rnd.tag = _one_line(_shown_tag(tag))
        reason = _one_line(reason or "no answer")
        self._fail(
            job,
            rnd,
            CoreError(
                Code.ABORTED,
                f"{rnd.describe()} cannot complete: {_ordinals_word(sorted(ordinals))} on {process.label()} gave up "
                f"on it and went on to its next round: {reason}",
            ),
        )
        return rnd

    def leave(self, job_name: str, incarnation: str, reason: str = "") -> None:
        """A process is done: its ordinals are gone now, not after the heartbeat timeout;
        ``reason``, the client's, says why (else: its client closed)."""
        job = self._job(job_name)
        if incarnation in job.processes:
            self.declare_dead(job_name, incarnation, _one_line(reason) if reason else "its client closed", left=True)

    @staticmethod
    def _remember_replaced(job: Job, incarnation: str, why: str) -> None:
        """Keeps why ``incarnation`` takes no part in ``job`` any more, for its late calls
        (the last _REPLACED_KEPT of them, or as many as the job has processes: a run of
        thousands dropped at once is told so, not that it is not registered)."""
        job.replaced[incarnation] = why
        while len(job.replaced) > max(_REPLACED_KEPT, len(job.processes)):
            job.replaced.popitem(last=False)

    @staticmethod
    def _started_before(r: Registration, when: float, now: float) -> bool:
        """Whether the registering process started before ``when`` (False when the
        registration gives no process age: it is then taken for a relaunch)."""
        return 0 < r.process_age < math.inf and now - r.process_age < when

    def _start_afresh(self, job: Job, why: str | None = None) -> None:
        """A new run starts from an empty rank table (keys stay: a new run may have written
        some before registering); the last run's pending rounds fail. Without ``why``, a
        relaunch: every process of the last run is gone, and those whose connections closed
        are declared dead now, as dropped."""
        relaunch, why = why is None, why or "every process of the last run is gone"
        error = CoreError(Code.ABORTED, f"job {job.name!r} starts afresh: {why}")
        for rnd in list(job.pending.values()):
            self._fail(job, rnd, error)

        def fate(p: Process) -> str | None:
            return (
                "left" if p.left else "died" if not p.alive
                else "lost its connection" if p.disconnected is not None
                else "was not heard from since the coordinator restarted" if p.restored else None
            )

        job.last_run = {p.task_id: f"{p.label()}, which {fate(p) or f'was dropped ({why})'}" for p in job.processes.values()}
        for p in list(job.processes.values()):
            if not p.alive:
                continue
            # (should it call again, it is told why it takes no part)
            self._remember_replaced(job, p.incarnation, f"job {job.name!r} started afresh ({why}) " + (
                f"as this process ({p.label()}) {fate(p)}" if relaunch else f"while this process ({p.label()}) was of the run before"
            ))
            if relaunch and p.disconnected is not None:  # (a job killed and relaunched at once left no other
                # word of its processes' end; one merely not heard from since a restart may live on)
                self.declare_dead(
                    job.name, p.incarnation,
                    f"its connection closed without a Leave, and a new run of job {job.name!r} registered before it "
                    "was heard from again", dropped=True,
                )
        if relaunch:
            self._drop_payloads(job)
        job.processes.clear()
        job.tasks.clear()
        job.members.clear()
        job.runtime_owners = None
        job.dead.clear()
        job.blocked.clear()
        job.refused.clear()
        if job.world_fixed_by != _DECLARED:
            job.world_size = None
        job.devices_per_task = None  # (a declared world size may be split anew)
        self._new_generation(job)
        job.formed = False
        self._changed()

    @staticmethod
    def _task_ordinals(job: Job, process: Process) -> set[int]:
        """Every ordinal of the process's task, its threads bound or not (they are gone with
        it: a round needing one it never bound must not wait for it)."""
        if job.devices_per_task is None or job.tasks.get(process.task_id) != process.incarnation:
            return process.ordinals
        first = process.task_id * job.devices_per_task
        return process.ordinals | set(range(first, first + job.devices_per_task))

    @staticmethod
    def _dead_members(job: Job, rnd: Round) -> list[int]:
        return sorted(o for o in job.dead if rnd.has_member(o)) if job.dead else []

    def _death_error(self, job: Job, rnd: Round, dead: list[int]) -> CoreError:
        causes, verbs = [], set()
        for p in job.processes.values():
            if not p.alive:
                ordinals = self._task_ordinals(job, p)
                if not ordinals.isdisjoint(dead):
                    causes.append(f"{_ordinals_word(sorted(ordinals))} on {p.label()}: {p.death}")
                    verbs.add("left" if p.left else "died")
            if p.ended:  # (also of a process gone since: why its replica ended first)
                for ordinal in sorted(p.ended.keys() & dead):
                    causes.append(f"ordinal {ordinal} on {p.label()}: its replica {p.ended[ordinal]}")
                    verbs.add("ended")
        verb = " or ".join(sorted(verbs))  # ("died or left": some were declared dead, some left)
        return CoreError(Code.ABORTED, f"{rnd.describe()} cannot complete: a member {verb} ({'; '.join(causes)})")

    def _replace(self, job: Job, old: Process, newcomer: str, now: float) -> None:
        """A new incarnation takes over a process's task (dead, or restarted on its host
        before it was declared dead): a new generation begins."""
        for ordinal in old.ordinals:
            job.members.pop(ordinal, None)
        job.runtime_owners = None
        ordinals = self._task_ordinals(job, old)
        job.dead -= ordinals
        del job.processes[old.incarnation]
        self._new_generation(job)
        if old.alive and old.restored:
            was = f"was not heard from since the coordinator restarted from its state file {max(0.0, now - old.last_seen):.1f} s before"
        elif old.alive:
            was = f"was last heard from {max(0.0, now - old.last_seen):.1f} s before" + (
                "" if old.disconnected is None else
                f", its connection closed {max(0.0, now - old.disconnected):.1f} s before without a Leave"
            )
        else:
            was = f"{'left' if old.left else 'died'}: {old.death}" if old.death else "had stopped"
        message = (
            f"task {old.task_id} ({_ordinals_word(sorted(ordinals))}) restarted: {newcomer} "
            f"replaces {old.label()}, which {was}"
        )
        self._remember_replaced(job, old.incarnation, message)
        for rnd in list(job.pending.values()):
            self._fail(
                job, rnd,
                CoreError(Code.ABORTED, f"job {job.name!r} moved to generation {job.generation}: {message}; {rnd.describe()} is void"),
            )
        self._event(job, "PROCESS_RESTARTED", old, message, ordinals)

    def _event(self, job: Job, kind: str, process: Process, message: str, ordinals: set[int]) -> None:
        self._changed()
        job.events.append(
            Event(
                kind=kind,
                generation=job.generation,
                ordinals=tuple(sorted(ordinals)),
                host=process.host,
                message=message,
                task=process.task_id,
                pid=process.pid,
            )
        )
        self._wakeups.append(("events", job.name))

    @staticmethod
    def _new_generation(job: Job) -> None:
        """Moves ``job`` to its next generation, forgetting the rounds of the generations
        before the last. The last one's stay until the next move: a resent call of a round
        that finished just before the move gets its outcome (Core._finished_before); other
        calls naming an old generation are refused as void (Core.arrive)."""
        job.generation += 1
        stale = [key for key in job.groups if key[0] < job.generation - 1]
        for key in stale:
            del job.groups[key]

    def _generation_reason(self, job: Job) -> str:
        restart = next((e for e in reversed(job.events) if e.kind == "PROCESS_RESTARTED"), None)
        return restart.message if restart else "restart"

    def events(self, job_name: str, since: int) -> tuple[int, list[Event]]:
        """The job's events from index ``since`` on, and the index of the first of them:
        indexes count from the job's first event, but only the latest ``_EVENTS_KEPT`` are
        kept, so a caller that fell further behind gets the oldest kept first."""
        log = self._job(job_name).events
        first = max(since, log.dropped)
        return first, log.since(first)

    # -- key-value ------------------------------------------------------------------------

    def _check_key(self, key: str) -> None:
        if not key:
            raise CoreError(Code.INVALID_ARGUMENT, "key must not be empty")
        if len(key) > self.limits.max_key_length:
            raise CoreError(
                Code.RESOURCE_EXHAUSTED,
                f"key {_shown_tag(key)!r} of {len(key)} characters (a torch Store's prefix included) exceeds the "
                f"limit of {self.limits.max_key_length} (max_key_length)",
            )

    @staticmethod
    def _check_request_id(request_id: str) -> None:
        if len(request_id) > MAX_REQUEST_ID_LENGTH:
            raise CoreError(
                Code.INVALID_ARGUMENT,
                f"request id of {len(request_id)} characters exceeds the limit of "
                f"{MAX_REQUEST_ID_LENGTH}; a request id names one call for its retries (the "
                "client sends a uuid of 32)",
            )

    def _check_value(self, key: str, value: bytes) -> None:
        if len(value) > self.limits.max_value_bytes:
            raise CoreError(
                Code.RESOURCE_EXHAUSTED,
                f"value for key {key!r} is {len(value)} bytes, over the limit of "
                f"{self.limits.max_value_bytes} bytes (max_value_bytes)",
            )

    def _kv_room(self, job: Job, values: Mapping[str, int]) -> None:
        """Refuses writes of ``values`` (key -> the length of its new value) that would take
        the job's keys and values past ``max_kv_bytes``."""
        if job.kv_bytes is None:
            job.kv_bytes = sum(len(k) + len(v) for k, v in job.kv.items())
        grow = sum(n - (len(job.kv[k]) if k in job.kv else -len(k)) for k, n in values.items())
        if grow > 0 and job.kv_bytes + grow > self.limits.max_kv_bytes:
            raise CoreError(
                Code.RESOURCE_EXHAUSTED,
                f"job {job.name!r} holds {job.kv_bytes} bytes of keys and values; {grow} more would pass the "
                f"limit of {self.limits.max_kv_bytes} (max_kv_bytes): delete keys it no longer needs",
            )

    def _write(self, job: Job, key: str, value: bytes) -> None:
        """Sets ``key`` (``_kv_room`` checked first, which counted ``kv_bytes``)."""
        old = job.kv.get(key)
        job.kv_bytes += len(value) - (len(old) if old is not None else -len(key))  # type: ignore[operator]
        job.kv[key] = value
        self._journaled(("set", job.name, key, value))
        self._wakeups.append(("kv", job.name, key))

    def _once(self, job: Job, request_id: str, change: str, key: str, apply):
        """Applies a non-idempotent ``change`` of ``key`` once per request id (retries get
        the first result). The id counts for that change of that key only: another change
        reusing it (a client's bug) is applied, not answered with a result of another type."""
        if not request_id:
            return apply()
        # (a long key by its digest: kept whole, 100,000 adds of a key of 4,000 characters
        # held 400 MB, and as much in the state file, for a store of one key)
        named = key if len(key) <= 32 else "#" + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()  # (33: no key's)
        entry = f"{change}\0{named}\0{request_id}"
        if entry in job.request_results:
            return job.request_results[entry]
        result = apply()
        self.record_request(job, entry, result)
        self._journaled(("request", job.name, entry, result))
        return result

    def check_store(self, job_name: str, seen: str) -> None:
        """Refuses a key-value call whose client saw (``seen``: a ``store_id`` answered
        before, empty when none was) keys of the job other than the ones there are now."""
        if not seen or seen == self.state_id:  # nothing yet; or no job yet, on this very core
            return
        job = self.jobs.get(job_name)
        if job is None or job.store_id != seen:
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"the keys of job {job_name!r} are not the ones this client saw: the coordinator restarted "
                "without its state file (serve --state-file keeps them), or dropped the job (at "
                "--max-jobs, a finished job, every process gone, may make room for another); this call "
                "fails, and the client's calls from now on use the job's keys as they are now",
            )

    def store_id(self, job_name: str) -> str:
        """What a key-value answer names as the store it was made on (``check_store``): the
        job's keys, or this core's state while there is no job."""
        job = self.jobs.get(job_name)
        return self.state_id if job is None else job.store_id

    def kv_set(self, job_name: str, entries: Sequence[tuple[str, bytes]], request_id: str = "") -> None:
        """Sets every entry; with ``request_id``, once (a resend whose first answer was lost
        must not overwrite what another client set meanwhile)."""
        for key, value in entries:
            self._check_key(key)
            self._check_value(key, value)
        self._check_request_id(request_id)
        job = self._job_or_create(job_name)

        def apply() -> None:
            self._kv_room(job, {key: len(value) for key, value in entries})
            for key, value in entries:
                self._write(job, key, value)

        self._once(job, request_id, "set", "", apply)

    def kv_get(self, job_name: str, keys: Sequence[str]) -> list[bytes | None]:
        for key in keys:
            self._check_key(key)
        job = self._job_if_any(job_name)
        return [None] * len(keys) if job is None else [job.kv.get(key) for key in keys]

    def kv_add(self, job_name: str, key: str, delta: int, request_id: str = "") -> int:
        self._check_key(key)
        self._check_request_id(request_id)
        job = self._job_or_create(job_name)

        def apply() -> int:
            current = job.kv.get(key, b"0")
            try:
                if b"_" in current:  # Python's int() takes "1_000"; no other store does
                    raise ValueError
                value = int(current) + delta
            except ValueError:
                raise CoreError(
                    Code.INVALID_ARGUMENT,
                    f"cannot add to key {key!r}: its value {current[:64]!r} is not an integer",
                ) from None
            if not -(2**63) <= value < 2**63:
                raise CoreError(
                    Code.INVALID_ARGUMENT,
                    f"adding {delta} to key {key!r} (value {int(current)}) leaves the 64-bit integer range",
                )
            text = str(value).encode()
            self._kv_room(job, {key: len(text)})
            self._write(job, key, text)
            return value

        return self._once(job, request_id, "add", key, apply)

    def kv_compare_set(
        self, job_name: str, key: str, expected: bytes, desired: bytes, request_id: str = ""
    ) -> bytes:
        """torch.distributed.Store.compare_set: swaps when the value equals ``expected``
        (a missing key matches an empty ``expected``); returns the value after the call,
        or ``expected`` when the key is missing and ``expected`` is not empty."""
        self._check_key(key)
        self._check_value(key, desired)
        self._check_request_id(request_id)
        job = self._job_or_create(job_name)

        def apply() -> bytes:
            current = job.kv.get(key)
            if (b"" if current is None else current) != expected:
                return expected if current is None else current
            self._kv_room(job, {key: len(desired)})
            self._write(job, key, desired)
            return desired

        return self._once(job, request_id, "compare_set", key, apply)

    def kv_append(self, job_name: str, key: str, value: bytes, request_id: str = "") -> None:
        self._check_key(key)
        self._check_request_id(request_id)
        job = self._job_or_create(job_name)

        def apply() -> None:
            combined = job.kv.get(key, b"") + value
            self._check_value(key, combined)
            self._kv_room(job, {key: len(combined)})
            job.kv_bytes += len(value) + (0 if key in job.kv else len(key))  # (counted by _kv_room)
            job.kv[key] = combined
            self._journaled(("append", job.name, key, value))  # what it appends: the whole value each time was quadratic
            self._wakeups.append(("kv", job.name, key))

        self._once(job, request_id, "append", key, apply)

    def kv_delete(self, job_name: str, key: str, request_id: str = "") -> bool:
        self._check_key(key)
        self._check_request_id(request_id)
        job = self._job_or_create(job_name)

        def apply() -> bool:
            old = job.kv.pop(key, None)
            if old is None:
                return False
            if job.kv_bytes is not None:
                job.kv_bytes -= len(key) + len(old)
            self._journaled(("delete", job.name, key))
            return True

        return self._once(job, request_id, "delete", key, apply)

    def kv_list(self, job_name: str, prefix: str = "") -> list[tuple[str, bytes]]:
        job = self._job_if_any(job_name)
        if job is None:
            return []
        return sorted((k, v) for k, v in job.kv.items() if k.startswith(prefix))

    def kv_count(self, job_name: str, prefix: str = "") -> int:
        job = self._job_if_any(job_name)
        if job is None:
            return 0
        if not prefix:
            return len(job.kv)
        return sum(1 for k in job.kv if k.startswith(prefix))

    def kv_timeout(self, job_name: str, keys: Sequence[str], waited: float) -> CoreError:
        job = self._job_if_any(job_name)
        missing = [k for k in keys if job is None or k not in job.kv]
        return CoreError(
            Code.DEADLINE_EXCEEDED,
            f"{_plural(len(missing), 'key')} of job {job_name!r} still not set after "
            f"{_duration(waited)} s: {keys_shown(missing)}",
        )

    # -- status ---------------------------------------------------------------------------

    def touch(self, job_name: str, incarnation: str, now: float) -> int:
        """A heartbeat: the process is alive now. Returns the job's generation."""
        job = self.jobs.get(job_name)
        if job is None:
            raise self._heard_stranger(job_name, incarnation, now, self._unknown_job(job_name))
        if incarnation not in job.processes and incarnation not in job.replaced:
            raise self._heard_stranger(job_name, incarnation, now, self._not_registered(job, incarnation))
        self._uses = job.used = self._uses + 1
        self._process(job, incarnation, now)
        return job.generation

    def _heard_stranger(self, job_name: str, incarnation: str, now: float, error: CoreError) -> CoreError:
        """A process this coordinator does not know heartbeats: the refusal ``error``, which
        the operator hears of (in the log, once per job and generation, and from status:
        ``strangers``)."""
        shown = job_name[: self.limits.max_name_length]
        job = self.jobs.get(shown)
        error.warn = (
            ("unknown process", shown, job.generation) if job else ("unknown job", shown),
            "unknown_process" if job else "unknown_job",
            f"refused calls from processes {'not registered in' if job else 'of'} job {shown!r}, "
            f"which this coordinator does not know: {self._why_unknown(job is not None)}",
        )
        if not shown or _control(shown):  # (no job's name: not kept for status)
            return error
        heard = self.unknown.pop(shown, None) or {}
        self.unknown[shown] = heard  # (the most recently heard last)
        incarnation = incarnation[: self.limits.max_name_length]  # (as its name: a bound on what is kept)
        heard.pop(incarnation, None)
        heard[incarnation] = now
        if len(heard) > _UNKNOWN_PROCESSES_KEPT:
            del heard[next(iter(heard))]
        if len(self.unknown) > _UNKNOWN_JOBS_KEPT:
            del self.unknown[next(iter(self.unknown))]
        return error

    def _why_unknown(self, job_known: bool) -> str:
        if self.journal is None:
            return (
                "it has no --state-file, so a restart forgot them, or their job was dropped at --max-jobs (made again "
                "since): they must register again"
                if job_known else
                "it has no --state-file, so a restart forgot its jobs, whose processes must start again"
            )
        return (
            f"their job was dropped at --max-jobs{' and made again since' if job_known else ''}, or they were started "
            "for another coordinator"
        )

    def strangers(self, now: float) -> list[StrangersView]:
        """Processes not known here that heartbeat it (their calls refused), heard from in the
        last _UNKNOWN_KEPT_FOR seconds, by job."""
        for name, heard in list(self.unknown.items()):
            for incarnation in [i for i, when in heard.items() if now - when > _UNKNOWN_KEPT_FOR]:
                del heard[incarnation]
            if not heard:
                del self.unknown[name]
        return [
            StrangersView(
                job=name,
                job_known=name in self.jobs,
                processes=len(heard),
                last_call_age=max(0.0, now - max(heard.values())),
                reason=self._why_unknown(name in self.jobs),
            )
            for name, heard in sorted(self.unknown.items())
        ]

    def _participants(self, job: Job, now: float | None) -> list[ParticipantView]:
        views = []
        for ordinal in sorted(job.members):
            m = job.members[ordinal]
            p = job.processes[m.incarnation]
            views.append(
                ParticipantView(
                    ordinal=ordinal,
                    local_ordinal=m.local_ordinal,
                    task_id=p.task_id,
                    thread_index=m.thread_index,
                    host=p.host,
                    pid=p.pid,
                    incarnation=p.incarnation,
                    last_seen_age=0.0 if now is None else max(0.0, now - p.last_seen),
                    runtime_ordinal=m.runtime_ordinal,
                    alive=p.alive,
                    left=p.left,
                    ended=p.ended.get(ordinal, ""),
                    client_version=p.client_version,
                    disconnected_age=(
                        max(0.0, now - p.disconnected) if now is not None and p.alive and p.disconnected is not None else None
                    ),
                    unheard_since_restart=now is not None and p.alive and p.restored,
                )
            )
        return views

    def status(self, now: float, job_name: str = "", *, participants: bool = True) -> list[JobView]:
        if job_name and job_name not in self.jobs:
            error = self._unknown_job(job_name)
            heard = [v for v in self.strangers(now) if v.job == job_name]
            raise CoreError(error.code, error.message + "".join(
                f"; {_plural(v.processes, 'process')} of it heartbeat this coordinator, the last "
                f"{_duration(v.last_call_age)} s ago" for v in heard
            ))
        jobs = [self._job(job_name)] if job_name else [self.jobs[n] for n in sorted(self.jobs)]
        views = []
        for job in jobs:
            pending = []
            for rnd in sorted(job.pending.values(), key=lambda r: r.started):
                missing = rnd.missing()
                pending.append(
                    PendingRoundView(
                        group=rnd.group,
                        number=rnd.number,
                        tags={rnd.tag: sorted(rnd.arrivals)} if rnd.arrivals else {},
                        arrived=sorted(rnd.arrivals),
                        missing=missing,
                        waiting_seconds=now - rnd.started,
                        missing_summary=self.describe_missing(job, missing, now),
                    )
                )
            views.append(
                JobView(
                    job=job.name,
                    world_size=job.world_size or 0,
                    registered=len(job.members),
                    generation=job.generation,
                    participants=self._participants(job, now) if participants else [],
                    pending_rounds=pending,
                    rounds_completed=job.rounds_completed,
                    kv_keys=len(job.kv),
                    refused={  # (not a task another process holds: a duplicate refused beside it; nor,
                        # once the world formed, one outside it: another job's under the same name)
                        task: (self._ordinals_of_task(job, task), why)
                        for task, why in sorted(job.refused.items())
                        if task not in job.tasks and not (job.formed and not self._ordinals_of_task(job, task))
                    },
                    devices_per_task=job.devices_per_task or 0,
                    world_missing_summary=self._world_missing(job, now),
                )
            )
        return views

    @staticmethod
    def _ordinals_of_task(job: Job, task: int) -> list[int]:
        """The ordinals of ``task`` (none while the job does not know its devices per task)."""
        n = job.devices_per_task
        return list(range(task * n, (task + 1) * n)) if n and task * n < (job.world_size or 0) else []

