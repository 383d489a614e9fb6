"""A threaded TCP proxy on loopback for fault injection in tests.

:class:`Proxy` listens on ``127.0.0.1:0`` and forwards every connection to ``upstream``;
given the coordinator's session port, it listens on 127.0.0.2 on a free port and on that
port number, and forwards each to its own.
While it runs a test can make it

- drop every open connection (:meth:`Proxy.drop`), optionally refusing new ones for a while
  (:meth:`Proxy.refuse`: accepted, then reset at once);
- blackhole the open connections (:meth:`Proxy.blackhole`): they stay open, nothing passes,
  as in a silent network partition;
- delay the bytes it forwards (``proxy.delay`` seconds before each chunk);
- cut connections at random moments: with ``proxy.cut_after = (low, high)`` each new
  connection is cut after a random number of bytes in that range (both directions
  together), usually in the middle of a frame.

Cuts close both sides, half of them with a TCP reset (SO_LINGER 0), half with a FIN.
``proxy.stats`` counts connections accepted, refused, dropped and cut, and bytes forwarded.

Thread safety: the fault knobs may be changed from any thread; ``_lock`` guards the set of
open links and the counters, and is never held across socket I/O.
"""

from __future__ import annotations

import collections
import random
import socket
import struct
import threading
import time

_CHUNK = 65536


def _close(sock: socket.socket, *, reset: bool) -> None:
    # close() alone does not end a connection another thread is blocked in recv() on (the
    # kernel keeps the file open until that call returns): shutdown wakes the reader first.
    try:
        if reset:  # RST instead of FIN: the peer sees "connection reset by peer"
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.shutdown(socket.SHUT_RD)  # wakes readers, sends nothing; close() sends the RST
        else:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class _Link:
    """One proxied connection: the client's socket, the upstream socket, two pump threads."""

    def __init__(self, proxy: "Proxy", downstream: socket.socket, upstream: socket.socket, budget: int | None):
        self.proxy = proxy
        self.sockets = (downstream, upstream)
        self.budget = budget  # bytes left before a random cut; None: never
        self.closed = False
        self.blackholed = False  # swallow everything, close nothing: a silent network partition
        self._lock = threading.Lock()

    def start(self) -> None:
        down, up = self.sockets
        for source, target in ((down, up), (up, down)):
            threading.Thread(target=self._pump, args=(source, target), daemon=True, name="proxy-pump").start()

    def _take(self, wanted: int) -> tuple[int, bool]:
        """How many of ``wanted`` bytes may pass, and whether the link must be cut after them."""
        with self._lock:
            if self.budget is None:
                return wanted, False
            allowed = min(wanted, self.budget)
            self.budget -= allowed
            return allowed, self.budget <= 0

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while not self.closed:
                data = source.recv(_CHUNK)
                if not data:
                    break
                if self.blackholed:
                    continue
                delay = self.proxy.delay
                if delay:
                    time.sleep(delay)
                allowed, cut = self._take(len(data))
                if allowed:
                    target.sendall(data[:allowed])
                    self.proxy._count("bytes", allowed)
                if cut:
                    self.close(reason="cut")
                    return
        except OSError:
            pass
        self.close(reason=None)

    def close(self, *, reason: str | None, reset: bool | None = None) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        if reason is not None:
            self.proxy._count(reason)
        if reset is None:
            reset = self.proxy._coin()
        for sock in self.sockets:
            _close(sock, reset=reset)
        self.proxy._forget(self)


class Proxy:
    """A TCP proxy on ``127.0.0.1:0`` in front of ``upstream`` (``"host:port"``) that injects faults
    (with ``session_port``, on 127.0.0.2 in front of both of the coordinator's ports).

    Usable as a context manager; ``address`` is what clients should dial.
    """

    def __init__(self, upstream: str, *, seed: int = 0, session_port: int | None = None) -> None:
        host, port = upstream.rsplit(":", 1)
        host = host.strip("[]")
        self.delay = 0.0
        self.cut_after: tuple[int, int] | None = None
        self.stats: collections.Counter = collections.Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self._refuse_until = 0.0
        # With the coordinator's session port, clients dial it on the host they dial the
        # gRPC port on: the proxy takes another loopback address to offer the same number.
        here = "127.0.0.1" if session_port is None else "127.0.0.2"
        routes = [(0, (host, int(port)))] + ([] if session_port is None else [(session_port, (host, session_port))])
        self._listeners = []
        for listen_port, target in routes:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((here, listen_port))
            listener.listen(128)
            listener.settimeout(0.1)  # so the accept loop notices close()
            self._listeners.append((listener, target))
        self.address = f"{here}:{self._listeners[0][0].getsockname()[1]}"
        self._running = True
        self._acceptors = [
            threading.Thread(target=self._accept_loop, args=route, daemon=True, name="proxy-accept")
            for route in self._listeners
        ]
        for acceptor in self._acceptors:
            acceptor.start()

    # -- faults -------------------------------------------------------------------------------

    def drop(self, *, refuse_for: float = 0.0) -> int:
        """Closes every open connection (and refuses new ones for ``refuse_for`` s); returns how many."""
        if refuse_for:
            self.refuse(refuse_for)
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close(reason="dropped")
        return len(links)

    def blackhole(self) -> int:
        """Open connections stay open but nothing passes any more (no FIN, no RST); returns how many."""
        with self._lock:
            links = list(self._links)
            self.stats["blackholed"] += len(links)
        for link in links:
            link.blackholed = True
        return len(links)

    def refuse(self, seconds: float) -> None:
        """For ``seconds``, new connections are accepted and reset at once."""
        with self._lock:
            self._refuse_until = max(self._refuse_until, time.monotonic() + seconds)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._links)

    # -- plumbing -------------------------------------------------------------------------------

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.stats[what] += n

    def _coin(self) -> bool:
        with self._lock:
            return self._rng.random() < 0.5

    def _forget(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)

    def _accept_loop(self, listener: socket.socket, target: tuple[str, int]) -> None:
        while self._running:
            try:
                downstream, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            downstream.settimeout(None)
            with self._lock:
                refusing = time.monotonic() < self._refuse_until
                cut_after = self.cut_after
                budget = None if cut_after is None else self._rng.randint(*cut_after)
            if refusing or not self._running:
                self._count("refused")
                _close(downstream, reset=True)
                continue
            try:
                upstream = socket.create_connection(target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                self._count("upstream-failed")
                _close(downstream, reset=True)
                continue
            for sock in (downstream, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(self, downstream, upstream, budget)
            with self._lock:
                self._links.add(link)
                self.stats["accepted"] += 1
            link.start()

    def close(self) -> None:
        """Stops accepting and closes every connection."""
        self._running = False
        for acceptor in self._acceptors:
            acceptor.join(5)
        for listener, _ in self._listeners:
            listener.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close(reason=None)

    def __enter__(self) -> "Proxy":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
