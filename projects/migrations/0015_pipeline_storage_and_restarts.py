"""Pipeline mode: stage units still holding their stage blobs (released by the storage sweep after their
step), and one live unit per step position, so a step a pause interrupted can start over."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('projects', '0014_stage_members'),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name='workunit',
            name='one_stage_unit_per_step',
        ),
        migrations.AddIndex(
            model_name='workunit',
            index=models.Index(condition=models.Q(('stage_weights__isnull', False)), fields=['version'], name='workunit_stage_blobs'),
        ),
        migrations.AddConstraint(
            model_name='workunit',
            constraint=models.UniqueConstraint(condition=models.Q(models.Q(('stage_kind', ''), _negated=True), models.Q(('status', 'cancelled'), _negated=True)), fields=('version', 'stage_kind', 'stage', 'micro_batch'), name='one_stage_unit_per_step'),
        ),
    ]
