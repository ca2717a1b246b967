"""`manage.py export_model mypkg.models:Net --input-shape 1,28,28 (--output DIR | --project-name ...)`.

Runs on the researcher's own machine: it imports *their* module (their code, their trust), traces it
with engine.export and either writes `graph.json` + `weights.safetensors` (to upload in the admin) or
creates the project directly. The server itself never imports uploaded code.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from kombu.exceptions import OperationalError as KombuOperationalError
from torch import Tensor, nn
from tqdm import tqdm

from engine import codecs
from engine.export import ExportError, export_module
from projects.models import Dataset, Project
from projects.services import ProjectError, project_create_from_graph, project_start

GRAPH_FILE = "graph.json"
WEIGHTS_FILE = "weights.safetensors"
Exported = tuple[dict[str, Any], dict[str, Tensor]]


def parse_shape(text: str) -> tuple[int, ...]:
    """'1,28,28' -> (1, 28, 28): the shape of one sample, without the batch dimension."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise CommandError(f"--input-shape must be integers like 1,28,28; got {text!r}.") from None
    if not shape or any(dim <= 0 for dim in shape):
        raise CommandError(f"--input-shape dimensions must be positive; got {text!r}.")
    return shape


def import_class(spec: str) -> type[nn.Module]:
    """'mypkg.models:Net' -> the class; every way this can go wrong becomes a CommandError."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise CommandError(f"Expected module:Class (e.g. mypkg.models:Net); got {spec!r}.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CommandError(f"Cannot import module '{module_name}': {exc}") from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise CommandError(f"'{class_name}' in module '{module_name}' is not a torch.nn.Module subclass.")
    return cls


def instantiate(cls: type[nn.Module]) -> nn.Module:
    try:
        return cls()
    except Exception as exc:  # the researcher's constructor may raise anything
        raise CommandError(f"{cls.__qualname__}() failed (it must work without arguments): {exc}") from exc


def export(module: nn.Module, shape: tuple[int, ...], dtype: str, loss: str, name: str) -> Exported:
    try:
        return export_module(module, shape, input_dtype=dtype, loss=loss, name=name)
    except ExportError as exc:  # its message names the op and the module path
        raise CommandError(f"Cannot export {name}: {exc}") from exc


def write_files(directory: Path, exported: Exported) -> list[Path]:
    graph, weights = exported
    directory.mkdir(parents=True, exist_ok=True)
    graph_path, weights_path = directory / GRAPH_FILE, directory / WEIGHTS_FILE
    graph_path.write_text(json.dumps(graph, indent=2) + "\n")
    weights_path.write_bytes(codecs.encode(weights))
    return [graph_path, weights_path]


def find_owner(username: str) -> User:
    owner = User.objects.filter(username=username).first()
    if owner is None:
        raise CommandError(f"There is no user '{username}'.")
    return owner


def find_dataset(dataset_id: int) -> Dataset:
    dataset = Dataset.objects.filter(pk=dataset_id).first()
    if dataset is None:
        raise CommandError(f"There is no dataset with id {dataset_id}.")
    return dataset


class Command(BaseCommand):
    help = "Export a torch.nn.Module (module:Class) to graph.json + weights.safetensors, or to a project."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("model", help="The module and class, e.g. mypkg.models:Net (built with no args).")
        parser.add_argument("--input-shape", required=True, type=parse_shape, help="One sample: 1,28,28.")
        parser.add_argument("--input-dtype", default="float32", choices=["float32", "int64"])
        parser.add_argument("--loss", default="cross_entropy", choices=["cross_entropy", "mse", "l1"])
        target = parser.add_mutually_exclusive_group(required=True)
        target.add_argument("--output", type=Path, help="Write graph.json and weights.safetensors here.")
        target.add_argument("--project-name", help="Create a project with this name instead.")
        parser.add_argument("--dataset-id", type=int, help="The project's dataset (with --project-name).")
        parser.add_argument("--owner", help="Username owning the project (with --project-name).")
        parser.add_argument("--start", action="store_true", help="Start training the new project.")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["project_name"] and not (options["dataset_id"] and options["owner"]):
            raise CommandError("--project-name needs --dataset-id and --owner.")
        # manage.py puts its own directory on sys.path; researchers expect their working directory too.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        with tqdm(total=4, desc="export_model", unit="step", file=sys.stderr) as bar:
            exported = self._export(options, bar)
            message = self._save(options, exported, bar)
        self.stdout.write(self.style.SUCCESS(message))

    def _export(self, options: dict[str, Any], bar: tqdm[Any]) -> Exported:
        bar.set_postfix_str("importing")
        cls = import_class(options["model"])
        bar.update()
        bar.set_postfix_str("instantiating")
        module = instantiate(cls)
        bar.update()
        bar.set_postfix_str("tracing")
        exported = export(
            module, options["input_shape"], options["input_dtype"], options["loss"], cls.__name__
        )
        bar.update()
        return exported

    def _save(self, options: dict[str, Any], exported: Exported, bar: tqdm[Any]) -> str:
        bar.set_postfix_str("saving")
        if options["output"] is not None:
            paths = write_files(options["output"], exported)
            bar.update()
            return "Wrote " + " and ".join(str(path) for path in paths)
        project = self._create_project(options, exported)
        bar.update()
        return f"Created project '{project.name}' (id {project.pk}, {project.status})."

    def _create_project(self, options: dict[str, Any], exported: Exported) -> Project:
        name = options["project_name"]
        if Project.objects.filter(name=name).exists():
            raise CommandError(f"A project named '{name}' exists already.")
        graph, weights = exported
        try:
            with transaction.atomic():
                project = project_create_from_graph(
                    owner=find_owner(options["owner"]),
                    name=name,
                    dataset=find_dataset(options["dataset_id"]),
                    graph_dict=graph,
                    weights=weights,
                )
        except ProjectError as exc:  # e.g. the model's input shape does not match the dataset's
            raise CommandError(str(exc)) from exc
        return self._start(project) if options["start"] else project

    def _start(self, project: Project) -> Project:
        try:
            return project_start(project=project)
        except KombuOperationalError:
            # Started and saved; only the "feed it now" kick missed the broker. Beat feeds it soon.
            return project
