"""A simulated TPU process for the integration tests: ``python pod_worker.py SCENARIO``.

Its topology comes from the environment (see ``pjrt_rendezvous.client._demo.simulated_env``);
each thread prints one JSON line: ``{"thread": i, "ordinal": o, ...}`` or ``{"error": ...}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time

import pjrt_rendezvous.client as pr

_print_lock = threading.Lock()


def emit(**record) -> None:
    with _print_lock:
        print(json.dumps(record), flush=True)


def error_record(exc: BaseException) -> dict:
    return dict(error=type(exc).__name__, message=str(exc), code=getattr(exc, "code", None))


def full_and_subsets(b: pr.Binding) -> dict:
    world = b.world_size
    everyone = pr.rendezvous("all", f"p{b.ordinal}".encode())
    firsts = list(range(min(3, world)))
    first = pr.rendezvous("firsts", b"f%d" % b.ordinal, replicas=firsts) if b.ordinal in firsts else None
    again = [pr.rendezvous("all", b"r%d-%d" % (b.ordinal, k)) for k in range(3)]
    pairs = [b.ordinal - b.ordinal % 2, b.ordinal - b.ordinal % 2 + 1]
    pair = pr.rendezvous("pair", b"x%d" % b.ordinal, replicas=pairs) if pairs[1] < world else None
    return dict(
        everyone=[p.decode() for p in everyone],
        first=None if first is None else [p.decode() for p in first],
        again=[[p.decode() for p in r] for r in again],
        pair=None if pair is None else [p.decode() for p in pair],
    )


def timeout_missing(b: pr.Binding) -> dict:
    # The process of task 1 never calls (but stays alive until the others are done);
    # everybody else must time out naming its ordinals. Every process registers first: the
    # round's 1.5 s do not count a slow start.
    client = pr.get_client()
    client.wait_world(timeout=60)
    if client.topology.task_id == 1:
        deadline = time.monotonic() + 60
        while client.add("timed-out", 0) < b.world_size - client.topology.devices_per_process:
            assert time.monotonic() < deadline, "the others did not time out"
            time.sleep(0.05)
        return {}
    try:
        pr.rendezvous("lonely", b"", timeout=1.5)
    finally:
        client.add("timed-out", 1)
    return {}


def tag_mismatch(b: pr.Binding) -> dict:
    if not os.environ.get("POD_WORKER_NO_WORLD_WAIT"):
        pr.get_client().wait_world(timeout=60)  # every process registered before the round fails
    tag = "save" if b.ordinal != 3 else "step"
    pr.rendezvous(tag, b"", timeout=float(os.environ.get("POD_WORKER_TIMEOUT", "30")))
    return {}


def not_in_replicas(b: pr.Binding) -> dict:
    # Ordinal 0 waits in round 'sub' of replicas [0, 1]; ordinal 3 wrongly calls it too, which
    # fails that round at once for its members: 0, and 1, which comes after.
    client = pr.get_client()
    if b.ordinal == 0:
        pr.rendezvous("sub", b"", replicas=[0, 1], timeout=30)
    elif b.ordinal == 3:
        deadline = time.monotonic() + 30
        while not any(job.pending_rounds for job in client.status().jobs):
            assert time.monotonic() < deadline, "ordinal 0 never waited in round 'sub'"
            time.sleep(0.02)
        try:
            pr.rendezvous("sub", b"", replicas=[0, 1], timeout=30)
        finally:
            client.set("bad-call-made", b"")
    elif b.ordinal == 1:
        client.wait(["bad-call-made"], timeout=30)
        pr.rendezvous("sub", b"", replicas=[0, 1], timeout=30)
    return {}


def kv_wait(b: pr.Binding) -> dict:
    client = pr.get_client()
    total = client.add("counter", 1)
    if b.ordinal == 0:
        started = time.monotonic()  # (before the set: the last ordinal's 0.5 s count from it)
        client.set("waiter-ready", b"1")
        value = client.get("late-key", timeout=30)  # released by the last ordinal's set
        return dict(total=total, value=value.decode(), waited=time.monotonic() - started)
    if b.ordinal == b.world_size - 1:
        client.wait(["waiter-ready"], timeout=30)
        time.sleep(0.5)  # let ordinal 0's get block on the coordinator
        client.set("late-key", b"from %d" % b.ordinal)
    return dict(total=total)


def hang(b: pr.Binding) -> dict:
    # Registers, says so, and then does nothing until killed.
    pr.get_client().set(f"ready/{b.ordinal}", b"")
    time.sleep(600)
    return {}


def survivor(b: pr.Binding) -> dict:
    # Waits in a round while a peer is killed, then meets the peer's replacement.
    client = pr.get_client()
    client.set(f"ready/{b.ordinal}", b"")
    started = time.monotonic()
    try:
        pr.rendezvous("before-death", b"", timeout=60)
        first = "completed"
    except pr.ParticipantFailedError as exc:
        first = f"{type(exc).__name__}: {exc}"
    aborted_after = time.monotonic() - started
    client.wait(["restarted"], timeout=60)
    while client.generation < 2:
        time.sleep(0.05)
    after = pr.rendezvous("after-restart", b"s%d" % b.ordinal, timeout=60)
    return dict(first=first, aborted_after=aborted_after, after=[p.decode() for p in after],
                events=[e.message for e in client.events])


def replacement(b: pr.Binding) -> dict:
    pr.get_client().set("restarted", b"")
    after = pr.rendezvous("after-restart", b"r%d" % b.ordinal, timeout=60)
    return dict(after=[p.decode() for p in after], generation=pr.get_client().generation)


def steady(b: pr.Binding) -> dict:
    # Many checked rounds and counted adds, slow enough that a coordinator restart lands mid-job.
    client = pr.get_client()
    rounds = int(os.environ.get("STEADY_ROUNDS", "40"))
    wrong = []
    for k in range(rounds):
        result = pr.rendezvous(f"step{k}", b"%d:%d" % (b.ordinal, k), timeout=120)
        if result != [b"%d:%d" % (o, k) for o in range(b.world_size)]:
            wrong.append(k)
        client.add("adds", 1)
        time.sleep(0.02)
    return dict(rounds=rounds, wrong=wrong, ordinal_after=pr.get_ordinal())


SCENARIOS = {
    f.__name__: f
    for f in (
        full_and_subsets, timeout_missing, tag_mismatch, not_in_replicas, kv_wait, hang, survivor, replacement, steady
    )
}


def main(scenario: str) -> int:
    client = pr.init()
    run = SCENARIOS[scenario]
    if os.environ.get("POD_WORKER_AFTER_OTHERS_LEFT"):  # a slower process: binds once every other has left
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(pr.UnknownJobError):  # (until the first registers)
                if any(p.left for job in client.status().jobs for p in job.participants):
                    break
            assert time.monotonic() < deadline, "no other process left"
            time.sleep(0.05)

    def thread_main(index: int) -> None:
        try:
            with pr.bind_thread(index) as b:
                emit(thread=index, ordinal=b.ordinal, local_ordinal=b.local_ordinal, pid=os.getpid(), **run(b))
        except Exception as exc:
            emit(thread=index, **error_record(exc))

    threads = [threading.Thread(target=thread_main, args=(i,)) for i in range(client.topology.devices_per_process)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
