"""An honest volunteer computed in-process with engine/: what a browser would send for a work unit."""

from __future__ import annotations

import torch

from engine import codecs
from engine.runtime import compute_gradients
from projects.datasets import shard_load
from projects.models import WorkUnit
from projects.services import project_graph, version_weights


def honest_update(work_unit: WorkUnit) -> tuple[bytes, float]:
    graph = project_graph(project=work_unit.project)
    x, y = shard_load(shard=work_unit.shard)
    window = slice(work_unit.offset, work_unit.offset + work_unit.count)
    result = compute_gradients(
        graph,
        version_weights(version=work_unit.version),
        {graph.inputs[0].name: torch.from_numpy(x[window])},
        {graph.targets[0].name: torch.from_numpy(y[window])},
    )
    return codecs.encode(result.grads), result.loss
