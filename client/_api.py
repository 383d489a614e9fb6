"""The module-level API: one client per process, one binding per thread.

Thread safety: ``init`` and ``shutdown`` take ``_lock``; everything else reads the
process client (set once) and the calling thread's binding.
"""

from __future__ import annotations

import atexit
import collections.abc
import logging
import os
import sys
import threading
import urllib.error
from typing import Any, Mapping, Sequence

from ._client import Binding, Client, _check_call, _payload_bytes, current_binding, inherited, xm_binding
from ._config import DEFAULT, Settings, check_setting_names, check_timeout
from ._errors import InvalidArgumentError, ParticipantFailedError, UsageError
from ._topology import Topology, detect_topology, metadata_fetcher, normalize_address

_lock = threading.Lock()
_client: Client | None = None
_init_args: dict | None = None
_atexit_registered = False
log = logging.getLogger("pjrt_rendezvous.client")
# init()'s parameters left out (anything else given means "these arguments")
_DEFAULTS = {"address": None, "job": None, "timeout": DEFAULT, "topology": None, "env": None}

_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes"


# (url, key) -> the metadata server's answer, or None for its "not found": what a VM's
# server says does not change while the VM runs, and an unbound thread's xm call detects the
# topology at each call (_world_of_one). Other errors (timeouts) are not kept.
_metadata_answers: dict[tuple[str, str], str | None] = {}


def metadata(env: Mapping[str, str]):
    """The metadata server's fetcher for ``env``, or None. The server exists only on Cloud
    TPU VMs: it is asked only there (PJRT_DEVICE=TPU) or when a test points
    PJRT_RENDEZVOUS_METADATA_URL at its own server. Each key is fetched once per process."""
    url = env.get("PJRT_RENDEZVOUS_METADATA_URL")
    if url is None and env.get("PJRT_DEVICE", "").upper() == "TPU":
        url = _METADATA_URL
    if not url:
        return None
    fetch = metadata_fetcher(url)

    def fetch_once(key: str) -> str:
        if (url, key) not in _metadata_answers:
            try:
                _metadata_answers[(url, key)] = fetch(key)
            except urllib.error.HTTPError as error:
                if error.code != 404:
                    raise
                _metadata_answers[(url, key)] = None
        answer = _metadata_answers[(url, key)]
        if answer is None:
            raise FileNotFoundError(f"{url}/{key}: not found (HTTP 404)")
        return answer

    return fetch_once


def _detect(env: Mapping[str, str], address: str | None) -> Topology:
    return detect_topology(env, address=address, metadata=metadata(env), runtime_devices=_runtime_devices)


def started_xla_runtime():
    """``torch_xla.runtime`` once torch_xla has started its runtime, else None (it is never
    imported or started from here: its configuration is the caller's)."""
    torch_xla = sys.modules.get("torch_xla")
    if torch_xla is None or not torch_xla._XLAC._xla_runtime_is_initialized():
        return None
    import torch_xla.runtime as xr

    return xr


def _runtime_devices() -> int | None:
    """The XLA runtime's devices in this process once torch_xla has started it; None before."""
    if started_xla_runtime() is None:
        return None
    import torch_xla.core.xla_model as xm

    count = len(xm.get_xla_supported_devices())
    log.info("cores per chip from the XLA runtime: %d device(s) in this process", count)
    return count


def init(
    address: str | None = None,
    *,
    job: str | None = None,
    timeout=DEFAULT,
    topology: Topology | None = None,
    env: Mapping[str, str] | None = None,
    **settings,
) -> Client:
    """Creates this process's client, or returns the one already created.

    Args:
        address: the coordinator as ``host:port``. Default: ``PJRT_RENDEZVOUS_ADDRESS``,
            else TPU worker 0 of ``TPU_WORKER_HOSTNAMES`` at the default port, else
            ``localhost``.
        job: the job on the coordinator (default ``PJRT_RENDEZVOUS_JOB``, else ``default``).
        timeout: default deadline in seconds for every wait; None waits forever. Default
            ``PJRT_RENDEZVOUS_TIMEOUT``, else 600.
        topology: the process's place in the pod; detected from ``env`` when left out.
        env: the environment to read (default ``os.environ``).
        **settings: further :class:`Settings` fields (``connect_timeout``, ``batch_window``).

    Returns:
        The process-wide :class:`Client`.

    Raises:
        UsageError: called again with different arguments, or bad settings.
        TopologyError: the environment does not describe a valid topology.
        TypeError: an argument or setting of the wrong type (``timeout="10"``, ``job=5``).
    """
    global _client, _init_args, _atexit_registered
    # (an int address failed deep in the address parser with AttributeError: 'strip', a str
    # topology or env with AttributeError too, and an argument compared with a client's)
    if address is not None and not isinstance(address, str):
        raise TypeError(f"init() address must be a str 'host:port' or None, got {address!r}")
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"init() topology must be a Topology or None, got {topology!r}")
    if env is not None and not isinstance(env, collections.abc.Mapping):
        raise TypeError(f"init() env must be a mapping of variable names to values or None, got {type(env).__name__}")
    args = dict(address=address, job=job, timeout=timeout, topology=topology, env=env, **settings)
    explicit = sorted(k for k, v in args.items() if v is not _DEFAULTS.get(k, DEFAULT))
    with _lock:
        if _client is not None and _client._closed:  # closed by hand: a new one, as after shutdown()
            _client = None
        if _client is not None:
            check_setting_names(settings)  # (else said to differ from the first call's)
            differ = [k for k in explicit if args != _init_args and not _same(_client, k, args[k])]
            if differ:
                raise UsageError(
                    f"init() was already called in this process with other arguments (now "
                    f"{differ}); call shutdown() first to change them"
                )
            return _client
        env = os.environ if env is None else env
        topology = topology or _detect(env, address)
        given = dict(settings, timeout=timeout)
        if job is not None:
            given["job"] = job
        address = topology.address if not address else normalize_address(address, "init(address=)")
        _client = Client(Settings.resolve(env, address=address, **given), topology)
        _init_args = args
        if not _atexit_registered:
            atexit.register(shutdown)  # leave the job on a normal exit
            _atexit_registered = True
        return _client


def _same(client: Client, name: str, value) -> bool:
    """Whether init()'s argument ``name`` asks for what ``client`` has already (it may have
    been made by an init() without arguments: a Store's, spawn's)."""
    if name == "address":
        try:
            return normalize_address(value, "init(address=)") == client.settings.address
        except UsageError:
            return False
    if name == "topology":
        return value == client.topology
    if name == "env":
        used = None if _init_args is None else _init_args["env"]
        return dict(value) == dict(os.environ if used is None else used)
    if name in ("fan_in", "transport") and isinstance(value, str):
        value = value.lower()  # (as Settings takes it)
    return getattr(client.settings, name, _same) == value


def shutdown() -> None:
    """Closes the process client (the next :func:`init` creates a new one)."""
    global _client, _init_args
    with _lock:
        client, _client, _init_args = _client, None, None
    if client is not None:
        client.close()


def _after_fork_in_child() -> None:
    """A forked child cannot use its parent's client: its gRPC channel, session socket and
    threads are the parent's (calls hung for their retry budget). The child's first use
    makes its own, as after :func:`shutdown`: from the child's environment (a child of
    ``xla.spawn(start_method="fork")`` is another task) and its own ``init`` arguments. The
    parent's is never closed here (that would tell the coordinator its threads left)."""
    global _client, _init_args, _lock
    _lock = threading.Lock()  # (held by a parent's thread at the fork, it would stay held)
    _client = _init_args = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def get_client() -> Client:
    """The process client, created from the environment on first use."""
    client = _client  # (read once: a shutdown() in another thread sets it to None)
    return client if client is not None and not client._closed else init()


def bind_thread(thread_index: int, **kwargs) -> Binding:
    """Registers the calling thread as device ``thread_index`` of this process.

    Returns the :class:`Binding`, usable as a context manager::

        with pjrt_rendezvous.client.bind_thread(index):
            ordinal = pjrt_rendezvous.client.get_ordinal()

    See :meth:`Client.bind_thread` for the keyword arguments and errors.
    """
    return get_client().bind_thread(thread_index, **kwargs)


def unbind_thread() -> None:
    """Forgets the calling thread's binding, if it has one (see :meth:`Client.unbind_thread`:
    its ordinal stays registered, its replica is not ended)."""
    from ._client import _bound

    # (or the binding of a client closed since, which calls name until it is forgotten)
    binding = getattr(_bound, "binding", None) or getattr(_bound, "closed", None)
    if binding is not None:
        binding.client.unbind_thread()


def _world_of_one() -> bool:
    """Whether the job is a world of one, as the environment (or the process client) lays it
    out and the started XLA runtime agrees: under torch_xla's own runner (``xmp.spawn``,
    ``torch_xla.launch``) the environment names no job, while the runtime runs a replica per
    device, and each unbound thread was answered as ordinal 0 of one, its rendezvous alone."""
    client = _client  # (read once, as in get_client)
    topology = client.topology if client is not None else _detect(os.environ, None)
    if topology.world_size != 1:
        return False
    runtime = started_xla_runtime()
    return runtime is None or runtime.world_size() == 1


def _binding(what: str) -> Binding | None:
    binding = current_binding()
    if binding is None:
        xm_binding(f"{what}()")  # (refuses a thread bound through a client closed since)
    if binding is None and not _world_of_one():
        raise UsageError(
            f"{what}() needs a bound thread: call pjrt_rendezvous.client.bind_thread(index) in "
            "this thread first (pjrt_rendezvous.client.xla.spawn does it for you)"
        )
    return binding


def get_ordinal() -> int:
    """The calling thread's global ordinal: task id x devices per process + thread index."""
    binding = _binding("get_ordinal")
    return 0 if binding is None else binding.ordinal


def get_local_ordinal() -> int:
    """The calling thread's ordinal within its host: local rank x devices + thread index."""
    binding = _binding("get_local_ordinal")
    return 0 if binding is None else binding.local_ordinal


def get_world_size() -> int:
    """Number of ordinals in the job: tasks x devices per process."""
    binding = _binding("get_world_size")
    return 1 if binding is None else binding.world_size


def master_local(local, what: str) -> bool:
    """``local`` of an ``is_master_ordinal`` call (``what`` names it) as a bool: True, False,
    or what equals 1 or 0 (an int, numpy's bool); anything else is a TypeError. torch_xla
    reads any value by its truth, so local="no" or local=None (meant as "the default"?)
    asked about global ordinal 0 or local one without a word: refused here instead."""
    if local is True or local is False:
        return local
    try:
        if not isinstance(local, (str, bytes)) and (local == 1 or local == 0):
            return bool(local)
    except (TypeError, ValueError):  # (an array's truth value)
        pass
    raise TypeError(f"{what} local must be a bool (True: local ordinal 0, False: global), got {local!r}")


def is_master_ordinal(local: bool = True) -> bool:
    """True for local ordinal 0 (``local=True``) or global ordinal 0. ``local`` may be 1 or 0
    too (torch_xla's is read by its truth); a str, None or another type is a TypeError."""
    local = master_local(local, "is_master_ordinal()")
    binding = _binding("is_master_ordinal")
    return binding is None or (binding.local_ordinal if local else binding.ordinal) == 0


def rendezvous(
    tag: str, payload: bytes = b"", replicas: Sequence[int] = (), *, timeout=DEFAULT
) -> list[bytes]:
    """Waits until every ordinal in ``replicas`` (default: all) made its matching call;
    returns their payloads in ascending ordinal order.

    A participant's k-th call on a replica group is round k of that group; every member
    must bring the same tag to a round.

    Args:
        tag: names the round; a mismatch fails the round for every member.
        payload: this ordinal's bytes.
        replicas: the participating ordinals; empty means all.
        timeout: seconds to wait (default: the configured one); None waits forever.

    Returns:
        ``list[bytes]``, one payload per participating ordinal, ordered by ordinal.

    Raises:
        TypeError: ``payload`` is not bytes, ``tag`` not a str, or ``replicas`` not a
            sequence of ints (a dict, str or bytes is not).
        UsageError: the calling thread is not bound (in a world of more than one).
        MismatchError: members brought different tags, or disagree on replicas.
        InvalidArgumentError: the caller is not in ``replicas``, or replicas repeat or are
            out of the world's range.
        LimitExceededError: a member's tag or payload is over the coordinator's limit
            (the round fails for every member).
        ParticipantFailedError: a member died or restarted, or the job moved to a new
            generation since this thread's last round (once per move: the next call is
            of the new generation).
        RendezvousTimeout: the deadline passed; the message names every missing
            ordinal with its host, its process's pid and when it was last seen.
        CoordinatorUnavailableError: the coordinator could not be reached within
            ``connect_timeout`` (one restarted within it is found again).
    """
    return _rendezvous("rendezvous", tag, payload, replicas, timeout)


def _rendezvous(what: str, tag: str, payload: bytes, replicas: Sequence[int], timeout) -> list[bytes]:
    binding = _binding(what)
    if binding is None:  # a world of one needs no coordinator; the same refusals as in more
        payload = _payload_bytes(payload)
        replicas = _check_call(tag, replicas)
        if timeout is not DEFAULT:
            check_timeout(timeout)
        # (as a bound thread is told, by its client or the coordinator)
        out_of_range = sorted({r for r in replicas if r != 0})
        if out_of_range:
            raise InvalidArgumentError(
                f"replicas {out_of_range} are out of range [0, 1) for a world of one (called by ordinal 0 "
                f"with tag {tag!r})"
            )
        if len(replicas) > 1:
            raise InvalidArgumentError(f"ordinal 0 called {what}({tag!r}) with replicas listing ordinal 0 more than once")
        return [payload]
    if _ended:  # (after the caller's own mistakes: its sibling's end is not the culprit of a str payload)
        replicas = _check_ended(what, tag, replicas, payload)
    if inherited(binding.client):  # (refused by the client too, as "rendezvous")
        binding.client._refuse_if_inherited(what, tag)
    return binding.client.rendezvous(binding, tag, payload, replicas, timeout=timeout)


# Ordinals of this process whose replica (xla.spawn's fn) has ended -> how ("returned", ...):
# a sibling's round that needs one fails at once (_check_ended), before it is sent (spawn
# tells the coordinator too, Client.end_replicas, for the rounds already waiting elsewhere).
_ended: dict[int, str] = {}


def _check_ended(what: str, tag: str, replicas: Sequence[int] = (), payload: Any = b"") -> list[int]:
    """Refuses a round that needs an ordinal of this process whose replica has ended: it
    would wait for it until its timeout (torch_xla's for ever). The call's own arguments are
    checked first (``payload`` too). Returns ``replicas`` as the list of ints the call is to
    take (read once: a generator, a numpy array)."""
    _payload_bytes(payload)
    replicas = _check_call(tag, replicas)
    ended = sorted(_ended if not replicas else _ended.keys() & set(replicas))
    if ended:
        hows = "; ".join(f"ordinal {o}: {_ended[o]}" for o in ended)
        raise ParticipantFailedError(
            f"{what}({tag!r}) needs ordinal {', '.join(map(str, ended))} of this process, whose "
            f"replica (spawn's fn) has already ended ({hows}); every replica must make the same calls"
        )
    return replicas


def barrier(tag: str, *, replicas: Sequence[int] = (), timeout=DEFAULT) -> None:
    """A rendezvous with an empty payload: returns once every member arrived."""
    _rendezvous("barrier", tag, b"", replicas, timeout)
