# Issue 11, item 5: image folders, text corpora and float targets besides .npz class labels.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('projects', '0007_project_max_activation_mb'),
    ]

    operations = [
        migrations.AddField(
            model_name='dataset',
            name='kind',
            field=models.CharField(choices=[('classes', 'One class label per sample'), ('tokens', 'Token sequences, each position labelled with the next token'), ('regression', 'Float targets (regression, dense outputs)')], default='classes', max_length=12),
        ),
        migrations.AddField(
            model_name='dataset',
            name='target_shape',
            field=models.JSONField(default=list, help_text='Shape of one target: [] for a class label, [T] for next tokens, any for floats.'),
        ),
        migrations.AddField(
            model_name='dataset',
            name='labels',
            field=models.JSONField(blank=True, default=list, help_text='What each class id stands for, in id order: image folder names, or the characters of a character-level vocabulary. Empty when ids are plain numbers (.npz labels) or bytes.'),
        ),
        migrations.AlterField(
            model_name='dataset',
            name='input_shape',
            field=models.JSONField(help_text='Shape of one sample, e.g. [1, 28, 28], or [64] token ids.'),
        ),
        migrations.AlterField(
            model_name='dataset',
            name='num_classes',
            field=models.PositiveIntegerField(help_text="Classes, or the vocabulary's size for tokens; 0 for float targets (no classes)."),
        ),
    ]
