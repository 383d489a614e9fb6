"""The scale run: thousands of simulated participants against one server, over real sockets.

A simulated process behaves on the wire like a real client process of its server:

- ours: its own connection to the session port carrying its calls as the client's does
  (length-prefixed Session messages, ``client/_session.py``), and a gRPC channel for its
  Watch stream: one Register per thread (as each thread's ``bind_thread`` does), a
  Heartbeat every 5 s, one WaitWorld, then one Rendezvous per round carrying all its
  threads' contributions (as the client combines them); plus a Watch stream. (A real
  client's first Register travels on gRPC, whose answer names the session port; a simulated
  one is given the port.) Requests are
  serialized with the generated protobuf classes; responses are not parsed (a real client
  on another host would pay that, not the coordinator).
- TCPStore: one client per process (threads combined locally), the add / last-sets / wait
  barrier of torch.elastic.
- JAX: one coordination-service client per process, ``wait_at_barrier`` per round.

Generators are subprocesses (``python _scale.py gen ...``): grpc.aio for ours, threads over
the C++ clients for the peers. The driver starts the server, connects the generators, gives
the go signal (world formation is timed from it, connection before it), and reads the
server's CPU time (/proc) across the timed rounds and its peak memory (VmHWM).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _report import ms, percentile, ratio, table  # noqa: E402
from _servers import cpu_seconds, peak_rss_mb, rss_mb  # noqa: E402

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # see run.py

TIMEOUT_S = 120.0
HEARTBEAT_S = 5.0
SIM_PER_HOST = 8  # simulated processes per simulated host
# Our two modes: every process calls the coordinator; host fan-in (client/_relay.py).
OURS = {"ours": "direct", "ours-fanin": f"host fan-in ({SIM_PER_HOST} processes per host)"}
_RPC = "/pjrt_rendezvous.v1.Coordinator/"


# -- generators (run in their own processes) ---------------------------------------------------


def _emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _await_go() -> None:
    line = sys.stdin.readline()
    if line.strip() != "go":
        raise SystemExit("no go signal")


async def _gen_ours(a) -> None:
    import asyncio

    fan_in = a.system == "ours-fanin"

    import grpc

    from pjrt_rendezvous.client._session import FRAME, frame
    from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb

    fields = pb.RendezvousRequest.DESCRIPTOR.fields_by_name
    if "process_indexes" in fields:  # the product's own wire form: what its relay sends it
        from pjrt_rendezvous.client._wire import set_contribution_rows

        _put_rows = functools.partial(set_contribution_rows, index_processes=True)
    elif "ordinals" in fields:  # an older product's lists
        from pjrt_rendezvous.client._wire import set_contribution_rows as _put_rows
    else:  # an older product (bench/compare.py --before): Contribution messages

        def _put_rows(request, rows) -> None:
            request.contributions.extend(pb.Contribution(ordinal=o, tag=t, payload=p, incarnation=i) for o, t, p, i in rows)

    loop = asyncio.get_running_loop()
    sims = range(a.first, a.first + a.count)
    t_start = time.monotonic()
    options = [
        ("grpc.use_local_subchannel_pool", 1),  # a TCP connection per simulated process
        ("grpc.max_receive_message_length", -1),
    ]
    channels = {i: grpc.aio.insecure_channel(a.address, options=options) for i in sims}
    watch = {i: ch.unary_stream(_RPC + "Watch") for i, ch in channels.items()}
    await asyncio.wait_for(asyncio.gather(*(ch.channel_ready() for ch in channels.values())), TIMEOUT_S)
    t_connected = time.monotonic()
    _emit({"ready": True, "connect_s": t_connected - t_start})
    await loop.run_in_executor(None, _await_go)

    # One session per simulated process on the session port: calls go out as messages with
    # an id, a reader task hands each answer to the call waiting for it (the client's
    # SocketSession does this with a thread).
    host = a.address.rsplit(":", 1)[0]
    sessions: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
    for i in sims:
        sessions[i] = await asyncio.open_connection(host, a.session_port)
        sessions[i][1].write(frame(pb.SessionHello().SerializeToString()))
    waiting: dict[tuple[int, int], asyncio.Future] = {}
    ids = iter(range(1, 1 << 62))

    async def read_answers(i: int) -> None:
        reader = sessions[i][0]
        while True:
            head = await reader.readexactly(FRAME.size)
            data = await reader.readexactly(FRAME.unpack(head)[0])
            for answer in pb.SessionResponse.FromString(data).answers:
                future = waiting.pop((i, answer.id), None)
                if future is not None and not future.done():
                    future.set_result(answer)

    readers = [asyncio.ensure_future(read_answers(i)) for i in sims]

    incarnations = {i: uuid.uuid4().hex for i in sims}
    generations: dict[int, int] = {}
    streams = []
    stop = asyncio.Event()

    async def heartbeat(i: int) -> None:
        request = pb.HeartbeatRequest(job=a.job, incarnation=incarnations[i]).SerializeToString()
        while True:
            try:
                await asyncio.wait_for(stop.wait(), HEARTBEAT_S)
                return
            except asyncio.TimeoutError:
                await call(i, "Heartbeat", request)

    async def call(i: int, method: str, body: bytes) -> bytes:
        call_id = next(ids)
        future = waiting[(i, call_id)] = loop.create_future()
        call = pb.SessionCall(id=call_id, method=method, request=body)
        sessions[i][1].write(frame(pb.SessionRequest(calls=[call]).SerializeToString()))
        answer = await asyncio.wait_for(future, TIMEOUT_S + 10)
        if answer.code:
            raise RuntimeError(f"{method} failed with status {answer.code}: {answer.message}")
        return answer.response

    async def form(i: int) -> None:
        async def register(t: int) -> None:
            request = pb.RegisterRequest(
                job=a.job,
                incarnation=incarnations[i],
                host=f"sim-host-{i // SIM_PER_HOST}",
                pid=100000 + i,
                task_id=i,
                num_tasks=a.P,
                devices_per_task=a.T,
                local_rank=i % SIM_PER_HOST,
                threads=[pb.ThreadSpec(thread_index=t)],
            )
            reply = pb.RegisterResponse.FromString(await call(i, "Register", request.SerializeToString()))
            generations[i] = reply.generation

        await asyncio.gather(*(register(t) for t in range(a.T)))
        streams.append(watch[i](pb.WatchRequest(job=a.job, incarnation=incarnations[i]).SerializeToString()))
        await call(i, "WaitWorld", pb.WaitWorldRequest(job=a.job, timeout=TIMEOUT_S).SerializeToString())

    await asyncio.wait_for(asyncio.gather(*(form(i) for i in sims)), TIMEOUT_S)
    t_formed = time.monotonic()
    beats = [asyncio.ensure_future(heartbeat(i)) for i in sims]

    samples: list[float] = []
    cpu = [0.0, 0.0]
    timing = a.first == 0

    # With host fan-in, the first simulated process of each host (its relay) sends one call
    # per round for the host's processes, each contribution naming its process; the hop to
    # the relay stays on the host, off the coordinator.
    speakers = [i for i in sims if not fan_in or i % SIM_PER_HOST == 0]

    async def rounds(i: int) -> None:
        host = range(i, min(i + SIM_PER_HOST, a.first + a.count)) if fan_in else [i]
        rows = [
            (o, "barrier", b"", incarnations[p] if fan_in else "")
            for p in host
            for o in range(p * a.T, (p + 1) * a.T)
        ]
        for r in range(a.warmup + a.rounds):
            message = pb.RendezvousRequest(
                job=a.job, incarnation=incarnations[i], round=r, timeout=TIMEOUT_S, generation=generations[i]
            )
            _put_rows(message, rows)
            request = message.SerializeToString()
            if timing and i == 0 and r == a.warmup:
                cpu[0] = cpu_seconds(a.server_pid)
            started = time.perf_counter()
            await call(i, "Rendezvous", request)
            if timing and i == 0 and r >= a.warmup:
                samples.append(time.perf_counter() - started)
        if timing and i == 0:
            cpu[1] = cpu_seconds(a.server_pid)

    await asyncio.wait_for(asyncio.gather(*(rounds(i) for i in speakers)), TIMEOUT_S * 2)
    stop.set()
    await asyncio.gather(*beats, return_exceptions=True)
    for stream in streams:
        stream.cancel()
    for reader in readers:
        reader.cancel()
    for _, writer in sessions.values():
        writer.close()
    await asyncio.gather(*readers, return_exceptions=True)
    _emit({"t_connected": t_connected, "t_formed": t_formed, "samples": samples, "cpu": cpu[1] - cpu[0]})
    await asyncio.gather(*(ch.close() for ch in channels.values()))


def _gen_threads(a) -> None:
    """TCPStore or JAX: one C++ client per simulated process, one Python thread each."""
    sims = list(range(a.first, a.first + a.count))
    clients: dict[int, object] = {}
    errors: list[str] = []

    def guarded(fn, *args):
        try:
            fn(*args)
        except BaseException as exc:  # reported to the driver
            errors.append(f"{type(exc).__name__}: {exc}")

    def run_all(fn, items):
        threads = [threading.Thread(target=guarded, args=(fn, i), daemon=True) for i in items]
        for th in threads:
            th.start()
        for th in threads:
            th.join(TIMEOUT_S * 2)
        if errors or any(th.is_alive() for th in threads):
            _emit({"error": errors[0] if errors else "threads did not finish"})
            os._exit(1)

    if a.system == "tcpstore":
        from datetime import timedelta

        from torch.distributed import TCPStore

        host, port = a.address.rsplit(":", 1)

        def connect(i):
            clients[i] = TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))

        def barrier(i, r):
            s = clients[i]
            if s.add(f"b/{r}", 1) == a.P:
                s.set(f"b/{r}/last", b"1")
            else:
                s.wait([f"b/{r}/last"])

    else:
        from jaxlib import _jax

        def connect(i):
            c = _jax.get_distributed_runtime_client(
                a.address, i, init_timeout=int(TIMEOUT_S), use_compression=True, heartbeat_timeout=100,
                shutdown_timeout=int(TIMEOUT_S),
            )
            c.connect()  # returns once every process connected
            clients[i] = c

        def barrier(i, r):
            clients[i].wait_at_barrier(f"b{r}", int(TIMEOUT_S * 1000))

    # The TCPStore clients' connects stall 5 s now and then on this machine (a reverse DNS
    # lookup that times out, bench/README.md): connect them all concurrently, before the go signal, untimed.
    t_start = time.monotonic()
    run_all(connect, sims)
    t_connected = time.monotonic()
    _emit({"ready": True, "connect_s": t_connected - t_start})
    _await_go()
    samples: list[float] = []
    cpu = [0.0, 0.0]
    timing = a.first == 0

    def loop(i):
        for r in range(a.warmup + a.rounds):
            if timing and i == 0 and r == a.warmup:
                cpu[0] = cpu_seconds(a.server_pid)
            started = time.perf_counter()
            barrier(i, r)
            if timing and i == 0 and r >= a.warmup:
                samples.append(time.perf_counter() - started)
        if timing and i == 0:
            cpu[1] = cpu_seconds(a.server_pid)

    run_all(loop, sims)
    _emit({"t_connected": t_connected, "t_formed": t_connected, "samples": samples, "cpu": cpu[1] - cpu[0]})
    if a.system == "jax":
        run_all(lambda i: clients[i].shutdown(), sims)
    os._exit(0)  # skip destructors of hundreds of C++ clients


# -- driver ------------------------------------------------------------------------------------


def _generators(system: str, P: int) -> int:
    # ours: grpc.aio is CPU-bound per RPC, so two generators at large sizes; the peers'
    # clients are C++ and release the GIL, one process of threads keeps up.
    if system in OURS and P >= 128:
        return 2
    return 1


def _run_one(system: str, P: int, T: int, rounds: int, log, profile: str | None = None) -> dict:
    import _servers

    server = _servers.start("ours" if system in OURS else system, num_processes=P)
    spy = None
    if profile and system in OURS:
        import _profile

        os.makedirs(profile, exist_ok=True)
        spy_path = os.path.join(profile, f"scale-{system}-{P}x{T}.txt")
        spy = _profile.attach(server.pid, spy_path)
        time.sleep(0.5)
    G = _generators(system, P)
    job = f"scale-{P}x{T}"
    gens = []
    logs = []
    try:
        per = -(-P // G)
        for g in range(G):
            first, count = g * per, min(per, P - g * per)
            argv = [
                sys.executable, os.path.abspath(__file__), "gen", "--system", system, "--address", server.address,
                "--job", job, "--P", str(P), "--T", str(T), "--first", str(first), "--count", str(count),
                "--rounds", str(rounds), "--warmup", str(max(3, rounds // 10)), "--server-pid", str(server.pid),
                "--session-port", str(server.session_port or 0),
            ]
            logs.append(tempfile.TemporaryFile(mode="w+"))
            gens.append(
                subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[-1], text=True,
                    env=_servers.peer_env(),
                )
            )
        deadline = time.monotonic() + TIMEOUT_S + 30

        def read(proc) -> dict:
            result: dict = {}
            done = threading.Event()

            def reader():
                line = proc.stdout.readline()
                if line:
                    result.update(json.loads(line))
                done.set()

            threading.Thread(target=reader, daemon=True).start()
            if not done.wait(max(0.0, deadline - time.monotonic())) or not result:
                alive = proc.poll() is None
                if alive:
                    proc.kill()
                    proc.wait()
                log_file = logs[gens.index(proc)]
                log_file.seek(0)
                lines = log_file.read().strip().splitlines()
                # the error line of a traceback, or the status/details of a gRPC error
                useful = [l.strip() for l in lines if l.strip().startswith(("status =", "details =")) or
                          (l and not l.startswith(" ") and ":" in l and not l.startswith(("Traceback", "[W")))]
                what = "did not answer in time" if alive else "died"
                raise RuntimeError(f"generator {what}: {'; '.join(useful[-3:])[:300] or 'no output'}")
            if "error" in result:
                raise RuntimeError(result["error"])
            return result

        readies = [read(proc) for proc in gens]
        cpu_before_go = server.cpu()
        t_go = time.monotonic()
        for proc in gens:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        deadline = time.monotonic() + TIMEOUT_S * 3
        outs = [read(proc) for proc in gens]
        timing = outs[0]
        result = {
            "formation_s": max(o["t_formed"] for o in outs) - t_go if system in OURS else None,
            "samples": timing["samples"],
            "cpu_per_round": timing["cpu"] / rounds,
            "cpu_total": server.cpu() - cpu_before_go,
            "peak_mb": peak_rss_mb(server.pid),
            "rss_mb": rss_mb(server.pid),
            "generators": G,
            "connect_s": max(r["connect_s"] for r in readies),
        }
        for proc in gens:
            proc.wait(60)
        if spy is not None:
            _profile.stop(spy)
            spy = None
            result["profile"] = spy_path
        return result
    finally:
        if spy is not None:
            _profile.stop(spy)
        for proc in gens:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.stop()
        for f in logs:
            f.close()


def rounds_at(processes: int, rounds: int) -> int:
    """Timed rounds at a size: ``rounds`` at 512 processes and more, up to ten times as many
    at smaller sizes, so each size's CPU per round is measured over a similar number of
    calls (40 rounds of 8 processes are over in about 10 ms, where the machine's noise is
    as large as what is measured)."""
    return max(rounds, min(rounds * 10, rounds * 512 // processes))


def run(sizes: list[tuple[int, int]], *, rounds: int, peers: list[str], log, profile: str | None = None) -> dict:
    out: dict = {"rounds": rounds, "sizes": {}}
    for P, T in sizes:
        key = f"{P}x{T}"
        entry = out["sizes"][key] = {}
        for system in list(OURS) + list(peers):
            started = time.monotonic()
            try:
                entry[system] = _run_one(system, P, T, rounds_at(P, rounds), log, profile)
            except Exception as exc:  # a size a peer cannot do is reported, not fatal
                entry[system] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                log(f"  scale {key} {system}: FAILED {entry[system]['error']}")
                continue
            e = entry[system]
            log(
                f"  scale {key} ({P * T} participants) {system}: barrier p50 {ms(percentile(e['samples'], 50))} ms, "
                f"server CPU {ms(e['cpu_per_round'])} ms/round, peak {e['peak_mb']:.0f} MB"
                + (f", formation {ms(e['formation_s'])} ms" if e.get("formation_s") is not None else "")
                + f" ({time.monotonic() - started:.1f} s)"
            )
    return out


def best_ours(entry: dict) -> tuple[str, dict] | None:
    """Our better mode at one size by server CPU per round: (mode label, its results)."""
    done = [(e["cpu_per_round"], OURS[k], e) for k, e in entry.items() if k in OURS and "error" not in e]
    return min(done, key=lambda x: x[0])[1:] if done else None


def render(scale: dict) -> str:
    lines = [
        "## Scale: simulated participants over real sockets (bench/_scale.py)\n",
        "Each simulated process has its own connection to the session port (and a gRPC channel for its Watch stream), and behaves on the wire "
        "like a client process of ours: a Register per thread, a Watch stream, heartbeats every 5 s, "
        "WaitWorld, then per round one Rendezvous carrying its threads (direct), or, with host fan-in, "
        f"one Rendezvous per simulated host of {SIM_PER_HOST} processes carrying all of theirs (what each "
        "host's relay sends; the hop to the relay stays on the host). The load generators share the 2 "
        f"cores with the server, so round latency includes their CPU. Timed barrier rounds per size: "
        + ", ".join(f"{rounds_at(int(key.split('x')[0]), scale['rounds'])} at {key}" for key in scale["sizes"])
        + " (every system the same at a size).\n",
    ]
    header = ["participants (processes x threads)", "mode", "connect (ms)", "world formation (ms)", "barrier p50 (ms)",
              "barrier p99 (ms)", "coordinator CPU per round (ms)", "CPU per round per process (µs)",
              "coordinator peak RSS (MB)"]
    rows = []
    for key, entry in scale["sizes"].items():
        P, T = (int(x) for x in key.split("x"))
        label = f"{P * T} ({key})"
        for system, mode in OURS.items():
            e = entry.get(system, {})
            if "error" in e or not e:
                rows.append([label, mode, f"n/a: {e.get('error', 'not run')}"] + ["n/a: see the third column"] * 6)
                continue
            rows.append([
                label,
                mode,
                ms(e["connect_s"]),
                ms(e["formation_s"]),
                ms(percentile(e["samples"], 50)),
                ms(percentile(e["samples"], 99)),
                ms(e["cpu_per_round"]),
                f"{e['cpu_per_round'] / P * 1e6:.0f}",
                f"{e['peak_mb']:.0f}",
            ])
    lines.append(table(header, rows) + "\n")
    lines.append(
        "\nIssue 5 targets at 4,096 participants (512 processes): world formation < 2 s, barrier p50 "
        "< 100 ms, coordinator peak memory < 150 MB, cost per round linear in processes (the µs per "
        "process column flat).\n"
    )
    lines.append("\n### Server CPU per barrier round, side by side (ms of server-process CPU per round)\n")
    lines.append(
        "Peers in their best form (one client per process, threads combined locally), so their "
        "servers see one client per simulated process; ours in both modes, the ratio for the better.\n"
    )
    header = ["participants", "ours direct", "ours host fan-in", "TCPStore", "JAX", "ours (better) / best peer",
              "ours (better) barrier p50", "TCPStore barrier p50", "JAX barrier p50"]
    rows = []
    for key, entry in scale["sizes"].items():
        P, T = (int(x) for x in key.split("x"))
        row = [f"{P * T} ({key})"]
        cpu = {}
        for system in (*OURS, "tcpstore", "jax"):
            e = entry.get(system)
            if e is None:
                row.append("skipped: not installed")
            elif "error" in e:
                row.append(f"n/a: {e['error'][:80]}")
            else:
                cpu[system] = e["cpu_per_round"]
                row.append(ms(e["cpu_per_round"]))
        peers = [v for k, v in cpu.items() if k not in OURS]
        best = best_ours(entry)
        row.append(ratio(best[1]["cpu_per_round"], min(peers)) if peers and best else "—")
        row.append(ms(percentile(best[1]["samples"], 50)) if best else "—")
        for system in ("tcpstore", "jax"):
            e = entry.get(system)
            row.append(ms(percentile(e["samples"], 50)) if e and "error" not in e else "—")
        rows.append(row)
    lines.append(table(header, rows) + "\n")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("gen")
    for name in ("--system", "--address", "--job"):
        gen.add_argument(name, required=True)
    for name in ("--P", "--T", "--first", "--count", "--rounds", "--warmup", "--server-pid", "--session-port"):
        gen.add_argument(name, type=int, required=True)
    drive = sub.add_parser("run", help="the scale run alone")
    drive.add_argument("--sizes", default="8x8,64x8,512x8")
    drive.add_argument("--rounds", type=int, default=40, help="timed rounds at 512 processes and more (see rounds_at)")
    drive.add_argument("--peers", default="tcpstore,jax")
    drive.add_argument("--profile", help="directory: record our coordinator with py-spy")
    drive.add_argument("--product", help="pjrt_rendezvous from this source tree instead of the installed one")
    args = parser.parse_args(argv)
    if getattr(args, "product", None):
        from _servers import use_product

        use_product(args.product)
    if args.command == "gen":
        if args.system in OURS:
            import asyncio

            asyncio.run(_gen_ours(args))
        else:
            _gen_threads(args)
        return 0
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    result = run(sizes, rounds=args.rounds, peers=[p for p in args.peers.split(",") if p],
                 log=lambda m: print(m, file=sys.stderr, flush=True), profile=args.profile)
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
