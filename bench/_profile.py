"""Profiling a running coordinator with py-spy (sampling, attached by pid; no code change).

``attach(pid, path)`` starts ``py-spy record --format raw`` (collapsed stacks) on the
process; ``stop(handle)`` ends it (SIGINT makes py-spy write its file); ``summarize(path)``
gives the top functions by self samples and by inclusive samples.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys


def py_spy() -> str | None:
    exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return exe if os.path.exists(exe) else shutil.which("py-spy")


def attach(pid: int, path: str, *, rate: int = 200, native: bool = False) -> subprocess.Popen | None:
    exe = py_spy()
    if exe is None:
        return None
    argv = [exe, "record", "--pid", str(pid), "--format", "raw", "--output", path]
    if native or os.environ.get("BENCH_PYSPY_NATIVE"):
        # native stacks need the process paused per sample: sample less often
        argv += ["--native", "--rate", str(min(rate, 50))]
    else:
        argv += ["--rate", str(rate), "--nonblocking"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(handle: subprocess.Popen | None) -> None:
    if handle is None:
        return
    handle.send_signal(signal.SIGINT)
    try:
        handle.wait(20)
    except subprocess.TimeoutExpired:
        handle.kill()
        handle.wait()


def _short(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py:123)"
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    path, _, line = where.rpartition(":")
    return f"{name} ({os.path.basename(path)}:{line})" if where else name


_OURS = ("_servicer.py", "_core.py", "_monitor.py", "_state.py", "_metrics.py", "_logging.py")
_PLUMBING = ("serve_forever", "main (", "_serve (")


def summarize(path: str, top: int = 15) -> dict:
    """{'samples': n, 'self': [(frame, share)], 'ours': [(frame, share)]}: the top frames by
    self samples, and our coordinator's functions by inclusive samples (line numbers dropped,
    so a function's lines count together)."""
    self_counts: collections.Counter = collections.Counter()
    ours_counts: collections.Counter = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = [_short(fr) for fr in stack.split(";")]
            # the first frame is the thread ("process 123:\"python\"" / "thread (0x..)")
            frames = [fr for fr in frames if not fr.startswith(("process ", "thread "))]
            if not frames:
                continue
            total += n
            self_counts[frames[-1]] += n
            functions = {fr.rsplit(":", 1)[0] + ")" for fr in frames if any(o in fr for o in _OURS)}
            for fn in functions:
                if not fn.startswith(_PLUMBING):
                    ours_counts[fn] += n
    share = lambda c: [(fr, n / total) for fr, n in c.most_common(top)]  # noqa: E731
    return {"samples": total, "self": share(self_counts) if total else [], "ours": share(ours_counts) if total else []}


def render(title: str, summary: dict) -> str:
    lines = [
        f"#### {title} ({summary['samples']} samples)",
        "",
        "| self % | frame (self time) | | inclusive % | our function (inclusive) |",
        "|---|---|---|---|---|",
    ]
    rows = max(len(summary["self"]), len(summary["ours"]))
    for i in range(rows):
        a, sa = summary["self"][i] if i < len(summary["self"]) else ("", None)
        b, sb = summary["ours"][i] if i < len(summary["ours"]) else ("", None)
        lines.append(
            f"| {'' if sa is None else f'{sa * 100:.1f}'} | {f'`{a}`' if a else '—'} | "
            f"| {'' if sb is None else f'{sb * 100:.1f}'} | {f'`{b}`' if b else '—'} |"
        )
    return "\n".join(lines) + "\n"
