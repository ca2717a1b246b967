from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("workers", "0012_device_paused_at")]

    operations = [
        migrations.AddField(
            model_name="device", name="resumed_at", field=models.DateTimeField(blank=True, null=True)
        ),
    ]
