"""The repository's platform/ directory (deployment files) must never shadow Python's `platform` module."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
REPORT = "import json, platform; print(json.dumps([platform.__file__, platform.system()]))"


def run(*argv: str) -> str:
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def assert_stdlib(stdout: str) -> None:
    module_file, system = json.loads(stdout.strip().splitlines()[-1])
    assert Path(module_file).resolve().parent == STDLIB
    assert system and isinstance(system, str)


def test_repository_platform_dir_is_not_a_package() -> None:
    assert not (ROOT / "platform" / "__init__.py").exists()


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param([sys.executable, "manage.py", "shell", "-c", REPORT], id="manage.py"),
        pytest.param([sys.executable, "-c", f"import config.asgi; {REPORT}"], id="asgi"),
        pytest.param([sys.executable, "-c", f"from config import celery_app; {REPORT}"], id="celery-app"),
    ],
)
def test_platform_is_the_stdlib_module(argv: list[str]) -> None:
    assert_stdlib(run(*argv))


def test_celery_cli_sees_the_stdlib_platform() -> None:
    """`celery -A config report` imports the app from the repository root and prints platform info."""
    import platform

    celery = Path(sys.executable).parent / "celery"
    argv = [str(celery)] if celery.exists() else [sys.executable, "-m", "celery"]
    out = run(*argv, "-A", "config", "report")
    assert f"system:{platform.system()}" in out
