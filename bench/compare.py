"""Before/after measurement of a product change, alternating on the same machine.

    python bench/compare.py --after /tmp/patched-tree [--before TREE] [--reps 3]
        [--sizes 2x1,8x8] [--workloads barrier,allgather,kv] [--scale 64x8,512x8]

Runs our system alone through bench/run.py (real processes, same workloads) and the scale
run (bench/_scale.py), alternating before / after ``--reps`` times, and prints medians of
round p50, server and client-process CPU per round, world formation and peak memory.
``--before`` defaults to the installed package; ``--after`` is a source tree with the
product folders (e.g. a ``git worktree`` of the change). Medians of alternating runs,
because this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _report import ms, percentile, table  # noqa: E402


def _one(product: str | None, args, tmp: str) -> dict:
    out = os.path.join(tmp, "raw.json")
    argv = [
        sys.executable, os.path.join(HERE, "run.py"), "--systems", "ours", "--sizes", args.sizes,
        "--workloads", args.workloads, "--rounds", str(args.rounds), "--reps", "1", "--scale", args.scale,
        "--scale-peers", "", "--scale-rounds", str(args.scale_rounds), "--output", os.path.join(tmp, "r.md"),
        "--json", out,
    ]
    if product:
        argv += ["--product", product]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    with open(out) as f:
        return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--after", required=True)
    parser.add_argument("--before")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sizes", default="2x1,8x8")
    parser.add_argument("--workloads", default="barrier,allgather,kv")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--scale", default="64x8,512x8")
    parser.add_argument("--scale-rounds", type=int, default=40)
    parser.add_argument("--json", help="write the raw runs here")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = [("before", args.before), ("after", args.after)]
            for label, product in order if rep % 2 == 0 else order[::-1]:
                runs[label].append(_one(product, args, tmp))
                print(f"rep {rep} {label} done", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)
    print(render(runs, args))
    return 0


def _median(values):
    values = [v for v in values if v is not None and v == v]
    return statistics.median(values) if values else float("nan")


def render(runs: dict, args) -> str:
    rows = []
    for size in args.sizes.split(","):
        for w in args.workloads.split(","):
            cells = [size, w]
            for what in ("p50", "cpu", "client_cpu"):
                vals = {}
                for label in ("before", "after"):
                    per_run = []
                    for r in runs[label]:
                        e = r["results"][size]["ours"]
                        if e.get("error"):
                            continue
                        if what == "p50":
                            per_run.append(percentile(e["samples"][w], 50))
                        elif what == "cpu":
                            c = e["cpu"][w]
                            per_run.append(sum(x[0] for x in c) / sum(x[2] for x in c))
                        else:  # a client process's CPU per round
                            c = e["client_cpu"][w]
                            per_run.append(sum(x[0] for x in c) / sum(x[1] for x in c))
                    vals[label] = _median(per_run)
                cells += [ms(vals["before"]), ms(vals["after"]), f"{vals['before'] / vals['after']:.2f}x"]
            rows.append(cells)
        cells = [size, "formation"]
        vals = {label: _median([r["results"][size]["ours"]["formation"][0] for r in runs[label]
                                if not r["results"][size]["ours"].get("error")]) for label in runs}
        cells += [ms(vals["before"]), ms(vals["after"]), f"{vals['before'] / vals['after']:.2f}x"] + [""] * 6
        rows.append(cells)
    out = [table(["size", "measure", "p50 before (ms)", "p50 after (ms)", "gain", "server CPU/round before (ms)",
                  "after (ms)", "gain", "client CPU/round before (ms)", "after (ms)", "gain"], rows)]
    if args.scale != "none":
        rows = []
        for key in args.scale.split(","):
            for system in ("ours", "ours-fanin"):  # the modes (bench/_scale.py OURS)
                def pick(label, fn):
                    vals = []
                    for r in runs[label]:
                        e = r["scale"]["sizes"][key].get(system, {"error": "not run"})
                        if "error" not in e:
                            vals.append(fn(e))
                    return _median(vals)

                P, T = (int(x) for x in key.split("x"))
                cells = [f"{P * T} ({key})", system]
                for name, fn, fmt in (
                    ("formation", lambda e: e["formation_s"], ms),
                    ("barrier p50", lambda e: percentile(e["samples"], 50), ms),
                    ("cpu/round", lambda e: e["cpu_per_round"], ms),
                    ("peak MB", lambda e: e["peak_mb"], lambda v: f"{v:.0f}"),
                ):
                    b, a = pick("before", fn), pick("after", fn)
                    cells += [f"{fmt(b)} → {fmt(a)}"]
                failures = {
                    label: sum("error" in r["scale"]["sizes"][key].get(system, {"error": ""}) for r in runs[label])
                    for label in runs
                }
                cells.append(f"{failures['before']} → {failures['after']}")
                rows.append(cells)
        out.append("")
        out.append(table(["participants", "mode", "world formation (ms)", "barrier p50 (ms)", "coordinator CPU/round (ms)",
                          "peak RSS (MB)", "failed runs"], rows))
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
