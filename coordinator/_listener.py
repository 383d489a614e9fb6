"""Listening sockets with an accept loop of our own, for the session port and the metrics port.

asyncio's own accept loop (``create_server``) goes on after EMFILE (out of open files) for
up to its backlog of tries, each logging a traceback and scheduling another retry: at a
backlog of 4,096 that flooded the log with hundreds of MB a minute and stalled the event
loop (CPython 3.11). Ours pauses accepting instead, with one warning a minute; the waiting
connections stay queued in the kernel.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from typing import Callable

from pjrt_rendezvous.client._topology import host_port

log = logging.getLogger("pjrt_rendezvous.coordinator")


class Listener:
    """Accepts connections on ``host:port`` for ``factory`` (an asyncio protocol factory);
    ``what`` names the port in its errors and warnings, ``open_count()`` tells them how many
    of its connections are open."""

    # Connections the kernel completes and queues while the event loop is busy: a pod's
    # processes connect at about the same time, as their Register answers name the session
    # port. asyncio's default of 100 drops the SYNs beyond it, and each of those connections
    # then waits for a retransmission, a second later. gRPC's port asks for as many; the
    # kernel caps it at net.core.somaxconn.
    BACKLOG = 4096
    # Out of open files (EMFILE), accepting pauses this long, with one warning a minute.
    ACCEPT_RETRY_DELAY = 1.0
    STARVED_WARNING_EVERY = 60.0

    def __init__(self, factory: Callable[[], asyncio.BaseProtocol], what: str, open_count: Callable[[], int]) -> None:
        self._factory = factory
        self._what = what
        self._open_count = open_count
        self.sockets: list[socket.socket] = []
        self._accepting: set[asyncio.Task] = set()  # connections being set up (the loop holds tasks weakly)
        self._starved_warning = float("-inf")  # when accepting last ran out of files, warned of

    async def start(self, host: str, port: int, option: str) -> int:
        """Listens on ``host`` (a wildcard, "0.0.0.0" or "::", on both families where the
        machine has IPv6, as gRPC's port does); returns the port. ``option`` names the
        setting in the error raised when it cannot (OSError)."""
        try:
            self.sockets = []
            if host in ("0.0.0.0", "::") and socket.has_dualstack_ipv6():
                # (asyncio's IPv6 sockets take IPv6 alone: IPv4 clients, which reach gRPC's
                # port, would find this one refused.)
                try:
                    self.sockets = [socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)]
                except OSError:
                    if host == "::":
                        raise  # (0.0.0.0: IPv4 alone, on a machine with IPv6 turned off)
            if not self.sockets:  # asyncio opens the sockets; the accept loop is ours
                server = await asyncio.get_running_loop().create_server(
                    self._factory, host, port, reuse_address=True, backlog=self.BACKLOG, start_serving=False
                )
                self.sockets = [sock.dup() for sock in server.sockets]
                server.close()  # closes its copies; ours listen on
        except OSError as exc:
            error = OSError(f"cannot listen on {self._what} {host_port(host, port)} ({option}): {exc.strerror or exc}")
            error.errno = exc.errno  # (its message stays the one above)
            raise error from None
        loop = asyncio.get_running_loop()
        for sock in self.sockets:
            sock.setblocking(False)
            sock.listen(self.BACKLOG)
            loop.add_reader(sock.fileno(), self._accept, sock)
        return self.sockets[0].getsockname()[1]

    def _accept(self, sock: socket.socket) -> None:
        """Takes the connections waiting on ``sock``: up to BACKLOG per turn of the loop."""
        loop = asyncio.get_running_loop()
        for _ in range(self.BACKLOG):
            try:
                connection, _ = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return  # none left
            except OSError as exc:
                # Out of files (EMFILE, ENFILE) or memory (ENOBUFS, ENOMEM), or anything else
                # that may last: the listening socket stays readable, so pause rather than
                # spin. The waiting connections stay queued in the kernel.
                loop.remove_reader(sock.fileno())
                loop.call_later(self.ACCEPT_RETRY_DELAY, self._resume, sock)
                now = time.monotonic()
                if now - self._starved_warning >= self.STARVED_WARNING_EVERY:
                    self._starved_warning = now
                    hint = (
                        " (raise the open files limit: ulimit -n, or LimitNOFILE=)"
                        if exc.errno in (errno.EMFILE, errno.ENFILE) else ""
                    )
                    log.warning(
                        "%s cannot accept connections: %s (%d open); pausing %g s at a time%s",
                        self._what, exc.strerror or exc, self._open_count(), self.ACCEPT_RETRY_DELAY, hint,
                        extra={"event": "accept_starved"},
                    )
                return
            connection.setblocking(False)
            task = loop.create_task(self._set_up(connection))
            self._accepting.add(task)
            task.add_done_callback(self._accepting.discard)

    def _resume(self, sock: socket.socket) -> None:
        if sock.fileno() >= 0:  # (-1: closed meanwhile)
            asyncio.get_running_loop().add_reader(sock.fileno(), self._accept, sock)

    async def _set_up(self, connection: socket.socket) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(self._factory, connection)
        except OSError as exc:  # the peer went away meanwhile
            log.debug("a connection to %s ended as it began: %s", self._what, exc)
            connection.close()

    def close(self) -> None:
        """Stops listening, and setting up the connections accepted."""
        loop = asyncio.get_running_loop()
        for sock in self.sockets:
            if sock.fileno() >= 0:
                loop.remove_reader(sock.fileno())
                sock.close()
        for task in list(self._accepting):
            task.cancel()
