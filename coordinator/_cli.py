"""The ``pjrt-rendezvous`` command: ``serve``, ``status``, ``demo``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import sys

from ._core import Limits
from ._server import DEFAULT_HEARTBEAT_TIMEOUT

DEFAULT_HOST = "127.0.0.1"


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {port}")
    return port


def _seconds(text: str) -> float | None:
    if text.lower() == "none":
        return None
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds or 'none', got {text}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    from pjrt_rendezvous.client._topology import DEFAULT_PORT

    parser = argparse.ArgumentParser(
        prog="pjrt-rendezvous",
        description="Coordinator and tools for PJRT thread-per-core rendezvous on TPU pod slices.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the coordinator (on host 0 of the pod slice)")
    serve.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to listen on (default {DEFAULT_HOST}; use 0.0.0.0 so other TPU hosts can connect)",
    )
    serve.add_argument(
        "--port", type=_port, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 picks a free one)"
    )
    serve.add_argument(
        "--world-size",
        type=_positive,
        help="fix the world size of --job up front (default: the first registration fixes it)",
    )
    serve.add_argument("--job", default="default", help="the job --world-size applies to (default 'default')")
    serve.add_argument(
        "--heartbeat-timeout",
        type=_seconds,
        default=DEFAULT_HEARTBEAT_TIMEOUT,
        help=f"declare a process dead after this many seconds without a heartbeat (default "
        f"{DEFAULT_HEARTBEAT_TIMEOUT:g}; 'none' disables)",
    )
    serve.add_argument("--state-file", type=pathlib.Path, help="keep ranks, job config and keys here across restarts")
    serve.add_argument("--token-file", type=pathlib.Path, help="file holding the shared secret every client must send")
    serve.add_argument("--tls-cert", type=pathlib.Path, help="PEM server certificate (enables TLS)")
    serve.add_argument("--tls-key", type=pathlib.Path, help="PEM private key of --tls-cert")
    serve.add_argument("--tls-ca", type=pathlib.Path, help="PEM CA that must sign client certificates (mutual TLS)")
    serve.add_argument("--grace", type=float, default=5.0, help="seconds in-flight calls get on shutdown (default 5)")
    for field in dataclasses.fields(Limits):
        serve.add_argument(
            f"--{field.name.replace('_', '-')}", type=_positive, default=field.default, help=f"limit (default {field.default})"
        )
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    status = commands.add_parser("status", help="show a job's participants and pending rounds")
    status.add_argument("--address", help="coordinator host:port (default: as the client finds it)")
    status.add_argument("--job", default="", help="one job (default: every job)")
    status.add_argument("--json", action="store_true", help="machine-readable output")

    demo = commands.add_parser("demo", help="run a coordinator and a simulated pod on this machine")
    demo.add_argument("--processes", type=_positive, default=4, help="simulated chips/processes (default 4)")
    demo.add_argument(
        "--threads", type=_positive, help="threads (cores) per process (default: by --accelerator, 2 on v3)"
    )
    demo.add_argument("--hosts", type=_positive, default=1, help="simulated TPU hosts (default 1)")
    demo.add_argument("--accelerator", default="v3-8", help="TPU_ACCELERATOR_TYPE to simulate (default v3-8)")
    demo.add_argument("--timeout", type=float, default=120.0, help="seconds before giving up (default 120)")
    return parser


def _serve(args) -> int:
    from ._core import CoreError
    from ._server import ServerOptions, serve_forever
    from ._state import StateFileError

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def ready(port: int) -> None:
        print(f"pjrt-rendezvous coordinator listening on {args.host}:{port}", flush=True)

    try:
        token = args.token_file.read_text().strip() if args.token_file else None
        options = ServerOptions(
            host=args.host,
            port=args.port,
            world_size=args.world_size,
            job=args.job,
            limits=Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)}),
            heartbeat_timeout=args.heartbeat_timeout,
            state_file=args.state_file,
            token=token,
            tls_cert=args.tls_cert.read_bytes() if args.tls_cert else None,
            tls_key=args.tls_key.read_bytes() if args.tls_key else None,
            tls_ca=args.tls_ca.read_bytes() if args.tls_ca else None,
            grace=args.grace,
        )
        serve_forever(options, on_ready=ready)
    except (CoreError, StateFileError, RuntimeError, OSError, ValueError) as exc:
        print(f"pjrt-rendezvous serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _status(args) -> int:
    from google.protobuf import json_format

    import pjrt_rendezvous.client as pr
    from pjrt_rendezvous.client._api import _detect
    from pjrt_rendezvous.client._client import Client
    from pjrt_rendezvous.client._config import Settings

    from ._core import format_ranges

    topology = _detect(os.environ, args.address)
    client = Client(Settings.resolve(os.environ, address=topology.address, connect_timeout=5.0), topology)
    try:
        response = client.status(args.job)
    except pr.RendezvousError as exc:
        print(f"pjrt-rendezvous status: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(json_format.MessageToDict(response, always_print_fields_with_no_presence=True), indent=2))
        return 0
    if not response.jobs:
        print(f"coordinator {topology.address}: no jobs")
    for job in response.jobs:
        print(
            f"job {job.job!r}: {job.registered}/{job.world_size} ordinals registered, "
            f"{job.rounds_completed} rounds completed, {job.kv_keys} keys, generation {job.generation}"
        )
        hosts: dict[str, list] = {}
        for p in job.participants:
            hosts.setdefault(p.host, []).append(p)
        for host, members in sorted(hosts.items()):
            pids = sorted({p.pid for p in members})
            seen = max(p.last_seen_age for p in members)
            print(
                f"  {host}: ordinals {format_ranges(p.ordinal for p in members)}, "
                f"{len(pids)} process(es) (pid {', '.join(map(str, pids))}), last seen {seen:.1f} s ago"
            )
        for r in job.pending_rounds:
            tags = ", ".join(f"{t.tag!r} from {format_ranges(t.ordinals)}" for t in r.tags)
            group = f"replicas [{format_ranges(r.replicas)}]" if r.replicas else "all ordinals"
            print(
                f"  pending round {r.round} of {group}: {tags}; {len(r.arrived)} arrived, waiting "
                f"{r.waiting_seconds:.1f} s for {r.missing_summary}"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "status":
        return _status(args)
    from pjrt_rendezvous.client._demo import run_demo

    return run_demo(
        processes=args.processes,
        threads=args.threads,
        hosts=args.hosts,
        accelerator=args.accelerator,
        timeout=args.timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
