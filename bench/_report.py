"""Statistics and the RESULTS.md tables."""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(seconds: float) -> str:
    if seconds != seconds:
        return "—"
    value = seconds * 1000
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def ratio(a: float, b: float) -> str:
    if a != a or b != b or b == 0:
        return "—"
    return f"{a / b:.2f}"


def machine() -> dict[str, str]:
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = "?"
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            mem = f"{kb / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    return {
        "cores": str(os.cpu_count()),
        "memory": mem,
        "cpu": model,
        "kernel": platform.release(),
        # The interpreter's build matters to every Python side (bench/HISTORY.md): which one ran.
        "python": f"{sys.version.split()[0]} ({os.path.realpath(sys.executable)})",
    }


def versions() -> dict[str, str]:
    out = {}
    for module in ("grpc", "google.protobuf", "torch", "jax", "jaxlib"):
        try:
            mod = __import__(module, fromlist=["__version__"])
            out[module.replace("google.", "")] = getattr(mod, "__version__", "?")
        except Exception as exc:  # an absent peer is reported, not fatal
            out[module.replace("google.", "")] = f"not installed ({type(exc).__name__})"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
            timeout=5,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
            timeout=5,
        ).stdout.strip()
        out["pjrt-rendezvous"] = f"git {commit}" + (" + uncommitted changes" if dirty else "")
        import pjrt_rendezvous.coordinator as coordinator

        where = os.path.dirname(os.path.dirname(os.path.realpath(coordinator.__file__)))
        if os.path.realpath(where) != os.path.realpath(os.path.join(os.path.dirname(__file__), "..")):
            out["pjrt-rendezvous"] = f"from {where}"
        from pjrt_rendezvous.client import _session

        native = getattr(_session, "_native", None)  # an older product has no native path
        out["pjrt-rendezvous"] += " (native path)" if native is not None else " (Python path only)"
    except (OSError, subprocess.SubprocessError):
        out["pjrt-rendezvous"] = "?"
    return out


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
