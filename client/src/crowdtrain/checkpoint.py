"""Trained weights back into the researcher's own nn.Module.

The exporter names the graph's parameters and buffers exactly as ``module.state_dict()`` does, so a
checkpoint loads by name, strictly: a name the module lacks, a shape that differs or a float tensor of the
module the checkpoint lacks is an error naming them. Integer buffers the graph never uses (BatchNorm's
``num_batches_tracked``) are left as they are, and a tied parameter is loaded once through any of its names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from engine import codecs
from engine.export.losses import LOSS_WEIGHT

from .client import Client
from .errors import CheckpointMismatch, CrowdtrainError

SHOWN = 8  # names listed in an error before "and N more"


@dataclass(frozen=True)
class Loaded:
    """What load_into loaded: the project and version (None from a file), its metrics and the names set."""

    project: int | None
    version: int | None
    metrics: dict[str, float]
    names: list[str] = field(repr=False)


def decode(data: bytes, source: str) -> dict[str, Tensor]:
    """A checkpoint's tensors (any of the platform's codecs), parsed without executing anything."""
    try:
        tensors, _ = codecs.decode(data)
    except codecs.CodecError as exc:
        raise CrowdtrainError(f"{source} is not a valid checkpoint: {exc}") from None
    return tensors


def module_tensors(module: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer by state_dict name, tied ones under each of their names."""
    named: dict[str, Tensor] = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def graph_only_removed(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Without the graph's own tensors (the loss's class weights), which belong to no module."""
    return {name: tensor for name, tensor in tensors.items() if name != LOSS_WEIGHT}


def check_fit(module: nn.Module, tensors: dict[str, Tensor], strict: bool = True) -> None:
    """Raise CheckpointMismatch unless ``tensors`` fit ``module`` by name and shape."""
    tensors = graph_only_removed(tensors)
    targets = module_tensors(module)
    unknown = sorted(set(tensors) - set(targets))
    if unknown:
        raise CheckpointMismatch(f"the module has no {_listed(unknown)}: is it the module that was pushed?")
    shapes = [
        f"{n} {list(t.shape)} vs {list(targets[n].shape)}"
        for n, t in tensors.items()
        if t.shape != targets[n].shape
    ]
    if shapes:
        raise CheckpointMismatch(f"shapes differ (checkpoint vs module): {_listed(shapes)}")
    if strict:
        loaded = {id(targets[n]) for n in tensors}
        missing = sorted(
            n
            for n, t in targets.items()
            if n not in tensors and t.is_floating_point() and id(t) not in loaded
        )
        if missing:
            raise CheckpointMismatch(
                f"the checkpoint has no {_listed(missing)} (strict=False loads the rest, e.g. for tensors "
                "the forward pass never uses)"
            )


def load_tensors(module: nn.Module, tensors: dict[str, Tensor], *, strict: bool = True) -> list[str]:
    """Copy ``tensors`` into ``module`` in place (each keeps its module's dtype and device)."""
    check_fit(module, tensors, strict)
    tensors = graph_only_removed(tensors)
    targets = module_tensors(module)
    with torch.no_grad():
        for name, tensor in tensors.items():
            targets[name].copy_(tensor)
    return sorted(tensors)


def load_into(
    module: nn.Module,
    project: int | str | None = None,
    version: str | int = "best",
    client: Client | None = None,
    *,
    file: str | Path | None = None,
    strict: bool = True,
) -> Loaded:
    """Load a project's checkpoint ("best", "latest" or a version number), or a pulled ``file``, into
    ``module``. ``client`` defaults to ``Client.from_config()`` (``crowdtrain login``'s token)."""
    if (project is None) == (file is None):
        raise CrowdtrainError("load_into needs either project=... or file=...")
    if file is not None:
        tensors = decode(_read(Path(file)), str(file))
        return Loaded(None, None, {}, load_tensors(module, tensors, strict=strict))
    api = client or Client.from_config()
    assert project is not None
    checkpoint = api.checkpoint(api.resolve_project(project), version)
    tensors = decode(checkpoint.data, f"version {checkpoint.version} of project {checkpoint.project}")
    names = load_tensors(module, tensors, strict=strict)
    return Loaded(checkpoint.project, checkpoint.version, checkpoint.metrics, names)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CrowdtrainError(f"cannot read {path}: {exc.strerror}") from None
