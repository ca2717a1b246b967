"""Real model definitions from torchvision and timm (none written for this project), at small input sizes
and with random weights: nothing is downloaded. tests/engine/test_corpus.py and tests/browser/test_corpus.py
run them with the hand-written corpus (tests/engine/corpus.py); docs/corpus.md has the table.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from tests.engine.corpus import CorpusModel


def _models_without_torchvision_init() -> Any:
    """torchvision.models, imported without running torchvision/__init__.py.

    PyPI's torchvision 0.28 wheel next to our CPU torch has a CUDA-built C extension that fails to load,
    and its __init__ then raises (in _meta_registrations.py). The model definitions are pure Python and
    need none of it, so the package is stood in by an empty module that keeps its path: submodules then
    import from the installed files as usual. Tests only; the platform never imports torchvision.
    """
    if "torchvision" not in sys.modules:
        spec = importlib.util.find_spec("torchvision")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError("torchvision is not installed (requirements-dev.txt)")
        package = types.ModuleType("torchvision")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["torchvision"] = package
    import torchvision.models

    return torchvision.models


tvm = _models_without_torchvision_init()
import timm  # noqa: E402 - imports torchvision, which needs the stand-in above

CLASSES = 10


def _tv(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    return lambda: getattr(tvm, name)(weights=None, num_classes=CLASSES, **kwargs)


def _timm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    return lambda: timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs)


def _vit_tiny() -> nn.Module:
    """torchvision's VisionTransformer class with small dimensions: vit_b_16's code, a browser-sized model."""
    return tvm.VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=4,
        hidden_dim=64,
        mlp_dim=128,
        num_classes=CLASSES,
    )


def _image(build: Callable[[], nn.Module], size: int = 32) -> CorpusModel:
    return CorpusModel(build, (3, size, size), "float32", nn.CrossEntropyLoss, classes=CLASSES)


# name -> model; the source (package and constructor) is in docs/corpus.md.
ZOO: dict[str, CorpusModel] = {
    # ResNet-18, EfficientNet and RegNet end in 1x1 maps at 32x32, where batch norm over few samples is so
    # ill-conditioned that float32 torch itself is off float64 (docs/corpus.md): the browser test needs 64x64.
    "tv_resnet18": _image(_tv("resnet18"), 64),
    "tv_mobilenet_v3_small": _image(_tv("mobilenet_v3_small")),
    # At 32x32 its last batch norms see 1x1 maps: batch statistics of 3 samples put float32 torch itself 2e-3
    # off float64, past the browser test's 1e-4; at 64x64 it is 1.5e-5.
    "tv_shufflenet_v2_x0_5": _image(_tv("shufflenet_v2_x0_5"), 64),
    "tv_squeezenet1_1": _image(_tv("squeezenet1_1"), 64),  # 32x32 pools down to nothing
    "tv_efficientnet_b0": _image(_tv("efficientnet_b0"), 64),
    "tv_regnet_x_400mf": _image(_tv("regnet_x_400mf")),
    "tv_vit_b_16": _image(_tv("vit_b_16", image_size=32)),
    "tv_vit_tiny": _image(_vit_tiny),
    "timm_convnext_atto": _image(_timm("convnext_atto")),
    "timm_mobilevit_xxs": _image(_timm("mobilevit_xxs"), 64),
    "timm_resnet10t": _image(_timm("resnet10t")),
}
