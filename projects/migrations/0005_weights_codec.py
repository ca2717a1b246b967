import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("projects", "0004_replication"),
    ]

    operations = [
        migrations.AddField(
            model_name="project",
            name="weights_codec",
            field=models.CharField(
                choices=[("fp32", "Fp32"), ("fp16", "Fp16"), ("int8", "int8 (blockwise, with error feedback)")],
                default="fp32",
                help_text="How model weights go down to volunteers; they train from exactly these (decoded) weights.",
                max_length=10,
            ),
        ),
        migrations.AddField(
            model_name="modelversion",
            name="wire_weights",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="projects.blob",
            ),
        ),
    ]
