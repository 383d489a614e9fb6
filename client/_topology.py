"""Topology detection: which process, host and ordinals this is, from an environment mapping.

Each value is taken from the first source that has it:

1. the ``address`` argument and the ``PJRT_RENDEZVOUS_*`` overrides;
2. the variables torch_xla and the TPU VM set (``CLOUD_TPU_TASK_ID``, ``TPU_WORKER_ID``,
   ``PJRT_LOCAL_PROCESS_RANK``/``_COUNT``, ``TPU_ACCELERATOR_TYPE``, ``TPU_PROCESS_BOUNDS``,
   ``TPU_CHIPS_PER_PROCESS_BOUNDS``, ``TPU_CHIPS_PER_HOST_BOUNDS``, ``CHIPS_PER_HOST_BOUNDS``,
   ``TPU_WORKER_HOSTNAMES``);
3. the GCE metadata server (``tpu-env``, ``worker-network-endpoints``), only when a fetcher is
   passed and ``TPU_SKIP_MDS_QUERY`` is unset or empty (as torch_xla reads it); ``tpu-env`` is read
   only when ``TPU_ACCELERATOR_TYPE`` is unset, when no chip bounds variable is set (for the
   host's chips), or when ``TPU_WORKER_ID`` is unset while the metadata names several workers,
   and a fetch that fails with ``OSError`` counts as absent;
4. defaults for a single process off TPU: a world of one at ``localhost:7481``.

``detect_address`` finds the coordinator's address the same way, and asks for nothing else
(``status`` uses it: it must work where the client cannot lay out the accelerator type).
``detect_topology`` and ``detect_address`` never read ``os.environ``: the caller passes the mapping.
"""

from __future__ import annotations

import ipaddress
import math
import operator
import re
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ._errors import TopologyError

DEFAULT_PORT = 7481

_CORES_PER_CHIP = {"v2": 2, "v3": 2, "v4": 1, "v5litepod": 1, "v5e": 1, "v5p": 1, "v6e": 1}
_ACCELERATOR_RE = re.compile(r"(?P<family>[a-z][a-z0-9]*)-(?P<size>[0-9]+)")
_INT_RE = re.compile(r"[+-]?[0-9]+")
_YAML_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Where this process sits in the job; ordinals are derived from it, never stored."""

    accelerator_type: str | None
    cores_per_chip: int
    chips_per_process: int
    task_id: int
    num_tasks: int
    local_rank: int
    local_world_size: int
    worker_id: int
    worker_hostnames: tuple[str, ...]
    host: str
    address: str
    # Nothing named the coordinator (no address, PJRT_RENDEZVOUS_ADDRESS or worker
    # hostnames): ``address`` is localhost's, which only its own host reaches.
    address_defaulted: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "worker_hostnames", tuple(self.worker_hostnames))
        for name in ("cores_per_chip", "chips_per_process", "num_tasks", "local_world_size"):
            if getattr(self, name) < 1:
                raise TopologyError(f"Topology.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("task_id", "local_rank", "worker_id"):
            if getattr(self, name) < 0:
                raise TopologyError(f"Topology.{name} must not be negative, got {getattr(self, name)}")
        if self.task_id >= self.num_tasks:
            raise TopologyError(
                f"Topology.task_id {self.task_id} must be less than num_tasks {self.num_tasks}"
            )
        if self.local_rank >= self.local_world_size:
            raise TopologyError(
                f"Topology.local_rank {self.local_rank} must be less than "
                f"local_world_size {self.local_world_size}"
            )
        if self.world_size > _INT32_MAX:  # (an ordinal is a 32-bit field on the wire)
            raise TopologyError(
                f"Topology: a world of {self.num_tasks} tasks x {self.devices_per_process} devices is "
                f"{self.world_size} ordinals, over {_INT32_MAX}"
            )
        if self.worker_hostnames and self.worker_id >= len(self.worker_hostnames):
            raise TopologyError(
                f"Topology.worker_id {self.worker_id} is out of range for "
                f"{len(self.worker_hostnames)} worker hostnames"
            )

    @property
    def devices_per_process(self) -> int:
        """PJRT devices (threads) this process drives: cores per chip × chips per process."""
        return self.cores_per_chip * self.chips_per_process

    @property
    def world_size(self) -> int:
        """Devices in the whole job: tasks × devices per process."""
        return self.num_tasks * self.devices_per_process

    def ordinal(self, thread_index: int) -> int:
        """Global ordinal of this process's ``thread_index``-th device."""
        return self.task_id * self.devices_per_process + self._check_thread(thread_index)

    def local_ordinal(self, thread_index: int) -> int:
        """Ordinal of this process's ``thread_index``-th device among this host's devices."""
        return self.local_rank * self.devices_per_process + self._check_thread(thread_index)

    def _check_thread(self, thread_index: int) -> int:
        if isinstance(thread_index, bool):
            raise TypeError(f"thread index must be an int, got {thread_index!r}")
        try:
            index = operator.index(thread_index)
        except TypeError:
            raise TypeError(f"thread index must be an int, got {thread_index!r}") from None
        n = self.devices_per_process
        if not 0 <= index < n:
            raise TopologyError(
                f"thread index {index} is out of range [0, {n}): this process drives {n} "
                f"device(s) ({self.cores_per_chip} core(s) per chip × "
                f"{self.chips_per_process} chip(s) per process)"
            )
        return index


def cores_per_chip(accelerator_type: str) -> int:
    """PJRT devices per chip for a TPU accelerator type such as ``"v3-8"``; never guesses."""
    if not isinstance(accelerator_type, str):
        raise TypeError(f"accelerator type must be a str, got {accelerator_type!r}")
    match = _ACCELERATOR_RE.fullmatch(accelerator_type.strip().lower())
    if match and match["family"] in _CORES_PER_CHIP and int(match["size"]) > 0:
        return _CORES_PER_CHIP[match["family"]]
    hint = ""
    if _unconfirmed(accelerator_type):
        # JAX's tpu_info lists TPU7x with two TensorCores a chip and no megacore (each core
        # a device); torch_xla 2.9 takes it for version 7, counts one device a chip there
        # (num_logical_cores_per_chip) and writes a fourth process bound of 2: how many
        # threads a process runs is its runtime's to say, not ours to guess (detect_topology
        # asks it).
        hint = (
            " (a TPU7x chip has two TensorCores and no megacore: JAX sees two devices a chip, "
            "torch_xla 2.9 counts one, so this is not guessed; or start torch_xla's runtime "
            "before init(), and its device count is used)"
        )
    raise TopologyError(
        f"unknown TPU accelerator type {accelerator_type!r}: cores per chip is known only for "
        "v2-*, v3-* (2) and v4-*, v5litepod-*, v5e-*, v5p-*, v6e-* (1); set "
        f"PJRT_RENDEZVOUS_CORES_PER_CHIP explicitly to the number of PJRT devices per chip{hint}"
    )


def _unconfirmed(accelerator_type: str) -> bool:
    """A TPU generation whose devices per chip are taken from the XLA runtime, not guessed
    (TPU7x: see cores_per_chip)."""
    match = _ACCELERATOR_RE.fullmatch(accelerator_type.strip().lower())
    return bool(match) and match["family"].startswith("tpu7")


def metadata_fetcher(base_url: str, timeout: float = 2.0) -> Callable[[str], str]:
    """A ``metadata(key) -> str`` for detect_topology: GET ``base_url/key`` from a GCE metadata server.

    Errors (unreachable server, HTTP 404, timeout) are raised as ``OSError``; detect_topology
    treats them as "no metadata". Proxies are bypassed: the metadata server is link-local.
    """
    base = base_url.rstrip("/")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def fetch(key: str) -> str:
        request = urllib.request.Request(
            f"{base}/{urllib.parse.quote(key, safe='')}", headers={"Metadata-Flavor": "Google"}
        )
        try:
            with opener.open(request, timeout=timeout) as response:
                return response.read().decode("utf-8")
        except urllib.error.HTTPError as error:
            error.close()  # it holds the response open; the status and message stay readable
            raise

    return fetch


# --- detection -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Raw:
    """A raw text value, where it came from, and the variable a user sets to fix or override it."""

    text: str
    source: str
    fix: str

    def hint(self) -> str:
        return "" if self.fix == self.source else f"; set {self.fix} to override it"


@dataclass(frozen=True)
class _Known:
    """A parsed integer with a description of its origin for error messages."""

    value: int
    source: str
    fix: str


def _from_env(env: Mapping[str, str], *names: str) -> _Raw | None:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip():
            return _Raw(value.strip(), name, name)
    return None


_INT32_MAX = 2**31 - 1


def _int(raw: _Raw | None, *, what: str, minimum: int, default: int, default_fix: str) -> _Known:
    if raw is None:
        return _Known(default, "default", default_fix)
    if not _INT_RE.fullmatch(raw.text):
        raise TopologyError(
            f"{raw.source} ({what}) must be an integer, got {raw.text!r}{raw.hint()}"
        )
    value = int(raw.text)
    if value < minimum:
        rule = "must not be negative" if minimum == 0 else f"must be at least {minimum}"
        raise TopologyError(f"{raw.source} ({what}) {rule}, got {value}{raw.hint()}")
    if value > _INT32_MAX:  # (the wire's field: it failed later as protobuf's "Value out of range")
        raise TopologyError(f"{raw.source} ({what}) must be at most {_INT32_MAX}, got {value}{raw.hint()}")
    return _Known(value, raw.source, raw.fix)


def _bounds(raw: _Raw) -> int:
    parts = [part.strip() for part in raw.text.split(",")]
    if len(parts) != 3 or not all(part.isascii() and part.isdigit() and int(part) > 0 for part in parts):
        raise TopologyError(
            f"{raw.source} must be 3 comma-separated positive integers like '2,2,1', "
            f"got {raw.text!r}{raw.hint()}"
        )
    return math.prod(int(part) for part in parts)


def _skip_mds(value: str | None) -> bool:
    """As torch_xla reads ``TPU_SKIP_MDS_QUERY`` (``_internal/tpu.py``): any value but an
    empty one skips the metadata server, "0" and "false" too, so that both agree."""
    return bool(value)


def _parse_tpu_env(text: str) -> dict[str, str]:
    """Parse the flat YAML of ``tpu-env``: lines of ``KEY: 'value'`` or ``KEY: value``."""
    result: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not _YAML_KEY_RE.fullmatch(key):
            continue
        if len(value) >= 2 and value[0] == value[-1] == "'":
            value = value[1:-1].replace("''", "'")
        elif len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        else:
            value = re.split(r"\s+#", value, maxsplit=1)[0].strip()
        result[key] = value
    return result


def _parse_endpoints(text: str) -> tuple[str, ...]:
    """``hostname:uid:ip,hostname:uid:ip`` -> the ips, in worker order."""
    hosts = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        fields = entry.split(":", 2)
        if len(fields) < 3 or not fields[2].strip():
            raise TopologyError(
                f"metadata worker-network-endpoints entry {entry!r} is not 'hostname:uid:ip' "
                f"(in {text.strip()!r}); set TPU_WORKER_HOSTNAMES to override it"
            )
        hosts.append(fields[2].strip())
    return tuple(hosts)


def host_port(host: str, port: int | str) -> str:
    """``host:port``, with an IPv6 host in brackets (the one place that formats addresses)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def normalize_address(text: str, source: str) -> str:
    """``text`` as ``host:port`` (see :func:`_normalize_address`); ``source`` names it in errors."""
    return _normalize_address(_Raw(text, source, source))


def _normalize_address(raw: _Raw) -> str:
    """``host``, ``host:port``, ``[v6]``, ``[v6]:port`` or a bare IPv6 literal -> ``host:port``."""
    text = raw.text.strip()

    def bad(reason: str) -> TopologyError:
        return TopologyError(
            f"{raw.source} {reason}, got {raw.text!r}; expected 'host', 'host:port', "
            f"'[ipv6]' or '[ipv6]:port' (default port {DEFAULT_PORT})"
        )

    def port_of(port_text: str) -> int:
        if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
            raise bad("has an invalid port (must be an integer in 1..65535)")
        return int(port_text)

    def ipv6(host: str) -> str:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad("is not a valid address") from None
        return host

    if not text:
        raise bad("must not be empty")
    if text.startswith("["):
        end = text.find("]")
        if end == -1:
            raise bad("has an unclosed '['")
        host, rest = ipv6(text[1:end]), text[end + 1 :]
        if not rest:
            return f"[{host}]:{DEFAULT_PORT}"
        if not rest.startswith(":"):
            raise bad("has text after ']' that is not ':port'")
        return f"[{host}]:{port_of(rest[1:])}"
    if text.count(":") > 1:
        return f"[{ipv6(text)}]:{DEFAULT_PORT}"
    host, sep, port_text = text.partition(":")
    if not host or any(c.isspace() or c in "/@[]" for c in host):
        raise bad("is not a valid address")
    return f"{host}:{port_of(port_text) if sep else DEFAULT_PORT}"


class _Metadata:
    """The metadata server as one detection sees it: each key fetched at most once, a fetch
    that fails with ``OSError`` counting as absent."""

    def __init__(self, env: Mapping[str, str], metadata: Callable[[str], str] | None) -> None:
        self.enabled = metadata is not None and not _skip_mds(env.get("TPU_SKIP_MDS_QUERY"))
        self._metadata = metadata
        self._fetched: dict[str, str | None] = {}
        self.tpu_env: dict[str, str] = {}  # filled by load_tpu_env

    def load_tpu_env(self) -> None:
        """Reads ``tpu-env`` into ``tpu_env`` (once): the fallback for the TPU variables."""
        if "tpu-env" not in self._fetched:
            text = self.fetch("tpu-env")
            self.tpu_env = _parse_tpu_env(text) if text else {}

    def fetch(self, key: str) -> str | None:
        if key not in self._fetched:
            try:
                self._fetched[key] = self._metadata(key)  # type: ignore[misc]  # only called when enabled
            except OSError as error:
                if isinstance(error, urllib.error.HTTPError):
                    error.close()
                self._fetched[key] = None
        return self._fetched[key]

    def from_tpu_env(self, fix: str, *keys: str) -> _Raw | None:
        for key in keys:
            value = self.tpu_env.get(key, "").strip()
            if value:
                return _Raw(value, f"metadata tpu-env {key}", fix)
        return None


def _accelerator(env: Mapping[str, str], mds: _Metadata) -> _Raw | None:
    """``TPU_ACCELERATOR_TYPE``, else the metadata server's ``tpu-env`` one (``tpu-env`` is then
    kept in ``mds.tpu_env``: the fallback for the other TPU variables)."""
    accelerator = _from_env(env, "TPU_ACCELERATOR_TYPE")
    if accelerator is None and mds.enabled:
        mds.load_tpu_env()
        accelerator = mds.from_tpu_env("TPU_ACCELERATOR_TYPE", "ACCELERATOR_TYPE")
    return accelerator


def _worker_hostnames(
    env: Mapping[str, str], mds: _Metadata, accelerator: Callable[[], _Raw | None]
) -> tuple[tuple[str, ...], str]:
    """The workers' hostnames, worker 0 first, and where they came from; ``accelerator`` is
    asked only when the metadata server would be (on a TPU VM only)."""
    raw = _from_env(env, "TPU_WORKER_HOSTNAMES")
    if raw is not None:
        hosts = tuple(h.strip() for h in raw.text.split(",") if h.strip())
        for host in hosts:
            _check_hostname(host, raw.source)
        return hosts, "TPU_WORKER_HOSTNAMES"
    if mds.enabled and accelerator() is not None:
        text = mds.fetch("worker-network-endpoints")
        return (_parse_endpoints(text) if text else ()), "metadata worker-network-endpoints"
    return (), "TPU_WORKER_HOSTNAMES"


def _check_hostname(host: str, source: str) -> None:
    """A worker's name or IP address as the hostnames list gives it: no port (the
    coordinator's is its own: 7481, or PJRT_RENDEZVOUS_ADDRESS), no brackets around an IPv6
    address. ``h0:8470`` would otherwise be taken for an IPv6 address, and dialed as
    ``[h0:8470]:7481``."""
    bad = any(c.isspace() or c in "/@[]" for c in host)
    if not bad and ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            bad = True
    if bad:
        raise TopologyError(
            f"{source} entry {host!r} is not a hostname or IP address: list the workers' names or "
            f"addresses, worker 0 first, without ports or brackets (the coordinator is worker 0 at port "
            f"{DEFAULT_PORT}, or PJRT_RENDEZVOUS_ADDRESS=host:port)"
        )


def _given_address(env: Mapping[str, str], address: str | None) -> str | None:
    """The ``address`` argument, else ``PJRT_RENDEZVOUS_ADDRESS``, as ``host:port``; None without either."""
    if address is not None:
        raw: _Raw | None = _Raw(address, "the address argument", "the address argument")
    else:
        raw = _from_env(env, "PJRT_RENDEZVOUS_ADDRESS")
    return None if raw is None else _normalize_address(raw)


def _default_address(hostnames: tuple[str, ...]) -> str:
    """Worker 0 at the default port, else this machine."""
    return host_port(hostnames[0], DEFAULT_PORT) if hostnames else f"localhost:{DEFAULT_PORT}"


def detect_address(
    env: Mapping[str, str], *, address: str | None = None, metadata: Callable[[str], str] | None = None
) -> str:
    """The coordinator's ``host:port`` as :func:`detect_topology` finds it, and nothing else.

    ``address``, else ``PJRT_RENDEZVOUS_ADDRESS``, else worker 0 of ``TPU_WORKER_HOSTNAMES``
    (or of the metadata server's ``worker-network-endpoints``) at port 7481, else
    ``localhost:7481``. The rest of the topology is not read, so an accelerator type the client
    cannot lay out, or a bad rank variable, is no error here.

    Raises:
        TopologyError: a malformed address, or a malformed ``worker-network-endpoints``.
    """
    given = _given_address(env, address)
    if given is not None:
        return given
    mds = _Metadata(env, metadata)
    hostnames, _ = _worker_hostnames(env, mds, lambda: _accelerator(env, mds))
    return _default_address(hostnames)


def detect_topology(
    env: Mapping[str, str],
    *,
    address: str | None = None,
    metadata: Callable[[str], str] | None = None,
    hostname: Callable[[], str] = socket.gethostname,
    runtime_devices: Callable[[], int | None] | None = None,
) -> Topology:
    """Work out this process's Topology from ``env`` (and ``metadata``, see the module docstring).

    ``runtime_devices``: the XLA runtime's devices in this process, or None while it has not
    started; asked only for a TPU generation whose cores per chip are unconfirmed (TPU7x),
    which is then that count over the process's chips."""
    mds = _Metadata(env, metadata)

    # Processes on this host.
    local_rank = _int(
        _from_env(env, "PJRT_RENDEZVOUS_LOCAL_RANK", "PJRT_LOCAL_PROCESS_RANK"),
        what="local rank", minimum=0, default=0, default_fix="PJRT_RENDEZVOUS_LOCAL_RANK",
    )
    local_world = _int(
        _from_env(env, "PJRT_RENDEZVOUS_LOCAL_WORLD_SIZE", "PJRT_LOCAL_PROCESS_COUNT"),
        what="local world size", minimum=1, default=1,
        default_fix="PJRT_RENDEZVOUS_LOCAL_WORLD_SIZE or PJRT_LOCAL_PROCESS_COUNT",
    )

    # Accelerator type, with the metadata server's tpu-env as the fallback for the TPU variables.
    accelerator = _accelerator(env, mds)
    accelerator_type = accelerator.text if accelerator else None

    # Cores per chip: override, else from the type, else (no TPU) 1.
    cores_override = _from_env(env, "PJRT_RENDEZVOUS_CORES_PER_CHIP")
    runtime_count = None  # the runtime's devices in this process, for an unconfirmed generation
    if cores_override is not None:
        cores = _int(cores_override, what="cores per chip", minimum=1, default=1, default_fix="").value
    elif accelerator is not None:
        try:
            cores = cores_per_chip(accelerator.text)
        except TopologyError as error:
            if runtime_devices is not None and _unconfirmed(accelerator.text):
                runtime_count = runtime_devices()
            if runtime_count is None:
                raise TopologyError(f"{error} (accelerator type from {accelerator.source})") from None
            cores = 0  # the runtime's count over the chips per process, below
    else:
        cores = 1

    # Chips per process. A host's bounds (the variables first, as for the other TPU variables,
    # then tpu-env, whose bounds describe one process per host) are split among local processes.
    chips_raw = _from_env(env, "TPU_CHIPS_PER_PROCESS_BOUNDS")
    if chips_raw is not None:
        chips = _bounds(chips_raw)
    else:
        per_host = _from_env(env, "TPU_CHIPS_PER_HOST_BOUNDS", "CHIPS_PER_HOST_BOUNDS")
        if per_host is None and mds.enabled and accelerator_type is not None:
            mds.load_tpu_env()  # (not read yet when TPU_ACCELERATOR_TYPE is set: one chip was guessed)
        per_host = per_host or mds.from_tpu_env(
            "TPU_CHIPS_PER_PROCESS_BOUNDS",
            "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS", "CHIPS_PER_HOST_BOUNDS",
        )
        chips = 1
        if per_host is not None:
            host_chips = _bounds(per_host)
            if host_chips % local_world.value:
                raise TopologyError(
                    f"{per_host.source}={per_host.text!r} gives {host_chips} chip(s) per host, which "
                    f"do not divide evenly among local world size {local_world.value} "
                    f"({local_world.source}); set TPU_CHIPS_PER_PROCESS_BOUNDS"
                )
            chips = host_chips // local_world.value
    if runtime_count is not None:
        if runtime_count < 1 or runtime_count % chips:
            raise TopologyError(
                f"the XLA runtime gives this process {runtime_count} device(s), which do not divide "
                f"evenly among its {chips} chip(s) ({accelerator_type}); set PJRT_RENDEZVOUS_CORES_PER_CHIP"
            )
        cores = runtime_count // chips

    # Worker hostnames and this host's index.
    hostnames, hostnames_source = _worker_hostnames(env, mds, lambda: accelerator)
    worker_raw = _from_env(env, "TPU_WORKER_ID")
    if worker_raw is None and mds.enabled and len(hostnames) > 1:
        mds.load_tpu_env()  # (not read yet when TPU_ACCELERATOR_TYPE is set: it knows this host's id)
        worker_raw = mds.from_tpu_env("TPU_WORKER_ID", "WORKER_ID")
    worker = _int(worker_raw, what="worker id", minimum=0, default=0, default_fix="TPU_WORKER_ID")
    if hostnames and worker.value >= len(hostnames):
        raise TopologyError(
            f"worker id {worker.value} ({worker.source}) is out of range for the {len(hostnames)} "
            f"worker hostnames in {hostnames_source} (valid: 0..{len(hostnames) - 1}); "
            f"fix {worker.fix} or TPU_WORKER_HOSTNAMES"
        )

    # Task id and count.
    task_raw = _from_env(env, "PJRT_RENDEZVOUS_TASK_ID", "CLOUD_TPU_TASK_ID")
    if task_raw is not None:
        task = _int(task_raw, what="task id", minimum=0, default=0, default_fix="")
        if worker.source == "default" and task.value // local_world.value < len(hostnames):
            # Nothing says which host this is: the task id does (worker 0 by default named
            # another host's, where the coordinator takes the same host and local rank for a
            # restart of the task, not two processes claiming one).
            worker = _Known(
                task.value // local_world.value,
                f"derived: task id {task.value} ({task.source}) // local world size {local_world.value} "
                f"({local_world.source})",
                "TPU_WORKER_ID",
            )
        if local_rank.source == "default" and local_world.value > 1 and task.value // local_world.value == worker.value:
            # Nor which of the host's processes: the task id says that too where it counts host
            # by host as the worker id does (every process of the host was local rank 0, its
            # local ordinals and local master those of the first).
            local_rank = _Known(
                task.value % local_world.value,
                f"derived: task id {task.value} ({task.source}) mod local world size {local_world.value} "
                f"({local_world.source})",
                "PJRT_RENDEZVOUS_LOCAL_RANK",
            )
    else:
        task = _Known(
            worker.value * local_world.value + local_rank.value,
            f"derived: worker id {worker.value} ({worker.source}) × local world size "
            f"{local_world.value} ({local_world.source}) + local rank {local_rank.value} "
            f"({local_rank.source})",
            f"{worker.fix} or CLOUD_TPU_TASK_ID",
        )
    num_raw = _from_env(env, "PJRT_RENDEZVOUS_NUM_TASKS")
    process_bounds = _from_env(env, "TPU_PROCESS_BOUNDS")
    metadata_bounds = mds.from_tpu_env("TPU_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS")
    if num_raw is not None:
        num = _int(num_raw, what="number of tasks", minimum=1, default=1, default_fix="")
    elif process_bounds is not None:
        if process_bounds.text.count(",") == 3:  # (torch_xla's for TPU7x: x,y,z,2)
            raise TopologyError(
                f"{process_bounds.source}={process_bounds.text!r} has a fourth number, as torch_xla writes "
                "for TPU7x, whose process layout this client does not guess: set PJRT_RENDEZVOUS_NUM_TASKS "
                "to the number of processes (and PJRT_RENDEZVOUS_TASK_ID to this one's)"
            )
        num = _Known(_bounds(process_bounds), "TPU_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS")
    elif metadata_bounds is not None:
        num = _Known(
            _bounds(metadata_bounds) * local_world.value,
            f"derived: {metadata_bounds.source} × local world size {local_world.value}",
            "PJRT_RENDEZVOUS_NUM_TASKS or TPU_PROCESS_BOUNDS",
        )
    else:
        num = _Known(
            max(1, len(hostnames)) * local_world.value,
            f"derived: {len(hostnames)} worker hostname(s) in {hostnames_source} × local world "
            f"size {local_world.value}",
            "PJRT_RENDEZVOUS_NUM_TASKS or TPU_PROCESS_BOUNDS",
        )

    if task_raw is None and num.value > 1:
        # A derived task id from defaults alone would make every process of the world task 0:
        # the second to register would look like a restart of the first and replace it.
        unknown = {}  # what is not known -> the variable that would say it
        if worker.source == "default" and num.value > local_world.value:
            unknown["worker id"] = "TPU_WORKER_ID"
        if local_rank.source == "default" and local_world.value > 1:
            unknown["local rank"] = "PJRT_LOCAL_PROCESS_RANK"
        if unknown:
            raise TopologyError(
                f"the world has {num.value} tasks ({num.source}), but nothing says which one this "
                f"process is: its {' and '.join(unknown)} is not set, so every process would be task 0; "
                f"set PJRT_RENDEZVOUS_TASK_ID (or CLOUD_TPU_TASK_ID) to this process's task id, "
                f"or {' and '.join(unknown.values())}"
            )
    if local_rank.value >= local_world.value:
        raise TopologyError(
            f"local rank {local_rank.value} ({local_rank.source}) must be less than the local world "
            f"size {local_world.value} ({local_world.source}); fix {local_rank.fix} or {local_world.fix}"
        )
    if task.value >= num.value:
        raise TopologyError(
            f"task id {task.value} ({task.source}) must be less than the number of tasks "
            f"{num.value} ({num.source}); fix {task.fix} or {num.fix}"
        )

    # Coordinator address (as detect_address finds it).
    given = _given_address(env, address)

    return Topology(
        accelerator_type=accelerator_type,
        cores_per_chip=cores,
        chips_per_process=chips,
        task_id=task.value,
        num_tasks=num.value,
        local_rank=local_rank.value,
        local_world_size=local_world.value,
        worker_id=worker.value,
        worker_hostnames=hostnames,
        host=hostnames[worker.value] if hostnames else hostname(),
        address=given or _default_address(hostnames),
        address_defaulted=given is None and not hostnames,
    )
