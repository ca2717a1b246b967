"""devstack/stack.py: a Stack runs its processes and management commands from the checkout it names, so
that a benchmark's "before" stack (benchmarks/server/shared_fleet.py, throughput.py) runs the base commit's
code."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from devstack.stack import ROOT, Stack


def test_a_stack_runs_its_processes_and_commands_from_its_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwds: list[Path] = []

    def record(argv: list[str], **options: Any) -> None:
        cwds.append(options["cwd"])

    monkeypatch.setattr(subprocess, "Popen", record)
    monkeypatch.setattr(subprocess, "run", record)
    other = tmp_path / "before"
    stack = Stack(var_dir=tmp_path, root=other)
    stack._spawn("web", "-m", "daphne")
    stack.manage("check")
    stack.manage_all(("check",))
    assert cwds == [other, other, other]
    assert Stack(var_dir=tmp_path).root == ROOT
