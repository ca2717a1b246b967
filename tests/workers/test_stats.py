"""workers/stats.py and the export_stats task: BOINC-style dumps written for real, read back, held against
the ledger; public names only; atomic files."""

from __future__ import annotations

import gzip
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.db.models import Sum

from projects.models import Project
from tests.workers.conftest import device_of, grant, user
from workers import stats
from workers.credit import credit_from_flops
from workers.models import CreditEntry, Volunteer
from workers.tasks import export_stats
from workers.teams import team_create, team_join

GFLOP = 10**9


@pytest.fixture
def stats_root(settings: Any, tmp_path: Path) -> Path:
    settings.STATS_ROOT = tmp_path / "stats"
    return settings.STATS_ROOT


@pytest.fixture
def credited(mlp_project: Project, second_project: Project) -> dict[str, User]:
    """Three volunteers with credit (two with display names, one under a hostile one), a team, devices."""
    people = {
        "named": user("zq_named_login", display_name="Marie C.", country="FR", url="https://marie.example/"),
        "plain": user("plain_public_login"),
        "hostile": user("zq_hostile_login", display_name="<b>&\x01\x1b 'Mallory'</b>"),
        "idle": user("zq_idle_login", display_name="Never computed"),
    }
    team = team_create(user=people["named"], name="Les Gradients", description="Nous & <vous>", country="FR")
    team_join(user=people["hostile"], team_id=team.pk)
    grant(mlp_project, people["plain"], 7 * GFLOP, device=device_of(people["plain"]))  # before it joins
    team_join(user=people["plain"], team_id=team.pk)
    for who, flops in (("named", 3), ("plain", 5), ("hostile", 11), ("named", 13)):
        grant(second_project, people[who], flops * GFLOP, device=device_of(people[who], f"{who}-browser"))
    grant(mlp_project, people["named"], 17 * GFLOP)  # a result without a device
    return people


def read_xml(path: Path) -> ET.Element:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        return ET.parse(handle).getroot()


def records(root: ET.Element) -> list[dict[str, str]]:
    return [{child.tag: child.text or "" for child in record} for record in root]


def ledger_by(field: str) -> dict[int, int]:
    rows = (
        CreditEntry.objects.exclude(**{f"{field}__isnull": True}).values(field).annotate(total=Sum("flops"))
    )
    return {row[field]: int(row["total"]) for row in rows}


def test_the_task_writes_dumps_that_parse_and_equal_the_ledger(
    stats_root: Path, credited: dict[str, User]
) -> None:
    counts = export_stats.apply().get()
    assert counts == {"user": 3, "team": 1, "host": 4}  # "plain" computed on two browsers

    users = records(read_xml(stats_root / "user.gz"))
    teams = records(read_xml(stats_root / "team.gz"))
    hosts = records(read_xml(stats_root / "host.gz"))
    assert read_xml(stats_root / "user.gz").tag == "users" and read_xml(stats_root / "host.gz").tag == "hosts"

    ledger = int(CreditEntry.objects.aggregate(total=Sum("flops"))["total"])
    assert sum(float(u["total_credit"]) for u in users) == pytest.approx(credit_from_flops(ledger), rel=1e-12)
    for dump, field in ((users, "volunteer_id"), (teams, "team_id"), (hosts, "result__device_id")):
        by_id = ledger_by(field)
        assert {int(r["id"]): int(r["total_flops"]) for r in dump} == by_id
        for record in dump:
            assert float(record["total_credit"]) == pytest.approx(
                credit_from_flops(by_id[int(record["id"])]), rel=1e-12
            )

    volunteers = {v.pk: v for v in Volunteer.objects.all()}
    for record in users:
        volunteer = volunteers[int(record["id"])]
        assert record["name"] == re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f]", "", volunteer.public_name())
        assert float(record["expavg_credit"]) == volunteer.expavg_credit
        assert float(record["expavg_time"]) == volunteer.expavg_time.timestamp()  # type: ignore[union-attr]
        assert re.fullmatch(r"[0-9a-f]{32}", record["cpid"])
    assert {u["name"]: u.get("country") for u in users}["Marie C."] == "France"
    assert teams[0]["name"] == "Les Gradients" and teams[0]["description"] == "Nous & <vous>"
    assert teams[0]["founder_name"] == "Marie C." and teams[0]["country"] == "France"
    assert {h["p_model"] for h in hosts} == {"webgl"} and all(h["userid"] for h in hosts)

    tables = read_xml(stats_root / "tables.xml")
    assert int(tables.findtext("nusers_total") or 0) == 3 and int(tables.findtext("nhosts_total") or 0) == 4
    assert float(tables.findtext("total_credit") or 0) == pytest.approx(credit_from_flops(ledger), rel=1e-12)
    assert [a.findtext("name") for a in tables.iter("application")] == ["MLP", "Second MLP"]


def test_the_json_dumps_hold_the_same_records(stats_root: Path, credited: dict[str, User]) -> None:
    stats.stats_export()
    for name, root in (("user", "users"), ("team", "teams"), ("host", "hosts")):
        xml = records(read_xml(stats_root / f"{name}.gz"))
        with gzip.open(stats_root / f"{name}.json.gz", "rt", encoding="utf-8") as handle:
            data = json.load(handle)[root]
        assert [
            {k: str(v) if not isinstance(v, float) else repr(v) for k, v in r.items()} for r in data
        ] == xml
    tables = json.loads((stats_root / "tables.json").read_text())
    assert tables["nusers_total"] == 3 and [a["name"] for a in tables["applications"]] == [
        "MLP",
        "Second MLP",
    ]


def test_no_email_or_private_username_leaks(stats_root: Path, credited: dict[str, User]) -> None:
    stats.stats_export()
    text = ""
    for path in sorted(stats_root.iterdir()):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as handle:
            text += handle.read()
    assert "@" not in text.replace("https://marie.example/", "")
    for private in ("zq_named_login", "zq_hostile_login", "zq_idle_login", "Never computed"):
        assert private not in text  # usernames behind display names, and volunteers without credit
    assert "plain_public_login" in text  # no display name: the username is the public name
    for who in credited.values():
        assert stats.stats_cpid(user_id=who.pk) not in (who.email, who.username)


def test_cross_project_ids_are_stable_and_distinct(stats_root: Path, credited: dict[str, User]) -> None:
    stats.stats_export()
    first = {u["id"]: u["cpid"] for u in records(read_xml(stats_root / "user.gz"))}
    stats.stats_export()
    assert {u["id"]: u["cpid"] for u in records(read_xml(stats_root / "user.gz"))} == first
    assert len(set(first.values())) == len(first)


def test_a_failed_export_leaves_the_last_dumps_whole(
    stats_root: Path, credited: dict[str, User], monkeypatch: pytest.MonkeyPatch
) -> None:
    stats.stats_export()
    before = {path.name: path.read_bytes() for path in stats_root.iterdir()}

    def broken_hosts() -> Any:
        yield {"id": 1}
        raise RuntimeError("the database went away half-way")

    monkeypatch.setattr(stats, "_hosts", broken_hosts)
    with pytest.raises(RuntimeError):
        stats.stats_export()
    assert {path.name: path.read_bytes() for path in stats_root.iterdir()} == before  # no temporary file left
    assert all(path.stat().st_mode & 0o044 == 0o044 for path in stats_root.iterdir())  # readable by nginx


def test_beat_runs_the_export_daily() -> None:
    from config.celery import app

    entry = settings.CELERY_BEAT_SCHEDULE["export-stats"]
    assert entry["task"] in app.tasks and entry["task"] == export_stats.name
    assert entry["schedule"].remaining_estimate is not None and entry["schedule"].hour == {3}
