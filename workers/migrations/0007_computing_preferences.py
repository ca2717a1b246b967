import django.core.validators
import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("workers", "0006_account"), ("projects", "0011_storage_pruning_fair_share")]

    operations: list[migrations.operations.base.Operation] = [
        migrations.CreateModel(
            name="ComputingPreferences",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "duty_cycle",
                    models.PositiveSmallIntegerField(
                        default=100,
                        help_text="Percent of the time spent computing (the rest between work units).",
                        validators=[
                            django.core.validators.MinValueValidator(10),
                            django.core.validators.MaxValueValidator(100),
                        ],
                    ),
                ),
                ("pause_when_hidden", models.BooleanField(default=True)),
                (
                    "pause_on_battery",
                    models.BooleanField(default=True, help_text="While the battery is discharging."),
                ),
                (
                    "battery_min_percent",
                    models.PositiveSmallIntegerField(
                        default=0,
                        help_text="Pause below this charge; 0: never.",
                        validators=[django.core.validators.MaxValueValidator(100)],
                    ),
                ),
                (
                    "pause_while_active",
                    models.BooleanField(
                        default=False,
                        help_text="Pause for a few seconds after each key press or mouse move on the page.",
                    ),
                ),
                (
                    "projects",
                    models.CharField(
                        choices=[
                            ("any", "Any project, new ones too"),
                            ("only", "Only the projects ticked below"),
                            ("except", "Any project except those ticked below"),
                        ],
                        default="any",
                        max_length=6,
                    ),
                ),
                (
                    "max_work_unit_mb",
                    models.PositiveIntegerField(
                        blank=True,
                        help_text="Largest download and memory of one work unit; empty: no limit.",
                        null=True,
                        validators=[
                            django.core.validators.MinValueValidator(1),
                            django.core.validators.MaxValueValidator(1000000),
                        ],
                    ),
                ),
                (
                    "max_download_mb_per_day",
                    models.PositiveIntegerField(
                        blank=True,
                        null=True,
                        validators=[
                            django.core.validators.MinValueValidator(1),
                            django.core.validators.MaxValueValidator(1000000),
                        ],
                    ),
                ),
                ("updated_at", models.DateTimeField(auto_now=True)),
                (
                    "chosen_projects",
                    models.ManyToManyField(blank=True, related_name="+", to="projects.project"),
                ),
                (
                    "device",
                    models.OneToOneField(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="computing_preferences",
                        to="workers.device",
                    ),
                ),
                (
                    "volunteer",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="computing_preferences",
                        to="workers.volunteer",
                    ),
                ),
            ],
            options={"verbose_name_plural": "computing preferences"},
        ),
        migrations.CreateModel(
            name="DeviceDownload",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("day", models.DateField()),
                ("bytes", models.PositiveBigIntegerField(default=0)),
                ("work_units", models.PositiveIntegerField(default=0)),
                ("blobs", models.JSONField(blank=True, default=list)),
                (
                    "device",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="downloads",
                        to="workers.device",
                    ),
                ),
            ],
        ),
        migrations.AddConstraint(
            model_name="computingpreferences",
            constraint=models.UniqueConstraint(
                condition=models.Q(("device__isnull", True)),
                fields=("volunteer",),
                name="one_default_preferences",
            ),
        ),
        migrations.AddConstraint(
            model_name="computingpreferences",
            constraint=models.CheckConstraint(
                condition=models.Q(("duty_cycle__gte", 10), ("duty_cycle__lte", 100)),
                name="preferences_duty_cycle_bounds",
            ),
        ),
        migrations.AddConstraint(
            model_name="computingpreferences",
            constraint=models.CheckConstraint(
                condition=models.Q(("battery_min_percent__lte", 100)), name="preferences_battery_bounds"
            ),
        ),
        migrations.AddConstraint(
            model_name="devicedownload",
            constraint=models.UniqueConstraint(
                fields=("device", "day"), name="one_download_row_per_device_day"
            ),
        ),
    ]
