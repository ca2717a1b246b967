from django.db import migrations, models


class Migration(migrations.Migration):
    """Issue 15: a round's progress counted on its version, crowd-sized rounds, and indexes for the hot
    queries (assignment, round readiness, norm history, results by work unit and state) that keep them fast
    without fresh table statistics."""

    dependencies = [("projects", "0011_storage_pruning_fair_share")]

    operations = [
        migrations.AddField(
            model_name="modelversion",
            name="round_target",
            field=models.PositiveBigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="modelversion",
            name="valid_samples",
            field=models.PositiveBigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="project",
            name="crowd_rounds",
            field=models.BooleanField(
                default=False,
                help_text="Rounds grow with the volunteers connected: a work unit for each of them. Sync SGD "
                "shares round_samples (the target batch) between them; averaging sizes each unit to take "
                "target_seconds.",
            ),
        ),
        migrations.AddIndex(
            model_name="result",
            index=models.Index(fields=["work_unit", "status"], name="result_unit_status"),
        ),
        migrations.AddIndex(
            model_name="result",
            index=models.Index(
                condition=models.Q(("checked", False), ("status", "received"), ("validation", "pending")),
                fields=["work_unit", "received_at"],
                name="result_awaiting_validation",
            ),
        ),
        migrations.AddIndex(
            model_name="result",
            index=models.Index(
                condition=models.Q(("aggregated", False), ("status", "received"), ("validation", "valid")),
                fields=["work_unit"],
                name="result_unaggregated",
            ),
        ),
        migrations.AddIndex(
            model_name="result",
            index=models.Index(
                condition=models.Q(("update_norm__isnull", False), ("validation", "valid")),
                fields=["-id"],
                name="result_valid_norm",
            ),
        ),
        migrations.AddIndex(
            model_name="workunit",
            index=models.Index(
                condition=models.Q(("status", "open"), ("wanted__gt", 0)),
                fields=["project", "version", "id"],
                name="workunit_sendable",
            ),
        ),
    ]
