"""A ``torch.distributed.Store`` on the coordinator's key-value store, and the
``pjrt-rendezvous://`` ``init_method``.

Needs torch 2.2 or newer (the ``[torch]`` extra: the errors below subclass torch's
``DistStoreError`` and ``DistNetworkError``, new in 2.2), not torch_xla. Importing this module
registers the URL scheme with ``torch.distributed.rendezvous``.

Ranks of a process group are not our ordinals: the Store needs no bound thread, only a client.
Keys live under a prefix in the coordinator job, so several groups (and several jobs) share one
coordinator without colliding.

Timeouts follow torch's conventions here, not ours: ``timedelta`` values, and a zero timeout
means "no timeout" (c10d's ``kNoTimeout``). Errors are torch's kinds as well as ours: a wait
that times out raises :class:`StoreTimeout` (our
:class:`~pjrt_rendezvous.client.RendezvousTimeout`, naming the missing keys, and torch's
``DistStoreError``), a refused call :class:`StoreError` (``DistStoreError``), an unreachable
coordinator :class:`StoreUnavailable` (``DistNetworkError``).

torch's C++ side does not keep a Python store alive (pytorch#106633): once the caller's last
reference went, a process group's later use of it (``new_group``, store-based barriers)
failed with "pure virtual function" errors. So every :class:`Store` lives as long as its
process (they are small, and a process makes a handful).
"""

from __future__ import annotations

import atexit
import functools
import os
import socket
import threading
import time
import urllib.parse
import uuid
import warnings
from datetime import timedelta
from typing import Iterable, Sequence

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from torch.distributed.rendezvous import register_rendezvous_handler

from . import _api
from ._client import Client, _integer, _key_list, inherited, store_callers
from ._config import Settings, check_timeout
from ._errors import CoordinatorUnavailableError, RemoteError, RendezvousTimeout, UsageError
from ._topology import DEFAULT_PORT, Topology, host_port

SCHEME = "pjrt-rendezvous"
DEFAULT_PREFIX = "torch.distributed"
# torch's default store timeout (c10d Store::kDefaultTimeout).
DEFAULT_TIMEOUT = timedelta(seconds=300)
_AT_ONCE = 0.001  # seconds: a wait that expires at once (ours take no 0, which means none)


class StoreTimeout(RendezvousTimeout, dist.DistStoreError):
    """A Store wait timed out: catchable as ``RendezvousTimeout`` and as torch's ``DistStoreError``."""


class StoreError(RemoteError, dist.DistStoreError):
    """The coordinator refused a Store call (``code`` says why): our ``RemoteError`` and
    torch's ``DistStoreError``."""


class StoreUnavailable(CoordinatorUnavailableError, dist.DistNetworkError):
    """The coordinator could not be reached for a Store call: our
    ``CoordinatorUnavailableError`` and torch's ``DistNetworkError``."""


_kept: list["Store"] = []  # every Store, for as long as the process lives (module docstring)
_kept_lock = threading.Lock()


def _as_torch_errors(method):
    """Raises a Store method's errors as torch's kinds too (module docstring)."""

    @functools.wraps(method)
    def call(self: "Store", *args, **kwargs):
        me = threading.get_ident()
        store_callers[me] = (self.client, threading.current_thread())  # (Client.close lets them leave)
        try:
            return method(self, *args, **kwargs)
        except RemoteError as exc:
            raise _torch_error(exc, self._root) from exc
        finally:
            store_callers.pop(me, None)

    return call


def _torch_error(exc: RemoteError, root: str) -> RemoteError:
    """``exc`` as torch's kind too (module docstring); ``root``: the prefix of its keys."""
    if isinstance(exc, RendezvousTimeout):
        # ("wait timeout", as torch's stores begin it: callers look for "timeout" in it)
        return StoreTimeout(f"wait timeout: {exc} (keys are stored under the prefix {root!r})")
    if isinstance(exc, CoordinatorUnavailableError):
        return StoreUnavailable(str(exc))
    return StoreError(str(exc), code=exc.code)


def _run_prefix(prefix: str, client: Client | None = None, timeout: float | None = None) -> str:
    """``prefix``, and under torchrun its run id and an id of this attempt (worker group)
    that its workers agree on (``_attempt``): a later run or restart on a long-lived
    coordinator does not meet this one's keys (gloo read a dead worker's address there)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return prefix
    if run_id == "none":  # torchrun's default --rdzv-id: every run's
        run_id = _invocation_id() or run_id
    root = f"{prefix}/{run_id}" if prefix else run_id
    return f"{root}/{_attempt(root, client, timeout)}"


_attempts: dict[str, str] = {}  # run root -> this process's attempt there (_attempt)
_attempts_lock = threading.Lock()
_agreeing: dict[str, threading.Lock] = {}  # run root -> held while this process agrees on it


def _attempt(root: str, client: Client | None, timeout: float | None) -> str:
    """This worker's attempt of the torchrun run ``root``, agreed with every worker of it
    once per process (rank 0 makes it up; ``_agree``). Not the restart count, which each
    node's agent keeps: a node restarted because another joined or failed keeps its count,
    and its workers would wait under another prefix until their timeout. Without ``RANK``
    and ``WORLD_SIZE`` (a dynamic group), the restart count it is."""
    with _attempts_lock:
        if root in _attempts:
            return _attempts[root]
        agreeing = _agreeing.setdefault(root, threading.Lock())
    with agreeing:  # (two threads agreeing at once, each with a nonce of its own, waited each other out)
        with _attempts_lock:
            if root in _attempts:
                return _attempts[root]
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except (KeyError, ValueError):
            rank = world = -1
        if not 0 <= rank < world:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        else:
            try:
                attempt = _agree(client or _api.get_client(), f"{root}/attempts/", rank, world, timeout)
            except RemoteError as exc:  # (torch's kinds too, as the Store's own calls)
                raise _torch_error(exc, root) from exc
        with _attempts_lock:
            return _attempts.setdefault(root, attempt)


def _agree(client: Client, base: str, rank: int, world: int, timeout: float | None) -> str:
    """Rank 0's fresh id, as every rank of this attempt gets it, under ``base``, where earlier
    attempts left their keys: each rank says hello with a nonce of its own; rank 0 answers
    every nonce it sees (a stale one from an earlier attempt too: nobody waits on it) under
    a key named by it, and returns once each rank's latest hello is acknowledged with its id
    (an acknowledgement left by an earlier attempt names another id)."""
    nonce = uuid.uuid4().hex
    client.set(f"{base}hello/{rank}", nonce.encode())
    if rank != 0:
        attempt = client.get(f"{base}for/{nonce}", timeout=timeout).decode()  # (rank 0 answers it)
        client.set(f"{base}ack/{rank}", f"{nonce}:{attempt}".encode())
        return attempt
    attempt = uuid.uuid4().hex[:12]
    hellos = [f"{base}hello/{r}" for r in range(world)]
    acks = [f"{base}ack/{r}" for r in range(world)]
    client.set(acks[0], f"{nonce}:{attempt}".encode())
    deadline = None if timeout is None else time.monotonic() + timeout
    served: set[bytes] = set()
    pause = 0.005
    while True:
        seen = client.multi_get(hellos, wait=False)
        fresh = list({h for h in seen if h is not None and h not in served})
        if fresh:
            client.multi_set([f"{base}for/{h.decode()}" for h in fresh], [attempt.encode()] * len(fresh))
            served.update(fresh)
        answered = client.multi_get(acks, wait=False)
        waiting = [r for r, (h, a) in enumerate(zip(seen, answered)) if h is None or a != h + b":" + attempt.encode()]
        if not waiting:
            return attempt
        if deadline is not None and time.monotonic() >= deadline:
            from pjrt_rendezvous.coordinator._core import format_ranges

            raise RendezvousTimeout(
                f"rank 0 waited {timeout:g} s for rank{'s' if len(waiting) > 1 else ''} {format_ranges(waiting)} "
                "of this torchrun attempt to start "
                f"(keys under {base!r}): every worker makes a Store or a {SCHEME}:// rendezvous"
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.2)


@functools.cache
def _invocation_id() -> str | None:
    """An id of this torchrun invocation that all its workers agree on, through the store of
    torchrun's agent (new for each invocation, kept across its restarts; its workers reach it
    as ``env://`` does); None without one."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not host or not port:
        return None
    try:
        agent = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
        return agent.compare_set("pjrt_rendezvous/invocation", "", uuid.uuid4().hex).decode()
    except (RuntimeError, ValueError) as exc:  # (DistError is a RuntimeError)
        warnings.warn(
            f"cannot reach torchrun's store at {host}:{port} ({exc}); keys go under the run id 'none', "
            "which every run without --rdzv-id shares: give a prefix",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def _key_bytes(value) -> bytes:
    # torch's own stores accept str or bytes from Python callers; C++ callers pass bytes.
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"Store values must be bytes or str, got {type(value).__name__}")


def _seconds(timeout: timedelta | float | None) -> float | None:
    """torch's timeout (timedelta; zero = no timeout) as our seconds (None = no timeout)."""
    if timeout is None:
        return None
    if not isinstance(timeout, (timedelta, int, float)) or isinstance(timeout, bool):  # ('x' raised float()'s ValueError)
        raise TypeError(f"timeout must be a timedelta or a number of seconds, got {timeout!r}")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if seconds < 0:
        raise UsageError(f"timeout must not be negative, got {timeout!r}")
    return None if seconds == 0 else check_timeout(seconds)


class Store(dist.Store):
    """A ``torch.distributed.Store`` backed by the coordinator's key-value store.

    Usable wherever torch takes a store::

        store = Store(prefix="my-run")          # the process client, from the environment
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)

    Every method gloo and ``init_process_group`` call is implemented, under the names C++
    calls (``deleteKey`` and ``getNumKeys`` are camelCase; torch's ``delete_key`` and
    ``num_keys`` reach them). Blocking calls (``get``, ``wait``) wait up to the store's timeout
    (``set_timeout``; for a ``pjrt-rendezvous://`` URL torch sets the process group's, but a
    Store passed as ``store=`` keeps its own, as a TCPStore does).

    Args:
        client: the client to use (default: the process client, created from the environment
            on first use). No thread needs to be bound.
        prefix: a namespace in the coordinator job; stores with the same prefix see the same
            keys. Default: ``torch.distributed``, and under torchrun also its run id
            (``TORCHELASTIC_RUN_ID``) and an id of the attempt its workers agree on (every
            worker makes a Store or a ``pjrt-rendezvous://`` rendezvous first), as for the
            URL. Give every run on a long-lived coordinator its own prefix (or job) when it
            is not run by torchrun: keys outlive processes there, unlike a TCPStore.
        timeout: the default for blocking calls (``timedelta`` or seconds; 0 = no timeout).
    """

    def __init__(
        self,
        client: Client | None = None,
        *,
        prefix: str | None = None,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__()
        if client is not None and not isinstance(client, Client):
            raise TypeError(
                f"client must be a pjrt_rendezvous.client.Client or None (the process's client), got {client!r}; "
                "for an address, pass pjrt_rendezvous.client.init(address) or use the URL pjrt-rendezvous://HOST:PORT"
            )
        seconds = _seconds(timeout)
        if prefix is None:
            prefix = _run_prefix(DEFAULT_PREFIX, client, seconds)
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {prefix!r}")
        self._client = client
        self._url: tuple | None = None  # (address, job, timeout) when made for a URL (rendezvous_handler)
        self.prefix = prefix
        self._root = prefix.rstrip("/") + "/" if prefix else ""
        # (a timedelta kept as given: one of 21 days or more read as 0; seconds at least a
        # millisecond before timedelta rounds them: under half a microsecond became 0, no timeout)
        self.set_timeout(
            timeout if isinstance(timeout, timedelta)
            else timedelta(0) if seconds is None else timedelta(seconds=max(seconds, _AT_ONCE))
        )
        with _kept_lock:
            _kept.append(self)

    def set_timeout(self, timeout: timedelta) -> None:
        seconds = _seconds(timeout)  # refused here, not at the next wait
        if seconds is not None and seconds < 0.001:
            # torch keeps whole milliseconds: under one became 0, which is no timeout
            timeout = timedelta(milliseconds=1)
        super().set_timeout(timeout)

    @property
    def client(self) -> Client:
        if self._client is None:
            return _api.get_client()
        if self._url is not None and self._client._closed:
            # The process client it was given was shut down (pr.shutdown(), perhaps to init()
            # again): the URL's coordinator is asked through the client _client_for finds now.
            self._client = _client_for(*self._url)
        if inherited(self._client):  # a forked child: its parent's client does not work here
            # The same settings (token, TLS) and place: a Store's client only reads and writes keys.
            self._client = Client(self._client.settings, self._client.topology)
        return self._client

    def _key(self, key: str | bytes) -> str:
        if isinstance(key, (bytes, bytearray)):  # as torch's own stores take them
            try:
                key = bytes(key).decode()
            except UnicodeDecodeError:
                raise ValueError(f"Store keys must be UTF-8 text here (the coordinator's keys are text), got {key!r}") from None
        if not isinstance(key, str):
            raise TypeError(f"Store keys must be str, got {type(key).__name__}")
        return self._root + key

    def _wait_seconds(self, timeout=None) -> float | None:
        timeout = self.timeout if timeout is None else timeout
        if isinstance(timeout, timedelta) and timeout < timedelta(0):
            # Set from C++ (PrefixStore.set_timeout), past our set_timeout's check, or given to
            # a wait (C++ passes any): it expires at once, as in torch's HashStore (it refused
            # every wait, for keys present too; TCPStore's waits for a missing key for ever).
            return _AT_ONCE
        return _seconds(timeout)

    # -- the c10d Store interface ---------------------------------------------------------

    @_as_torch_errors
    def set(self, key: str, value) -> None:
        self.client.set(self._key(key), _key_bytes(value))

    @_as_torch_errors
    def get(self, key: str) -> bytes:
        """Waits up to the store timeout for ``key``; returns its value."""
        return self.client.get(self._key(key), timeout=self._wait_seconds())

    @_as_torch_errors
    def add(self, key: str, value: int) -> int:
        """Adds the int ``value`` (numpy's too; not a bool, float or str: TypeError) to ``key``."""
        return self.client.add(self._key(key), _integer(value, "Store add value"))

    @_as_torch_errors
    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        """Sets ``key`` to ``desired_value`` if it holds ``expected_value`` (a missing key
        matches an empty ``expected_value``); returns the value after the call."""
        return self.client.compare_set(self._key(key), _key_bytes(expected_value), _key_bytes(desired_value))

    @_as_torch_errors
    def check(self, keys: Sequence[str]) -> bool:
        return self.client.check([self._key(k) for k in _key_list(keys)])

    @_as_torch_errors
    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Waits until every key exists, up to ``timeout`` (default: the store timeout)."""
        self.client.wait([self._key(k) for k in _key_list(keys)], timeout=self._wait_seconds(timeout))

    @_as_torch_errors
    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self.client.multi_get([self._key(k) for k in _key_list(keys)], timeout=self._wait_seconds())

    @_as_torch_errors
    def multi_set(self, keys: Sequence[str], values: Iterable) -> None:
        keys, values = [self._key(k) for k in _key_list(keys)], [_key_bytes(v) for v in values]
        if len(keys) != len(values):  # (torch's stores raise DistStoreError)
            raise StoreError(f"multi_set got {len(keys)} keys but {len(values)} values", code="INVALID_ARGUMENT")
        self.client.multi_set(keys, values)

    @_as_torch_errors
    def append(self, key: str, value) -> None:
        self.client.append(self._key(key), _key_bytes(value))

    def has_extended_api(self) -> bool:
        return True

    @_as_torch_errors
    def deleteKey(self, key: str) -> bool:  # noqa: N802 -- the name C++ calls
        return self.client.delete(self._key(key))

    @_as_torch_errors
    def getNumKeys(self) -> int:  # noqa: N802 -- the name C++ calls
        """Keys under this store's prefix."""
        return self.client.count(self._root)

    def clone(self) -> "Store":
        """Another Store on the same keys (kept alive as every Store is; torch's
        ``PrefixStore`` and group splitting clone the store)."""
        clone = Store(self._client, prefix=self.prefix)
        dist.Store.set_timeout(clone, self.timeout)  # (a negative one too, set from C++: _wait_seconds)
        clone._url = self._url
        return clone

    def __repr__(self) -> str:
        address = self._client.settings.address if self._client else "(process client)"
        return f"Store(address={address!r}, prefix={self.prefix!r}, timeout={self.timeout})"


# -- the pjrt-rendezvous:// init_method --------------------------------------------------------

_clients_lock = threading.Lock()  # guards _clients and _generations
_clients: dict[tuple[str, str | None, float | None], Client] = {}  # (address, job, connect budget)
_generations: dict[tuple[str, str, str], int] = {}


def _address(parsed: urllib.parse.ParseResult, url: str) -> str:
    try:
        host, port = parsed.hostname, DEFAULT_PORT if parsed.port is None else parsed.port
    except ValueError as exc:
        raise UsageError(f"{url!r}: {exc}") from None
    if not host:
        raise UsageError(f"{url!r} names no coordinator host: use {SCHEME}://HOST:PORT")
    if port == 0:
        raise UsageError(f"{url!r}: port 0 is no coordinator's port")
    return host_port(host, port)


def _client_for(address: str, job: str | None, timeout: timedelta | None = None) -> Client:
    """A client that looks for an unreachable coordinator as long as ``timeout``
    (init_process_group's, as TCPStore's connect) unless PJRT_RENDEZVOUS_CONNECT_TIMEOUT says
    otherwise: the process client when it talks to ``address`` (and ``job``), is not closed
    and looks no longer than that (it took its own 60 s for a timeout of 3), else a
    key-value-only client of our own, one per (address, job, budget)."""
    seconds = _seconds(timeout)
    if seconds is not None and os.environ.get("PJRT_RENDEZVOUS_CONNECT_TIMEOUT"):
        seconds = None
    process_client = _api._client
    if (
        process_client is not None
        and not process_client._closed
        and process_client.settings.address == address
        and (job is None or process_client.settings.job == job)
        and (seconds is None or process_client.settings.connect_timeout <= seconds)
    ):
        return process_client
    with _clients_lock:
        client = _clients.get((address, job, seconds))
        if client is None:
            given = {} if job is None else {"job": job}
            if seconds is not None:
                given["connect_timeout"] = seconds
            settings = Settings.resolve(os.environ, address=address, **given)
            # A Store client only uses the key-value calls; its topology is never registered.
            topology = Topology(
                accelerator_type=None, cores_per_chip=1, chips_per_process=1, task_id=0,
                num_tasks=1, local_rank=0, local_world_size=1, worker_id=0,
                worker_hostnames=(), host=socket.gethostname(), address=address,
            )
            if not _clients:
                atexit.register(_close_clients)
            client = _clients[(address, job, seconds)] = Client(settings, topology)
        return client


def _close_clients() -> None:
    """At the interpreter's exit, as shutdown() the process client: a Store's caller still
    looking for a coordinator gone is let out of torch's frames (Client.close)."""
    with _clients_lock:
        clients = list(_clients.values())
    for client in clients:
        client.close()


def _int_arg(query: dict, name: str, env_name: str, url: str) -> int:
    source = f"{name}= (init_process_group's argument or the URL)" if name in query else env_name
    text = query.get(name, os.environ.get(env_name))
    if text is None:
        raise UsageError(
            f"{SCHEME}:// rendezvous: {name} is missing: pass {name}= to init_process_group, "
            f"put ?{name}= in the URL ({url!r}), or set {env_name}"
        )
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{SCHEME}:// rendezvous: {name} {text!r} (from {source}) is not an int") from None


_URL_PARAMETERS = ("job", "prefix", "rank", "world_size")  # (torch adds rank and world_size)


def rendezvous_handler(url: str, timeout: timedelta = default_pg_timeout, **kwargs):
    """The ``pjrt-rendezvous://HOST:PORT[?job=J&prefix=P&rank=R&world_size=N]`` init_method.

    ``timeout`` is ``init_process_group``'s; without one (``torch.distributed.rpc``), torch's
    handlers' default, ``default_pg_timeout``.
    ``rank`` and ``world_size`` come from ``init_process_group``'s arguments (torch puts them in
    the query), the URL, or ``RANK``/``WORLD_SIZE``. Keys go under ``prefix`` (default
    ``torch.distributed``; under torchrun also ``TORCHELASTIC_RUN_ID`` and the attempt's id,
    ``_run_prefix``) plus the number of groups this process created there before, so a
    process group created again after ``destroy_process_group`` does not meet the previous
    one's keys (every rank makes the same groups on the URL, in the same order). A rank of a
    world of several that joined those keys before, in another process (an earlier run with
    the same prefix), is refused: ``UsageError`` naming ``?prefix=``.

    Yields:
        ``(Store, rank, world_size)``, as torch's handlers do.
    """
    parsed = urllib.parse.urlparse(url)
    query = {k: v[-1] for k, v in urllib.parse.parse_qs(parsed.query, keep_blank_values=True).items()}
    unknown = sorted(set(query) - set(_URL_PARAMETERS))
    if unknown:  # (a mistyped prefix put the keys under the default one, shared across runs)
        import difflib

        close = [difflib.get_close_matches(name, _URL_PARAMETERS, n=1) for name in unknown]
        hints = "".join(f"; {name}: did you mean {match[0]}?" for name, match in zip(unknown, close) if match)
        raise UsageError(
            f"{SCHEME}:// rendezvous: unknown parameter(s) {', '.join(unknown)} in {url!r} "
            f"(known: {', '.join(_URL_PARAMETERS)}){hints}"
        )
    address = _address(parsed, url)
    rank = _int_arg(query, "rank", "RANK", url)
    world_size = _int_arg(query, "world_size", "WORLD_SIZE", url)
    if world_size < 1 and world_size != -1:  # (-1: not known, as torch.distributed.rpc's dynamic groups pass)
        raise UsageError(f"{SCHEME}:// rendezvous: world size must be at least 1 (or -1: not known), got {world_size}")
    if not 0 <= rank < (world_size if world_size > 0 else rank + 1):
        raise UsageError(f"{SCHEME}:// rendezvous: rank {rank} is out of range for world size {world_size}")
    job = query.get("job") or None
    client = _client_for(address, job, timeout)
    # Under torchrun a given prefix gets the run and attempt too: a restarted attempt's
    # workers count their groups from 0 again, and met the failed attempt's gloo addresses.
    prefix = _run_prefix(query.get("prefix", DEFAULT_PREFIX), client, _seconds(timeout))
    counted = (client.settings.address, client.settings.job, prefix)  # (however the URL spells them)
    with _clients_lock:
        generation = _generations.get(counted, 0)
        _generations[counted] = generation + 1
    store = Store(client, prefix=f"{prefix}/{generation}" if prefix else str(generation), timeout=timeout)
    store._url = (address, client.settings.job, timeout)  # (the job in use now: not another after init(job=...))
    # Each rank of a world of several marks the namespace (beside the Store's keys): a mark
    # there before, from another process, is an earlier run's, whose keys this run would read
    # (gloo waited on its peers' addresses without a word). A world of one reads no peer's.
    # (So the handler connects, as TCPStore's clients do: an unreachable coordinator fails
    # init at its timeout.)
    try:
        joined = client.add(f"{store.prefix}.ranks/{rank}", 1) if world_size > 1 else 1
    except RemoteError as exc:
        raise _torch_error(exc, store.prefix) from exc
    if joined > 1:
        raise UsageError(
            f"{SCHEME}:// rendezvous: rank {rank} joined a process group under prefix {store.prefix!r} of job "
            f"{client.settings.job!r} on this coordinator before, in another process: an earlier run's, whose keys "
            "are still there (this run would read its peers' addresses, and gloo wait on them without a word); "
            f"give each run a prefix of its own (?prefix=<run id> in {url!r}), or run under torchrun"
        )
    yield store, rank, world_size
    raise RuntimeError(f"Unable to perform re-rendezvous using {SCHEME}:// method")


def _after_fork_in_child() -> None:
    """The parent's clients do not work in a forked child (see _api): it makes its own.
    (Locks a parent's thread held at the fork would stay held.)"""
    global _clients_lock, _attempts_lock
    _clients_lock, _attempts_lock = threading.Lock(), threading.Lock()
    _clients.clear()
    _agreeing.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _register() -> None:
    try:
        register_rendezvous_handler(SCHEME, rendezvous_handler)
    except RuntimeError:  # already registered (this module was reloaded)
        pass


_register()
