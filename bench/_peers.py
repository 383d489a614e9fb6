"""The systems under test as seen from one worker process: ours, TCPStore (two forms), JAX.

Each system offers the four workloads to the threads of one process:

- ``connect_process`` / ``connect_thread``: open the process's (or the thread's) client;
- ``form_world(t)``: publish this thread's ordinal and learn every ordinal of the world;
- ``barrier(t, r)``: round ``r`` of a barrier over every participant;
- ``allgather(t, r, payload)``: round ``r`` of an all-gather of one payload per participant,
  returning every payload in ordinal order;
- ``kv(t, r)``: set this participant's key of round ``r``, then a blocking get of round
  ``r``'s key of the same thread of the next process (``peer``: another process's key, so
  every get can wait).

"Threads combined locally" means the threads of a process meet at a ``threading.Barrier``
whose action (run by the last thread to arrive) makes the process's one call for all of
them - the trick a user of TCPStore or jax.distributed would write. Ours needs no such
trick for rendezvous rounds: its client combines the threads of a round into one call by
itself. Its key-value workload combines threads locally like the peers' (a multi_set and a
multi_get per process).

The peers are given their best honest form: TCPStore's barrier is torch.elastic's
add / last-member-sets / wait; JAX uses ``wait_at_barrier`` and ``key_value_dir_get``.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from datetime import timedelta

TIMEOUT_S = 60.0  # every wait of every system is bounded by this
KV_SIZE = 64


def payload_for(ordinal: int, r: int, size: int) -> bytes:
    """Ordinal ``ordinal``'s payload of round ``r``: a result of another round, or another
    ordinal's, does not pass for it."""
    head = b"%08d.%07d" % (ordinal, r)
    return head + b"." * (size - len(head)) if size >= len(head) else head[:size]


def kv_value(ordinal: int, r: int) -> bytes:
    return payload_for(ordinal, r, KV_SIZE)


def _pack(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def _unpack(blob: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(blob):
        (n,) = struct.unpack_from("<I", blob, i)
        out.append(blob[i + 4 : i + 4 + n])
        i += 4 + n
    return out


class _Combiner:
    """Threads of one process meet; the last one to arrive runs ``fn(slots)`` once for all of
    them and every thread gets its result (or its exception)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._slots: list = [None] * threads
        self._arrived = 0
        self._generation = 0
        self._results: dict[int, tuple[bool, object]] = {}
        self._cond = threading.Condition()

    def __call__(self, t: int, value, fn):
        with self._cond:
            generation = self._generation
            self._slots[t] = value
            self._arrived += 1
            leader = self._arrived == self.threads
            if leader:
                slots, self._slots, self._arrived = self._slots, [None] * self.threads, 0
            else:
                while self._generation == generation:
                    if not self._cond.wait(TIMEOUT_S + 10):
                        raise TimeoutError("sibling threads did not arrive")
                ok, result = self._results[generation]
        if leader:
            try:
                ok, result = True, fn(slots)
            except BaseException as exc:  # handed to every thread of the round
                ok, result = False, exc
            with self._cond:
                # A thread cannot be two rounds ahead of a sibling that has not read its result.
                self._results[generation] = (ok, result)
                self._results.pop(generation - 2, None)
                self._generation += 1
                self._cond.notify_all()
        if not ok:
            raise result
        return result


class System:
    name = "?"
    per_thread_clients = False

    def __init__(self, *, address: str, process: int, processes: int, threads: int, job: str) -> None:
        self.address = address
        self.p = process
        self.P = processes
        self.T = threads
        self.N = processes * threads
        self.job = job
        self.combine = _Combiner(threads)

    def ordinal(self, t: int) -> int:
        return self.p * self.T + t

    def peer(self, ordinal: int) -> int:
        """Whose key ``ordinal`` gets in the key-value workload: the same thread of the next
        process (with one process, the next ordinal)."""
        return (ordinal + (self.T if self.P > 1 else 1)) % self.N

    def connect_process(self) -> None:
        pass

    def connect_thread(self, t: int) -> None:
        pass

    def close_thread(self, t: int) -> None:
        pass

    def close_process(self) -> None:
        pass


class Ours(System):
    """pjrt-rendezvous: one Client per process; each thread binds its ordinal."""

    name = "ours"

    def connect_process(self) -> None:
        import grpc

        from pjrt_rendezvous.client._client import Client
        from pjrt_rendezvous.client._config import Settings
        from pjrt_rendezvous.client._topology import Topology

        topology = Topology(
            accelerator_type=None,
            cores_per_chip=self.T,
            chips_per_process=1,
            task_id=self.p,
            num_tasks=self.P,
            local_rank=self.p,
            local_world_size=self.P,
            worker_id=0,
            worker_hostnames=(),
            host="bench-host",
            address=self.address,
        )
        # BENCH_OURS_SETTINGS='{"progress_interval": null}': client settings for experiments
        extra = json.loads(os.environ.get("BENCH_OURS_SETTINGS", "{}"))
        self.client = Client(Settings(address=self.address, job=self.job, timeout=TIMEOUT_S, **extra), topology)
        # The client connects lazily; connection time is the channel becoming ready.
        grpc.channel_ready_future(self.client._channel).result(timeout=TIMEOUT_S)
        self.bindings: list = [None] * self.T

    def form_world(self, t: int) -> int:
        self.bindings[t] = self.client.bind_thread(t)
        table = self.combine(t, None, lambda _: self.client.wait_world(timeout=TIMEOUT_S))
        return len(table)

    def barrier(self, t: int, r: int) -> None:
        self.client.rendezvous(self.bindings[t], "barrier", b"")

    def allgather(self, t: int, r: int, payload: bytes) -> list[bytes]:
        return self.client.rendezvous(self.bindings[t], "gather", payload)

    def kv(self, t: int, r: int) -> bytes:
        # Threads combined locally, as TCPStore's process form and JAX do it: our client
        # combines a round's threads by itself, not key-value calls (a thread's get may
        # wait for a key its siblings' do not).
        def exchange(_):
            c = self.client
            ordinals = [self.ordinal(i) for i in range(self.T)]
            c.multi_set([f"kv/{r}/{o}" for o in ordinals], [kv_value(o, r) for o in ordinals])
            return c.multi_get([f"kv/{r}/{self.peer(o)}" for o in ordinals], timeout=TIMEOUT_S)

        return self.combine(t, None, exchange)[t]

    def close_thread(self, t: int) -> None:
        self.client.unbind_thread()

    def close_process(self) -> None:
        self.client.close()


def _tcpstore(address: str):
    from torch.distributed import TCPStore

    host, port = address.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))


def _store_barrier(store, key: str, members: int) -> None:
    # torch.distributed.elastic.utils.store.barrier: add, the last member sets, all wait.
    if store.add(key, 1) == members:
        store.set(key + "/last", b"1")
    else:
        store.wait([key + "/last"])


class OursStateFile(Ours):
    """Ours with the coordinator keeping a state file (``serve --state-file``), as the image,
    the systemd unit and the Kubernetes manifest run it: every answered change is on disk."""

    name = "ours/state-file"


class TCPStoreThread(System):
    """TCPStore with one client per participant (thread)."""

    name = "tcpstore/thread"
    per_thread_clients = True

    def connect_process(self) -> None:
        self.stores: list = [None] * self.T

    def connect_thread(self, t: int) -> None:
        self.stores[t] = _tcpstore(self.address)

    def form_world(self, t: int) -> int:
        s = self.stores[t]
        o = self.ordinal(t)
        s.set(f"{self.job}/w/{o}", f"bench-host:{self.p}:{t}".encode())
        return len(s.multi_get([f"{self.job}/w/{i}" for i in range(self.N)]))

    def barrier(self, t: int, r: int) -> None:
        _store_barrier(self.stores[t], f"{self.job}/b/{r}", self.N)

    def allgather(self, t: int, r: int, payload: bytes) -> list[bytes]:
        s = self.stores[t]
        s.set(f"{self.job}/g/{r}/{self.ordinal(t)}", payload)
        return s.multi_get([f"{self.job}/g/{r}/{i}" for i in range(self.N)])

    def kv(self, t: int, r: int) -> bytes:
        s = self.stores[t]
        o = self.ordinal(t)
        s.set(f"{self.job}/kv/{r}/{o}", kv_value(o, r))
        return s.get(f"{self.job}/kv/{r}/{self.peer(o)}")

    def close_thread(self, t: int) -> None:
        self.stores[t] = None


class TCPStoreProcess(System):
    """TCPStore with one client per process; threads combined locally."""

    name = "tcpstore/process"

    def connect_process(self) -> None:
        self.store = _tcpstore(self.address)

    def form_world(self, t: int) -> int:
        def publish_and_read(slots):
            s = self.store
            keys = [f"{self.job}/w/{self.ordinal(i)}" for i in range(self.T)]
            s.multi_set(keys, [f"bench-host:{self.p}:{i}".encode() for i in range(self.T)])
            return s.multi_get([f"{self.job}/w/{i}" for i in range(self.N)])

        return len(self.combine(t, None, publish_and_read))

    def barrier(self, t: int, r: int) -> None:
        self.combine(t, None, lambda _: _store_barrier(self.store, f"{self.job}/b/{r}", self.P))

    def allgather(self, t: int, r: int, payload: bytes) -> list[bytes]:
        def gather(slots):
            s = self.store
            s.set(f"{self.job}/g/{r}/{self.p}", _pack(slots))
            blobs = s.multi_get([f"{self.job}/g/{r}/{q}" for q in range(self.P)])
            return [v for blob in blobs for v in _unpack(blob)]

        return self.combine(t, payload, gather)

    def kv(self, t: int, r: int) -> bytes:
        def exchange(slots):
            s = self.store
            ordinals = [self.ordinal(i) for i in range(self.T)]
            s.multi_set([f"{self.job}/kv/{r}/{o}" for o in ordinals], [kv_value(o, r) for o in ordinals])
            return s.multi_get([f"{self.job}/kv/{r}/{self.peer(o)}" for o in ordinals])

        return self.combine(t, None, exchange)[t]

    def close_process(self) -> None:
        self.store = None


class JaxProcess(System):
    """jax.distributed's client (the XLA coordination service), one per process as JAX has it;
    threads combined locally for barrier and all-gather; key-value calls made by each thread on
    the shared client (JAX has no multi-set to combine them into)."""

    name = "jax/process"

    def connect_process(self) -> None:
        from jaxlib import _jax

        # As jax.distributed.initialize makes it (use_compression=True); connect() returns once
        # every process has connected.
        self.client = _jax.get_distributed_runtime_client(
            self.address,
            self.p,
            init_timeout=int(TIMEOUT_S),
            use_compression=True,
            heartbeat_timeout=100,
            shutdown_timeout=int(TIMEOUT_S),
        )
        self.client.connect()
        self._ms = int(TIMEOUT_S * 1000)

    def form_world(self, t: int) -> int:
        def publish_and_read(slots):
            c = self.client
            c.key_value_set(f"w/{self.p}", ",".join(f"bench-host:{self.p}:{i}" for i in range(self.T)))
            c.wait_at_barrier("world", self._ms)
            return [e for _, v in c.key_value_dir_get("w/") for e in v.split(",")]

        return len(self.combine(t, None, publish_and_read))

    def barrier(self, t: int, r: int) -> None:
        self.combine(t, None, lambda _: self.client.wait_at_barrier(f"b{r}", self._ms))

    def allgather(self, t: int, r: int, payload: bytes) -> list[bytes]:
        def gather(slots):
            c = self.client
            c.key_value_set_bytes(f"g{r}/{self.p:06d}", _pack(slots))
            c.wait_at_barrier(f"g{r}", self._ms)
            entries = sorted(c.key_value_dir_get_bytes(f"g{r}/"))
            return [v for _, blob in entries for v in _unpack(blob)]

        return self.combine(t, payload, gather)

    def kv(self, t: int, r: int) -> bytes:
        o = self.ordinal(t)
        self.client.key_value_set_bytes(f"kv/{r}/{o}", kv_value(o, r))
        return self.client.blocking_key_value_get_bytes(f"kv/{r}/{self.peer(o)}", self._ms)

    def close_process(self) -> None:
        self.client.shutdown()  # a barrier of every process, bounded by shutdown_timeout


SYSTEMS = {cls.name: cls for cls in (Ours, OursStateFile, TCPStoreThread, TCPStoreProcess, JaxProcess)}
SERVER_KIND = {"ours": "ours", "ours/state-file": "ours/state-file", "tcpstore/thread": "tcpstore", "tcpstore/process": "tcpstore", "jax/process": "jax"}
