"""systemd service notifications (``sd_notify``) without libsystemd.

Under ``Type=notify`` systemd passes ``NOTIFY_SOCKET``, a datagram socket that takes
newline-separated ``KEY=value`` assignments: ``READY=1`` once the service listens,
``STOPPING=1`` when it begins to shut down, ``WATCHDOG=1`` as a keep-alive when the unit
sets ``WatchdogSec=``, ``STATUS=...`` free text for ``systemctl status``. The protocol is
the one ``sd_notify(3)`` implements: a path, or an abstract socket written with a leading
``@``. Outside systemd (no ``NOTIFY_SOCKET``) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Mapping

log = logging.getLogger("pjrt_rendezvous.coordinator")


def notify(state: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """Sends ``state`` (e.g. ``"READY=1\\nSTATUS=serving"``) to ``$NOTIFY_SOCKET``.

    Args:
        state: newline-separated assignments, as ``sd_notify(3)`` takes them.
        environ: where to look up ``NOTIFY_SOCKET`` (default ``os.environ``).

    Returns:
        True when the message was sent; False when there is no socket to send to or the
        send failed (logged: a missing notification must not stop the coordinator, systemd
        reports the unit's start as timed out instead).
    """
    environ = os.environ if environ is None else environ
    address = environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        target = "\0" + address[1:]  # abstract namespace
    elif address.startswith("/"):
        target = address
    else:  # e.g. vsock:CID:PORT, which only systemd inside VMs uses
        log.warning("NOTIFY_SOCKET=%r is not a unix socket path; notification %r not sent", address, state, extra={"event": "notify_failed"})
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(target)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("could not notify systemd at %s: %s", address, exc, extra={"event": "notify_failed"})
        return False
    return True


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` keep-alives when systemd asks for them, else None.

    systemd sets ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``, the process meant) for units with
    ``WatchdogSec=``; ``sd_watchdog_enabled(3)`` advises pinging at half the interval.
    """
    environ = os.environ if environ is None else environ
    pid = environ.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2e6 if usec > 0 else None
