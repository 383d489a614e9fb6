"""Regenerate the Python stubs in protos/v1 from protos/pjrt_rendezvous/v1/*.proto.

A development script (``make protos``), kept beside the .proto sources, outside the
package's modules, so that the wheel does not ship it (setuptools installs every module of
a package folder; exclude-package-data leaves modules alone).

Run: python -m grpc_tools.protoc is called with an import-path mapping so the
generated modules import each other as ``pjrt_rendezvous.protos.v1`` (the
installed name) while the .proto keeps its package ``pjrt_rendezvous.v1``.
``tests/test_protos.py`` regenerates into a temporary folder and fails when the
committed stubs differ. Needs grpcio-tools (pinned in the ``test`` extra).
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = ROOT / "protos"
SOURCE = HERE / "pjrt_rendezvous" / "v1"
TARGET = HERE / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    """Writes the generated stubs into ``out``; returns the files written."""
    from grpc_tools import protoc

    protos = sorted(SOURCE.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-Ipjrt_rendezvous/protos/v1={SOURCE}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(f"pjrt_rendezvous/protos/v1/{p.name}" for p in protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for produced in sorted((pathlib.Path(tmp) / "pjrt_rendezvous" / "protos" / "v1").iterdir()):
            shutil.copyfile(produced, out / produced.name)
            written.append(out / produced.name)
        return written


if __name__ == "__main__":
    for path in generate(TARGET):
        print(path.relative_to(ROOT))
    sys.exit(0)
