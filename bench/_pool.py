"""Real worker processes (the "processes" of a size) and one benchmark session in each.

The harness imports every library once, then forks the P workers of a size from itself, so
32 processes do not each spend seconds importing torch and jax on a 2-core machine (nothing
has opened a channel or started a server in the parent when it forks). A worker serves
sessions until told to stop: one session = one system, all its workloads, from a fresh
server. Each session runs T threads per worker.

Timeline of a session (CLOCK_MONOTONIC is one clock for every process of the machine):
  parent sends the spec; every worker builds its threads and says "ready"; the parent
  notes t_go and sets the go event; workers connect (connection time), then every
  thread publishes its ordinal and learns the world (world formation); then each
  workload runs `warmup` untimed rounds and `rounds` timed ones. Ordinal 0 times its
  calls and reads the server's CPU time (/proc) at the first and last timed round. A
  session fails when a system's round did not wait for a late participant (the last
  warm-up round) or its last round returned anything but that round's values.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import traceback

import _peers
from _servers import cpu_seconds

WORKLOADS = ("barrier", "allgather", "kv")
# In the last warm-up round of each workload one participant comes this late: ordinal 0's call
# must return at least half of it after the round's barrier, or the system's form did not wait
# (a check, never timed).
LATE_S = 0.05


def _thread_main(system, spec, t: int, state: dict) -> None:
    p, N = system.p, system.N
    first = p == 0 and t == 0
    state["released"].wait()
    if system.per_thread_clients:
        system.connect_thread(t)
    state["t_conn"][t] = time.monotonic()
    known = system.form_world(t)
    state["t_known"][t] = time.monotonic()
    if known != N:
        raise RuntimeError(f"thread {t} learned {known} ordinals, expected {N}")
    me, size = system.ordinal(t), spec["payload_size"]
    # Late once per workload: every system's ordinal 0 must wait for it (a world of one has none).
    late = system.peer(0) if N > 1 else None
    warmup, rounds = spec["warmup"], spec["rounds"]
    for workload in spec["workloads"]:
        samples = []
        cpu0 = wall0 = own0 = 0.0
        result = None
        for r in range(warmup + rounds):
            if first and r == warmup:
                cpu0, wall0 = cpu_seconds(spec["server_pid"]), time.monotonic()
            if t == 0 and r == warmup:
                own0 = time.process_time()
            if r == warmup - 1 and late is not None:  # everyone starts the round together (a
                # key-value round has no barrier of its own: a peer can be ahead), then one comes late
                system.barrier(t, -1 - spec["workloads"].index(workload))
                synced = time.perf_counter()  # (ordinal 0's wait counts from here: descheduled
                if me == late:                # before its call, it still waited)
                    time.sleep(LATE_S)
            payload = _peers.payload_for(me, r, size) if workload == "allgather" else None
            started = time.perf_counter()
            if workload == "barrier":
                system.barrier(t, r)
            elif workload == "allgather":
                result = system.allgather(t, r, payload)
            else:
                result = system.kv(t, r)
            samples.append(time.perf_counter() - started)
            if first and r == warmup - 1 and late is not None:
                waited = time.perf_counter() - synced
                if waited < LATE_S / 2:
                    raise RuntimeError(
                        f"{workload}: ordinal 0 did not wait for ordinal {late}, {LATE_S * 1000:g} ms late "
                        f"(its call returned {waited * 1000:.3f} ms after the round began)"
                    )
        last = warmup + rounds - 1
        if workload == "allgather" and result != [_peers.payload_for(i, last, size) for i in range(system.N)]:
            raise RuntimeError(f"the last all-gather returned a wrong result ({len(result)} payloads)")
        if workload == "kv" and result != _peers.kv_value(system.peer(me), last):
            raise RuntimeError(f"the last kv get returned {result[:16]!r}")
        if t == 0:  # this process's CPU (all its threads) over the timed rounds
            state["client_cpu"][workload] = time.process_time() - own0
        if first:
            state["samples"][workload] = samples[warmup:]
            state["cpu"][workload] = (cpu_seconds(spec["server_pid"]) - cpu0, time.monotonic() - wall0)
    system.close_thread(t)


def run_session(p: int, spec: dict, conn, go) -> dict:
    cls = _peers.SYSTEMS[spec["system"]]
    system = cls(
        address=spec["address"], process=p, processes=spec["P"], threads=spec["T"], job=spec["job"]
    )
    T = spec["T"]
    state = {
        "released": threading.Event(),
        "t_conn": [None] * T,
        "t_known": [None] * T,
        "samples": {},
        "cpu": {},
        "client_cpu": {},
    }
    errors: list[str] = []

    def guarded(t: int) -> None:
        try:
            _thread_main(system, spec, t, state)
        except BaseException:
            errors.append(f"process {p} thread {t}: {traceback.format_exc(limit=6)}")
            state["released"].set()

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in range(T)]
    for th in threads:
        th.start()
    conn.send("ready")
    go.wait()
    try:
        system.connect_process()
    except BaseException:
        errors.append(f"process {p} connect: {traceback.format_exc(limit=6)}")
    t_process_connected = time.monotonic()
    state["released"].set()
    deadline = time.monotonic() + spec["budget"]
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    if any(th.is_alive() for th in threads):
        errors.append(f"process {p}: threads still running after {spec['budget']:.0f} s")
    else:
        try:
            system.close_process()
        except BaseException:
            errors.append(f"process {p} close: {traceback.format_exc(limit=6)}")
    if errors:
        return {"error": errors[0]}
    return {
        "t_connected": max([t_process_connected] + state["t_conn"]),
        "t_known": max(state["t_known"]),
        "samples": state["samples"],
        "cpu": state["cpu"],
        "client_cpu": state["client_cpu"],
    }


def _worker_main(p: int, conn, go) -> None:
    while True:
        spec = conn.recv()
        if spec is None:
            return
        try:
            result = run_session(p, spec, conn, go)
        except BaseException:
            result = {"error": f"process {p}: {traceback.format_exc(limit=6)}"}
        conn.send(result)
        if "error" in result:
            os._exit(1)  # threads may be stuck in a peer's C++ call: never reuse this process


class SessionFailed(Exception):
    pass


class Pool:
    """P forked worker processes; ``session(spec)`` runs one system across all of them."""

    def __init__(self, processes: int) -> None:
        self.P = processes
        self._ctx = multiprocessing.get_context("fork")
        self._start()

    def _start(self) -> None:
        self._go = self._ctx.Event()
        self._conns = []
        self._procs = []
        for p in range(self.P):
            parent, child = self._ctx.Pipe()
            proc = self._ctx.Process(target=_worker_main, args=(p, child, self._go), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    def _recv_all(self, deadline: float, what: str) -> list:
        out = []
        for p, conn in enumerate(self._conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise SessionFailed(f"process {p} gave no {what} within the budget (infeasible here?)")
            try:
                out.append(conn.recv())
            except EOFError:
                raise SessionFailed(f"process {p} died") from None
        return out

    def session(self, spec: dict) -> dict:
        """Runs one session; returns {connect_s, formation_s, samples, cpu, client_cpu}
        (client_cpu: workload -> mean CPU seconds of a client process over the timed rounds)."""
        self._go.clear()
        try:
            for conn in self._conns:
                conn.send(spec)
            self._recv_all(time.monotonic() + 60, "ready")
            t_go = time.monotonic()
            self._go.set()
            results = self._recv_all(time.monotonic() + spec["budget"] + 15, "result")
        except (SessionFailed, OSError) as exc:
            self.restart()
            raise SessionFailed(str(exc)) from None
        failed = [r["error"] for r in results if "error" in r]
        if failed:
            self.restart()
            raise SessionFailed(failed[0])
        return {
            "connect_s": max(r["t_connected"] for r in results) - t_go,
            "formation_s": max(r["t_known"] for r in results) - t_go,
            "samples": results[0]["samples"],
            "cpu": results[0]["cpu"],
            "client_cpu": {
                w: sum(r["client_cpu"][w] for r in results) / len(results) for w in results[0]["client_cpu"]
            },
        }

    def restart(self) -> None:
        self.close(force=True)
        self._start()

    def close(self, force: bool = False) -> None:
        for conn in self._conns:
            try:
                if not force:
                    conn.send(None)
                conn.close()
            except OSError:
                pass
        for proc in self._procs:
            proc.join(0 if force else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
