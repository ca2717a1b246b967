"""The daily statistics export, in BOINC's db_dump format (https://boinc.berkeley.edu/trac/wiki/DbDump),
for the stats sites that read BOINC projects' dumps: user.gz, team.gz and host.gz (gzipped XML: <users>,
<teams>, <hosts>), tables.xml, and the same records as JSON (user.json.gz, team.json.gz, host.json.gz,
tables.json), in settings.STATS_ROOT, served at /stats/.

As BOINC: only rows with credit are listed; total_credit is in Cobblestones; expavg_credit is the stored
recent average as of expavg_time (unix seconds), for readers to decay to their own now; ids are the site's
(users are volunteers, hosts are devices). Names are public names only (Volunteer.public_name), and the
cross-project ids (cpid, host_cpid) are HMACs of the user's or device's id with the site's secret: stable
from one dump to the next, and made of nothing anyone could reverse to an e-mail address or username.

Every file is written to a temporary name in the same directory and renamed over the old one (atomic on
POSIX), so a reader never sees half a file; tables.xml goes last. The records are read from one
REPEATABLE READ snapshot (PostgreSQL), so the files agree with each other, and streamed (constant memory).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any
from xml.sax.saxutils import escape

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Sum
from django.utils import timezone, translation
from django.utils.crypto import salted_hmac
from django_countries import countries

from projects.models import Project
from workers.credit import credit_from_flops
from workers.models import Device, Team, Volunteer

Record = dict[str, Any]
# Characters XML 1.0 cannot carry at all (a hostile display name must not make a dump unreadable).
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
# What /stats/ may serve: the names written here, nothing with a slash or a leading dot.
FILE_NAME = re.compile(r"^[a-z]+(\.[a-z]+)+$")


@dataclass(frozen=True)
class Table:
    name: str  # the file's base name (user, team, host)
    root: str  # BOINC's enclosing tag (users, teams, hosts)
    tag: str
    records: Callable[[], Iterator[Record]]


def stats_export(*, root: Path | None = None) -> dict[str, int]:
    """Write every dump into `root` (settings.STATS_ROOT); returns the number of records per table."""
    root = Path(root or settings.STATS_ROOT)
    root.mkdir(parents=True, exist_ok=True)
    tables = [Table("user", "users", "user", _users), Table("team", "teams", "team", _teams)]
    tables.append(Table("host", "hosts", "host", _hosts))
    # One snapshot for every file; inside a caller's transaction (tests) that transaction is the snapshot.
    snapshot = connection.vendor == "postgresql" and not connection.in_atomic_block
    with transaction.atomic():
        if snapshot:
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        counts = {table.name: _write_table(root=root, table=table) for table in tables}
        _write_tables(root=root, counts=counts, now=timezone.now())
    return counts


def stats_cpid(*, user_id: int) -> str:
    """A volunteer's public cross-project id: 32 hex digits, stable while SECRET_KEY is."""
    return salted_hmac("crowdtrain.stats.cpid", f"user:{user_id}").hexdigest()[:32]


def _host_cpid(device_id: int) -> str:
    return salted_hmac("crowdtrain.stats.cpid", f"host:{device_id}").hexdigest()[:32]


# --- records -------------------------------------------------------------------------------------


def _users() -> Iterator[Record]:
    volunteers = Volunteer.objects.filter(total_flops__gt=0).select_related("user").order_by("pk")
    for volunteer in volunteers.iterator(chunk_size=2000):
        yield {
            "id": volunteer.pk,
            "name": volunteer.public_name(),
            "country": _country(volunteer.country),
            "create_time": _unix(volunteer.created_at),
            **_credit(volunteer),
            "cpid": stats_cpid(user_id=volunteer.user_id),
            "teamid": volunteer.team_id,
            "url": volunteer.url,
        }


def _teams() -> Iterator[Record]:
    teams = Team.objects.filter(total_flops__gt=0).select_related("founder__volunteer").order_by("pk")
    for team in teams.iterator(chunk_size=2000):
        founder = getattr(team.founder, "volunteer", None) if team.founder else None
        yield {
            "id": team.pk,
            "name": team.name,
            "userid": founder.pk if founder else None,
            "founder_name": founder.public_name() if founder else None,
            **_credit(team),
            "create_time": _unix(team.created_at),
            "url": team.url,
            "description": team.description,
            "country": _country(team.country),
        }


def _hosts() -> Iterator[Record]:
    for device in Device.objects.filter(total_flops__gt=0).order_by("pk").iterator(chunk_size=2000):
        yield {
            "id": device.pk,
            "userid": device.volunteer_id,
            **_credit(device),
            "p_vendor": "browser",
            "p_model": device.backend,  # webgpu, webgl, wasm, cpu: what computed
            "p_fpops": device.gflops * 1e9,
            "create_time": _unix(device.created_at),
            "host_cpid": _host_cpid(device.pk),
        }


def _credit(row: Volunteer | Team | Device) -> Record:
    return {
        "total_credit": row.total_credit(),
        "expavg_credit": row.expavg_credit,
        "expavg_time": row.expavg_time.timestamp() if row.expavg_time else 0.0,
        "total_flops": row.total_flops,
    }


def _unix(at: datetime) -> int:
    return int(at.timestamp())


def _country(code: str) -> str:
    """BOINC's dumps give the country's English name."""
    with translation.override("en"):
        return str(countries.name(code)) if code else ""


# --- files ---------------------------------------------------------------------------------------


def _write_table(*, root: Path, table: Table) -> int:
    count = 0
    with ExitStack() as stack:
        xml = stack.enter_context(_atomic_text(root / f"{table.name}.gz", compress=True))
        js = stack.enter_context(_atomic_text(root / f"{table.name}.json.gz", compress=True))
        xml.write(f'<?xml version="1.0" encoding="UTF-8"?>\n<{table.root}>\n')
        js.write(f'{{"{table.root}": [')
        for record in table.records():
            xml.write(_xml(table.tag, record))
            js.write(("," if count else "") + "\n" + json.dumps(_present(record), ensure_ascii=False))
            count += 1
        xml.write(f"</{table.root}>\n")
        js.write("\n]}\n")
    return count


def _write_tables(*, root: Path, counts: dict[str, int], now: datetime) -> None:
    projects = list(
        Project.objects.exclude(status=Project.Status.DRAFT).order_by("pk").values_list("name", flat=True)
    )
    summary: Record = {
        "update_time": _unix(now),
        "nusers_total": counts["user"],
        "nteams_total": counts["team"],
        "nhosts_total": counts["host"],
        "total_credit": credit_from_flops(_total_flops()),
    }
    with _atomic_text(root / "tables.json", compress=False) as js:
        js.write(
            json.dumps({**summary, "applications": [{"name": name} for name in projects]}, indent=1) + "\n"
        )
    with _atomic_text(root / "tables.xml", compress=False) as xml:
        xml.write('<?xml version="1.0" encoding="UTF-8"?>\n<tables>\n' + "".join(_fields(summary, "    ")))
        apps = "".join(
            f"        <application>\n            <name>{_text(n)}</name>\n        </application>\n"
            for n in projects
        )
        xml.write(f"    <applications>\n{apps}    </applications>\n</tables>\n")


def _total_flops() -> int:
    return int(Volunteer.objects.aggregate(total=Sum("total_flops"))["total"] or 0)


def _present(record: Record) -> Record:
    """Without empty fields (as BOINC's dumps), and without characters XML cannot carry, in both formats."""
    clean = {key: _NOT_XML.sub("", v) if isinstance(v, str) else v for key, v in record.items()}
    return {key: value for key, value in clean.items() if value not in (None, "")}


def _xml(tag: str, record: Record) -> str:
    return f"<{tag}>\n{''.join(_fields(_present(record), ' '))}</{tag}>\n"


def _fields(record: Record, indent: str) -> Iterator[str]:
    for key, value in record.items():
        yield f"{indent}<{key}>{_text(value)}</{key}>\n"


def _text(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return escape(_NOT_XML.sub("", str(value)))


@contextmanager
def _atomic_text(path: Path, *, compress: bool) -> Iterator[IO[str]]:
    """A text file (UTF-8, gzipped or not) that appears at `path` whole, or not at all."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as raw:
            # No file name in the gzip header (it would be the temporary one); mtime 0: same data, same bytes.
            binary = gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) if compress else raw
            text = io.TextIOWrapper(binary, encoding="utf-8", newline="\n")
            yield text
            text.detach()  # flushed into `binary`, which stays open
            if binary is not raw:
                binary.close()  # the gzip trailer; `raw` stays open
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would keep nginx out
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
