"""Load: many rendezvous rounds with checksummed payloads across real processes x threads.

Every member derives the same plan from a seeded RNG: each round is the full world or a
random subset, with a tag drawn from a few (tags repeat: rounds, not tags, match calls).
Each payload is (ordinal, round, length, sha256 over header, tag and body) plus a random
body of up to 4 KiB. Every thread checks every result it gets (length, ordinal order,
checksum, exact bytes) and reports a digest of it; the parent checks that all members of a
round saw the same result and that the coordinator completed each planned round once.

``PJRT_RENDEZVOUS_LOAD_ROUNDS`` / ``PJRT_RENDEZVOUS_LOAD_SEED`` override the round count
and the seed; ``-s`` prints the figures.
"""

from __future__ import annotations

import collections
import json
import os
import runpy
import subprocess
import sys
import time

import pytest

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client._demo import simulated_env
from pjrt_rendezvous.coordinator import Coordinator

ROUNDS = int(os.environ.get("PJRT_RENDEZVOUS_LOAD_ROUNDS", "0"))  # 0: each shape's own count
SEED = int(os.environ.get("PJRT_RENDEZVOUS_LOAD_SEED", "20240611"))
SHAPES = [  # (processes, hosts, rounds); 2 threads per process (a simulated v3)
    pytest.param(4, 2, 1000, id="4x2-1000-rounds"),
    pytest.param(8, 4, 300, id="8x2-300-rounds"),
]

# The worker, written to a temporary file: `python load_worker.py SEED ROUNDS`. The parent
# loads the same file (without running main) to recompute the plan and the payloads.
WORKER = r'''
import hashlib
import json
import os
import random
import struct
import sys
import threading

HEADER = struct.Struct(">iiI")  # ordinal, round, body length
DIGEST = 32


def plan(seed, rounds, world):
    """[(tag, members, replicas)] for every round: identical in every thread of every process."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        kind = rng.random()
        if kind < 0.3:
            members = list(range(world))
            replicas = [] if rng.random() < 0.5 else list(members)  # both mean the full world
        else:
            members = sorted(rng.sample(range(world), rng.randint(1, world)))
            replicas = list(members)
            rng.shuffle(replicas)  # order does not matter; the result is in ordinal order
        out.append((f"t{rng.randrange(4)}", members, replicas))
    return out


def payload(seed, ordinal, rnd, tag):
    rng = random.Random(f"{seed}/{ordinal}/{rnd}")
    body = rng.randbytes(rng.randrange(0, 4097))
    head = HEADER.pack(ordinal, rnd, len(body))
    return head + hashlib.sha256(head + tag.encode() + body).digest() + body


def check(seed, result, rnd, tag, members):
    """Raises AssertionError unless ``result`` is exactly the members' payloads in ordinal order."""
    assert len(result) == len(members), f"round {rnd}: {len(result)} payloads for {len(members)} members"
    for position, (ordinal, blob) in enumerate(zip(members, result)):
        got_ordinal, got_round, length = HEADER.unpack_from(blob)
        head, digest, body = blob[:HEADER.size], blob[HEADER.size:HEADER.size + DIGEST], blob[HEADER.size + DIGEST:]
        assert (got_ordinal, got_round) == (ordinal, rnd), (
            f"round {rnd} position {position}: payload of ordinal {got_ordinal} round {got_round}, "
            f"expected ordinal {ordinal} round {rnd}"
        )
        assert length == len(body), f"round {rnd} ordinal {ordinal}: body {len(body)} bytes, header says {length}"
        checksum = hashlib.sha256(head + tag.encode() + body).digest()
        assert checksum == digest, f"round {rnd} ordinal {ordinal}: bad checksum"
        assert blob == payload(seed, ordinal, rnd, tag), f"round {rnd} ordinal {ordinal}: wrong bytes"


def main(seed, rounds):
    import pjrt_rendezvous.client as pr

    client = pr.init()
    lock = threading.Lock()

    def thread_main(index):
        record = dict(thread=index, pid=os.getpid())
        try:
            with pr.bind_thread(index) as b:
                record.update(ordinal=b.ordinal, world=b.world_size)
                steps = plan(seed, rounds, b.world_size)
                digests, payloads = [], 0
                for rnd, (tag, members, replicas) in enumerate(steps):
                    if b.ordinal not in members:
                        continue
                    result = pr.rendezvous(tag, payload(seed, b.ordinal, rnd, tag), replicas)
                    check(seed, result, rnd, tag, members)
                    digests.append([rnd, hashlib.sha256(b"".join(result)).hexdigest()[:16]])
                    payloads += len(result)
                record.update(rounds=len(digests), payloads=payloads, digests=digests)
        except BaseException as exc:
            record.update(error=type(exc).__name__, message=str(exc)[:2000])
        with lock:
            print(json.dumps(record), flush=True)

    threads = [threading.Thread(target=thread_main, args=(i,)) for i in range(client.topology.devices_per_process)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
'''


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "load_worker.py"
    path.write_text(WORKER)
    return path


def run_pod(address, worker, *, processes, hosts, seed, rounds, timeout=120):
    children = []
    for task in range(processes):
        env = simulated_env(
            address=address, accelerator="v3-8", task=task, processes=processes, hosts=hosts, threads=None
        )
        env["PJRT_RENDEZVOUS_TIMEOUT"] = "60"  # a lost payload shows as a timeout, not a hang
        children.append(
            subprocess.Popen(
                [sys.executable, str(worker), str(seed), str(rounds)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
        )
    records = []
    deadline = time.monotonic() + timeout
    try:
        for child in children:
            out, err = child.communicate(timeout=max(1, deadline - time.monotonic()))
            assert child.returncode == 0, err[-3000:]
            records += [json.loads(line) for line in out.splitlines()]
    finally:
        for child in children:
            child.kill()
    return sorted(records, key=lambda r: r.get("ordinal", -1))


@pytest.mark.slow
@pytest.mark.parametrize("processes, hosts, rounds", SHAPES)
def test_checksummed_rounds_across_processes_and_threads(worker, processes, hosts, rounds):
    """4 x 2 threads over 1000 rounds and 8 x 2 over 300, full-world and random subsets: no payload lost, duplicated,
    corrupted or misordered; each round completes once."""
    rounds = ROUNDS or rounds
    seed = SEED + processes
    world = processes * 2
    with Coordinator(port=0) as coordinator:
        started = time.monotonic()
        records = run_pod(coordinator.address, worker, processes=processes, hosts=hosts, seed=seed, rounds=rounds)
        elapsed = time.monotonic() - started
        observer = pr.Client(pr.Settings(address=coordinator.address), pr.detect_topology({}))
        (job,) = observer.status().jobs
        observer.close()

    assert [r.get("error") for r in records] == [None] * world, [r for r in records if "error" in r][:3]
    assert [r["ordinal"] for r in records] == list(range(world))
    assert {r["world"] for r in records} == {world}

    # Every thread took part in exactly the rounds the plan gives it, in order.
    module = runpy.run_path(str(worker))
    steps = module["plan"](seed, rounds, world)
    for r in records:
        mine = [k for k, (_, members, _) in enumerate(steps) if r["ordinal"] in members]
        assert [k for k, _ in r["digests"]] == mine, f"ordinal {r['ordinal']} saw other rounds than planned"

    # All members of a round got byte-identical results (each thread already checked its own).
    by_round = collections.defaultdict(set)
    for r in records:
        for k, digest in r["digests"]:
            by_round[k].add(digest)
    assert sorted(by_round) == list(range(rounds))
    assert all(len(d) == 1 for d in by_round.values()), {k: d for k, d in by_round.items() if len(d) > 1}

    # The coordinator finished each planned round once: none lost, none doubled, none left.
    assert (job.world_size, job.registered, len(job.pending_rounds)) == (world, world, 0)
    assert job.rounds_completed == rounds

    rounds_checked = sum(r["rounds"] for r in records)
    payloads_checked = sum(r["payloads"] for r in records)
    assert rounds_checked == sum(len(members) for _, members, _ in steps)
    full = sum(1 for _, members, _ in steps if len(members) == world)
    print(
        f"\nload: {processes} processes x 2 threads on {hosts} hosts, {rounds} rounds ({full} full-world, "
        f"{rounds - full} subsets, seed {seed}): {rounds_checked} per-thread rounds and {payloads_checked} "
        f"payloads checked in {elapsed:.1f} s"
    )
