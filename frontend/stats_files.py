"""/stats/: the statistics dumps (workers/stats.py) for stats sites, and a page listing them.

nginx serves the files itself in production (platform/nginx.conf); this serves them wherever nginx does not
(development, a bare daphne). Only plain names the export writes are served (no slash, no leading dot: no
path leaves STATS_ROOT, no temporary file half-written), with their own content type and no
Content-Encoding: a .gz is downloaded as the gzip file it is, as BOINC's are.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from django.conf import settings
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.translation import gettext as _
from django.views.decorators.http import require_GET

from workers.stats import FILE_NAME

CONTENT_TYPES = {".gz": "application/gzip", ".xml": "application/xml", ".json": "application/json"}


@require_GET
def stats_index(request: HttpRequest) -> HttpResponse:
    root = Path(settings.STATS_ROOT)
    files = sorted(path for path in root.iterdir() if FILE_NAME.match(path.name)) if root.is_dir() else []
    listed = [
        {"name": f.name, "size": f.stat().st_size, "at": datetime.fromtimestamp(f.stat().st_mtime, tz=UTC)}
        for f in files
    ]
    return render(request, "frontend/stats.html", {"files": listed})


@require_GET
def stats_file(request: HttpRequest, name: str) -> FileResponse:
    path = Path(settings.STATS_ROOT) / name
    if not FILE_NAME.match(name) or not path.is_file():
        raise Http404(_("No such file."))
    response = FileResponse(path.open("rb"), content_type=CONTENT_TYPES.get(path.suffix, "text/plain"))
    response["Cache-Control"] = "public, max-age=3600"
    return response
