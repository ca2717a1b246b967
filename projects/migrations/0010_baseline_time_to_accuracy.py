import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("projects", "0009_resource_share_target")]

    operations = [
        migrations.CreateModel(
            name="Baseline",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                (
                    "status",
                    models.CharField(
                        choices=[
                            ("pending", "Pending"),
                            ("running", "Running"),
                            ("done", "Done"),
                            ("skipped", "Skipped"),
                            ("failed", "Failed"),
                        ],
                        default="pending",
                        max_length=10,
                    ),
                ),
                (
                    "reason",
                    models.CharField(
                        blank=True, help_text="Why it was skipped, failed or stopped.", max_length=300
                    ),
                ),
                ("budget_seconds", models.FloatField()),
                ("budget_samples", models.PositiveBigIntegerField()),
                ("queued_at", models.DateTimeField(blank=True, null=True)),
                ("started_at", models.DateTimeField(blank=True, null=True)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                (
                    "project",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="baseline",
                        to="projects.project",
                    ),
                ),
            ],
        ),
        migrations.CreateModel(
            name="BaselinePoint",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("seconds", models.FloatField()),
                ("samples", models.PositiveBigIntegerField()),
                ("metrics", models.JSONField(help_text="{metric name: value}, e.g. test_loss, test_accuracy.")),
                (
                    "baseline",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="points",
                        to="projects.baseline",
                    ),
                ),
            ],
            options={
                "ordering": ["baseline", "samples"],
                "constraints": [
                    models.UniqueConstraint(fields=("baseline", "samples"), name="one_baseline_point_per_samples")
                ],
            },
        ),
    ]
