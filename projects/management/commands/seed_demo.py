"""`manage.py seed_demo`: create the demo datasets and running projects, once."""

from __future__ import annotations

import os
from argparse import ArgumentParser
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError

from projects import demo


def demo_owner() -> User:
    """The admin from `ensure_admin` (CROWDTRAIN_ADMIN_USER, default 'admin'), else the first superuser."""
    users = get_user_model().objects
    username = os.environ.get("CROWDTRAIN_ADMIN_USER") or "admin"
    owner = users.filter(username=username).first() or users.filter(is_superuser=True).order_by("pk").first()
    if owner is None:
        raise CommandError("No admin user to own the demo projects: run `manage.py ensure_admin` first.")
    return owner


class Command(BaseCommand):
    help = "Create the MNIST demo project (+ Fashion-MNIST's, if Debian's dataset-fashion-mnist is there)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--no-fashion", action="store_true", help="Skip the Fashion-MNIST demo.")

    def handle(self, *args: Any, no_fashion: bool, **options: Any) -> None:
        owner = demo_owner()
        self.seed(demo.MNIST_DEMO, owner)
        if no_fashion:
            return
        if not demo.fashion_available():
            self.stdout.write("Fashion-MNIST demo skipped: install Debian's dataset-fashion-mnist to get it.")
            return
        from engine.presets import PRESETS

        if (preset := demo.FASHION_DEMO.preset) not in PRESETS:
            self.stdout.write(f"Fashion-MNIST demo skipped: engine.presets has no '{preset}' preset yet.")
            return
        self.seed(demo.FASHION_DEMO, owner)

    def seed(self, item: demo.Demo, owner: User) -> None:
        project = demo.demo_seed(demo=item, owner=owner)
        if project is None:
            self.stdout.write(f"Demo project '{item.project}' exists; nothing to do.")
            return
        dataset = project.dataset
        self.stdout.write(
            self.style.SUCCESS(
                f"Created '{project.name}' ({project.status}) on '{dataset.name}': "
                f"{dataset.train_samples:,} train / {dataset.test_samples:,} test samples."
            )
        )
