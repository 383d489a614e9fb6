"""A test seam: know when a client's Watch stream is open.

:func:`watch_opened` wraps the client's stub so that the returned event is set once the
coordinator's Watch stream has brought the client its first event (its marker: the stream is
open). A test that kills or stops a client waits for it, since a stream's close is what the
coordinator sees first. Importable by the tests and by scripts they run (``sys.path``).
"""

import threading


def watch_opened(client) -> threading.Event:
    opened, stub = threading.Event(), client._stub

    class Stub:
        def __getattr__(self, name):
            return getattr(stub, name)

        def Watch(self, *args, **kwargs):
            for event in stub.Watch(*args, **kwargs):
                opened.set()
                yield event

    client._stub = Stub()
    return opened
