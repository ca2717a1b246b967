from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("workers", "0005_profile_teams_recent_credit")]

    operations: list[migrations.operations.base.Operation] = [
        # A device its volunteer forgot (accounts.services.device_forget): kept for its credit, hidden.
        migrations.AddField(
            model_name="device",
            name="forgotten_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
