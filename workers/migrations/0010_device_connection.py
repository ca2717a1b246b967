from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("workers", "0009_socket_hygiene")]

    operations = [
        migrations.AddField(
            model_name="device",
            name="connection",
            field=models.CharField(blank=True, default="", max_length=100),
        ),
    ]
