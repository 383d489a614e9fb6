"""Side-by-side benchmark: pjrt-rendezvous vs torch's TCPStore vs JAX's coordination service.

Usage (from the repository root, in an environment with the package, grpcio and the peers):

    python bench/run.py                                   # the full run, writes bench/RESULTS.md
    python bench/run.py --sizes 2x1,8x1,8x8,32x8 --rounds 200 --scale 8x8,64x8,512x8
    python bench/run.py --smoke                           # seconds (CI's, with --output): $TMPDIR/smoke-RESULTS.md

Sizes are PROCESSESxTHREADS: real processes, each running THREADS participant threads.
Every system runs the same workloads at every size in the same run, in alternating order
(reversed every other repetition, rotated every two), each from a fresh server process:

  barrier    rounds of a barrier over every participant (empty payload)
  allgather  rounds of a rendezvous with a 1 KiB payload per participant (all-gather)
  formation  from all processes started (a go signal) to every ordinal known to every
             participant; connection time (go -> every client connected) reported apart
  kv         set this participant's key, then a blocking get of the next process's one

Systems: ours (one Client per process; it combines its threads' rounds itself);
TCPStore with one client per participant and with one client per process and threads
combined locally (the better is reported, and named); JAX's coordination service with one
client per process (as jax.distributed has it), threads combined locally; and ours again with
its coordinator keeping a state file (``--state-file``, as deployed), reported beside ours
in a table of its own. Round latency is timed by ordinal 0 around each of its calls, only
after every client connected and the world formed. A peer that is not installed is skipped; a size a peer cannot do within the
budget is reported as such in the table.

The scale run (``--scale``) drives our coordinator alone with simulated processes over real
gRPC (bench/_scale.py) and measures server CPU per round for all three servers. Numbers are
p50/p99 and ratios, never assertions: the machine is small and shared.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The XLA coordination client and service log every barrier at INFO: give JAX its best form,
# as a production user would (read when jaxlib loads, so before anything imports it).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
# This machine's DNS server drops some reverse lookups, which torch's TCPStore client makes on
# every connect: cap the resolver's wait at 1 s instead of 5 (see bench/README.md). Connects are
# never inside a timed round.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

from _report import machine, ms, percentile, ratio, table, versions  # noqa: E402

ALL_SYSTEMS = ("ours", "tcpstore/thread", "tcpstore/process", "jax/process")
# Ours again, its coordinator keeping a state file as deployed: reported beside ours, not a peer.
STATE_FILE = "ours/state-file"
WORKLOAD_TITLES = {
    "barrier": "Barrier (empty payload), time per round",
    "allgather": "Rendezvous with 1 KiB per participant (all-gather), time per round",
    "kv": "Key-value: set own key, blocking get of the next process's (same thread), time per round",
}
# issue 5: ratio ours / best peer (p50) to reach, by workload and size
TARGETS = {
    ("barrier", "8x8"): 1.0,
    ("barrier", "32x8"): 1.0,
    ("allgather", "8x8"): 1.0,
    ("allgather", "32x8"): 1.0,
    ("barrier", "2x1"): 3.0,
    ("barrier", "8x1"): 3.0,
}
# issue 5: the peers' barrier p50 (ms) measured on 2026-11-30, threads combined locally
ISSUE_PEER_BARRIER_MS = {
    "tcpstore": {"2x1": 0.08, "8x1": 0.35, "8x8": 1.2, "32x8": 5.6},
    "jax": {"2x1": 0.38, "8x1": 1.16, "8x8": 2.15},
}


def parse_size(text: str) -> tuple[int, int]:
    p, _, t = text.lower().partition("x")
    P, T = int(p), int(t or 1)
    if P < 1 or T < 1:
        raise argparse.ArgumentTypeError(f"bad size {text!r}")
    return P, T


def _payload(text: str) -> int:
    size = int(text)
    if size < 16:  # (the check of every round's results reads its ordinal and round there)
        raise argparse.ArgumentTypeError(f"--payload must be at least 16 bytes, got {size}")
    return size


def available_systems(wanted) -> tuple[list[str], dict[str, str]]:
    """The systems whose libraries import here; the others with the reason."""
    ok, skipped = [], {}
    for name in wanted:
        try:
            if name.startswith("ours"):
                import grpc  # noqa: F401

                import pjrt_rendezvous.client  # noqa: F401
            elif name.startswith("tcpstore"):
                from torch.distributed import TCPStore  # noqa: F401
            elif name.startswith("jax"):
                from jaxlib import _jax  # noqa: F401

                _jax.get_distributed_runtime_client  # noqa: B018
            ok.append(name)
        except Exception as exc:  # a missing peer is skipped and said so
            skipped[name] = f"not installed ({type(exc).__name__}: {exc})"
    return ok, skipped


def _order(systems: list[str], rep: int) -> list[str]:
    """Repetition ``rep``'s order: reversed every other repetition (each system first and last
    in turn), rotated by one every two (each one in the middle too)."""
    k = (rep // 2) % len(systems)
    order = systems[k:] + systems[:k]
    return order[::-1] if rep % 2 else order


def run_matrix(args, systems: list[str], log) -> dict:
    import _pool
    import _servers

    results: dict = {}
    for size in args.sizes:
        P, T = parse_size(size)
        pool = _pool.Pool(P)
        results[size] = {s: {"connect": [], "formation": [], "samples": {}, "cpu": {}, "client_cpu": {}, "peak_mb": [], "error": None}
                         for s in systems}
        try:
            for rep in range(args.reps):
                order = _order(systems, rep)
                for name in order:
                    entry = results[size][name]
                    if entry["error"]:
                        continue  # failed once at this size: do not burn the budget again
                    rounds = max(1, -(-args.rounds // args.reps))
                    server = _servers.start(_peers_server(name), num_processes=P)
                    spec = dict(
                        system=name,
                        address=server.address,
                        server_pid=server.pid,
                        P=P,
                        T=T,
                        job=f"bench-{size}-{rep}",
                        rounds=rounds,
                        warmup=max(3, rounds // 10),
                        payload_size=args.payload,
                        workloads=list(args.workloads),
                        budget=args.budget,
                    )
                    started = time.monotonic()
                    spy = None
                    if args.profile and name == "ours":
                        import _profile

                        os.makedirs(args.profile, exist_ok=True)
                        spy_path = os.path.join(args.profile, f"ours-{size}-rep{rep}.txt")
                        spy = _profile.attach(server.pid, spy_path)
                        time.sleep(0.5)  # py-spy needs a moment to attach
                    try:
                        out = pool.session(spec)
                    except _pool.SessionFailed as exc:
                        entry["error"] = _short(str(exc), args.budget)
                        log(f"  {size} {name}: FAILED {entry['error']}")
                        continue
                    finally:
                        peak = _safe(server.peak_mb)
                        if spy is not None:
                            _profile.stop(spy)
                            entry.setdefault("profiles", []).append(spy_path)
                        server.stop()
                    entry["connect"].append(out["connect_s"])
                    entry["formation"].append(out["formation_s"])
                    entry["peak_mb"].append(peak)
                    for w, s in out["samples"].items():
                        entry["samples"].setdefault(w, []).extend(s)
                    for w, (cpu, wall) in out["cpu"].items():
                        entry["cpu"].setdefault(w, []).append((cpu, wall, rounds))
                    for w, cpu in out["client_cpu"].items():
                        entry["client_cpu"].setdefault(w, []).append((cpu, rounds))
                    summary = ", ".join(
                        f"{w} p50 {ms(percentile(s, 50))} ms" for w, s in out["samples"].items()
                    )
                    log(
                        f"  {size} rep {rep} {name}: connect {ms(out['connect_s'])} ms, formation "
                        f"{ms(out['formation_s'])} ms, {summary} ({time.monotonic() - started:.1f} s)"
                    )
        finally:
            pool.close()
    return results


def _cpu_table(results: dict, workloads, skipped: dict, key: str, fmt) -> str:
    """A table of CPU per round (``entry[key][workload]``: (cpu seconds, ..., rounds) per
    repetition) per size, workload and system, with the ratio ours / best peer."""
    header = ["size", "workload", "ours", "TCPStore thread", "TCPStore process", "JAX", "ours/best peer"]
    rows = []
    for size, per_system in results.items():
        for workload in workloads:
            row = [size, workload]
            best = float("inf")
            o = float("nan")
            for name in ALL_SYSTEMS:
                entry = per_system.get(name)
                runs = entry[key].get(workload) if entry and not entry["error"] else None
                if runs:
                    per_round = sum(r[0] for r in runs) / sum(r[-1] for r in runs)
                    row.append(fmt(per_round))
                    if name == "ours":
                        o = per_round
                    else:
                        best = min(best, per_round)
                else:
                    row.append(_cell_na(entry, skipped.get(name)))
            row.append(ratio(o, best if best != float("inf") else float("nan")))
            rows.append(row)
    return table(header, rows)


def _peers_server(name: str) -> str:
    import _peers

    return _peers.SERVER_KIND[name]


def _safe(fn):
    try:
        return fn()
    except OSError:
        return float("nan")


def _short(text: str, budget: float) -> str:
    last = [line for line in text.strip().splitlines() if line.strip()]
    line = last[-1] if last else text
    if "within the budget" in text or "still running" in text:
        return f"did not finish within the {budget:.0f} s budget"
    return line.strip()[:160]


# -- RESULTS.md ------------------------------------------------------------------------------


def _cell_na(entry, skipped_reason: str | None) -> str:
    if skipped_reason:
        return f"skipped: {skipped_reason.split(' (')[0]}"
    if entry and entry["error"]:
        return f"n/a: {entry['error']}"
    return "n/a: no samples"


def _best_tcpstore(per_system: dict, key) -> str | None:
    """The TCPStore form with the lower p50 for ``key(entry) -> samples``."""
    best, best_p50 = None, float("inf")
    for name in ("tcpstore/thread", "tcpstore/process"):
        entry = per_system.get(name)
        if entry and not entry["error"]:
            values = key(entry)
            if values:
                p50 = percentile(values, 50)
                if p50 < best_p50:
                    best, best_p50 = name, p50
    return best


def _p50_ratio(per_system: dict, workload: str) -> tuple[float, float]:
    """(ours p50, best peer p50) for a workload at one size; NaN where not measured."""
    nan = float("nan")
    ours = per_system.get("ours")
    o = percentile(ours["samples"].get(workload, []), 50) if ours and not ours["error"] else nan
    best = nan
    for name, entry in per_system.items():
        if not name.startswith("ours") and not entry["error"] and entry["samples"].get(workload):
            p = percentile(entry["samples"][workload], 50)
            best = p if best != best else min(best, p)
    return o, best


def targets_section(results: dict, scale: dict | None) -> str:
    """Issue 5's targets, each with the measured value and whether it is met."""
    rows = []

    def verdict(ok) -> str:
        return "not measured" if ok is None else ("met" if ok else "MISSED")

    for (workload, size), target in TARGETS.items():
        if size not in results:
            continue
        o, b = _p50_ratio(results[size], workload)
        ok = None if o != o or b != b else o / b <= target
        rows.append([f"{workload} p50 at {size}: ours / best peer <= {target:g}", ratio(o, b), verdict(ok)])
    if scale:
        import _scale

        for key, entry in scale["sizes"].items():
            P, T = (int(x) for x in key.split("x"))
            best = _scale.best_ours(entry)
            peers = [e["cpu_per_round"] for k, e in entry.items() if k not in _scale.OURS and "error" not in e]
            ok, value = None, "—"
            if best and peers:
                mode, ours = best
                value = f"{ms(ours['cpu_per_round'])} vs {ms(min(peers))} ms ({ratio(ours['cpu_per_round'], min(peers))}; ours {mode})"
                ok = ours["cpu_per_round"] <= min(peers)
            elif best is None:
                value = "ours failed: " + entry.get("ours", {}).get("error", "not run")[:80]
            rows.append([f"server CPU per round at {P * T} ({key}): ours <= best peer", value, verdict(ok)])
        big = {_scale.OURS[k]: e for k, e in scale["sizes"].get("512x8", {}).items() if k in _scale.OURS and "error" not in e}
        if big:
            def each(fmt) -> str:  # every mode's figure, named
                return "; ".join(f"{mode}: {fmt(e)}" for mode, e in big.items())

            best_formation = min(e["formation_s"] for e in big.values())
            rows.append(["4,096 participants: world formation < 2 s", each(lambda e: f"{ms(e['formation_s'])} ms"),
                         verdict(best_formation < 2)])
            best_p50 = min(percentile(e["samples"], 50) for e in big.values())
            rows.append(["4,096 participants: barrier p50 < 100 ms", each(lambda e: f"{ms(percentile(e['samples'], 50))} ms"),
                         verdict(best_p50 < 0.1)])
            best_peak = min(e["peak_mb"] for e in big.values())
            rows.append(["4,096 participants: coordinator peak memory < 150 MB", each(lambda e: f"{e['peak_mb']:.0f} MB"),
                         verdict(best_peak < 150)])
            small = scale["sizes"].get("8x8", {})
            growth = {}
            for system, mode in _scale.OURS.items():
                a, b = small.get(system, {}), scale["sizes"]["512x8"].get(system, {})
                if a and b and "error" not in a and "error" not in b:
                    growth[mode] = (a["cpu_per_round"] / 8, b["cpu_per_round"] / 512)
            if growth:
                rows.append(["cost per round linear in processes (CPU per process per round, 4,096 vs 64)",
                             "; ".join(f"{mode}: {x * 1e6:.0f} -> {y * 1e6:.0f} µs ({y / x:.2f}x)" for mode, (x, y) in growth.items()),
                             verdict(all(y / x <= 1.5 for x, y in growth.values()))])
    if not rows:
        return ""
    return "\n## Issue 5 targets\n\n" + table(["target", "measured", "verdict"], rows) + "\n"


def _state_file_section(results: dict, workloads) -> str:
    """Ours without and with a state file (the deployed default), side by side."""
    rows = []
    for size, per_system in results.items():
        plain, kept = per_system.get("ours"), per_system.get(STATE_FILE)
        if not plain or not kept:
            continue
        for workload in workloads:
            row = [size, workload]
            p50 = {}
            for name, entry in (("ours", plain), (STATE_FILE, kept)):
                samples = entry["samples"].get(workload) if not entry["error"] else None
                runs = entry["cpu"].get(workload) if not entry["error"] else None
                p50[name] = percentile(samples, 50) if samples else float("nan")
                row.append(ms(p50[name]) if samples else _cell_na(entry, None))
                row.append(ms(sum(r[0] for r in runs) / sum(r[-1] for r in runs)) if runs else _cell_na(entry, None))
            row.append(ratio(p50[STATE_FILE], p50["ours"]))
            rows.append(row)
    if not rows:
        return ""
    header = ["size", "workload", "ours p50", "ours server CPU per round", "with a state file p50",
              "with a state file server CPU per round", "with / without (p50)"]
    return (
        "\n## Ours with a state file (ms)\n\n"
        "The image, the systemd unit and the Kubernetes manifest run the coordinator with "
        "`--state-file`: every change is on disk before it is answered (a finished round or a "
        "key-value change is a line appended to the journal, fsynced). The tables above measure "
        "ours without one, as the peers keep no state on disk; here both, from the same run.\n\n"
        + table(header, rows) + "\n"
    )


def render(args, results: dict, systems: list[str], skipped: dict, scale: dict | None, command: str) -> str:
    out = []
    m, v = machine(), versions()
    out.append("# Benchmark results: pjrt-rendezvous vs TCPStore vs JAX coordination service\n")
    out.append(f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} by\n")
    out.append(f"```\n{command}\n```\n")
    out.append(
        f"Machine: {m['cores']} cores, {m['memory']} memory, {m['cpu']}, Linux {m['kernel']}; "
        "shared and noisy: read ratios, not absolute speeds.  \n"
        f"Versions: Python {m['python']}, grpcio {v['grpc']}, protobuf {v['protobuf']}, "
        f"torch {v['torch']}, jax {v['jax']} (jaxlib {v['jaxlib']}), pjrt-rendezvous {v['pjrt-rendezvous']}.\n"
    )
    out.append(
        f"Each system ran at each size in {args.reps} repetition(s), order alternating (reversed every other repetition, rotated every "
        f"two), each from a fresh server process; {args.rounds} timed rounds per workload in total (after untimed "
        "warm-up rounds, the last of which checks that every system's round waits for a late "
        "participant), timed by ordinal 0. Times in ms. Ratio = ours / best peer (below 1: ours "
        "is faster; p50 against the best peer p50, p99 against the best p99 shown). TCPStore is the better (by p50) of one client per participant (`thread`) and "
        "one client per process with threads combined locally (`process`); JAX is one client per "
        "process with threads combined locally (its key-value calls are made per thread on the "
        "shared client). Ours is one client per process: it combines a rendezvous round's threads "
        "itself; its key-value workload combines threads locally (a multi_set and a multi_get per "
        "process). Every TCPStore client here waits at most 1 s (not 5) for the reverse DNS "
        "lookup it makes when connecting (`RES_OPTIONS`, see bench/README.md). "
        + (f"Skipped: {'; '.join(f'{k}: {r}' for k, r in skipped.items())}." if skipped else "")
        + "\n"
    )

    def peer_cells(per_system, key, name_for_tcp):
        cells = []
        best = [float("inf"), float("inf")]  # the best peer form's p50 and, apart, the best p99
        for label, name in (("tcpstore", name_for_tcp), ("jax", "jax/process")):
            entry = per_system.get(name) if name else None
            if label == "tcpstore" and name is None:
                entry = per_system.get("tcpstore/process") or per_system.get("tcpstore/thread")
                reason = skipped.get("tcpstore/process")
            else:
                reason = skipped.get(name)
            values = key(entry) if entry and not entry["error"] else None
            if values:
                p50, p99 = percentile(values, 50), percentile(values, 99)
                cells += [ms(p50), ms(p99)]
                if label == "tcpstore":
                    cells.append(name.split("/")[1])
                best = [min(best[0], p50), min(best[1], p99)]
            else:
                na = _cell_na(entry, reason)
                cells += [na, na] + ([na] if label == "tcpstore" else [])
        return cells, best

    out.append(targets_section(results, scale))

    for workload in args.workloads:
        out.append(f"\n## {WORKLOAD_TITLES[workload]} (ms)\n")
        header = ["size", "ours p50", "ours p99", "TCPStore p50", "TCPStore p99", "TCPStore form",
                  "JAX p50", "JAX p99", "ours/best p50", "ours/best p99", "target (p50 ratio)"]
        rows = []
        for size, per_system in results.items():
            key = lambda e, w=workload: e["samples"].get(w)  # noqa: E731
            ours = per_system.get("ours")
            o = key(ours) if ours and not ours["error"] else None
            row = [size]
            if o:
                o50, o99 = percentile(o, 50), percentile(o, 99)
                row += [ms(o50), ms(o99)]
            else:
                o50 = o99 = float("nan")
                na = _cell_na(ours, skipped.get("ours"))
                row += [na, na]
            cells, (b50, b99) = peer_cells(per_system, key, _best_tcpstore(per_system, key))
            row += cells
            row += [ratio(o50, b50), ratio(o99, b99)]
            target = TARGETS.get((workload, size))
            if target is None:
                row.append("—")
            elif o50 == o50 and b50 != float("inf"):
                row.append(f"≤ {target:g}: {'met' if o50 / b50 <= target else 'MISSED'}")
            else:
                row.append(f"≤ {target:g}: not measured")
            rows.append(row)
        out.append(table(header, rows) + "\n")

    out.append(_state_file_section(results, args.workloads))

    # world formation
    out.append("\n## World formation (ms): go signal -> every ordinal known to every participant\n")
    out.append(
        "Median of the repetitions (max in parentheses). Connection = go -> every client connected "
        "(for JAX, connect() itself waits for every process). TCPStore form: the better formation.\n"
    )
    header = ["size", "ours", "ours connect", "TCPStore", "TCPStore connect", "TCPStore form", "JAX",
              "JAX connect", "ours/best (formation)"]
    rows = []
    for size, per_system in results.items():
        row = [size]
        best = float("inf")
        o50 = float("nan")
        tcp = _best_tcpstore(per_system, lambda e: e["formation"])
        for label, name in (("ours", "ours"), ("tcpstore", tcp), ("jax", "jax/process")):
            entry = per_system.get(name) if name else None
            if entry and not entry["error"] and entry["formation"]:
                f = entry["formation"]
                c = entry["connect"]
                row += [f"{ms(percentile(f, 50))} ({ms(max(f))})", f"{ms(percentile(c, 50))} ({ms(max(c))})"]
                if label == "tcpstore":
                    row.append(name.split("/")[1])
                if label == "ours":
                    o50 = percentile(f, 50)
                else:
                    best = min(best, percentile(f, 50))
            else:
                reason = skipped.get(name or "tcpstore/process") if label != "ours" else skipped.get("ours")
                if label == "tcpstore" and name is None:
                    entry = per_system.get("tcpstore/process") or per_system.get("tcpstore/thread")
                na = _cell_na(entry, reason)
                row += [na, na] + ([na] if label == "tcpstore" else [])
        row.append(ratio(o50, best if best != float("inf") else float("nan")))
        rows.append(row)
    out.append(table(header, rows) + "\n")

    # server CPU per round, side by side
    out.append("\n## Server process CPU per round (ms of CPU, user+system, from /proc)\n")
    out.append(
        "CPU time of the server process over the timed rounds / rounds. The servers share the 2 "
        "cores with the clients here; in a pod the clients run on other hosts and this is what "
        "limits scale.\n"
    )
    out.append(_cpu_table(results, args.workloads, skipped, "cpu", ms) + "\n")

    out.append("\n## Client process CPU per round (µs of CPU, all threads of one process)\n")
    out.append(
        "CPU time of each client process over the timed rounds / rounds, averaged over the "
        "processes (`time.process_time`). With the server's CPU, this is what a round's latency "
        "is made of on 2 shared cores.\n"
    )
    out.append(_cpu_table(results, args.workloads, skipped, "client_cpu", lambda s: f"{s * 1e6:.0f}") + "\n")

    # the issue's reference figures
    out.append("\n## Peers' barrier p50 reproduced vs issue 5's figures (ms, threads combined locally)\n")
    header = ["size", "TCPStore here (process form)", "TCPStore issue 5", "JAX here", "JAX issue 5"]
    rows = []
    for size, per_system in results.items():
        row = [size]
        for name, label in (("tcpstore/process", "tcpstore"), ("jax/process", "jax")):
            entry = per_system.get(name)
            values = entry["samples"].get("barrier") if entry and not entry["error"] else None
            row.append(ms(percentile(values, 50)) if values else _cell_na(entry, skipped.get(name)))
            ref = ISSUE_PEER_BARRIER_MS[label].get(size)
            row.append(f"{ref:g}" if ref is not None else "—")
        rows.append(row)
    out.append(table(header, rows) + "\n")

    if scale:
        import _scale

        out.append("\n" + _scale.render(scale))

    profiles = [(f"{size}, all workloads", path) for size, per_system in results.items()
                for path in per_system.get("ours", {}).get("profiles", [])[:1]]
    if scale:
        profiles += [(f"scale {key} ({system}): formation + barrier rounds", entry[system]["profile"])
                     for key, entry in scale["sizes"].items() for system in ("ours", "ours-fanin")
                     if entry.get(system, {}).get("profile")]
    if profiles:
        import _profile

        out.append("\n## Where our coordinator spends its time (py-spy, Python frames)\n")
        out.append(
            "Sampled without pausing the process. `Handle._run` self time is native code run from "
            "event-loop callbacks: gRPC's Cython/C core (completion queue, HTTP/2, protobuf) and socket reads.\n"
        )
        for title, path in profiles:
            try:
                out.append(_profile.render(title, _profile.summarize(path, top=12)))
            except OSError:
                out.append(f"#### {title}: no profile written\n")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2x1,8x1,8x8,32x8", help="PROCESSESxTHREADS list")
    parser.add_argument("--rounds", type=int, default=200, help="timed rounds per workload, over all repetitions")
    parser.add_argument("--reps", type=int, default=2, help="repetitions per system and size (order alternates)")
    parser.add_argument("--systems", default=",".join((*ALL_SYSTEMS, STATE_FILE)))
    parser.add_argument("--workloads", default="barrier,allgather,kv")
    parser.add_argument(
        "--payload", type=_payload, default=1024, help="all-gather bytes per participant (at least 16: ordinal and round)"
    )
    parser.add_argument("--budget", type=float, default=90.0, help="seconds one session may take")
    parser.add_argument(
        "--scale", default="8x8,64x8,512x8", help="scale run sizes (simulated processes x threads); 'none' skips"
    )
    parser.add_argument("--scale-rounds", type=int, default=40,
                        help="timed scale rounds at 512 processes and more; up to 10x as many at smaller sizes")
    parser.add_argument("--scale-peers", default="tcpstore,jax", help="peers in the scale CPU comparison")
    parser.add_argument(
        "--product", help="benchmark pjrt_rendezvous from this source tree instead of the installed one"
    )
    parser.add_argument("--profile", help="directory: record our coordinator with py-spy during its sessions")
    parser.add_argument("--smoke", action="store_true", help="smallest sizes, few rounds (CI): seconds")
    parser.add_argument(
        "--output", help="the table's file (default bench/RESULTS.md; with --smoke, smoke-RESULTS.md in the temporary folder:"
        " a smoke run does not replace the committed results)",
    )
    parser.add_argument("--json", help="also write the raw numbers here")
    args = parser.parse_args(argv)
    if args.output is None:
        args.output = os.path.join(tempfile.gettempdir(), "smoke-RESULTS.md") if args.smoke else os.path.join(HERE, "RESULTS.md")
    if args.product:
        from _servers import use_product

        use_product(args.product)
    command = "python bench/run.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    if args.smoke:
        args.sizes = "2x1"
        args.rounds = min(args.rounds, 20)
        args.reps = 1
        args.budget = min(args.budget, 30.0)
        args.scale = "4x2" if args.scale != "none" else "none"
        args.scale_rounds = min(args.scale_rounds, 10)
    args.sizes = [s.strip().lower() for s in args.sizes.split(",") if s.strip()]
    for s in args.sizes:
        parse_size(s)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    systems, skipped = available_systems(wanted)
    if "ours" not in systems:
        log(f"cannot benchmark without our package: {skipped.get('ours')}")
        return 2
    # Import the peers' libraries here, once: the workers fork from this process.
    for name in systems:
        if name.startswith("tcpstore"):
            import torch.distributed  # noqa: F401
        elif name.startswith("jax"):
            from jaxlib import _jax  # noqa: F401
    import grpc  # noqa: F401

    import pjrt_rendezvous.client  # noqa: F401

    started = time.monotonic()
    log(f"systems: {', '.join(systems)}; skipped: {skipped or 'none'}")
    results = run_matrix(args, systems, log)
    scale = None
    if args.scale != "none":
        import _scale

        peers = [p for p in args.scale_peers.split(",") if p and any(s.startswith(p) for s in systems)]
        scale = _scale.run(
            [parse_size(s) for s in args.scale.split(",")], rounds=args.scale_rounds, peers=peers, log=log,
            profile=args.profile,
        )
    text = render(args, results, systems, skipped, scale, command)
    text += f"\nWall time of this run: {time.monotonic() - started:.0f} s.\n"
    with open(args.output, "w") as f:
        f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "scale": scale, "skipped": skipped}, f, indent=1, default=str)
    log(f"wrote {args.output} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
