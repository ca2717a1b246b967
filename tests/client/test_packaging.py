"""What `pip install ./client` must hold: the client and the engine, whose every import the client's own
dependencies provide (never Django or any other part of the platform), and the engine's data files."""

from __future__ import annotations

import fnmatch
import re
import sys
import tomllib
from pathlib import Path

from tests.test_architecture import PLATFORM, ROOT, _imported

CLIENT = ROOT / "client"
PYPROJECT = tomllib.loads((CLIENT / "pyproject.toml").read_text())
# Import names that differ from their distribution's name.
DISTRIBUTION = {"yaml": "pyyaml", "PIL": "pillow"}


def modules(package: Path, prefix: str) -> dict[str, Path]:
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        found[".".join([prefix, *(parts[:-1] if parts[-1] == "__init__" else parts)])] = path
    return found


def shipped_modules() -> dict[str, Path]:
    return {**modules(CLIENT / "src" / "crowdtrain", "crowdtrain"), **modules(ROOT / "engine", "engine")}


def top_level_imports() -> set[str]:
    return {
        target.split(".")[0] for name, path in shipped_modules().items() for target in _imported(name, path)
    }


def declared() -> set[str]:
    return {
        re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0].lower() for dep in PYPROJECT["project"]["dependencies"]
    }


def test_the_client_and_engine_import_nothing_of_the_platform() -> None:
    assert top_level_imports() & set(PLATFORM) == set()


def test_every_third_party_import_is_a_declared_dependency() -> None:
    third_party = top_level_imports() - set(sys.stdlib_module_names) - {"crowdtrain", "engine", "__future__"}
    missing = {DISTRIBUTION.get(name, name).lower() for name in third_party} - declared()
    assert missing == set(), f"add to client/pyproject.toml's dependencies: {sorted(missing)}"
    assert "django" not in declared()


def test_every_engine_data_file_is_packaged() -> None:
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["engine"]
    data = [p.name for p in (ROOT / "engine").iterdir() if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert data, "engine/spec.json expected"
    assert [name for name in data if not any(fnmatch.fnmatch(name, pat) for pat in patterns)] == []


def test_the_shared_exporter_is_the_engines_own_module() -> None:
    import crowdtrain.exporting
    import engine.export

    assert vars(crowdtrain.exporting)["export_module"] is engine.export.export_module
    assert Path(engine.export.__file__).resolve().is_relative_to(ROOT / "engine")
