# Issue 9: a project's bound on activation memory per training sample (engine.graph.ActivationMemory).

import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('projects', '0006_work_unit_spot_check'),
    ]

    operations = [
        migrations.AddField(
            model_name='project',
            name='max_activation_mb',
            field=models.PositiveIntegerField(default=64, help_text="Refuse models whose activations need more MiB than this per training sample (every node's output, twice for the backward pass; ResNet-18 on 32x32 needs 16).", validators=[django.core.validators.MinValueValidator(1), django.core.validators.MaxValueValidator(1024)]),
        ),
    ]
