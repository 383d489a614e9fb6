"""The servers under test, each in its own process, and what /proc says about them.

- ours: the real CLI, ``python -m pjrt_rendezvous.coordinator serve --port 0`` (and a free
  session port);
- TCPStore: a master store (libuv backend) in a process of its own (``python _servers.py tcpstore``);
- JAX: the XLA coordination service in a dedicated process (``python _servers.py jax N``), so its
  CPU and memory are not mixed with a client's. ``jax.distributed.initialize`` would host it in
  process 0; the service and the clients are the same C++ objects either way.

Every server prints ``listening on HOST:PORT`` and exits when its stdin closes (the peers'
servers) or on SIGTERM (ours), so a crashed harness leaves nothing behind for long.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_ticks_seconds(pid: int) -> float:
    """User + system CPU time of every thread of ``pid`` so far (/proc/PID/stat; 10 ms ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # after the ")" of comm: state is field 3, utime 14 and stime 15 (1-based in proc(5))
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def cpu_seconds(pid: int) -> float:
    """CPU time of the live threads of ``pid`` so far, in ns resolution.

    The same quantity as utime + stime of /proc/PID/stat, which counts in 10 ms ticks - too
    coarse for rounds of 0.1 ms - so this sums the on-CPU time of each thread from
    /proc/PID/task/TID/schedstat. Falls back to the ticks where schedstat is missing.
    """
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # the thread just ended
    except OSError:
        return cpu_ticks_seconds(pid)
    return total / 1e9 if total else cpu_ticks_seconds(pid)


def peak_rss_mb(pid: int) -> float:
    """VmHWM (peak resident set) of ``pid`` in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    """A server subprocess: ``address``, ``pid``, ``stop()``; its log goes to a temp file."""

    def __init__(
        self, kind: str, argv: list[str], env: dict[str, str] | None = None, timeout: float = 60.0, folder: str | None = None
    ):
        self.kind = kind
        self.folder = folder  # removed by stop()
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{kind.replace('/', '-')}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        deadline = time.monotonic() + timeout
        line = ""
        while "listening on" not in line:
            line = self.proc.stdout.readline()
            if not line or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{kind} server did not start; see {self.log.name}")
        self.address = line.rsplit(" ", 1)[1].strip()
        self.pid = self.proc.pid
        self.session_port: int | None = None  # ours: the session port (client/_session.py)
        if kind.startswith("ours"):
            line = self.proc.stdout.readline()
            if "session port" not in line:
                self.stop()
                raise RuntimeError(f"{kind} server named no session port; see {self.log.name}")
            self.session_port = int(line.rsplit(":", 1)[1])

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def peak_mb(self) -> float:
        return peak_rss_mb(self.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def use_product(tree: str) -> str:
    """Makes ``pjrt_rendezvous`` import from the source tree ``tree`` (a checkout with the
    package's top-level folders) in this process and every subprocess started after, ahead
    of the installed (editable) one: for before/after measurements of a patch."""
    import atexit

    tree = os.path.abspath(tree)
    _build_native(tree)
    root = tempfile.mkdtemp(prefix="bench-product-")
    atexit.register(shutil.rmtree, root, True)
    os.mkdir(os.path.join(root, "pjrt_rendezvous"))
    for name in ("coordinator", "client", "protos"):
        os.symlink(os.path.join(tree, name), os.path.join(root, "pjrt_rendezvous", name))
    sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = root + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    return root


def _build_native(tree: str) -> None:
    """Builds the tree's native module in place if it has one and it is not built (as
    ``pip install`` would: a tree from ``git archive`` has only its source). Without a
    compiler the tree runs its Python path, as the package would; RESULTS.md says which."""
    source = os.path.join(tree, "client", "_native.c")
    target = os.path.join(tree, "client", "_native" + sysconfig.get_config_var("EXT_SUFFIX"))
    if os.path.exists(source) and not os.path.exists(target):
        compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
        include = sysconfig.get_paths()["include"]
        try:
            subprocess.run([*compiler, "-shared", "-fPIC", "-O2", "-I", include, source, "-o", target], check=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"{tree}: native module not built ({exc}); measuring its Python path", file=sys.stderr)


class ForkedServer:
    """A peer's server in a child forked from the harness, which has already imported the
    peer's library (a fresh interpreter would spend seconds importing torch first). Same
    interface as :class:`Server`."""

    def __init__(self, kind: str, target, *args) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        self.kind = kind
        self.session_port = None  # ours only
        self.proc = ctx.Process(target=_forked_main, args=(child, target, args), daemon=True)
        self.proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(60):
            self.stop()
            raise RuntimeError(f"{kind} server did not start")
        self.address = parent.recv()
        self.pid = self.proc.pid

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def peak_mb(self) -> float:
        return peak_rss_mb(self.pid)

    def stop(self) -> None:
        self._conn.close()
        self.proc.terminate()  # the child also holds the pipe's other end: signal it
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _forked_main(conn, target, args) -> None:
    try:
        target(lambda address: conn.send(address), *args)
        try:
            conn.recv()
        except EOFError:
            pass
    finally:
        os._exit(0)


def peer_env() -> dict[str, str]:
    env = dict(os.environ)
    # The XLA coordination service logs every barrier at INFO (one line per round): give
    # JAX its best form, as a production user would, and keep warnings.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    return env


def start(kind: str, *, num_processes: int = 0, python: str = sys.executable) -> Server:
    if kind in ("ours", "ours/state-file"):
        argv = [python, "-m", "pjrt_rendezvous.coordinator", "serve", "--port", "0"]
        folder = None
        if kind == "ours/state-file":  # on this machine's disk, as a deployment's would be
            folder = tempfile.mkdtemp(prefix="bench-state-")
            argv += ["--state-file", os.path.join(folder, "coordinator.state")]
        return Server(kind, argv, env=dict(os.environ), folder=folder)
    here = os.path.abspath(__file__)
    if kind == "tcpstore" and "torch.distributed" in sys.modules:
        return ForkedServer(kind, _tcpstore_master)
    if kind == "jax" and "jaxlib._jax" in sys.modules:
        return ForkedServer(kind, _jax_service, num_processes)
    if kind == "tcpstore":
        return Server(kind, [python, here, "tcpstore"], env=peer_env())
    if kind == "jax":
        return Server(kind, [python, here, "jax", str(num_processes)], env=peer_env())
    raise ValueError(kind)


_keep: list = []  # the server objects live as long as the process


def _tcpstore_master(ready) -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    _keep.append(store)
    ready(f"127.0.0.1:{store.port}")


def _jax_service(ready, num_processes: int) -> None:
    import socket

    from jaxlib import _jax

    with socket.socket() as s:  # the service takes a fixed port: pick a free one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _keep.append(
        _jax.get_distributed_runtime_service(
            f"127.0.0.1:{port}", num_processes, heartbeat_timeout=100, shutdown_timeout=60
        )
    )
    ready(f"127.0.0.1:{port}")


def _print_ready(address: str) -> None:
    print(f"listening on {address}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "tcpstore":
        _tcpstore_master(_print_ready)
    elif sys.argv[1] == "jax":
        _jax_service(_print_ready, int(sys.argv[2]))
    else:
        raise SystemExit(f"unknown server kind {sys.argv[1]!r}")
    sys.stdin.read()  # until the harness closes our stdin
    os._exit(0)
