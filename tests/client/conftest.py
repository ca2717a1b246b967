"""The client's tests never touch the real ~/.config: each gets its own XDG_CONFIG_HOME and no
CROWDTRAIN_URL / CROWDTRAIN_TOKEN from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "config-home"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    monkeypatch.delenv("CROWDTRAIN_URL", raising=False)
    monkeypatch.delenv("CROWDTRAIN_TOKEN", raising=False)
    return home
