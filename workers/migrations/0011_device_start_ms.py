from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("workers", "0010_device_connection")]

    operations = [
        migrations.AddField(
            model_name="device",
            name="start_ms",
            field=models.PositiveIntegerField(
                default=0, help_text="Observed time from a work unit's arrival to the start of its computing."
            ),
        ),
    ]
