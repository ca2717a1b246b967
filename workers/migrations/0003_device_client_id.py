"""One Device per browser (issue 9, item 7): the browser's own id, unique per volunteer, and connected time
summed over its connections. Existing rows (one per connection) keep their figures under ids of their own."""

import django.utils.timezone
from django.db import migrations, models

import workers.models

BATCH = 1000


def keep_existing_rows(apps, schema_editor):
    Device = apps.get_model("workers", "Device")
    batch = []
    for device in Device.objects.only("pk", "created_at", "disconnected_at").iterator(chunk_size=BATCH):
        device.client_id = f"legacy:{device.pk}"
        device.connected_at = device.created_at
        if device.disconnected_at is not None:
            device.online_ms = max(0, int((device.disconnected_at - device.created_at).total_seconds() * 1000))
        batch.append(device)
        if len(batch) == BATCH:
            Device.objects.bulk_update(batch, ["client_id", "connected_at", "online_ms"])
            batch = []
    Device.objects.bulk_update(batch, ["client_id", "connected_at", "online_ms"])


class Migration(migrations.Migration):

    dependencies = [
        ("workers", "0002_device_disconnected_at"),
    ]

    operations = [
        migrations.AddField(
            model_name="device",
            name="client_id",
            field=models.CharField(default=workers.models.server_client_id, max_length=64),
        ),
        migrations.AddField(
            model_name="device",
            name="connected_at",
            field=models.DateTimeField(
                default=django.utils.timezone.now, help_text="Start of the latest connection."
            ),
        ),
        migrations.AddField(
            model_name="device",
            name="online_ms",
            field=models.PositiveBigIntegerField(default=0, help_text="Connected time of earlier connections."),
        ),
        migrations.RunPython(keep_existing_rows, migrations.RunPython.noop),
        migrations.AddConstraint(
            model_name="device",
            constraint=models.UniqueConstraint(fields=("volunteer", "client_id"), name="device_one_row_per_browser"),
        ),
    ]
