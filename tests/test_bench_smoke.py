"""Smoke run of the side-by-side benchmark (bench/run.py --smoke): the harness runs end to end
with every peer that is installed and writes complete, well-formed tables. Never asserts a speed."""

from __future__ import annotations

import importlib
import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN = ROOT / "bench" / "run.py"

_NUMBER = re.compile(r"^\d+(\.\d+)?( \(\d+(\.\d+)?\))?$")  # "1.23" or "1.23 (4.56)"
_EXPLAINED = re.compile(r"^(n/a|skipped): \S")  # a cell a peer could not fill says why
_RATIO = re.compile(r"^\d+\.\d\d$")
# Column headings by the system whose value they hold (its p50, or its only value).
_COLUMNS = {
    "TCPStore p50": ("tcpstore/thread", "tcpstore/process"),
    "TCPStore p99": ("tcpstore/thread", "tcpstore/process"),
    "TCPStore": ("tcpstore/thread", "tcpstore/process"),
    "TCPStore thread": ("tcpstore/thread",),
    "TCPStore process": ("tcpstore/process",),
    "JAX p50": ("jax/process",),
    "JAX p99": ("jax/process",),
    "JAX": ("jax/process",),
}


def _check_peer_cells(systems: list[str], cells: dict[str, str], where: str) -> None:
    """An installed peer is measured: a number, never a failure explained (the harness runs
    every installed peer, and a peer's form that did not wait or returned wrong values fails)."""
    named = [name for name in _COLUMNS if name in cells]
    assert named, f"{where}: no peer's column in {list(cells)}"
    for name in named:
        expected = _NUMBER if any(o in systems for o in _COLUMNS[name]) else _EXPLAINED
        assert expected.match(cells[name]), f"{where}: {name} = {cells[name]!r}"


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def _installed_systems() -> list[str]:
    systems = ["ours", "ours/state-file"]
    if _importable("torch.distributed"):
        systems += ["tcpstore/thread", "tcpstore/process"]
    if _importable("jaxlib._jax"):
        systems.append("jax/process")
    return systems


def _tables(text: str) -> dict[str, list[list[str]]]:
    """Markdown tables by the heading above them: rows of stripped cells (header first)."""
    tables: dict[str, list[list[str]]] = {}
    heading = None
    current: list[list[str]] | None = None
    for line in text.splitlines():
        if line.startswith("#"):
            heading, current = line.lstrip("#").strip(), None
        elif line.startswith("|"):
            if current is None:
                current = tables.setdefault(heading, [])
            current.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        else:
            current = None
    return tables


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    systems = _installed_systems()
    proc = subprocess.run(
        [
            sys.executable,
            str(RUN),
            "--smoke",
            "--systems",
            ",".join(systems),
            "--output",
            str(out / "RESULTS.md"),
            "--json",
            str(out / "raw.json"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return systems, (out / "RESULTS.md").read_text(), json.loads((out / "raw.json").read_text())


def test_every_table_is_complete_and_well_formed(smoke):
    """Every table has a header, a separator and rows of the header's width, with no empty cell."""
    _, text, _ = smoke
    tables = _tables(text)
    assert tables, text
    for heading, rows in tables.items():
        header, separator, body = rows[0], rows[1], rows[2:]
        assert all(set(c) <= {"-", ":"} and c for c in separator), heading
        assert len(separator) == len(header), heading
        assert body, f"table {heading!r} has no rows"
        for row in body:
            assert len(row) == len(header), f"{heading!r}: {row} does not match {header}"
            assert all(cell for cell in row), f"{heading!r}: empty cell in {row}"


def test_each_workload_has_a_row_per_size_and_a_cell_per_system(smoke):
    """The workload tables cover the smoke size; ours and every installed peer are measured
    (an absent peer says why), and the ratios are numbers when a peer is installed."""
    systems, text, _ = smoke
    tables = _tables(text)
    for title in ("Barrier", "Rendezvous with 1 KiB", "Key-value", "World formation"):
        matches = [rows for heading, rows in tables.items() if heading.startswith(title)]
        assert len(matches) == 1, f"no single table for {title!r}: {list(tables)}"
        header, body = matches[0][0], matches[0][2:]
        assert [row[0] for row in body] == ["2x1"], body
        for row in body:
            cells = dict(zip(header, row))
            ours = [name for name in ("ours p50", "ours p99", "ours", "ours connect") if name in cells]
            assert ours, f"{title}: no column of ours in {header}"
            for name in ours:
                assert _NUMBER.match(cells[name]), f"{title}: {name} not measured: {row}"
            _check_peer_cells(systems, cells, title)
            peers = any(not name.startswith("ours") for name in systems)
            ratios = [name for name in ("ours/best p50", "ours/best p99", "ours/best (formation)") if name in cells]
            assert ratios, f"{title}: no ratio column in {header}"
            for name in ratios:
                assert (_RATIO if peers else re.compile("^—$")).match(cells[name]), f"{title}: {name} {row}"


def test_ours_with_a_state_file_is_measured_beside_ours(smoke):
    """Ours with its coordinator keeping a state file (as deployed): a row per workload, both
    measured, and the ratio between them."""
    _, text, _ = smoke
    (rows,) = [rows for heading, rows in _tables(text).items() if heading.startswith("Ours with a state file")]
    body = rows[2:]
    assert [(row[0], row[1]) for row in body] == [("2x1", w) for w in ("barrier", "allgather", "kv")], body
    for row in body:
        assert all(_NUMBER.match(cell) for cell in row[2:6]), row
        assert re.match(r"^\d+\.\d\d$", row[6]), row


def test_header_names_machine_versions_and_command(smoke):
    """RESULTS.md says where and how it was measured."""
    _, text, _ = smoke
    assert "python bench/run.py --smoke" in text
    for word in ("cores", "memory", "Python", "grpcio", "torch", "jax"):
        assert word in text, word


def test_scale_and_server_cpu_tables_are_present(smoke):
    """The scale run and the side-by-side server CPU tables are written, ours measured."""
    _, text, raw = smoke
    tables = _tables(text)
    assert any(h.startswith("Scale") for h in tables), list(tables)
    assert any(h.startswith("Server CPU per barrier round") for h in tables), list(tables)
    assert any(h.startswith("Server process CPU per round") for h in tables), list(tables)
    scale = raw["scale"]["sizes"]
    assert scale and all("error" not in entry["ours"] for entry in scale.values()), scale
    systems = smoke[0]
    (rows,) = [rows for heading, rows in tables.items() if heading.startswith("Server process CPU per round")]
    header, body = rows[0], rows[2:]
    assert [row[1] for row in body] == ["barrier", "allgather", "kv"], body
    for row in body:
        cells = dict(zip(header, row))
        assert _NUMBER.match(cells["ours"]), row
        _check_peer_cells(systems, cells, "server CPU")
        if len(systems) > 2:
            assert _RATIO.match(cells["ours/best peer"]), row


def test_client_cpu_table_measures_every_installed_system(smoke):
    """Client process CPU per round is written for every size and workload, ours measured,
    and each peer measured or its absence explained."""
    _, text, _ = smoke
    (rows,) = [rows for heading, rows in _tables(text).items() if heading.startswith("Client process CPU per round")]
    header, body = rows[0], rows[2:]
    assert body and [row[0] for row in body] == ["2x1"] * len(body), body
    for row in body:
        cells = dict(zip(header, row))
        assert re.match(r"^\d+$", cells["ours"]) and int(cells["ours"]) > 0, row
        _check_peer_cells(smoke[0], cells, "client CPU")


def test_state_file_bench_compares_the_journal_with_whole_rewrites():
    """bench/state_file.py runs at the smallest size and prints one complete row per workload."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "state_file.py"), "--sizes", "2x1", "--rounds", "3", "--reps", "1"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    header, rule, *rows = [line for line in out.splitlines() if line.startswith("|")]
    assert "journal" in header and rule.startswith("|---")
    assert [row.split("|")[1].strip() for row in rows] == ["barrier", "key-value"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "2x1 (2)" and all(_NUMBER.match(c) or c.endswith("x") for c in cells[2:]), cells
