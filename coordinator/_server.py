"""Running the coordinator: a grpc.aio server with health checking and reflection.

:class:`Coordinator` runs one in a background thread of the calling process (task 0
embedding it, the demo, tests); :func:`serve_forever` runs one in the foreground
(``pjrt-rendezvous serve``) until SIGINT or SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb
from pjrt_rendezvous.protos.v1 import coordinator_pb2_grpc as pb_grpc

from ._core import Core, Limits
from ._servicer import Servicer

log = logging.getLogger("pjrt_rendezvous.coordinator")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
DEFAULT_JOB = "default"

# Our own limits (Limits) give precise messages; gRPC's 4 MiB default would refuse large
# rendezvous results with a generic error first.
_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    # Two coordinators on one port must fail loudly, not share the traffic.
    ("grpc.so_reuseport", 0),
]


async def start_server(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    core: Core | None = None,
    limits: Limits | None = None,
    heartbeat_timeout: float | None = None,
    world_size: int | None = None,
    job: str = DEFAULT_JOB,
) -> tuple[grpc.aio.Server, int, Core]:
    """Starts a server on ``host:port`` (0 picks a free port); returns it, the port and the core.

    The liveness watcher runs as a task of the calling event loop until the server stops.
    """
    core = core or Core(limits, heartbeat_timeout=heartbeat_timeout)
    if world_size is not None:
        core.declare_job(job, world_size)
    server = grpc.aio.server(options=_OPTIONS)
    servicer = Servicer(core)
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    liveness = asyncio.get_running_loop().create_task(servicer.watch_liveness())
    original_stop = server.stop

    async def stop(grace):
        liveness.cancel()
        await health_servicer.enter_graceful_shutdown()
        return await original_stop(grace)

    server.stop = stop
    return server, bound, core


class Coordinator:
    """A coordinator serving from a background thread of this process.

    >>> with Coordinator(port=0) as coordinator:
    ...     address = coordinator.address   # "127.0.0.1:PORT"
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        world_size: int | None = None,
        job: str = DEFAULT_JOB,
        limits: Limits | None = None,
        heartbeat_timeout: float | None = None,
    ) -> None:
        self._args = dict(
            host=host, port=port, world_size=world_size, job=job, limits=limits, heartbeat_timeout=heartbeat_timeout
        )
        self._host = host
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._stopping: asyncio.Event | None = None
        self._grace: float | None = 1.0
        self.port: int | None = None
        self.core: Core | None = None

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("the coordinator is not running; call start() first")
        host = "127.0.0.1" if self._host in ("0.0.0.0", "") else self._host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def start(self) -> "Coordinator":
        started = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            self._stopping = asyncio.Event()
            try:
                self._server, self.port, self.core = await start_server(**self._args)
            except BaseException as exc:  # reported to start()'s caller
                failure.append(exc)
                return
            finally:
                started.set()
            await self._stopping.wait()
            await self._server.stop(self._grace)

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(main())
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name="pjrt-rendezvous-coordinator", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        """Stops serving; calls still running get ``grace`` seconds, then are cancelled."""
        if self._server is None or self._loop is None or self._thread is None:
            return
        self._grace = grace
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join()
        self._server = None

    def __enter__(self) -> "Coordinator":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def serve_forever(
    host: str,
    port: int,
    *,
    world_size: int | None = None,
    job: str = DEFAULT_JOB,
    limits: Limits | None = None,
    heartbeat_timeout: float | None = None,
    grace: float = 5.0,
    on_ready=None,
) -> None:
    """Serves until SIGINT/SIGTERM, then drains for ``grace`` seconds."""

    async def main() -> None:
        server, bound, _ = await start_server(
            host, port, world_size=world_size, job=job, limits=limits, heartbeat_timeout=heartbeat_timeout
        )
        if on_ready is not None:
            on_ready(bound)
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        await stopping.wait()
        log.info("stopping: in-flight calls get %.1f s", grace)
        started = time.monotonic()
        await server.stop(grace)
        log.info("stopped after %.1f s", time.monotonic() - started)

    asyncio.run(main())
