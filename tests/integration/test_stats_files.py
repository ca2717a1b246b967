"""/stats/ (frontend/stats_files.py): the dumps' list and the files as they are, and nothing else."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from workers.stats import stats_export


@pytest.fixture
def stats_root(settings: Any, tmp_path: Path) -> Path:
    settings.STATS_ROOT = tmp_path / "stats"
    return settings.STATS_ROOT


def test_the_index_is_empty_before_the_first_export(client: Client, stats_root: Path) -> None:
    response = client.get("/stats/")
    assert response.status_code == 200 and 'id="stats-files"' not in response.content.decode()


def test_the_dumps_are_listed_and_served_as_gzip_files(client: Client, stats_root: Path, db: None) -> None:
    stats_export()
    (stats_root / ".user.gz.half-written.tmp").write_bytes(b"partial")
    html = client.get("/stats/").content.decode()
    for name in ("user.gz", "team.gz", "host.gz", "tables.xml", "user.json.gz", "tables.json"):
        assert f'href="/stats/{name}"' in html
    assert ".tmp" not in html

    response = client.get("/stats/user.gz")
    body = b"".join(response.streaming_content)  # type: ignore[attr-defined]
    assert response["Content-Type"] == "application/gzip" and "Content-Encoding" not in response
    assert gzip.decompress(body).startswith(b'<?xml version="1.0" encoding="UTF-8"?>\n<users>')
    assert client.get("/stats/tables.xml")["Content-Type"] == "application/xml"


def test_nothing_outside_the_dumps_is_served(client: Client, stats_root: Path, db: None) -> None:
    stats_export()
    (stats_root.parent / "secret.txt").write_text("not for you")
    for path in (
        "/stats/.user.gz.x.tmp",
        "/stats/..%2Fsecret.txt",
        "/stats/../secret.txt",
        "/stats/%2e%2e/secret.txt",
        "/stats/missing.gz",
        "/stats/user.gz/",
    ):
        assert client.get(path).status_code == 404, path
    assert client.post("/stats/user.gz").status_code in (403, 405)
