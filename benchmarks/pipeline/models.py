"""The benchmark's models as real graphs and real partitions: per-stage FLOPs, activation and weight bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.export import export_module
from engine.flops import train_flops_per_sample
from engine.graph import Graph, load_graph
from engine.partition import MemoryModel, PartitionError, partition
from engine.presets import GPT, ResNet18

from .config import BUDGET_BYTES, GPT_LAYERS, MICRO_BATCH, MICRO_BATCHES

FLOAT_BYTES = 4


@dataclass(frozen=True)
class StageFacts:
    forward: float  # FLOPs of the forward pass for one micro-batch
    backward: float  # FLOPs of the backward unit (recomputation included; the last stage: backward only)
    param_bytes: int  # fp32 params the stage's volunteers download and whose gradients they send
    crossing: int  # bytes per sample of the fp32 activation leaving the stage (0 for the last)
    sends_grad_back: bool  # needs_input_grad: an activation gradient goes back to the previous stage


@dataclass(frozen=True)
class ModelFacts:
    name: str
    params: int  # fp32 parameter bytes of the whole model
    train_flops: int  # per sample, forward + backward
    data_bytes: int  # per sample: inputs and targets as the server ships them (float32 / int32)
    fits_one_device: bool  # data parallel possible within BUDGET_BYTES (micro-batch, no optimizer state)
    one_device_bytes: int


def gpt_graph(width: int) -> Graph:
    torch.manual_seed(0)
    module = GPT(dim=width, heads=max(width // 64, 1), layers=GPT_LAYERS)
    graph, _ = export_module(module, (64,), "int64", name=f"gpt-{width}")
    return load_graph(graph)


def cnn_graph() -> Graph:
    torch.manual_seed(0)
    graph, _ = export_module(ResNet18(), (3, 32, 32), "float32", name="resnet18")
    return load_graph(graph)


def memory_model() -> MemoryModel:
    # Volunteers keep no optimizer state: the server applies the optimizer in every mode.
    return MemoryModel(budget_bytes=BUDGET_BYTES, micro_batch=MICRO_BATCH, optimizer_slots=0)


def model_facts(graph: Graph) -> ModelFacts:
    whole = partition(graph, 1, MemoryModel(micro_batch=MICRO_BATCH, optimizer_slots=0)).stages[0]
    per_sample = sum(math.prod(s.shape[1:]) * FLOAT_BYTES for s in (*graph.inputs, *graph.targets))
    return ModelFacts(
        name=graph.name,
        params=sum(math.prod(p.shape) for p in graph.params) * FLOAT_BYTES,
        train_flops=train_flops_per_sample(graph),
        data_bytes=per_sample,
        fits_one_device=whole.memory.total <= BUDGET_BYTES,
        one_device_bytes=whole.memory.total,
    )


def stage_facts(
    graph: Graph, stages: int, micro_batches: int | None = MICRO_BATCHES
) -> list[StageFacts] | None:
    """The partition's stages within the per-device budget, or None when no split into ``stages`` fits:
    the cuts making the shortest GPipe step of ``micro_batches`` (None: the smallest bottleneck)."""
    try:
        p = partition(graph, stages, memory_model(), micro_batches=micro_batches)
    except PartitionError:
        return None
    return [
        StageFacts(
            forward=float(s.forward_flops * MICRO_BATCH),
            backward=float((s.backward_flops if s.last else s.backward_unit_flops) * MICRO_BATCH),
            param_bytes=sum(math.prod(q.shape) for q in s.graph.params) * FLOAT_BYTES,
            crossing=0 if s.last else math.prod(s.graph.targets[0].shape[1:]) * FLOAT_BYTES,
            sends_grad_back=s.needs_input_grad,
        )
        for s in p.stages
    ]
