"""crowdtrain.config: the token file is private from its first byte, the environment wins over it."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from crowdtrain.config import (
    Credentials,
    config_path,
    forget_credentials,
    load_credentials,
    save_credentials,
)
from crowdtrain.errors import CrowdtrainError, NotLoggedIn


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_saved_token_is_readable_by_its_owner_only(config_home: Path) -> None:
    path = save_credentials(Credentials("http://a.example", "secret-token"))
    assert path == config_home / "crowdtrain" / "config.json"
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700
    assert json.loads(path.read_text()) == {"url": "http://a.example", "token": "secret-token"}


def test_a_world_readable_file_left_behind_becomes_private(config_home: Path) -> None:
    path = config_path()
    path.parent.mkdir(parents=True)
    path.write_text("{}")
    path.chmod(0o644)
    partial = path.with_name("config.json.partial")
    partial.write_text("stale")  # a crash mid-write left this, world-readable
    partial.chmod(0o666)
    save_credentials(Credentials("http://a.example", "t"))
    assert mode(path) == 0o600
    assert not partial.exists()


def test_load_reads_the_file_and_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    save_credentials(Credentials("http://a.example", "file-token"))
    assert load_credentials() == Credentials("http://a.example", "file-token")
    monkeypatch.setenv("CROWDTRAIN_TOKEN", "env-token")
    assert load_credentials() == Credentials("http://a.example", "env-token")
    monkeypatch.setenv("CROWDTRAIN_URL", "http://b.example")
    assert load_credentials() == Credentials("http://b.example", "env-token")


def test_nothing_stored_says_how_to_log_in() -> None:
    with pytest.raises(NotLoggedIn, match="crowdtrain login URL"):
        load_credentials()


def test_a_url_without_token_names_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CROWDTRAIN_URL", "http://b.example")
    with pytest.raises(NotLoggedIn, match=r"not logged in to http://b\.example"):
        load_credentials()


def test_forget_keeps_the_url_and_drops_the_token() -> None:
    path = save_credentials(Credentials("http://a.example", "t"))
    forget_credentials()
    assert json.loads(path.read_text()) == {"url": "http://a.example"}
    assert mode(path) == 0o600


@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_a_corrupt_file_is_an_error_not_a_silent_reset(content: str) -> None:
    path = config_path()
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(CrowdtrainError, match="delete it and log in again"):
        load_credentials()
