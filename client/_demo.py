"""``pjrt-rendezvous demo``: a coordinator and a simulated pod on this machine.

The parent starts an embedded coordinator on a free loopback port and one real process per
simulated chip, each given the TPU variables torch_xla would set (``TPU_ACCELERATOR_TYPE``,
``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES``, ``PJRT_LOCAL_PROCESS_RANK``/``_COUNT``). Every
process runs one thread per core; each thread derives its ordinal from those variables,
then takes part in tagged rendezvous rounds over the full world and over a subset. The
parent prints what every thread saw and checks it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import TextIO

# Taken out of the caller's environment: what would place a simulated process elsewhere
# than its task, and every client setting (PJRT_RENDEZVOUS_*) but those kept: the caller's
# token, TLS files or timeouts are not the demo coordinator's, whose processes would then
# fail or wait for nothing. The native module's switch stays (it changes no outcome).
_SCRUBBED = (
    "CLOUD_TPU_TASK_ID", "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS",
    "CHIPS_PER_HOST_BOUNDS",
)
_SCRUBBED_PREFIX = "PJRT_RENDEZVOUS_"
_KEPT = ("PJRT_RENDEZVOUS_NATIVE",)
# One Python process (about 50 MB) each, on this machine: a bound on what a typo can start.
MAX_PROCESSES = 512


def simulated_env(
    *, address: str, accelerator: str, task: int, processes: int, hosts: int, threads: int | None
) -> dict[str, str]:
    """The environment of simulated task ``task``: what a TPU VM and torch_xla would set, and
    of the caller's only what concerns no client setting."""
    per_host = processes // hosts
    env = {
        k: v for k, v in os.environ.items()
        if k not in _SCRUBBED and (not k.startswith(_SCRUBBED_PREFIX) or k in _KEPT)
    }
    env.update(
        PJRT_RENDEZVOUS_ADDRESS=address,
        TPU_SKIP_MDS_QUERY="1",
        TPU_ACCELERATOR_TYPE=accelerator,
        TPU_WORKER_ID=str(task // per_host),
        TPU_WORKER_HOSTNAMES=",".join(f"sim-host-{h}" for h in range(hosts)),
        PJRT_LOCAL_PROCESS_RANK=str(task % per_host),
        PJRT_LOCAL_PROCESS_COUNT=str(per_host),
    )
    if threads is not None:
        env["PJRT_RENDEZVOUS_CORES_PER_CHIP"] = str(threads)
    return env


def _worker() -> int:
    """One simulated process: a thread per core, each printing one JSON line."""
    import pjrt_rendezvous.client as pr

    client = pr.init()
    lock = threading.Lock()
    failures = []

    def thread_main(index: int) -> None:
        try:
            with pr.bind_thread(index) as b:
                world = pr.get_world_size()
                me = f"ordinal {b.ordinal} on {client.topology.host}".encode()
                everyone = pr.rendezvous("hello", me)
                parity = b.ordinal % 2
                subset = [o for o in range(world) if o % 2 == parity]
                started = time.perf_counter()
                half = pr.rendezvous(("evens", "odds")[parity], me, replicas=subset)
                again = pr.rendezvous("hello", me)  # a repeated tag is a new round
                pr.barrier("done")
                line = dict(
                    ordinal=b.ordinal,
                    local_ordinal=b.local_ordinal,
                    task=client.topology.task_id,
                    thread=index,
                    host=client.topology.host,
                    pid=os.getpid(),
                    world=world,
                    master=pr.is_master_ordinal(local=False),
                    everyone=[p.decode() for p in everyone],
                    subset=subset,
                    half=[p.decode() for p in half],
                    again_equal=again == everyone,
                    ms=round((time.perf_counter() - started) * 1000, 2),
                )
            with lock:
                print(json.dumps(line), flush=True)
        except Exception as exc:  # reported by the parent with this thread's index
            failures.append(exc)
            with lock:
                print(json.dumps(dict(error=f"thread {index}: {type(exc).__name__}: {exc}")), flush=True)

    threads = [
        threading.Thread(target=thread_main, args=(i,)) for i in range(client.topology.devices_per_process)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 1 if failures else 0


def _check(row: dict) -> str:
    world = row["world"]
    expected = [f"ordinal {o} on " for o in range(world)]
    ok = len(row["everyone"]) == world and all(p.startswith(e) for p, e in zip(row["everyone"], expected))
    ok &= row["half"] and all(p.startswith(f"ordinal {o} on ") for p, o in zip(row["half"], row["subset"]))
    ok &= row["again_equal"] and row["master"] == (row["ordinal"] == 0)
    return "ok" if ok else "WRONG"


def _short(ordinals: list[int]) -> str:
    shown = ", ".join(map(str, ordinals[:4]))
    return f"[{shown}{', ...' if len(ordinals) > 4 else ''}]"


def run_demo(
    *,
    processes: int = 4,
    threads: int | None = None,
    hosts: int = 1,
    accelerator: str = "v3-8",
    timeout: float = 120.0,
    out: TextIO = sys.stdout,
) -> int:
    """Runs the simulated pod; prints a table; returns 0 when every thread saw the right
    results."""
    from pjrt_rendezvous.coordinator import Coordinator
    from pjrt_rendezvous.coordinator._core import Limits

    from ._errors import TopologyError
    from ._topology import cores_per_chip

    if processes < 1 or hosts < 1 or processes % hosts:
        print(f"--processes ({processes}) must be a positive multiple of --hosts ({hosts})", file=sys.stderr)
        return 2
    if processes > MAX_PROCESSES:
        print(
            f"--processes {processes}: the demo starts a Python process for each on this machine, at most "
            f"{MAX_PROCESSES} (thousands of simulated participants: the scale run of bench/run.py)",
            file=sys.stderr,
        )
        return 2
    try:
        threads_each = threads or cores_per_chip(accelerator)
    except TopologyError as exc:
        print(f"{exc}; or give the demo --threads", file=sys.stderr)
        return 2
    if processes * threads_each > Limits.max_world_size:
        print(
            f"{processes} processes x {threads_each} threads is a world of {processes * threads_each}, over the "
            f"coordinator's limit of {Limits.max_world_size} (max_world_size)",
            file=sys.stderr,
        )
        return 2
    with Coordinator(port=0) as coordinator:
        # The shape is --hosts and --processes; the accelerator type only sets the threads
        # (cores per chip): a pod of any size is simulated under any type's name.
        print(
            f"coordinator on {coordinator.address}; simulating {hosts} host(s), {processes} processes, "
            f"{threads_each} threads each (TPU_ACCELERATOR_TYPE={accelerator})",
            file=out,
            flush=True,  # (seen while the processes run, through a pipe too)
        )
        started = time.perf_counter()
        deadline = started + timeout  # for the whole run, not for each process
        children: list[subprocess.Popen] = []
        try:
            rows, errors = _run_children(
                children, coordinator.address, processes, hosts, accelerator, threads, timeout, deadline
            )
        finally:  # (an interrupt: no process is left behind)
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        elapsed = time.perf_counter() - started
    return _report(rows, errors, elapsed, out)


def _run_children(
    children: list[subprocess.Popen], address: str, processes: int, hosts: int, accelerator: str,
    threads: int | None, timeout: float, deadline: float,
) -> tuple[list[dict], list[str]]:
    """Starts the simulated processes (into ``children``) and collects what their threads
    saw, and the errors."""
    for task in range(processes):
        if time.perf_counter() > deadline:  # (a machine too slow to start them all)
            return [], [f"only {task} of {processes} processes started within {timeout:g} s"]
        env = simulated_env(
            address=address, accelerator=accelerator, task=task, processes=processes, hosts=hosts, threads=threads
        )
        children.append(
            subprocess.Popen(
                [sys.executable, "-m", "pjrt_rendezvous.client._demo", "--worker"], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    rows: list[dict] = []
    errors: list[str] = []
    for child in children:
        try:
            output, _ = child.communicate(timeout=max(0.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            child.kill()
            output, _ = child.communicate()
            errors.append(f"pid {child.pid} did not finish within {timeout:g} s")
        for line in output.splitlines():
            record = json.loads(line)
            (errors.append(record["error"]) if "error" in record else rows.append(record))
        if child.returncode and not errors:
            errors.append(f"pid {child.pid} exited with {child.returncode}")
    return rows, errors


def _report(rows: list[dict], errors: list[str], elapsed: float, out: TextIO) -> int:
    """Prints the table of what every thread saw; 0 when all of it is right."""
    rows.sort(key=lambda r: r["ordinal"])
    header = ("ordinal", "local", "task", "thread", "host", "pid", "'hello' (all)", "subset round", "check")
    table = [header]
    for r in rows:
        everyone = r["everyone"]
        table.append(
            (
                str(r["ordinal"]),
                str(r["local_ordinal"]),
                str(r["task"]),
                str(r["thread"]),
                r["host"],
                str(r["pid"]),
                f"{_counted(len(everyone), 'payload')}, ordinals {everyone[0].split()[1]}..{everyone[-1].split()[1]}",
                f"{('evens', 'odds')[r['ordinal'] % 2]}: {_counted(len(r['half']), 'payload')} from {_short(r['subset'])}",
                _check(r),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip(), file=out)
        if i == 0:
            print("  ".join("-" * w for w in widths), file=out)
    if rows:
        received = rows[0]["everyone"]
        shown = received if len(received) <= 4 else [*received[:2], "...", received[-1]]
        print(f"\nordinal 0 received: {shown}", file=out)
    bad = [r for r in rows if _check(r) != "ok"]
    world = rows[0]["world"] if rows else 0
    if len(rows) != world:
        errors.append(f"{len(rows)} threads reported, expected {world}")
    for error in errors:
        print(f"error: {error}", file=out)
    verdict = "FAILED" if bad or errors or not rows else "ok"
    if rows:
        print(
            f"\n{_counted(len(rows), 'ordinal')}, world size {world}, 4 rounds each (all, subset, all again, "
            f"barrier) in {elapsed:.2f} s: {verdict}",
            file=out,
        )
    else:
        print(f"\nno thread reported in {elapsed:.2f} s: {verdict}", file=out)
    return 0 if verdict == "ok" else 1


def _counted(n: int, thing: str) -> str:
    return f"{n} {thing}" if n == 1 else f"{n} {thing}s"


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    sys.exit(_worker())
