"""Client settings: keyword arguments, then ``PJRT_RENDEZVOUS_*`` variables, then defaults.

Times are seconds. ``None`` disables a timeout (wait forever); ``0`` is never "forever"
and is refused.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import stat
import time
from typing import Any, Iterable, Mapping

from ._errors import UsageError

DEFAULT_JOB = "default"


class _Default:
    """Marker for "use the configured default" where ``None`` already means "forever"."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()

# setting -> the environment variable that sets it (defaults: the Settings fields)
_VARIABLES: dict[str, str] = {
    "job": "PJRT_RENDEZVOUS_JOB",
    "timeout": "PJRT_RENDEZVOUS_TIMEOUT",
    "connect_timeout": "PJRT_RENDEZVOUS_CONNECT_TIMEOUT",
    "batch_window": "PJRT_RENDEZVOUS_BATCH_WINDOW",
    "fan_in": "PJRT_RENDEZVOUS_FAN_IN",
    "transport": "PJRT_RENDEZVOUS_TRANSPORT",
    "heartbeat_interval": "PJRT_RENDEZVOUS_HEARTBEAT_INTERVAL",
    "progress_interval": "PJRT_RENDEZVOUS_PROGRESS_INTERVAL",
    "token": "PJRT_RENDEZVOUS_TOKEN",
    "token_file": "PJRT_RENDEZVOUS_TOKEN_FILE",
    "tls_ca": "PJRT_RENDEZVOUS_TLS_CA",
    "tls_cert": "PJRT_RENDEZVOUS_TLS_CERT",
    "tls_key": "PJRT_RENDEZVOUS_TLS_KEY",
}
# Read by detect_topology (client/_topology.py) and the native module's switch.
TOPOLOGY_VARIABLES = tuple(
    f"PJRT_RENDEZVOUS_{name}"
    for name in ("ADDRESS", "TASK_ID", "NUM_TASKS", "CORES_PER_CHIP", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "METADATA_URL", "NATIVE")
)
# The launch that started a process, set by its launcher (xla.spawn) for the coordinator: see
# RegisterRequest.launch.
LAUNCH_VARIABLE = "PJRT_RENDEZVOUS_LAUNCH"
_TEXT = {"job", "fan_in", "transport", "token", "token_file", "tls_ca", "tls_cert", "tls_key"}
FAN_IN_MODES = ("auto", "host", "off")
# With fan_in="auto", hosts relay for their processes from this many hosts on.
FAN_IN_AUTO_HOSTS = 16
TRANSPORTS = ("auto", "grpc")


def versions_differ(theirs: str, ours: str) -> bool:
    """Whether two package versions are known to differ: "" (a side older than the field)
    and "unknown" (sent by earlier versions run from a checkout never installed) say nothing."""
    return theirs != ours and not {theirs, ours} & {"", "unknown"}


def comment_hint(value: str) -> str:
    """For an error about a setting's ``value``: a hint when it holds what looks like a
    comment, which systemd's ``EnvironmentFile=`` keeps in the value (a shell drops it)."""
    if not re.search(r"\s#", value):
        return ""
    return (
        " (a comment after the value? systemd's EnvironmentFile= keeps everything after '=' in "
        "the value: put comments on lines of their own)"
    )


def tls_pair_problem(cert: str, key: str) -> str | None:
    """Why the files ``cert`` and ``key`` are not a PEM certificate and its unencrypted private
    key (an encrypted one, which gRPC cannot use, fails here, not at a password prompt); None
    when they are, or cannot be read (their reader says so). Read at OpenSSL's security level
    0: gRPC's BoringSSL takes keys the system's level refuses (a 1,024-bit RSA key)."""
    import ssl

    try:
        with open(cert, "rb") as c, open(key, "rb") as k:
            cert_text, key_text = c.read(), k.read()
    except OSError:
        return None
    if b"ENCRYPTED" in key_text:  # ("BEGIN ENCRYPTED PRIVATE KEY", or "Proc-Type: 4,ENCRYPTED")
        return f"the key is encrypted, which gRPC cannot use: decrypt it (openssl pkey -in {key} -out NEW.key)"
    if _PEM_CERTIFICATE not in cert_text and b"PRIVATE KEY-----" in cert_text:
        return "the certificate's file holds a private key (the two files swapped?)"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.set_ciphers("ALL:@SECLEVEL=0")
    try:
        context.load_cert_chain(cert, key, password=b"")
    except ssl.SSLError as exc:
        return exc.reason or "not PEM"
    except OSError:
        return None
    return None


def certificate_out_of_date(cert: str, now: float | None = None) -> str | None:
    """When the (first) certificate in the PEM file ``cert`` has expired, or is not valid
    yet: which, and when; None when it is valid now, or cannot be read (as Python's own
    test decoder, where a build lacks it)."""
    import ssl

    try:
        decoded = ssl._ssl._test_decode_cert(cert)  # (the one reader of a certificate's dates in the standard library)
        after, before = ssl.cert_time_to_seconds(decoded["notAfter"]), ssl.cert_time_to_seconds(decoded["notBefore"])
    except (AttributeError, KeyError, ValueError, OSError, ssl.SSLError):
        return None
    now = time.time() if now is None else now
    if now > after:
        return f"it expired on {decoded['notAfter']}"
    if now < before - _CLOCK_SLACK:  # (a certificate just issued by a host whose clock is ahead)
        return f"it is not valid before {decoded['notBefore']} (is this host's clock right?)"
    return None


_CLOCK_SLACK = 300.0  # seconds


MAX_TOKEN_LENGTH = 4096  # characters; gRPC's headers take 8 KiB in all by default


def check_setting_names(names: Iterable[str]) -> None:
    """Refuses a setting :meth:`Settings.resolve` does not know (UsageError naming those it does)."""
    unknown = set(names) - set(_VARIABLES)
    if unknown:
        raise UsageError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(_VARIABLES)}")


def check_token(token: str, source: str) -> str:
    """``token`` if gRPC metadata can carry it (printable ASCII), else a UsageError naming
    ``source`` (serve and the clients alike: a token with a line break inside, as a wrapped
    ``openssl rand -base64 64`` gives, was taken, then every call failed as "Invalid metadata")."""
    if not token.strip():
        raise UsageError(f"the token from {source} is empty")
    if len(token) > MAX_TOKEN_LENGTH:  # (gRPC refused every call: "metadata size exceeds hard limit")
        raise UsageError(
            f"the token from {source} is {len(token)} characters, over the {MAX_TOKEN_LENGTH} a gRPC header "
            "carries here: a shared secret needs no more than 64 (`openssl rand -hex 32`)"
        )
    if re.search(r"\s#", token):
        raise UsageError(f"the token from {source} holds a blank followed by '#'{comment_hint(token)}")
    for position, char in enumerate(token):
        if not " " <= char <= "~":
            line = " (a line break: the token must be the only line, no comment line)" if char in "\r\n" else ""
            raise UsageError(
                f"the token from {source} holds character {ord(char):#x} at position {position}{line}: a "
                "token must be printable ASCII on one line (gRPC metadata), e.g. from `openssl rand -hex 32`"
            )
    return token


def read_secret(path: str, what: str, source: str, logger: str = "pjrt_rendezvous.client") -> bytes:
    """The bytes of the secret file ``path`` (``what`` it is, ``source`` where the path came
    from). A regular file that other users may read or write is taken, with a warning on
    ``logger`` (as ssh and libpq warn of, or refuse, such secrets). OSError when unreadable."""
    with open(path, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        data = f.read()
    if stat.S_ISREG(mode) and mode & 0o077:
        logging.getLogger(logger).warning(
            "the %s %s (%s) is open to other users (mode %03o): `chmod 600 %s`",
            what, path, source, stat.S_IMODE(mode), path,
        )
    return data


def read_token_file(path: str, source: str, logger: str = "pjrt_rendezvous.client") -> str:
    """The token in the file ``path`` (``source`` names where the path came from), stripped
    (see :func:`read_secret`)."""
    try:
        data = read_secret(path, "token file", source, logger)
    except OSError as exc:
        raise UsageError(f"cannot read the token file {path} ({source}): {exc.strerror}") from exc
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"the token file {path} ({source}) is not ASCII text (byte {data[exc.start]:#x} at "
            f"{exc.start}): a token must be printable ASCII on one line"
        ) from None


def token_conflict(variable: str, file_variable: str) -> str:
    """The refusal when a token and a token file disagree (serve and the clients alike)."""
    return (
        f"{variable} and {file_variable} are both set and hold different tokens; set one of "
        "them (the coordinator and its clients must read the same one)"
    )


_PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
# The longest wait every path can measure (poll() counts int32 milliseconds: 24.8 days);
# a longer timeout waits without a limit.
LONGEST_TIMEOUT = 21 * 86400.0


def check_timeout(value: Any, what: str = "timeout", none: str = "None waits forever") -> float | None:
    """Validates a timeout: a positive number of seconds, or None for no limit (as is
    anything from LONGEST_TIMEOUT, 21 days, on). ``none`` says what None means (settings that
    must be finite: _finite_seconds)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds or None, got {value!r}")
    if not value > 0:  # NaN too
        raise UsageError(f"{what} must be > 0 seconds ({none}), got {value!r}")
    return None if value >= LONGEST_TIMEOUT else float(value)


def quote_hint(value: str) -> str:
    """For an error about a setting's ``value``: a hint when it is quoted, as ``docker run
    --env-file`` and Kubernetes keep quotes in the value (a shell and systemd drop them)."""
    value = value.strip()
    if len(value) < 2 or value[0] != value[-1] or value[0] not in "'\"":
        return ""
    return " (quotes around the value? docker's --env-file keeps them in it: write the value bare)"


def _parse_number(variable: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"{variable}={text!r} is not a number of seconds{quote_hint(text)}") from None


NO_LIMIT_WORDS = ("none", "inf", "infinity", "forever")


def parse_seconds(text: str, what: str = "") -> float | None:
    """A timeout as written in an environment variable ``what`` or on the command line: a
    positive number of seconds, or a word for no limit ('none', 'inf', 'infinity', 'forever')."""
    if text.strip().lower() in NO_LIMIT_WORDS:
        return None
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{what + '=' if what else ''}{text!r} is not a number of seconds (or 'none'){quote_hint(text)}") from None
    if not value > 0:  # NaN too
        raise UsageError(f"{what + ' ' if what else ''}must be > 0 seconds or 'none', got {text!r}")
    return None if math.isinf(value) else value


_PATHS = ("token_file", "tls_ca", "tls_cert", "tls_key")
_FINITE = ("connect_timeout", "heartbeat_interval")  # (no 'none': a client needs them to end)


def _finite_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    if not 0 < value < LONGEST_TIMEOUT:  # NaN too
        raise UsageError(
            f"{name} must be a number of seconds > 0 and under {LONGEST_TIMEOUT / 86400:g} days "
            f"(init({name}=), {_VARIABLES[name]}), got {value!r}"
        )
    return float(value)


def check_text_setting(name: str, value: Any) -> None:
    """A TypeError for a token given as anything but a str, or a file setting as anything but
    a path (an int ``token_file`` or ``tls_ca`` was opened as that file descriptor; an int
    token failed with AttributeError: 'strip')."""
    if value is None or value is DEFAULT or isinstance(value, str):
        return
    if name in _PATHS:
        if not isinstance(value, os.PathLike):
            raise TypeError(f"{name} must be a path (str or os.PathLike) or None, got {value!r}")
    else:
        raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")  # (a secret: not shown)


def job_problem(job) -> str | None:
    """Why ``job`` cannot name a job (None: it can). The coordinator's ``serve --job`` asks
    too: a job no client could join must not be served."""
    if not isinstance(job, str):
        return "is not a string"
    if not job:
        return "is empty"
    if job != job.strip():  # one host's stray space would make it a job of its own
        return "has spaces at an end"
    if not job.isprintable():  # (only then can it hold one: the core is not imported for every client)
        from pjrt_rendezvous.coordinator._core import _control  # (the coordinator's own test: refused there too)

        if _control(job):
            return "holds a control character"
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything a :class:`Client` is configured with.

    Attributes:
        address: the coordinator, ``host:port``.
        job: the job namespace on the coordinator.
        timeout: default deadline of rendezvous, barrier, world and blocking key-value
            waits; None waits forever.
        connect_timeout: how long transient failures (coordinator unreachable) are retried,
            with exponential backoff and jitter, before a call fails; always also bounded
            by the call's own deadline.
        batch_window: how long the first thread of a process to reach a round waits for its
            sibling threads, so one call carries them all. Costs no latency: the round cannot
            finish without them anyway. A host relay (``fan_in``) waits as long for the
            host's processes that have not called yet. Either waits at most half the time
            left before the round's deadline (past the round's, the call would find it
            failed, its own ordinals named missing).
        fan_in: "host": the rendezvous calls of a host's processes go through a relay in
            the host's first process (local rank 0), which sends one call per round for
            the host, so the coordinator handles one message per host instead of one per
            process (client/_relay.py); "off": every process calls the coordinator; "auto"
            (default): "host" in worlds of at least 16 hosts with more than one process
            each.
        transport: "auto" (default): calls travel on the coordinator's session port
            (length-prefixed messages on plain TCP, cheaper than gRPC) when it offers one
            and this client does not use TLS, else on gRPC; "grpc": always on gRPC.
        heartbeat_interval: seconds between heartbeats (shortened to a third of the
            coordinator's heartbeat timeout when that is smaller).
        progress_interval: while blocked in a rendezvous round, log a "still waiting ..."
            line naming the missing ordinals this often, in ``wait_world`` one saying
            how many ordinals registered and which are missing, and in a blocking get or
            wait one naming the keys not set yet; None never logs.
        token: the coordinator's shared secret, sent with every call (never shown in repr).
        token_from: where ``token`` came from, for a refusal of it ("a wrong token" says which
            to fix); :meth:`resolve` sets it.
        tls_ca: PEM file of the CA that signed the coordinator's certificate; enables TLS.
        tls_cert, tls_key: PEM client certificate and key, for mutual TLS.
    """

    address: str
    job: str = DEFAULT_JOB
    timeout: float | None = 600.0
    connect_timeout: float = 60.0
    batch_window: float = 1.0
    fan_in: str = "auto"
    transport: str = "auto"
    heartbeat_interval: float = 5.0
    progress_interval: float | None = 60.0
    token: str | None = dataclasses.field(default=None, repr=False)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token_from: str = dataclasses.field(default="", repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("address", "job", "fan_in", "transport"):  # (a wrong type is a TypeError, as elsewhere)
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {getattr(self, name)!r}")
        if not self.address:
            raise UsageError(f"address must be 'host:port', got {self.address!r}")
        problem = job_problem(self.job)
        if problem is not None:
            raise UsageError(f"job {self.job!r} {problem} (PJRT_RENDEZVOUS_JOB, init(job=))")
        object.__setattr__(self, "timeout", check_timeout(self.timeout))
        for name in _FINITE:
            object.__setattr__(self, name, _finite_seconds(name, getattr(self, name)))
        window = self.batch_window
        if isinstance(window, bool) or not isinstance(window, (int, float)):
            raise TypeError(f"batch_window must be a number of seconds, got {window!r}")
        if not 0 <= window < math.inf:
            raise UsageError(f"batch_window must be a finite number of seconds >= 0 (PJRT_RENDEZVOUS_BATCH_WINDOW), got {window!r}")
        for name, allowed in (("fan_in", FAN_IN_MODES), ("transport", TRANSPORTS)):  # (any case, as from their variables)
            value = getattr(self, name)
            if value.lower() not in allowed:
                raise UsageError(f"{name} must be one of {', '.join(allowed)} ({_VARIABLES[name]}), got {value!r}")
            object.__setattr__(self, name, value.lower())
        object.__setattr__(self, "progress_interval", check_timeout(self.progress_interval, "progress_interval", "None: never"))
        for name in ("token", "tls_ca", "tls_cert", "tls_key"):
            check_text_setting(name, getattr(self, name))
        if self.token is not None:  # (stripped, as from the variable or a file)
            source = "PJRT_RENDEZVOUS_TOKEN, the file PJRT_RENDEZVOUS_TOKEN_FILE names, or init(token=)"
            object.__setattr__(self, "token", check_token(self.token.strip(), source))
        if (self.tls_cert is None) != (self.tls_key is None):
            raise UsageError("mutual TLS needs both tls_cert and tls_key (PJRT_RENDEZVOUS_TLS_CERT / _TLS_KEY)")
        if self.tls_cert is not None and self.tls_ca is None:
            raise UsageError("a client certificate needs tls_ca too (PJRT_RENDEZVOUS_TLS_CA)")

    def credentials(self):
        """gRPC channel credentials when TLS is configured, else None."""
        if self.tls_ca is None:
            return None
        import grpc

        def read(path: str | None, name: str, marker: bytes) -> bytes | None:
            # Checked here: gRPC takes any bytes and fails each connection's handshake later,
            # which a client retries as an unreachable coordinator.
            if path is None:
                return None
            variable = _VARIABLES[name]
            try:
                if name == "tls_key":
                    data = read_secret(path, "TLS key", f"{name}, {variable}")
                else:
                    with open(path, "rb") as f:
                        data = f.read()
            except OSError as exc:
                raise UsageError(f"cannot read the TLS file {path} ({name}, {variable}): {exc.strerror}") from exc
            if b"-----BEGIN " not in data or marker not in data:
                what = "certificate" if marker == _PEM_CERTIFICATE else "private key"
                raise UsageError(f"the TLS file {path} ({name}, {variable}) holds no PEM {what}")
            return data

        credentials = grpc.ssl_channel_credentials(
            root_certificates=read(self.tls_ca, "tls_ca", _PEM_CERTIFICATE),
            private_key=read(self.tls_key, "tls_key", b"PRIVATE KEY-----"),
            certificate_chain=read(self.tls_cert, "tls_cert", _PEM_CERTIFICATE),
        )
        problem = None if self.tls_cert is None else tls_pair_problem(self.tls_cert, self.tls_key)
        if problem is not None:  # (another key: every handshake failed, retried for connect_timeout)
            raise UsageError(
                f"the TLS key {self.tls_key} (tls_key, {_VARIABLES['tls_key']}) is not an unencrypted private key of "
                f"the certificate {self.tls_cert} (tls_cert, {_VARIABLES['tls_cert']}): {problem}"
            )
        problem = None if self.tls_cert is None else certificate_out_of_date(self.tls_cert)
        if problem is not None:  # (a coordinator without mutual TLS never asks for it: not refused)
            logging.getLogger("pjrt_rendezvous.client").warning(
                "the TLS certificate %s (tls_cert, %s) cannot be used: %s; a coordinator with mutual TLS closes each "
                "connection this client opens (\"Socket closed\", retried for connect_timeout): reissue it",
                self.tls_cert, _VARIABLES["tls_cert"], problem,
            )
        return credentials

    @classmethod
    def resolve(cls, env: Mapping[str, str], *, address: str, **given: Any) -> "Settings":
        """Builds settings from keyword arguments (values other than DEFAULT win), then
        ``env``, then defaults."""
        check_setting_names(given)
        for name in ("token", *_PATHS):  # (before a token file is read, or a token compared with it)
            check_text_setting(name, given.get(name))
        values: dict[str, Any] = {}
        for name, variable in _VARIABLES.items():
            value = given.get(name, DEFAULT)
            if value is DEFAULT and env.get(variable):
                text = env[variable]
                if name in ("job", *_PATHS) and comment_hint(text):  # (the token's check says it too)
                    raise UsageError(f"{variable}={text!r} holds a blank followed by '#'{comment_hint(text)}")
                if name in ("fan_in", "transport"):
                    value = text.strip().lower()  # as parse_seconds reads its words
                elif name in _TEXT:
                    value = text.strip() if name == "token" else text
                elif name in ("batch_window", *_FINITE):
                    value = _parse_number(variable, text)
                else:
                    value = parse_seconds(text, variable)
            if value is not DEFAULT:
                values[name] = value
        token_file = values.pop("token_file", None)
        token_given, file_given = (given.get(n, DEFAULT) not in (DEFAULT, None) for n in ("token", "token_file"))
        if token_file is not None and (file_given or not token_given):  # an argument wins over a variable
            source = "init(token_file=)" if file_given else _VARIABLES["token_file"]
            from_file = check_token(read_token_file(token_file, source), f"the file {token_file} ({source})")
            if "token" in values and token_given == file_given and values["token"].strip() != from_file:
                names = ("init(token=)", "init(token_file=)") if file_given else (_VARIABLES["token"], _VARIABLES["token_file"])
                raise UsageError(token_conflict(*names))
            values["token"] = from_file
            values["token_from"] = f"the file {token_file} ({source})"
        elif values.get("token") is not None:
            values["token_from"] = "init(token=)" if token_given else _VARIABLES["token"]
        return cls(address=address, **values)
