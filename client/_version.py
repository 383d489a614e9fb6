"""The package's version: its one source (pyproject.toml reads it when the package is built).

A client tells it to the coordinator at registration, which names a process whose client is
of another version; read here, a process does not scan ``sys.path`` for the installed
distribution's metadata (``importlib.metadata``, tens of milliseconds of each process's start).
"""

VERSION = "0.1.0"
