"""Pipeline mode (issue 14): the project's stage settings and the stage units' fields."""

import django.core.validators
import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("projects", "0012_hot_path_indexes")]

    operations = [
        migrations.AddField(
            model_name="project",
            name="activation_codec",
            field=models.CharField(
                choices=[("fp32", "fp32"), ("fp16", "fp16"), ("int8", "int8")],
                default="fp16",
                help_text="Pipeline: how activations and their gradients travel (engine/activations.py).",
                max_length=10,
            ),
        ),
        migrations.AddField(
            model_name="project",
            name="device_memory_mb",
            field=models.PositiveIntegerField(
                blank=True,
                help_text="Per-device memory budget in MiB (parameters, gradients, optimizer state, one "
                "micro-batch's activations): data-parallel modes refuse models over it, pipeline mode cuts "
                "them into stages under it.",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="project",
            name="micro_batches",
            field=models.PositiveSmallIntegerField(
                default=4,
                help_text="Pipeline: micro-batches of batch_size samples per step (GPipe's M).",
                validators=[
                    django.core.validators.MinValueValidator(1),
                    django.core.validators.MaxValueValidator(64),
                ],
            ),
        ),
        migrations.AddField(
            model_name="project",
            name="pipeline_stages",
            field=models.PositiveSmallIntegerField(
                default=0,
                help_text="Pipeline: stages the model is cut into; 0: the fewest that fit the per-device "
                "memory "
                "budget.",
                validators=[django.core.validators.MaxValueValidator(64)],
            ),
        ),
        migrations.AddField(
            model_name="workunit",
            name="grad_blob",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="projects.blob",
            ),
        ),
        migrations.AddField(
            model_name="workunit",
            name="input_blob",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="projects.blob",
            ),
        ),
        migrations.AddField(
            model_name="workunit",
            name="loss_scale",
            field=models.FloatField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="workunit",
            name="micro_batch",
            field=models.PositiveSmallIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="workunit",
            name="stage",
            field=models.PositiveSmallIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="workunit",
            name="stage_kind",
            field=models.CharField(blank=True, default="", max_length=8),
        ),
        migrations.AlterField(
            model_name="project",
            name="mode",
            field=models.CharField(
                choices=[
                    ("sync_sgd", "Synchronous SGD (gradients, one server step per round)"),
                    ("averaging", "Averaging (local steps, outer optimizer on averaged deltas)"),
                    ("async_sgd", "Asynchronous SGD (applied on arrival, staleness-weighted)"),
                    ("pipeline", "Pipeline (the model cut into stages, GPipe micro-batches, one step each)"),
                ],
                default="sync_sgd",
                max_length=20,
            ),
        ),
        migrations.AddConstraint(
            model_name="workunit",
            constraint=models.UniqueConstraint(
                condition=models.Q(("stage_kind", ""), _negated=True),
                fields=("version", "stage_kind", "stage", "micro_batch"),
                name="one_stage_unit_per_step",
            ),
        ),
        migrations.AddField(
            model_name="workunit",
            name="stage_graph",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="projects.blob",
            ),
        ),
        migrations.AddField(
            model_name="workunit",
            name="stage_weights",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="projects.blob",
            ),
        ),
    ]
