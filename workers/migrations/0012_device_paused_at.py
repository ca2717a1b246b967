from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("workers", "0011_device_start_ms")]

    operations = [
        migrations.AddField(
            model_name="device", name="paused_at", field=models.DateTimeField(blank=True, null=True)
        ),
    ]
