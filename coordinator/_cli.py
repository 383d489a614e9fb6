"""The ``pjrt-rendezvous`` command: ``serve``, ``status``, ``health``, ``demo``.

``serve`` options take their defaults from ``PJRT_RENDEZVOUS_*`` variables (see
:data:`SERVE_VARIABLES`), so a container or a systemd ``EnvironmentFile`` can configure
the coordinator without a command line; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import pathlib
import re
import signal
import sys
import time
from typing import Any, Callable, Mapping

from pjrt_rendezvous.client._config import (
    NO_LIMIT_WORDS, check_token, comment_hint, job_problem, parse_seconds, quote_hint, read_secret, read_token_file, token_conflict,
    versions_differ,
)
from pjrt_rendezvous.client._demo import MAX_PROCESSES
from pjrt_rendezvous.client._errors import UsageError
from pjrt_rendezvous.client._topology import host_port
from pjrt_rendezvous.client._version import build

from ._core import MAX_ROUND_BYTES, MIN_HEARTBEAT_TIMEOUT, MIN_NAME_LENGTH, Limits, _ordinals_word, _plural, format_ranges
from ._monitor import DEFAULT_LATE_AFTER
from ._server import DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_JOB, DEFAULT_SESSION_PORT, listen_host

DEFAULT_HOST = "127.0.0.1"
DEFAULT_HEALTH_TIMEOUT = 5.0
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# serve option (argparse dest) -> the variable that sets its default.
SERVE_VARIABLES: dict[str, str] = {
    "host": "PJRT_RENDEZVOUS_HOST",
    "port": "PJRT_RENDEZVOUS_PORT",
    "world_size": "PJRT_RENDEZVOUS_WORLD_SIZE",
    "job": "PJRT_RENDEZVOUS_JOB",
    "heartbeat_timeout": "PJRT_RENDEZVOUS_HEARTBEAT_TIMEOUT",
    "state_file": "PJRT_RENDEZVOUS_STATE_FILE",
    "token_file": "PJRT_RENDEZVOUS_TOKEN_FILE",
    # The client's PJRT_RENDEZVOUS_TLS_* name the client's own certificate and the CA it
    # trusts; the server's files are other files, so they have other names.
    "tls_cert": "PJRT_RENDEZVOUS_SERVER_TLS_CERT",
    "tls_key": "PJRT_RENDEZVOUS_SERVER_TLS_KEY",
    "tls_ca": "PJRT_RENDEZVOUS_SERVER_TLS_CA",
    "grace": "PJRT_RENDEZVOUS_GRACE",
    "session_port": "PJRT_RENDEZVOUS_SESSION_PORT",
    "metrics_port": "PJRT_RENDEZVOUS_METRICS_PORT",
    "metrics_host": "PJRT_RENDEZVOUS_METRICS_HOST",
    "late_after": "PJRT_RENDEZVOUS_LATE_AFTER",
    "log_level": "PJRT_RENDEZVOUS_LOG_LEVEL",
    "log_format": "PJRT_RENDEZVOUS_LOG_FORMAT",
    **{f.name: f"PJRT_RENDEZVOUS_{f.name.upper()}" for f in dataclasses.fields(Limits)},
}
# Read by serve besides SERVE_VARIABLES: the shared secret itself (as clients read it).
TOKEN_VARIABLE = "PJRT_RENDEZVOUS_TOKEN"
# Read by status and health: the name the coordinator's TLS certificate is issued for, when
# they connect to it by another name (127.0.0.1 in a container).
TLS_SERVER_NAME_VARIABLE = "PJRT_RENDEZVOUS_TLS_SERVER_NAME"
# The client settings (client/_config.py) status and health use: TLS, and the token (status
# only: health checks are exempt from it). The others (timeouts, job, fan-in...) they do not
# use, so a malformed one must not fail them.
CLIENT_TLS_VARIABLES = ("PJRT_RENDEZVOUS_TLS_CA", "PJRT_RENDEZVOUS_TLS_CERT", "PJRT_RENDEZVOUS_TLS_KEY")
CLIENT_TOKEN_VARIABLES = (TOKEN_VARIABLE, SERVE_VARIABLES["token_file"])


def known_variables() -> set[str]:
    """Every PJRT_RENDEZVOUS_* variable the package reads: serve and clients warn of any
    other in their environment (a misspelt state file variable was ignored without a word,
    and the restart after lost what it was to keep)."""
    from pjrt_rendezvous.client._config import _VARIABLES, LAUNCH_VARIABLE, TOPOLOGY_VARIABLES

    return {
        *SERVE_VARIABLES.values(), TOKEN_VARIABLE, TLS_SERVER_NAME_VARIABLE, *_VARIABLES.values(), *TOPOLOGY_VARIABLES,
        LAUNCH_VARIABLE,
    }


def unknown_variables(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """The ``PJRT_RENDEZVOUS_*`` variables of ``env`` nothing reads, each with its warning
    (naming the known one it resembles): serve's and every client's."""
    import difflib

    known = known_variables()
    prefix = "PJRT_RENDEZVOUS_"
    unknown = []
    for name in sorted(n for n in env if n.startswith(prefix) and n not in known):
        close = difflib.get_close_matches(name.removeprefix(prefix), sorted(k.removeprefix(prefix) for k in known), n=1, cutoff=0.75)
        if re.fullmatch(r"PJRT_RENDEZVOUS_(SERVICE_[A-Z_]+|PORT_\d+_[A-Z_]+)", name):
            hint = " (a Kubernetes service link: enableServiceLinks: false in the pod's spec)"
        else:
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
        unknown.append((name, f"{name} is not a variable pjrt-rendezvous reads{hint}: ignored"))
    return unknown


def _warn_of_variables(args, env: Mapping[str, str]) -> None:
    """Warns of a ``PJRT_RENDEZVOUS_*`` variable nothing reads, and of a client's TLS
    variable where serve has no TLS of its own."""
    log = logging.getLogger("pjrt_rendezvous.coordinator")
    for name, warning in unknown_variables(env):
        log.warning("%s", warning, extra={"event": "setting_ignored", "variable": name})
    if args.tls_cert is None:
        for name in sorted(n for n in CLIENT_TLS_VARIABLES if env.get(n)):
            server = name.replace("PJRT_RENDEZVOUS_", "PJRT_RENDEZVOUS_SERVER_")
            log.warning(
                "%s names a client's TLS file, which serve does not read: its own is %s (or --%s); serving without TLS",
                name, server, server.removeprefix("PJRT_RENDEZVOUS_SERVER_").lower().replace("_", "-"),
                extra={"event": "setting_ignored", "variable": name},
            )


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        hint = ""
        if text.strip().startswith("tcp://"):  # what Kubernetes sets for a Service named pjrt-rendezvous
            hint = " (a Kubernetes service link? set enableServiceLinks: false in the pod: deploy/kubernetes/README.md)"
        raise argparse.ArgumentTypeError(f"port must be an integer, got {text!r}{hint}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {port}")
    return port


def _session_port(text: str) -> int | str | None:
    word = text.strip().lower()
    if word in ("off", "auto"):
        return None if word == "off" else word
    try:
        return _port(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, auto or off") from None


def _seconds(text: str) -> float | None:
    try:
        value = parse_seconds(text)  # as the client reads its timeouts
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value is None and text.strip().lower() not in NO_LIMIT_WORDS or value is not None and value > _MAX_SECONDS:
        # (parse_seconds reads an infinite number, 1e400 too, as no limit: only the words may mean that)
        raise argparse.ArgumentTypeError(f"must be at most {_MAX_SECONDS:g} s (about 31 years) or 'none', got {text}")
    return value


def _heartbeat_seconds(text: str) -> float | None:
    try:
        number = float(text)
    except ValueError:
        number = math.nan  # (a word: 'none', a unit, or not a number, _seconds says)
    value = number if number < MIN_HEARTBEAT_TIMEOUT else _seconds(text)  # (-5 is told the minimum, not "> 0")
    if value is not None and value < MIN_HEARTBEAT_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"must be at least {MIN_HEARTBEAT_TIMEOUT:g} s (or 'none'), got {text}: clients heartbeat at a "
            "third of it, and shorter declares a process dead as it registers"
        )
    return value


def _path(text: str) -> pathlib.Path:
    if not text.strip():  # (pathlib takes "" for ".", this folder)
        raise argparse.ArgumentTypeError("must not be empty")
    return pathlib.Path(text)


# The longest a command waits or a drain lasts: gRPC's deadlines end about 292 years on, and
# one past it failed at once as a timeout.
_MAX_SECONDS = 1e9


def _seconds_within(text: str, *, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (0 < value if positive else 0 <= value) or value == math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds {'>' if positive else '>='} 0, got {text}")
    if value > _MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be at most {_MAX_SECONDS:g} s (about 31 years), got {text}")
    return value


def _positive_seconds(text: str) -> float:
    return _seconds_within(text, positive=True)


def _non_negative_seconds(text: str) -> float:
    return _seconds_within(text, positive=False)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.upper()


def _log_format(text: str) -> str:
    if text.lower() not in ("text", "json"):
        raise argparse.ArgumentTypeError(f"must be 'text' or 'json', got {text!r}")
    return text.lower()


def _host(text: str) -> str:
    try:
        return listen_host(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _job(text: str) -> str:
    """A job name as clients accept it (client/_config.py's Settings)."""
    problem = job_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}, which clients refuse in a job name")
    return text


def _variable(env: Mapping[str, str], dest: str, convert: Callable[[str], Any], default: Any) -> Any:
    """Serve option ``dest`` as its variable in ``env`` sets it (``default`` when unset or
    empty).

    Raises:
        ValueError: the variable cannot be read, named with its value.
    """
    variable = SERVE_VARIABLES[dest]
    text = env.get(variable, "")
    if text == "":
        return default
    if comment_hint(text):  # (a path or job name took it in: files and a job named with it)
        raise ValueError(f"{variable}={text!r} holds a blank followed by '#'{comment_hint(text)}")
    try:
        return convert(text)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        hint = comment_hint(text) or ("" if quote_hint(text) in str(exc) else quote_hint(text))
        raise ValueError(f"{variable}={text!r}: {exc}{hint}") from None


class _Flag(argparse.Action):
    """Stores a serve option given on the command line, which wins over its variable: that
    variable is then neither used, nor refused when malformed, nor named in errors."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.bad_variables.pop(self.dest, None)
        namespace.sources[self.dest] = option_string


def _source(args, dest: str) -> str:
    """What set serve option ``dest``, for errors: its flag, or the variable it came from."""
    return args.sources.get(dest, "--" + dest.replace("_", "-"))


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    from pjrt_rendezvous.client._topology import DEFAULT_PORT

    parser = argparse.ArgumentParser(
        prog="pjrt-rendezvous",
        description="Coordinator and tools for PJRT thread-per-core rendezvous on TPU pod slices.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {build()}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve",
        help="run the coordinator (on host 0 of the pod slice)",
        description="Run the coordinator. Every option's default can be set by the variable shown "
        "in brackets; a flag on the command line wins.",
        epilog="Exit codes: 0 stopped by a signal; 2 settings refused (a malformed value, or values "
        "that contradict each other: starting again cannot help); 1 anything else (a port in use, "
        "a file or folder that is not there or cannot be read, a state file that cannot be used or "
        "written, a failure while serving).",
    )

    # A bad serve variable is reported by `serve` only (unless its flag is given, see _Flag):
    # `health` (the container's probe), `status` and `demo` must keep working in the same
    # environment. dest -> why its variable cannot be read; dest -> the variable it came from.
    bad_variables: dict[str, str] = {}
    sources: dict[str, str] = {}
    serve.set_defaults(bad_variables=bad_variables, sources=sources)

    def option(name: str, convert: Callable[[str], Any], default: Any, help: str, **kwargs) -> None:
        dest = name.lstrip("-").replace("-", "_")
        variable = SERVE_VARIABLES[dest]
        if env.get(variable, "") != "":
            sources[dest] = variable
        try:
            default = _variable(env, dest, convert, default)
        except ValueError as exc:
            bad_variables[dest] = str(exc)
        metavar = {
            _port: "PORT",
            _session_port: "{PORT,auto,off}",
            _positive: "N",
            _seconds: "SECONDS",
            _non_negative_seconds: "SECONDS",
            _heartbeat_seconds: "SECONDS",
            _path: "PATH",
            _host: "HOST",
            _log_level: "{" + ",".join(LOG_LEVELS) + "}",
            _log_format: "{text,json}",
        }.get(convert)
        serve.add_argument(
            name, action=_Flag, type=convert, default=default, metavar=metavar, help=f"{help} [{variable}]", **kwargs
        )

    option(
        "--host",
        _host,
        DEFAULT_HOST,
        f"address to listen on (default {DEFAULT_HOST}; 0.0.0.0 so other TPU hosts can connect)",
    )
    option("--port", _port, DEFAULT_PORT, f"port (default {DEFAULT_PORT}; 0 picks a free one)")
    option(
        "--world-size",
        _positive,
        None,
        "fix the world size of --job up front (default: the first registration fixes it)",
    )
    option("--job", _job, DEFAULT_JOB, f"the job --world-size applies to (default {DEFAULT_JOB!r})")
    option(
        "--heartbeat-timeout",
        _heartbeat_seconds,
        DEFAULT_HEARTBEAT_TIMEOUT,
        f"declare a process dead after this many seconds without a heartbeat (default "
        f"{DEFAULT_HEARTBEAT_TIMEOUT:g}; at least {MIN_HEARTBEAT_TIMEOUT:g}; 'none' disables)",
    )
    option("--state-file", _path, None, "keep ranks, job config, finished rounds and keys here across restarts")
    option(
        "--token-file",
        _path,
        None,
        f"file holding the shared secret every client must send (or the secret itself in {TOKEN_VARIABLE})",
    )
    option("--tls-cert", _path, None, "PEM server certificate (enables TLS)")
    option("--tls-key", _path, None, "PEM private key of --tls-cert")
    option("--tls-ca", _path, None, "PEM CA that must sign client certificates (mutual TLS)")
    option("--grace", _non_negative_seconds, 5.0, "seconds in-flight calls get on shutdown (default 5)")
    option(
        "--session-port",
        _session_port,
        "auto",
        f"also serve clients' calls as length-prefixed messages on plain TCP on this port, "
        f"cheaper than gRPC (default 'auto': {DEFAULT_SESSION_PORT} ({DEFAULT_SESSION_PORT + 1} when --port is {DEFAULT_SESSION_PORT}; "
        "held by something else, a warning and none), or a free one with --port 0; "
        "0 picks a free one; 'off' none; none with TLS)",
    )
    option(
        "--metrics-port",
        _port,
        None,
        "serve Prometheus metrics over HTTP at /metrics on this port (default: none; 0 picks a free one)",
    )
    option("--metrics-host", _host, None, "address the metrics endpoint listens on (default: the same as --host)")
    option(
        "--late-after",
        _seconds,
        DEFAULT_LATE_AFTER,
        f"log a round still waiting (again each time its wait doubles), or a world still incomplete, after this many "
        f"seconds, naming who is missing (default "
        f"{DEFAULT_LATE_AFTER:g}; 'none' never)",
    )
    for field in dataclasses.fields(Limits):
        bound = {
            "max_name_length": f"; at least {MIN_NAME_LENGTH}, as it bounds client ids too",
            "max_round_bytes": f"; at most {MAX_ROUND_BYTES}: every member's answer holds the round's payloads",
        }.get(field.name, "")
        option(f"--{field.name.replace('_', '-')}", _positive, field.default, f"limit (default {field.default}{bound})")
    option("--log-level", _log_level, "INFO", f"one of {', '.join(LOG_LEVELS)} (default INFO)")
    option("--log-format", _log_format, "text", "text lines or JSON lines on stderr (default text)")

    status = commands.add_parser(
        "status",
        help="show a job's hosts, processes and pending rounds",
        description="Show who registered and what every pending round waits for. The coordinator is "
        "found as clients find it (PJRT_RENDEZVOUS_ADDRESS, TPU worker 0, localhost), or where serve "
        "listens when serve's PJRT_RENDEZVOUS_PORT is set (as in the image); token and TLS come from "
        "the client variables (PJRT_RENDEZVOUS_TOKEN, PJRT_RENDEZVOUS_TLS_CA, ...). Exit code 0 with an "
        "answer, 1 without one (unreachable, refused, an unknown --job), 2 for a bad argument or setting.",
    )
    status.add_argument(
        "--address",
        help="coordinator host:port (default: PJRT_RENDEZVOUS_ADDRESS, else where serve listens when "
        "PJRT_RENDEZVOUS_PORT is set, else as a client finds it: TPU worker 0, else localhost)",
    )
    status.add_argument("--job", default="", help="one job (default: every job)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=DEFAULT_HEALTH_TIMEOUT,
        help=f"seconds to wait for the answer (default {DEFAULT_HEALTH_TIMEOUT:g})",
    )
    tls_server_name = dict(
        default=env.get(TLS_SERVER_NAME_VARIABLE) or None,
        help=f"name the server certificate must carry when it differs from --address's host [{TLS_SERVER_NAME_VARIABLE}]",
    )
    status.add_argument("--tls-server-name", **tls_server_name)

    health = commands.add_parser(
        "health",
        help="check the coordinator's gRPC health service; exit code 0 when serving, 1 if not, 2 for a bad setting",
        description="Ask the standard gRPC health service (grpc.health.v1.Health) of a coordinator. "
        "Exit code 0 when it is SERVING, 1 otherwise (unreachable, NOT_SERVING, timeout), 2 for a bad "
        "argument or setting (a malformed address or port, a TLS file that cannot be read). TLS comes "
        "from the client variables (PJRT_RENDEZVOUS_TLS_CA, ...); health checks need no token, and it "
        "sends none.",
    )
    health.add_argument(
        "--address",
        help=f"coordinator host:port (default: this machine, at PJRT_RENDEZVOUS_HOST and "
        f"PJRT_RENDEZVOUS_PORT as serve reads them, else 127.0.0.1:{DEFAULT_PORT})",
    )
    health.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=DEFAULT_HEALTH_TIMEOUT,
        help=f"seconds to wait for the answer (default {DEFAULT_HEALTH_TIMEOUT:g})",
    )
    health.add_argument("--wait", action="store_true", help="wait up to --timeout for the coordinator to be serving")
    health.add_argument("--service", default="", help="service to ask about (default '': the whole server)")
    health.add_argument("--tls-server-name", **tls_server_name)

    demo = commands.add_parser("demo", help="run a coordinator and a simulated pod on this machine")
    demo.add_argument("--processes", type=_positive, default=4, help=f"simulated chips/processes (default 4; at most {MAX_PROCESSES}, a multiple of --hosts)")
    demo.add_argument(
        "--threads", type=_positive, help="threads (cores) per process (default: by --accelerator, 2 on v3)"
    )
    demo.add_argument("--hosts", type=_positive, default=1, help="simulated TPU hosts (default 1)")
    demo.add_argument(
        "--accelerator", default="v3-8",
        help="TPU_ACCELERATOR_TYPE the processes get (default v3-8): it sets their threads (cores per chip); the "
        "shape is --hosts and --processes",
    )
    demo.add_argument(
        "--timeout", type=_positive_seconds, default=120.0, help="seconds for the whole run before giving up (default 120)"
    )
    return parser


# -- serve ----------------------------------------------------------------------------------


def session_port(args) -> int | None:
    """The session port ``serve`` opens: none with TLS; "auto" is 7482 (7483 when the gRPC
    port is 7482), or a free one when the gRPC port is a free one too (tests, benchmarks)."""
    if args.tls_cert:
        if args.session_port not in ("auto", None):
            logging.getLogger("pjrt_rendezvous.coordinator").warning(
                "no session port with TLS (it is plain TCP): %s=%s is ignored; clients use gRPC's stream",
                _source(args, "session_port"), args.session_port, extra={"event": "setting_ignored"},
            )
        return None
    if args.session_port == "auto":  # (7483 when --port takes 7482)
        return 0 if args.port == 0 else DEFAULT_SESSION_PORT + (args.port == DEFAULT_SESSION_PORT)
    return args.session_port


def _json_line(level: int, message: str, **fields) -> str:
    """A line ``serve`` prints itself (not through the log) as a JSON line shaped like the
    log's: ``time``, ``level``, ``logger``, ``message`` and ``fields``."""
    from ._logging import JsonFormatter

    record = logging.makeLogRecord(
        {"name": "pjrt_rendezvous.coordinator", "levelno": level, "levelname": logging.getLevelName(level), "msg": message}
    )
    record.__dict__.update(fields)
    return JsonFormatter().format(record)


def announce(log_format: str, message: str, service: str, address: str, port: int, **fields) -> None:
    """Prints one of the lines ``serve`` starts with on stdout: ``message``, or under
    ``--log-format json`` a JSON line shaped like the log's with ``event`` ``"address"``,
    ``service`` (``grpc``, ``session`` or ``metrics``), ``address``, ``port`` and ``fields``,
    so that all its output is JSON."""
    if log_format == "json":
        message = _json_line(logging.INFO, message, event="address", service=service, address=address, port=port, **fields)
    print(message, flush=True)


def _failed(log_format: str, message: str) -> None:
    """Says on stderr why ``serve`` does not run: under ``--log-format json`` one more JSON
    line (``event`` ``"failed"``) for the log collector, else ``message``."""
    print(_json_line(logging.ERROR, message, event="failed") if log_format == "json" else message, file=sys.stderr)


def _token(args, env: Mapping[str, str]) -> str | None:
    """The shared secret ``serve`` requires: ``PJRT_RENDEZVOUS_TOKEN``, or the file
    ``--token-file`` names (both given, they must agree); None without either. Read and
    checked as the clients read and check theirs: gRPC sends it in a header, which takes
    printable ASCII alone, so anything else would fail every call as "Invalid metadata".

    Raises:
        UsageError: the file cannot be read, or a token is not printable ASCII; naming
            where it came from.
        ValueError: the two disagree.
    """
    token = check_token(env[TOKEN_VARIABLE].strip(), TOKEN_VARIABLE) if env.get(TOKEN_VARIABLE) else None
    if args.token_file is not None:
        where = _source(args, "token_file")
        from_file = check_token(
            read_token_file(str(args.token_file), where, "pjrt_rendezvous.coordinator"), f"the file {args.token_file} ({where})"
        )
        if token is not None and token != from_file:
            raise ValueError(token_conflict(TOKEN_VARIABLE, f"the token file ({where})"))
        token = from_file
    return token


def _read(args, dest: str) -> bytes | None:
    """The contents of the file serve option ``dest`` names (None without one)."""
    path = getattr(args, dest)
    if path is None:
        return None
    try:
        if dest == "tls_key":
            return read_secret(str(path), "TLS key", _source(args, dest), "pjrt_rendezvous.coordinator")
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path} ({_source(args, dest)}): {exc.strerror or exc}") from exc


def _check_tls_files(args) -> None:
    """A certificate and key that are not a PEM pair, a certificate out of date, or a CA file
    without a certificate: refused as malformed settings (exit 2), before gRPC fails to
    listen with them (exit 1, restarted by the unit to fail again). A file that cannot be
    read is _read's to report."""
    import ssl

    from pjrt_rendezvous.client._config import certificate_out_of_date, tls_pair_problem

    problem = None if args.tls_cert is None or args.tls_key is None else tls_pair_problem(str(args.tls_cert), str(args.tls_key))
    if problem is not None:
        raise ValueError(
            f"the TLS certificate {args.tls_cert} (--tls-cert) and key {args.tls_key} (--tls-key) are not a PEM "
            f"certificate and its unencrypted private key: {problem}"
        )
    problem = None if args.tls_cert is None else certificate_out_of_date(str(args.tls_cert))
    if problem is not None:  # (every client would refuse it, each after retrying)
        raise ValueError(f"the TLS certificate {args.tls_cert} (--tls-cert) is refused by every client: {problem}; reissue it")
    if args.tls_ca is not None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cafile=str(args.tls_ca))
        except ssl.SSLError as exc:
            raise ValueError(f"the client CA {args.tls_ca} (--tls-ca) holds no PEM certificate: {exc.reason or exc}") from None
        except OSError:
            pass


def _serve(args, env: Mapping[str, str]) -> int:
    from . import _logging
    from ._core import CoreError
    from ._server import ServerOptions, serve_forever
    from ._state import StateFileError

    _logging.configure(args.log_level, args.log_format)

    def ready(running) -> None:
        # Where it listens, on stdout for whoever started it (scripts, tests: --port 0).
        address = host_port(args.host, running.port)
        announce(args.log_format, f"pjrt-rendezvous coordinator listening on {address}", "grpc", address, running.port)
        if running.session_port is not None:
            address = host_port(args.host, running.session_port)
            announce(args.log_format, f"pjrt-rendezvous session port {address}", "session", address, running.session_port)
        if running.metrics_port is not None:
            address = host_port(args.host if args.metrics_host is None else args.metrics_host, running.metrics_port)
            announce(
                args.log_format, f"pjrt-rendezvous metrics on http://{address}/metrics", "metrics", address,
                running.metrics_port, url=f"http://{address}/metrics",
            )

    _warn_of_variables(args, env)
    if args.job != DEFAULT_JOB and args.world_size is None and args.sources.get("job") == "--job":
        # (the flag only: PJRT_RENDEZVOUS_JOB may be there for clients, in an environment shared)
        logging.getLogger("pjrt_rendezvous.coordinator").warning(
            "--job %r does nothing without %s: it only names the job whose world size that fixes "
            "(clients choose their job themselves)", args.job, _source(args, "world_size"),
            extra={"event": "setting_ignored"},
        )
    configured = False
    try:
        _check_tls_files(args)
        options = ServerOptions(
            host=args.host,
            port=args.port,
            world_size=args.world_size,
            job=args.job,
            limits=Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)}),
            heartbeat_timeout=args.heartbeat_timeout,
            state_file=args.state_file,
            token=_token(args, env),
            tls_cert=_read(args, "tls_cert"),
            tls_key=_read(args, "tls_key"),
            tls_ca=_read(args, "tls_ca"),
            grace=args.grace,
            session_port=session_port(args),
            session_port_required=args.session_port != "auto" or args.port == 0,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            late_after=args.late_after,
        )
        configured = True
        serve_forever(options, on_ready=ready)
    except (CoreError, StateFileError, RuntimeError, OSError, ValueError) as exc:
        why = str(exc)
        if isinstance(exc, ValueError):  # ServerOptions names its flags: name the variables that set them
            why = re.sub(r"--[a-z]+(?:-[a-z]+)*", lambda flag: _source(args, flag[0][2:].replace("-", "_")), why)
        _failed(args.log_format, f"pjrt-rendezvous serve: {why}")
        # 2 as for a malformed flag (the unit does not restart on it): settings refused before
        # serving; not a file or folder that cannot be read (it may be there on the next try:
        # a secret or volume mounted late), nor what fails once it runs
        refused = not configured and isinstance(exc, ValueError) and not isinstance(exc.__cause__, OSError)
        return 2 if refused else 1
    return 0


# -- health ---------------------------------------------------------------------------------


def local_address(env: Mapping[str, str]) -> str:
    """Where ``serve`` run with ``env`` can be reached from this machine: its
    ``PJRT_RENDEZVOUS_HOST`` and ``_PORT`` read as ``serve`` reads them.

    Raises:
        ValueError: a variable ``serve`` would refuse, or port 0 (a free port: which one,
            only ``serve`` knows); naming the variable.
    """
    from pjrt_rendezvous.client._topology import DEFAULT_PORT

    host = _variable(env, "host", _host, "")
    port = _variable(env, "port", _port, DEFAULT_PORT)
    if port == 0:
        raise ValueError(f"{SERVE_VARIABLES['port']}=0 makes serve pick a free port; name it with --address")
    return host_port("127.0.0.1" if host in ("", "0.0.0.0", "::") else host, port)


def _dial(
    command: str, address: str, address_source: str, env: Mapping[str, str], tls_server_name: str | None, *, token: bool
):
    """A channel to ``address`` (normalized like the clients' addresses: default port, IPv6
    brackets; ``address_source`` names what gave it, for errors) with the client variables'
    TLS, and with ``token`` the token's metadata; or prints why not and returns None."""
    import grpc

    from pjrt_rendezvous.client._config import Settings
    from pjrt_rendezvous.client._errors import RendezvousError
    from pjrt_rendezvous.client._topology import normalize_address

    try:
        address = normalize_address(address, address_source)
        used = CLIENT_TLS_VARIABLES + (CLIENT_TOKEN_VARIABLES if token else ())
        settings = Settings.resolve({k: env[k] for k in used if k in env}, address=address)
        credentials = settings.credentials()
    except RendezvousError as exc:
        print(f"pjrt-rendezvous {command}: {exc}", file=sys.stderr)
        return None
    # (the answer of a large pod's status is over gRPC's default 4 MiB)
    # (and directly, as the client connects: not through http_proxy, https_proxy or grpc_proxy)
    options = [("grpc.max_receive_message_length", -1), ("grpc.enable_http_proxy", 0)]
    options += [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
    if credentials is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, credentials, options=options)
    metadata = (("authorization", f"Bearer {settings.token}"),) if settings.token else None
    return address, channel, metadata


RETRY_EVERY = 0.2  # seconds between a status or health call and the next while it waits


def _ask(call: Callable[[float], Any], timeout: float, again: Callable[[Any], bool]) -> Any:
    """``call(seconds left)``, again every RETRY_EVERY s while ``again(its answer or
    grpc.RpcError)`` and ``timeout`` allows; returns the last answer or error. The calls fail
    fast instead of waiting for the connection (``wait_for_ready``), which would end in
    DEADLINE_EXCEEDED and hide why it fails (refused, an unknown host, plaintext against
    TLS); a failed call names that."""
    import grpc

    deadline = time.monotonic() + timeout
    while True:
        try:
            outcome = call(max(0.001, deadline - time.monotonic()))
        except grpc.RpcError as exc:
            outcome = exc
        if not again(outcome) or time.monotonic() + RETRY_EVERY >= deadline:
            return outcome
        time.sleep(RETRY_EVERY)


def _rpc_failure(exc, timeout: float) -> str:
    """A failed call's status for ``health`` and ``status``, with the clients' TLS hint, or
    what no answer within ``timeout`` (--timeout) means."""
    import grpc

    from pjrt_rendezvous.client._errors import connection_hint

    details = exc.details() or "(no details)"
    hint = connection_hint(details) if exc.code() == grpc.StatusCode.UNAVAILABLE else ""
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # connected (else UNAVAILABLE), not answered
        hint = f" No answer within {timeout:g} s (--timeout): the coordinator, or the network to it, is frozen or overloaded."
    return f"{exc.code().name}: {details}{'.' if hint and not details.endswith('.') else ''}{hint}"


def _health(args, env: Mapping[str, str]) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address, address_source = args.address, "--address"
    if address is None:
        try:
            address, address_source = local_address(env), SERVE_VARIABLES["host"]
        except ValueError as exc:
            print(f"pjrt-rendezvous health: {exc}", file=sys.stderr)
            return 2
    # No token: health checks are exempt from it, so a probe does not depend on it.
    dialed = _dial("health", address, address_source, env, args.tls_server_name, token=False)
    if dialed is None:
        return 2
    address, channel, _ = dialed
    request = health_pb2.HealthCheckRequest(service=args.service)
    serving = health_pb2.HealthCheckResponse.SERVING
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = _ask(
            lambda timeout: stub.Check(request, timeout=timeout),
            args.timeout,
            lambda reply: args.wait and (isinstance(reply, grpc.RpcError) or reply.status != serving),
        )
    service = f" service {args.service!r}" if args.service else ""
    if not isinstance(reply, grpc.RpcError) and reply.status == serving:
        print(f"{address}{service}: SERVING")
        return 0
    if not isinstance(reply, grpc.RpcError):
        outcome = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    elif reply.code() == grpc.StatusCode.NOT_FOUND:  # (gRPC's health service says no more)
        outcome = "NOT_FOUND: the coordinator has no such service"
    else:
        outcome = _rpc_failure(reply, args.timeout)
    print(f"pjrt-rendezvous health: {address}{service}: {outcome}", file=sys.stderr)
    return 1


# -- status ---------------------------------------------------------------------------------


def _plain(message) -> dict:
    """A protobuf message as JSON-ready data: proto3 JSON field names, but 64-bit integers
    as numbers (the canonical mapping makes them strings) and every field present."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None:
            value = [_plain(v) for v in value] if _repeated(field) else _plain(value)
        elif _repeated(field):
            value = list(value)
        elif field.has_presence and not message.HasField(field.name):
            value = None
        out[field.json_name] = value
    return out


def _repeated(field) -> bool:
    is_repeated = getattr(field, "is_repeated", None)  # protobuf >= 5.28
    if is_repeated is not None:
        return bool(is_repeated)
    return field.label == field.LABEL_REPEATED  # pragma: no cover - older protobuf


def _natural(text: str) -> list:
    """Sort key putting host-2 before host-10."""
    return [int(part) if part.isdecimal() else part for part in re.split(r"(\d+)", text)]


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


def _pids(
    pids: list[int], dead: set[int] = frozenset(), left: set[int] = frozenset(), closed: set[int] = frozenset(),
    unheard: set[int] = frozenset(), limit: int = 4,
) -> str:
    """The first ``limit`` pids, the dead, then those whose connection closed, then those not
    heard from since a restart, then the departed first (a host of 8 processes hid its dead
    one behind "+4 more")."""
    marks = [(dead, "dead"), (closed, "connection closed"), (unheard, "not since the restart"), (left, "left")]
    pids = sorted(pids, key=lambda p: [p not in which for which, _ in marks])  # (stable: the given order within)
    shown = [next((f"{p} ({mark})" for which, mark in marks if p in which), str(p)) for p in pids[:limit]]
    if len(pids) > limit:
        shown.append(f"+{len(pids) - limit} more")
    return ", ".join(shown)


def _host_pids(host: dict) -> tuple[str, bool]:
    """A host's pids as :func:`_pids` marks them, and whether every one is unheard since a
    restart (their last seen counts from it: they may have been gone long before): then
    the host is marked as a whole, else each unheard pid (the whole host was marked, its
    heard processes too)."""
    unheard = set(host["unheardPids"])
    every = bool(unheard) and unheard >= set(host["pids"])
    closed, dead, left = set(host["closedPids"]), set(host["deadPids"]), set(host["leftPids"])
    return _pids(host["pids"], dead, left, closed, set() if every else unheard), every


# A pending round's missing ordinals in `status`, one line per host: this many hosts at most
# (a round of 512 hosts took 512 lines); and ordinals as ranges cut short past _RANGES_SHOWN
# characters (a strided group, every 8th ordinal of 512, widened every line of its table).
_HOSTS_SHOWN = 8
_RANGES_SHOWN = 40


def _ranges_cut(ordinals: list[int]) -> str:
    return format_ranges(ordinals, _RANGES_SHOWN)


def _where(missing_by_host: list[dict], refused: set[int]) -> list[str]:
    """Missing ordinals where they are, a host per line (of _HOSTS_SHOWN at most):
    ``missingByHost`` of :func:`summarize_job`; ``refused``: the ordinals of the tasks
    refused (the others of no process never registered)."""
    lines, more, nowhere = [], [], 0  # (nowhere: the lines of ordinals of no process)
    for m in missing_by_host:
        if m["host"] is None:  # (not a host: always said)
            turned_away = [o for o in m["ordinals"] if o in refused]
            never = [o for o in m["ordinals"] if o not in refused]
            said = ([f"{_ranges_cut(turned_away)} refused (below)"] if turned_away else []) + (
                [f"{_ranges_cut(never)} never registered"] if never else []
            )
            lines += said
            nowhere += len(said)
            continue
        if len(lines) - nowhere >= _HOSTS_SHOWN:
            more.append(m)
            continue
        pids, every = _host_pids(m)
        detail = [f"pid{'s' if len(m['pids']) != 1 else ''} {pids}"]
        if every:
            detail.append(f"not heard from since the coordinator restarted {_age(m['lastSeenAge'])} ago")
        elif m["lastSeenAge"] is not None:
            detail.append(f"last seen {_age(m['lastSeenAge'])} ago")
        lines.append(f"{_ranges_cut(m['ordinals'])} on {m['host']} ({', '.join(detail)})")
    if more:
        lines.append(
            f"and {_plural(sum(len(m['ordinals']) for m in more), 'ordinal')} on "
            f"{_plural(len(more), 'host')} more (status --json lists them)"
        )
    return lines


def _table(headers: list[str], rows: list[list], indent: str = "  ") -> list[str]:
    """Left-aligned columns; a cell may be a list of lines (the row then spans several)."""
    cells = [[c if isinstance(c, list) else [str(c)] for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, lines in enumerate(row):
            widths[i] = max([widths[i], *(len(line) for line in lines)])
    out = [indent + "  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for row in cells:
        for k in range(max(len(lines) for lines in row)):
            parts = [(lines[k] if k < len(lines) else "").ljust(w) for lines, w in zip(row, widths)]
            out.append(indent + "  ".join(parts).rstrip())
    return out


def _dead(participant) -> bool:
    """Declared dead (a process that closed its client has left: not alive, not dead)."""
    return not participant.alive and not participant.left


def _processes_cell(host: dict) -> str:
    """A host's process count, and of them the dead and departed: "2 (1 dead, 1 left)"."""
    gone = ", ".join(f"{host[k]} {k}" for k in ("dead", "left") if host[k])
    return f"{host['processes']}" + (f" ({gone})" if gone else "")


def _closed(participant) -> bool:
    """Alive, but its connection closed without a Leave (declared dead soon unless heard from)."""
    return participant.HasField("disconnected_age")


def summarize_job(job) -> dict:
    """What ``status`` shows of one ``JobStatus``: hosts, unregistered ordinals and, per
    pending round, the missing ordinals grouped by host."""
    by_ordinal = {p.ordinal: p for p in job.participants}
    hosts: dict[str, dict] = {}
    for p in job.participants:
        entry = hosts.setdefault(p.host, {"processes": {}, "ordinals": []})
        entry["ordinals"].append(p.ordinal)
        entry["processes"][p.incarnation] = p
    host_rows = []
    for host in sorted(hosts, key=_natural):
        entry = hosts[host]
        procs = sorted(entry["processes"].values(), key=lambda p: (p.task_id, p.pid))
        host_rows.append(
            {
                "host": host,
                "processes": len(procs),
                "dead": sum(1 for p in procs if _dead(p)),
                "left": sum(1 for p in procs if p.left),
                "pids": [p.pid for p in procs],
                "deadPids": [p.pid for p in procs if _dead(p)],
                "leftPids": [p.pid for p in procs if p.left],
                "closedPids": [p.pid for p in procs if _closed(p)],
                "unheardPids": [p.pid for p in procs if p.unheard_since_restart],
                "tasks": format_ranges(p.task_id for p in procs),
                "ordinals": sorted(entry["ordinals"]),  # (a list, as everywhere in --json; ranges: its text)
                "ranges": format_ranges(entry["ordinals"]),
                "endedOrdinals": [o for o in entry["ordinals"] if by_ordinal[o].ended],  # (replicas done, their process not)
                # Of its live processes while it has any: one that left long ago is not news.
                "lastSeenAge": max(p.last_seen_age for p in ([q for q in procs if q.alive] or procs)),
            }
        )
    not_registered = [o for o in range(job.world_size) if o not in by_ordinal]
    # An ordinal not registered whose task's process registered others (a thread not bound
    # yet) is that process's, as the coordinator's messages say: by task, the live one first.
    by_task: dict[int, object] = {}
    for p in sorted(job.participants, key=lambda p: p.alive):
        by_task[p.task_id] = p
    per_task = job.devices_per_task

    def owner(o: int):
        return by_ordinal.get(o) or (by_task.get(o // per_task) if per_task else None)

    def by_host(missing) -> list[dict]:
        groups: dict[str | None, list[int]] = {}
        for o in missing:
            p = owner(o)
            groups.setdefault(None if p is None else p.host, []).append(o)
        missing_by_host = []
        for host in sorted(groups, key=lambda h: min(groups[h])):
            ordinals = groups[host]
            procs = {p.incarnation: p for p in map(owner, ordinals) if p is not None}
            missing_by_host.append(
                {
                    "host": host,
                    "ordinals": ordinals,
                    "ranges": format_ranges(ordinals),
                    "pids": sorted(p.pid for p in procs.values()),
                    "deadPids": sorted(p.pid for p in procs.values() if _dead(p)),
                    "leftPids": sorted(p.pid for p in procs.values() if p.left),
                    "closedPids": sorted(p.pid for p in procs.values() if _closed(p)),
                    "unheardPids": sorted(p.pid for p in procs.values() if p.unheard_since_restart),
                    "lastSeenAge": max((p.last_seen_age for p in procs.values()), default=None),
                }
            )
        return missing_by_host

    rounds = []
    for r in job.pending_rounds:
        missing_by_host = by_host(r.missing)
        rounds.append(
            {
                "round": r.round,
                "group": "all" if not r.replicas else format_ranges(r.replicas),
                "tags": {t.tag: list(t.ordinals) for t in r.tags},
                "arrived": len(r.arrived),
                "expected": len(r.arrived) + len(r.missing),
                "ageSeconds": r.waiting_seconds,
                "missingByHost": missing_by_host,
                "missingSummary": r.missing_summary,
            }
        )
    return {
        "hosts": host_rows,
        "notRegistered": not_registered,
        "notRegisteredByHost": by_host(not_registered),
        "pendingRounds": rounds,
    }


def status_json(response, address: str) -> dict:
    """``status --json``: every field of the StatusResponse (``coordinatorVersion``, ``jobs``,
    ``unknownProcesses``; proto3 JSON names, numbers as numbers) plus the ``address`` asked and, per job,
    ``hosts``, ``notRegistered``, ``notRegisteredByHost`` and per pending round ``group``,
    ``expected`` and ``missingByHost``."""
    jobs = []
    for job in response.jobs:
        data = _plain(job)
        summary = summarize_job(job)
        data["hosts"] = summary["hosts"]
        data["notRegistered"] = summary["notRegistered"]
        data["notRegisteredByHost"] = summary["notRegisteredByHost"]
        for plain, derived in zip(data["pendingRounds"], summary["pendingRounds"]):
            plain["group"] = derived["group"]
            plain["expected"] = derived["expected"]
            plain["missingByHost"] = derived["missingByHost"]
        jobs.append(data)
    return {
        "address": address, "coordinatorVersion": response.coordinator_version, "jobs": jobs,
        "unknownProcesses": [_plain(u) for u in response.unknown_processes],
    }


_FINISHED_SHOWN = 3  # finished jobs shown in full by status; more are named on one line


def render_status(response, address: str, job: str = "") -> str:
    """The ``status`` table of every job in ``response`` (``job``: the one asked for)."""
    ours = response.coordinator_version
    coordinator = f"coordinator {address}" + (f" (pjrt-rendezvous {ours})" if ours else "")
    # (asked for one job, the count of the coordinator's is not known: "1 job" read as it)
    lines = [coordinator if job else f"{coordinator}: {_plural(len(response.jobs), 'job') if response.jobs else 'no jobs'}"]
    # A long-lived coordinator keeps up to --max-jobs finished runs: past a few, one line.
    finished = [
        j.job for j in response.jobs
        if j.participants and not j.pending_rounds and not j.refused and not any(p.alive for p in j.participants)
    ]
    strangers = {u.job: u for u in response.unknown_processes}
    folded = set(finished) - set(strangers) if len(finished) > _FINISHED_SHOWN else set()
    for job in response.jobs:
        if job.job in folded:
            continue
        summary = summarize_job(job)
        refused = {o for t in job.refused for o in t.ordinals}
        world = str(job.world_size) if job.world_size else "?"
        processes = {p.incarnation: p for p in job.participants}.values()
        gone = [  # (a finished or crashed job's ordinals stay registered)
            f"{n} {state}" for n, state in (
                (sum(1 for p in processes if p.left), "left"), (sum(1 for p in processes if _dead(p)), "dead")
            ) if n
        ]
        lines += [
            "",
            f"job {job.job!r}: {job.registered}/{world} ordinals registered, generation {job.generation}, "
            f"{_plural(job.rounds_completed, 'round')} completed, {_plural(job.kv_keys, 'key')}, "
            f"{_plural(len(job.pending_rounds), 'pending round')}"
            + (f"; of {_plural(len(processes), 'process')}, {' and '.join(gone)}" if gone else ""),
        ]
        others: dict[str, dict[str, str]] = {}  # a client version not the coordinator's -> its processes
        for p in job.participants:
            if versions_differ(p.client_version, ours):
                others.setdefault(p.client_version, {})[p.incarnation] = f"{p.host} pid {p.pid}"
        for version, processes in sorted(others.items()):
            named = sorted(processes.values())
            more = f" and {len(named) - 4} more" if len(named) > 4 else ""
            lines.append(f"  client version {version} (not the coordinator's): {', '.join(named[:4])}{more}")
        if summary["notRegistered"] and job.registered:
            ordinals = summary["notRegistered"]
            where = _where(summary["notRegisteredByHost"], refused)
            said = f" ({'; '.join(where)})" if where != [f"{_ranges_cut(ordinals)} never registered"] else ""
            lines.append(f"  not registered: ordinal{'s' if len(ordinals) > 1 else ''} {_ranges_cut(ordinals)}{said}")
        if summary["hosts"]:
            rows = [
                [
                    h["host"],
                    _processes_cell(h),
                    pids,
                    # (ended ordinals named as such: "(2 ended)" read as a count)
                    h["ranges"] + (f" ({_ordinals_word(h['endedOrdinals'])} ended)" if h["endedOrdinals"] else ""),
                    f"{_age(h['lastSeenAge'])} ago" + (" (not since the restart)" if every else ""),
                ]
                for h in summary["hosts"]
                for pids, every in [_host_pids(h)]
            ]
            lines += [""] + _table(["HOST", "PROCESSES", "PIDS", "ORDINALS", "LAST SEEN"], rows)
        if summary["pendingRounds"]:
            rows = []
            for r, pending in zip(summary["pendingRounds"], job.pending_rounds):
                tags = r["tags"]
                tag = (
                    repr(next(iter(tags)))
                    if len(tags) == 1
                    else ", ".join(f"{t!r} ({format_ranges(o)})" for t, o in tags.items())
                )
                missing = _where(r["missingByHost"], refused)
                group = _ranges_cut(list(pending.replicas)) if pending.replicas else "all"
                rows.append([r["round"], group, tag, f"{r['arrived']}/{r['expected']}", _age(r["ageSeconds"]), missing])
            lines += [""] + _table(["ROUND", "GROUP", "TAG", "ARRIVED", "AGE", "MISSING"], rows)
        if job.job in strangers:  # (their calls refused: the serve log has a line for them too)
            u = strangers[job.job]
            lines += ["", f"  not registered in it, yet calling: {_strangers(u)} (refused: {u.reason})"]
        if job.refused:  # (why a job does not form: the serve log has a line for each too)
            rows = [[str(t.task_id), format_ranges(t.ordinals) or "?", t.reason] for t in job.refused]
            lines += [""] + _table(["REFUSED TASK", "ORDINALS", "WHY (its latest registration)"], rows)
    if folded:
        names = sorted(folded, key=_natural)
        more = f" and {len(names) - 20} more" if len(names) > 20 else ""
        lines += [
            "",
            f"{len(names)} finished jobs (every process left or dead; `status --job NAME` shows one, "
            f"--json all): {', '.join(map(repr, names[:20]))}{more}",
        ]
    unknown = [u for u in response.unknown_processes if not u.job_known]
    if unknown:  # (their processes' calls refused: the serve log has a line for each job too)
        lines += ["", f"jobs this coordinator does not know, whose processes still call it (refused: {unknown[0].reason}):"]
        lines += [f"  job {u.job!r}: {_strangers(u)}" for u in unknown]
    return "\n".join(lines) + "\n"


def _strangers(u) -> str:
    return f"{_plural(u.processes, 'process')}, the last heard from {_age(u.last_call_age)} ago"


def client_address(env: Mapping[str, str]) -> str:
    """The coordinator's address as a client in ``env`` finds it (asking the metadata server
    where the client would), without the rest of its topology: ``status`` needs no accelerator
    type the client can lay out.

    Raises:
        TopologyError: a malformed address or ``worker-network-endpoints``.
    """
    from pjrt_rendezvous.client._api import metadata
    from pjrt_rendezvous.client._topology import detect_address

    return detect_address(env, metadata=metadata(env))


def _status(args, env: Mapping[str, str]) -> int:
    import grpc

    from pjrt_rendezvous.client._errors import RendezvousError, unchanging
    from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb
    from pjrt_rendezvous.protos.v1 import coordinator_pb2_grpc as pb_grpc

    try:
        if args.address is not None:  # ('' too: refused as for health, not taken for unset)
            address, address_source = args.address, "--address"
        elif env.get("PJRT_RENDEZVOUS_ADDRESS", "").strip():
            address, address_source = env["PJRT_RENDEZVOUS_ADDRESS"], "PJRT_RENDEZVOUS_ADDRESS"
        elif env.get(SERVE_VARIABLES["port"]):  # next to a serve configuration (the image, a unit's file)
            address, address_source = local_address(env), SERVE_VARIABLES["host"]
        else:  # as a client finds it: TPU worker 0, else localhost (checked there)
            address, address_source = client_address(env), "the coordinator's address"
    except RendezvousError as exc:  # (from client_address)
        print(f"pjrt-rendezvous status: {exc} (or name the coordinator: --address)", file=sys.stderr)
        return 2
    except ValueError as exc:  # (from local_address)
        print(f"pjrt-rendezvous status: {exc}", file=sys.stderr)
        return 2
    dialed = _dial("status", address, address_source, env, args.tls_server_name, token=True)
    if dialed is None:
        return 2
    address, channel, metadata = dialed
    with channel:  # waits up to --timeout for a coordinator that is starting
        stub = pb_grpc.CoordinatorStub(channel)
        response = _ask(
            lambda timeout: stub.Status(pb.StatusRequest(job=args.job), timeout=timeout, metadata=metadata),
            args.timeout,
            # (not a server of another protocol, nor a certificate refused: waiting changes neither)
            lambda reply: isinstance(reply, grpc.RpcError) and reply.code() == grpc.StatusCode.UNAVAILABLE
            and not unchanging(reply.details() or ""),
        )
    if isinstance(response, grpc.RpcError):
        print(f"pjrt-rendezvous status: {address}: {_rpc_failure(response, args.timeout)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status_json(response, address), indent=2))
    else:
        sys.stdout.write(render_status(response, address, args.job))
    return 0


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    try:
        code = _main(argv, env)
        sys.stdout.flush()  # (here, not at exit: what is left of the output fails too)
        return code
    except BrokenPipeError:  # stdout closed early (`status --json | head`): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (nor at exit's flush)
        return 1
    except KeyboardInterrupt:  # Ctrl-C in status, health --wait or demo: no traceback, the shell's code
        print("pjrt-rendezvous: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


def _main(argv: list[str] | None, env: Mapping[str, str] | None) -> int:
    env = os.environ if env is None else env
    args = _parser(env).parse_args(argv)
    if args.command == "serve":
        if args.bad_variables:  # (json when PJRT_RENDEZVOUS_LOG_FORMAT or the flag could say so)
            _failed(args.log_format, f"pjrt-rendezvous: {'; '.join(args.bad_variables.values())}")
            return 2
        return _serve(args, env)
    if args.command == "status":
        return _status(args, env)
    if args.command == "health":
        return _health(args, env)
    from pjrt_rendezvous.client._demo import run_demo

    return run_demo(
        processes=args.processes,
        threads=args.threads,
        hosts=args.hosts,
        accelerator=args.accelerator,
        timeout=args.timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
