from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("workers", "0008_teams_credit")]

    operations = [
        migrations.AddIndex(
            model_name="device",
            index=models.Index(
                condition=models.Q(("disconnected_at__isnull", True)),
                fields=["last_seen"],
                name="device_connected_last_seen",
            ),
        ),
    ]
