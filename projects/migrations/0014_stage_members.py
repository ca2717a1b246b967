"""Swarms per stage (issue 14, item 4): stage membership, and an index on what each device holds in flight."""

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('projects', '0013_pipeline_mode'),
        ('workers', '0009_socket_hygiene'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name='StageMember',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('stage', models.PositiveSmallIntegerField()),
                ('joined_at', models.DateTimeField(default=django.utils.timezone.now, help_text='When it joined this stage.')),
                ('speed_gflops', models.FloatField(default=0.0)),
            ],
        ),
        migrations.AddIndex(
            model_name='result',
            index=models.Index(condition=models.Q(('status', 'in_progress')), fields=['device'], name='result_device_in_flight'),
        ),
        migrations.AddField(
            model_name='stagemember',
            name='device',
            field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='stage_memberships', to='workers.device'),
        ),
        migrations.AddField(
            model_name='stagemember',
            name='project',
            field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='stage_members', to='projects.project'),
        ),
        migrations.AddIndex(
            model_name='stagemember',
            index=models.Index(fields=['project', 'stage'], name='stagemember_project_stage'),
        ),
        migrations.AddConstraint(
            model_name='stagemember',
            constraint=models.UniqueConstraint(fields=('project', 'device'), name='one_stage_per_device_and_project'),
        ),
    ]
