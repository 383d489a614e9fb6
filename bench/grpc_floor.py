"""The floor under any Python coordinator: server CPU per message of an echo server.

    python bench/grpc_floor.py [--clients 8,64] [--rounds 300] [--uvloop]

N clients (each its own connection) make one call per round, all at once, like a barrier;
the server only echoes. Compares a grpc.aio unary call per round, one long-lived gRPC
bidirectional stream per client (one message each way per round), and length-prefixed
messages on plain TCP served by an asyncio Protocol (what the coordinator's session port
does). Whatever our servicer does comes on top of these numbers, so they bound what
Python-level optimization can reach and tell whether a protocol change is worth it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _servers import cpu_seconds  # noqa: E402


async def _serve() -> None:
    import grpc

    async def unary(request, context):
        return request

    async def bidi(requests, context):
        async for message in requests:
            yield message

    handler = grpc.method_handlers_generic_handler(
        "floor",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    framed = await asyncio.get_running_loop().create_server(_FramedEcho, "127.0.0.1", 0)
    print(port, framed.sockets[0].getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(None)


class _FramedEcho(asyncio.Protocol):
    """Echoes each length-prefixed message (4-byte big-endian length, then the bytes)."""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= 4:
            end = 4 + int.from_bytes(self.buffer[:4], "big")
            if len(self.buffer) < end:
                break
            self.transport.write(bytes(self.buffer[:end]))
            del self.buffer[:end]


async def _timed(one, targets: list, pid: int, rounds: int) -> tuple[float, float]:
    """Wall time and server CPU per round of ``one(target)`` for every target at once,
    after 20 untimed rounds."""
    for _ in range(20):
        await asyncio.gather(*(one(t) for t in targets))
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    for _ in range(rounds):
        await asyncio.gather(*(one(t) for t in targets))
    wall, cpu = time.monotonic() - t0, cpu_seconds(pid) - cpu0
    return wall / rounds, cpu / rounds


async def _drive_framed(port: int, pid: int, clients: int, rounds: int, payload: bytes) -> tuple[float, float]:
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(clients)]
    message = len(payload).to_bytes(4, "big") + payload

    async def one(connection):
        reader, writer = connection
        writer.write(message)
        await reader.readexactly(len(message))

    result = await _timed(one, connections, pid, rounds)
    for _, writer in connections:
        writer.close()
    return result


async def _drive(ports: tuple[int, int], pid: int, clients: int, rounds: int, mode: str, payload: bytes) -> tuple[float, float]:
    if mode == "framed":
        return await _drive_framed(ports[1], pid, clients, rounds, payload)
    import grpc

    port = ports[0]
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(clients)
    ]
    await asyncio.gather(*(c.channel_ready() for c in channels))
    if mode == "unary":
        calls = [c.unary_unary("/floor/Unary") for c in channels]

        async def one(call):
            await call(payload)

    else:
        calls = [c.stream_stream("/floor/Bidi")() for c in channels]

        async def one(call):
            await call.write(payload)
            await call.read()

    result = await _timed(one, calls, pid, rounds)
    if mode == "bidi":
        for c in calls:
            await c.done_writing()
    await asyncio.gather(*(c.close() for c in channels))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="8,64")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--payload", type=int, default=64)
    parser.add_argument("--uvloop", action="store_true", help="run the server on uvloop")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        if args.uvloop:
            import uvloop

            uvloop.install()
        asyncio.run(_serve())
        return 0
    argv = [sys.executable, os.path.abspath(__file__), "--serve"] + (["--uvloop"] if args.uvloop else [])
    server = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ports = tuple(int(p) for p in server.stdout.readline().split())
        print("| clients | mode | round (ms) | server CPU per round (ms) | server CPU per message (µs) |")
        print("|---|---|---|---|---|")
        for n in (int(x) for x in args.clients.split(",")):
            modes = ("unary", "bidi", "framed")
            results: dict[str, list] = {mode: [] for mode in modes}
            for rep in range(args.reps):  # rotate the order of the modes
                for mode in modes[rep % 3 :] + modes[: rep % 3]:
                    results[mode].append(asyncio.run(_drive(ports, server.pid, n, args.rounds, mode, b"x" * args.payload)))
            for mode, values in results.items():
                wall = sorted(v[0] for v in values)[len(values) // 2]
                cpu = sorted(v[1] for v in values)[len(values) // 2]
                print(f"| {n} | {mode} | {wall * 1e3:.2f} | {cpu * 1e3:.2f} | {cpu / n * 1e6:.0f} |")
    finally:
        server.stdin.close()
        server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
