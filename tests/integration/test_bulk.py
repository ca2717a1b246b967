"""config/bulk.py on PostgreSQL: rows written back in one statement, as bulk_update would write them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from config.bulk import bulk_write
from projects.blobs import blob_put
from projects.models import Project, Result
from tests.integration.test_arrival_batches import _assigned

pytestmark = pytest.mark.django_db


def test_rows_are_written_in_one_statement_with_nulls_times_and_keys(mlp_project: Project) -> None:
    first, second = _assigned(mlp_project, 2)
    untouched = Result.objects.get(pk=second.pk)
    now = timezone.now()
    first.status, first.received_at, first.loss, first.samples = "received", now, None, 7
    first.blob = blob_put(data=b"an update")
    second.received_at, second.loss, second.reason = now - timedelta(days=1), 0.25, 'it\'s "quoted"'
    fields = ["status", "received_at", "loss", "samples", "blob", "reason"]
    with CaptureQueriesContext(connection) as queries:
        bulk_write([first, second], fields)
    assert len(queries) == 1
    one, two = Result.objects.get(pk=first.pk), Result.objects.get(pk=second.pk)
    assert (one.status, one.received_at, one.loss, one.samples) == ("received", now, None, 7)
    assert one.blob_id == first.blob.sha256
    assert (two.received_at, two.loss, two.reason) == (now - timedelta(days=1), 0.25, 'it\'s "quoted"')
    assert (two.status, two.samples, two.blob_id) == (untouched.status, untouched.samples, None)


def test_nothing_to_write_is_no_statement() -> None:
    with CaptureQueriesContext(connection) as queries:
        bulk_write([], ["status"])
    assert len(queries) == 0
