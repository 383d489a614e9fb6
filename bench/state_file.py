"""What a state file (``serve --state-file``, the default of the image, the unit and the
Kubernetes manifest) adds to a barrier round and to a round of key sets, side by side: the
changes appended to the journal (what the coordinator does) vs the whole state rewritten at
every change (what it did before the journal; ``JOURNAL_LIMIT = 0`` forces it).

    python bench/state_file.py [--sizes 2x1,8x1,64x8,512x8] [--rounds 40] [--reps 3]

In-process and without sockets: the real core and the real state writer (its thread, its
fsyncs, in a temporary folder of this machine's disk). A barrier round is one arrival of
every process, then one flush, as the coordinator does when the round's last arrival
completes it; a key-value round is one set by every process of a key per thread (each
ordinal overwrites its own key, 16 bytes), then one flush, as when the sets arrive together
(group commit). Reported, the better of ``--reps``: the process CPU a flush takes (the
writer's thread included) and its wall time (what the callers wait for their answers), per
round.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import tempfile
import time

from _report import ms, table

from pjrt_rendezvous.coordinator import _server, _state
from pjrt_rendezvous.coordinator._core import Contribution, Core, Registration, ThreadRequest


def _core(processes: int, threads: int) -> Core:
    core = Core()
    for task in range(processes):
        core.register(
            0.0,
            Registration(
                job="j", incarnation=f"inc-{task}", host=f"host-{task // 4}", pid=1000 + task, task_id=task,
                num_tasks=processes, devices_per_task=threads, local_rank=task % 4,
                threads=tuple(ThreadRequest(thread_index=i) for i in range(threads)),
            ),
        )
    return core


async def _measure(processes: int, threads: int, rounds: int, reps: int, whole: bool, workload: str) -> tuple[float, float]:
    core = _core(processes, threads)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="bench-state-"))
    writer = _server._StateWriter(core, _state.Files(folder / "coordinator.state"))
    await writer.flush()
    rows = [[Contribution(p * threads + t, "barrier", b"", "") for t in range(threads)] for p in range(processes)]
    number = 0

    def barrier() -> None:
        nonlocal number
        for p in range(processes):
            core.arrive(0.0, job="j", incarnation=f"inc-{p}", replicas=[], round_number=number, contributions=rows[p], deadline=None)
        number += 1

    def key_sets() -> None:
        nonlocal number
        value = b"%016d" % number
        for p in range(processes):
            core.kv_set("j", [(f"kv/{p * threads + t}", value) for t in range(threads)])
        number += 1

    change = barrier if workload == "barrier" else key_sets
    limit = _state.JOURNAL_LIMIT
    _state.JOURNAL_LIMIT = 0 if whole else limit
    best = (float("inf"), float("inf"))
    try:
        for _ in range(reps):
            cpu = wall = 0.0
            for _ in range(rounds):
                change()
                started, clock = time.process_time(), time.perf_counter()
                await writer.flush()
                cpu += time.process_time() - started
                wall += time.perf_counter() - clock
            best = min(best, (cpu / rounds, wall / rounds))
    finally:
        _state.JOURNAL_LIMIT = limit
        writer.close()
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2x1,8x1,64x8,512x8")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    rows = []
    for workload in ("barrier", "key-value"):
        for size in args.sizes.split(","):
            processes, threads = map(int, size.split("x"))
            journal = asyncio.run(_measure(processes, threads, args.rounds, args.reps, False, workload))
            whole = asyncio.run(_measure(processes, threads, args.rounds, args.reps, True, workload))
            rows.append([
                workload, f"{size} ({processes * threads})", ms(journal[0]), ms(whole[0]),
                f"{whole[0] / journal[0]:.1f}x", ms(journal[1]), ms(whole[1]),
            ])
            print(f"  {workload} {size}: journal {ms(journal[0])} ms CPU, whole state {ms(whole[0])} ms CPU per round", file=sys.stderr)
    print(table(
        ["workload", "size (participants)", "flush CPU per round: journal (ms)", "whole state rewritten (ms)",
         "whole / journal", "flush wall per round: journal (ms)", "whole state (ms)"],
        rows,
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
