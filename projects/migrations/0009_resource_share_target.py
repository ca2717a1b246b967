from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("projects", "0008_dataset_kind")]

    operations = [
        migrations.RenameField("project", "priority", "resource_share"),
        migrations.AlterField(
            model_name="project",
            name="resource_share",
            field=models.PositiveIntegerField(
                default=100,
                help_text="BOINC-style resource share: running projects get volunteer time in proportion.",
            ),
        ),
        migrations.AddField(
            model_name="project",
            name="target_metric",
            field=models.CharField(
                choices=[
                    ("test_accuracy", "Test accuracy (higher is better)"),
                    ("test_loss", "Test loss (lower is better)"),
                ],
                default="test_accuracy",
                help_text="The metric that picks the best checkpoint and the ETA's goal.",
                max_length=20,
            ),
        ),
        migrations.AddField(
            model_name="project",
            name="target_value",
            field=models.FloatField(
                blank=True,
                help_text="Goal for the target metric (e.g. 0.95 accuracy, or a loss of 0.1).",
                null=True,
            ),
        ),
    ]
