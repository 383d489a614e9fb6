"""Prometheus metrics of the coordinator (``serve --metrics-port``), with no dependency.

What is measured:

- gauges read from the core at scrape time: registered and expected ordinals, processes
  alive and dead, generation, pending rounds and the oldest one's age, keys; per job;
- counters and a histogram fed as things happen: rounds completed / failed (by status
  code), how long completed rounds waited (first arrival to completion), RPCs handled (by
  service, method and status code, through :class:`RpcInterceptor`).

Exposition is the Prometheus text format 0.0.4, served at ``/metrics`` by a small asyncio
HTTP server on the coordinator's own event loop (:func:`start_http_server`), so a scrape
reads the core from the thread that owns it and needs no lock.

Thread safety: none needed; everything here runs on the coordinator's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
import socket
from typing import Callable, Iterable, Sequence

import grpc

from pjrt_rendezvous.client._version import build

from ._listener import Listener

log = logging.getLogger("pjrt_rendezvous.coordinator")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds a round waits, first arrival to completion: from a tight training-step barrier
# (milliseconds) to a slow checkpoint or compile skew (minutes).
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


@dataclasses.dataclass
class Family:
    """One metric: name, type, help text and its samples ``(suffix, labels, value)``."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    samples: list[tuple[str, dict[str, str], float]] = dataclasses.field(default_factory=list)

    def add(self, labels: dict[str, str], value: float, suffix: str = "") -> None:
        self.samples.append((suffix, labels, value))


def exposition(families: Iterable[Family]) -> str:
    """The Prometheus text format of ``families``."""
    lines = []
    for family in families:
        help_text = family.help.replace("\\", "\\\\").replace("\n", "\\n")
        lines.append(f"# HELP {family.name} {help_text}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for suffix, labels, value in family.samples:
            text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            labels_text = f"{{{text}}}" if text else ""
            lines.append(f"{family.name}{suffix}{labels_text} {_number(value)}")
    return "\n".join(lines) + "\n"


class Histogram:
    """Cumulative-bucket histogram per label set."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(sorted(buckets))
        self._series: dict[tuple, list] = {}  # labels -> [bucket counts..., sum, count]

    def observe(self, labels: tuple[tuple[str, str], ...], value: float) -> None:
        series = self._series.setdefault(labels, [0] * len(self.buckets) + [0.0, 0])
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                series[i] += 1
        series[-2] += value
        series[-1] += 1

    def forget(self, labels: tuple[tuple[str, str], ...]) -> None:
        self._series.pop(labels, None)

    def count(self, labels: tuple[tuple[str, str], ...]) -> int:
        series = self._series.get(labels)
        return 0 if series is None else series[-1]

    def fill(self, family: Family, keep: Callable[[tuple], bool] = lambda labels: True) -> None:
        for labels, series in sorted(self._series.items()):
            if not keep(labels):
                continue
            base = dict(labels)
            for bound, count in zip(self.buckets, series):
                family.add({**base, "le": _number(bound)}, count, "_bucket")
            family.add({**base, "le": "+Inf"}, series[-1], "_bucket")
            family.add(base, series[-2], "_sum")
            family.add(base, series[-1], "_count")


# The coordinator job's label: not "job", which Prometheus sets on every scraped series
# (the scrape job) and would rename ours to "exported_job".
JOB_LABEL = "rendezvous_job"
# Codes a round usually fails with, exported from 0 for every job.
FAILURE_CODES = ("ABORTED", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")
# What happens to a job's processes (its events), exported from 0 for every job.
PROCESS_EVENTS = ("dead", "left", "restarted")
# Seconds a finished job (every process gone, no round pending) is still exported: a
# coordinator keeps finished jobs until --max-jobs, and their series made every scrape of
# a long-lived one large and slow (about 32 series a job).
FINISHED_SHOWN = 600.0


def _shown(job, now: float, counted: float) -> bool:
    """Whether ``job`` is exported: not finished (see FINISHED_SHOWN) longer than that ago,
    counted from its last process heard from or its last event counted (``counted``: a
    process declared dead for silence was last heard heartbeat_timeout s before its death
    was counted, and with a timeout of 600 s or more its death was never exported)."""
    if job.pending or not job.processes or any(p.alive for p in job.processes.values()):
        return True
    return now - max(counted, max(p.last_seen for p in job.processes.values())) < FINISHED_SHOWN


class Metrics:
    """The coordinator's event-fed metrics; :meth:`render` adds the gauges read from the core."""

    def __init__(self) -> None:
        self.round_wait = Histogram(WAIT_BUCKETS)
        self.rounds_failed: dict[tuple[str, str], int] = {}  # (job, code) -> rounds
        self.process_events: dict[tuple[str, str], int] = {}  # (job, one of PROCESS_EVENTS) -> processes
        self.rpcs: dict[tuple[str, str, str], int] = {}  # (service, method, code) -> calls
        self._counted: dict[str, float] = {}  # job -> when its last failed round or process event was counted

    def round_completed(self, job: str, waited: float) -> None:
        self.round_wait.observe(((JOB_LABEL, job),), max(0.0, waited))

    def round_failed(self, job: str, code: str, now: float) -> None:
        self.rounds_failed[(job, code)] = self.rounds_failed.get((job, code), 0) + 1
        self._counted[job] = now

    def process_event(self, job: str, event: str, now: float) -> None:
        self.process_events[(job, event)] = self.process_events.get((job, event), 0) + 1
        self._counted[job] = now

    def forget(self, job: str) -> None:
        """A job the coordinator dropped: its series end."""
        self.rounds_failed = {key: n for key, n in self.rounds_failed.items() if key[0] != job}
        self.process_events = {key: n for key, n in self.process_events.items() if key[0] != job}
        self._counted.pop(job, None)
        self.round_wait.forget(((JOB_LABEL, job),))

    def rpc_handled(self, service: str, method: str, code: str) -> None:
        key = (service, method, code)
        self.rpcs[key] = self.rpcs.get(key, 0) + 1

    def render(self, core, now: float) -> str:
        """The text exposition: live gauges of ``core`` at ``now`` plus the counters."""
        def family(name: str, kind: str, help: str) -> Family:
            made = Family(f"pjrt_rendezvous_{name}", kind, help)
            families.append(made)
            return made

        families: list[Family] = []
        family("build_info", "gauge", "Always 1; the version label is the coordinator's build (client/_version.py).").add(
            {"version": build()}, 1
        )
        expected = family("participants_expected", "gauge", "World size of the job (0 until known).")
        registered = family("participants_registered", "gauge", "Ordinals registered in the job.")
        processes = family(
            "processes", "gauge", "Registered processes of the job by state (alive; left: closed its client; dead)."
        )
        generation = family(
            "job_generation", "gauge", "Generation of the job; grows at each restart of a process and each new run."
        )
        completed = family(
            "rounds_completed_total",
            "counter",
            "Rendezvous rounds completed in the job, restored with the state file (the other counters start "
            "again at 0 when the coordinator does).",
        )
        failed = family(
            "rounds_failed_total", "counter", "Rendezvous rounds failed since the coordinator started, by gRPC status code."
        )
        events = family(
            "process_events_total",
            "counter",
            "Processes of the job declared dead, gone (closed their client) or replaced by a restart, since the "
            "coordinator started, by event.",
        )
        pending = family("rounds_pending", "gauge", "Rendezvous rounds waiting for members.")
        oldest = family(
            "round_oldest_pending_age_seconds", "gauge", "Seconds the oldest pending round has waited (0 when none)."
        )
        keys = family("kv_keys", "gauge", "Keys in the job's key-value store.")
        wait = family(
            "round_wait_seconds",
            "histogram",
            "Seconds from a round's first arrival to its completion, for rounds completed since the coordinator started.",
        )
        rpcs = family("rpcs_total", "counter", "RPCs handled (calls on a Session stream under their own method), by service, method and gRPC status code.")

        shown = {name for name, job in core.jobs.items() if _shown(job, now, self._counted.get(name, -math.inf))}
        failures = dict.fromkeys(((name, code) for name in shown for code in FAILURE_CODES), 0)
        failures.update(self.rounds_failed)  # every job's usual codes from 0: rate() sees the first
        for name in sorted(shown):
            job = core.jobs[name]
            labels = {JOB_LABEL: name}
            expected.add(labels, job.world_size or 0)
            registered.add(labels, len(job.members))
            alive = sum(1 for p in job.processes.values() if p.alive)
            left = sum(1 for p in job.processes.values() if p.left)
            processes.add({**labels, "state": "alive"}, alive)
            processes.add({**labels, "state": "left"}, left)
            processes.add({**labels, "state": "dead"}, len(job.processes) - alive - left)
            generation.add(labels, job.generation)
            completed.add(labels, job.rounds_completed)
            pending.add(labels, len(job.pending))
            started = min((r.started for r in job.pending.values()), default=None)
            oldest.add(labels, 0.0 if started is None else max(0.0, now - started))
            keys.add(labels, len(job.kv))
        for (job_name, code), count in sorted(failures.items()):
            if job_name in shown:
                failed.add({JOB_LABEL: job_name, "code": code}, count)
        happened = dict.fromkeys(((name, event) for name in shown for event in PROCESS_EVENTS), 0)
        happened.update(self.process_events)
        for (job_name, event), count in sorted(happened.items()):
            if job_name in shown:
                events.add({JOB_LABEL: job_name, "event": event}, count)
        self.round_wait.fill(wait, lambda labels: dict(labels)[JOB_LABEL] in shown)
        for (service, method, code), count in sorted(self.rpcs.items()):
            rpcs.add({"service": service, "method": method, "code": code}, count)
        return exposition(families)


def _split_method(full: str) -> tuple[str, str]:
    service, _, method = full.lstrip("/").rpartition("/")
    return service, method


def _code_name(context, default: grpc.StatusCode) -> str:
    try:
        code = context.code()
    except Exception:  # pragma: no cover - defensive: never let counting break a call
        code = None
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # some grpc versions report the numeric code
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), default.name)
    return default.name


class RpcInterceptor(grpc.aio.ServerInterceptor):
    """Counts every handled RPC by service, method and final status code.

    Put it first among the interceptors so refusals by later ones (the token check) are
    counted too. Calls to methods the server does not have count as ``method="(unknown)"``
    (the method name a caller sends is not trusted as a label value).
    """

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            self._metrics.rpc_handled("(unknown)", "(unknown)", grpc.StatusCode.UNIMPLEMENTED.name)
            return None
        service, method = _split_method(details.method)
        record = self._metrics.rpc_handled

        def finished(context, exc: BaseException | None) -> None:
            if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                code = grpc.StatusCode.CANCELLED.name
            elif exc is not None and not isinstance(exc, grpc.aio.AbortError):
                code = _code_name(context, grpc.StatusCode.UNKNOWN)
            else:
                code = _code_name(context, grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN)
            record(service, method, code)

        def wrap(behavior):
            if behavior is None:
                return None
            if inspect.isasyncgenfunction(behavior):

                async def streaming(request, context):
                    try:
                        async for item in behavior(request, context):
                            yield item
                    except BaseException as exc:
                        finished(context, exc)
                        raise
                    finished(context, None)

                return streaming

            async def unary(request, context):
                try:
                    result = behavior(request, context)
                    if inspect.isawaitable(result):
                        result = await result
                except BaseException as exc:
                    finished(context, exc)
                    raise
                finished(context, None)
                return result

            return unary

        if handler.unary_unary:
            make, behavior = grpc.unary_unary_rpc_method_handler, handler.unary_unary
        elif handler.unary_stream:
            make, behavior = grpc.unary_stream_rpc_method_handler, handler.unary_stream
        elif handler.stream_unary:
            make, behavior = grpc.stream_unary_rpc_method_handler, handler.stream_unary
        else:
            make, behavior = grpc.stream_stream_rpc_method_handler, handler.stream_stream
        return make(
            wrap(behavior),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


_MAX_REQUEST_HEAD = 16 * 1024
_READ_TIMEOUT = 10.0  # for an answer to be read
_HEAD_TIMEOUT = 3.0  # for a request to come (a scraper sends it at once)
# Connections served at once: the port takes no token, and each connection holds one of the
# open files the clients' ports need too. Past this, a new one is closed at once.
_MAX_CONNECTIONS = 64


async def _respond(
    writer: asyncio.StreamWriter, status: str, body: bytes, content_type: str, head_only: bool, extra: str = ""
) -> None:
    writer.write(
        (
            f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}"
            "Connection: close\r\n\r\n"
        ).encode("ascii")
        + (b"" if head_only else body)
    )
    await asyncio.wait_for(writer.drain(), _READ_TIMEOUT)  # (a scraper that does not read)


class HttpServer:
    """What :func:`start_http_server` returns: its listening ``sockets``, and :meth:`close`."""

    def __init__(self, listener: Listener, transports: set[asyncio.BaseTransport]) -> None:
        self._listener = listener
        self._transports = transports

    @property
    def sockets(self) -> list[socket.socket]:
        return self._listener.sockets

    def close(self) -> None:
        """Stops listening and drops the connections still open: a scraper that does not
        read its answer must not hold the coordinator's stop (as asyncio's ``wait_closed``
        does from Python 3.12)."""
        self._listener.close()
        for transport in list(self._transports):
            transport.abort()


async def start_http_server(render: Callable[[], str], host: str, port: int) -> HttpServer:
    """Serves ``render()`` at ``GET /metrics`` on ``host:port`` (0 picks a free port).

    One request per connection (``Connection: close``), at most ``_MAX_CONNECTIONS`` at
    once, its request within ``_HEAD_TIMEOUT``; ``HEAD`` works, other methods get
    405 and other paths 404. ``render`` runs on the event loop. Raises OSError naming the
    port and ``--metrics-host, --metrics-port`` when it cannot listen.
    """
    transports: set[asyncio.BaseTransport] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(transports) >= _MAX_CONNECTIONS:
            writer.transport.abort()
            return
        transports.add(writer.transport)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _HEAD_TIMEOUT)
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            parts = request_line.split()
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                await _respond(writer, "400 Bad Request", b"bad request\n", "text/plain", False)
                return
            method, target = parts[0], parts[1].split("?", 1)[0]
            head_only = method == "HEAD"
            if method not in ("GET", "HEAD"):
                await _respond(writer, "405 Method Not Allowed", b"only GET and HEAD\n", "text/plain", False, "Allow: GET, HEAD\r\n")
            elif target == "/metrics":
                await _respond(writer, "200 OK", render().encode(), CONTENT_TYPE, head_only)
            elif target == "/":
                body = b"pjrt-rendezvous coordinator: metrics at /metrics\n"
                await _respond(writer, "200 OK", body, "text/plain; charset=utf-8", head_only)
            else:
                await _respond(writer, "404 Not Found", b"not found; try /metrics\n", "text/plain", head_only)
        except asyncio.TimeoutError:
            writer.transport.abort()  # nothing asked, or the answer not read, in time
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a client that went away or sent garbage gets nothing
        except Exception:  # pragma: no cover - a bug here must not take the coordinator down
            log.exception("metrics request failed", extra={"event": "internal_error"})
        finally:
            transports.discard(writer.transport)
            writer.close()

    def connection() -> asyncio.StreamReaderProtocol:
        return asyncio.StreamReaderProtocol(asyncio.StreamReader(limit=_MAX_REQUEST_HEAD), handle)

    listener = Listener(connection, "the metrics port", lambda: len(transports))
    await listener.start(host, port, "--metrics-host, --metrics-port")
    return HttpServer(listener, transports)
