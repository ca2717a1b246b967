"""Storage that does not grow forever and fair share between projects (issue 12, items 6 and 7):
Blob.stored_at (the collector's grace period), pruned versions (weights nullable, pruned_at), Result.digest
(replays caught after updates are deleted; filled from the blob of existing results), a partial index on
results still holding an update, and ProjectUsage (recent FLOPs per project for the scheduler)."""

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


def fill_digests(apps, schema_editor):
    Result = apps.get_model("projects", "Result")
    Result.objects.filter(blob__isnull=False).update(digest=models.F("blob_id"))


class Migration(migrations.Migration):
    dependencies = [("projects", "0010_baseline_time_to_accuracy")]

    operations = [
        migrations.CreateModel(
            name="ProjectUsage",
            fields=[
                (
                    "project",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="usage",
                        serialize=False,
                        to="projects.project",
                    ),
                ),
                ("recent_flops", models.FloatField(default=0.0)),
                ("updated_at", models.DateTimeField(default=django.utils.timezone.now)),
            ],
        ),
        migrations.AddField(
            model_name="blob",
            name="stored_at",
            field=models.DateTimeField(db_index=True, default=django.utils.timezone.now),
        ),
        migrations.AddField(
            model_name="modelversion",
            name="pruned_at",
            field=models.DateTimeField(
                blank=True, help_text="When its weights and optimizer state were deleted to save space.", null=True
            ),
        ),
        migrations.AddField(
            model_name="result",
            name="digest",
            field=models.CharField(blank=True, db_index=True, max_length=64),
        ),
        migrations.RunPython(fill_digests, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="modelversion",
            name="weights",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="projects.blob",
            ),
        ),
        migrations.AddIndex(
            model_name="result",
            index=models.Index(
                condition=models.Q(("blob__isnull", False)), fields=["work_unit"], name="result_holding_blob"
            ),
        ),
    ]
