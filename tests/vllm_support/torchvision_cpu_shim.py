"""Lets torchvision import beside a CPU-only torch when its C++ ops cannot load.

PyPI's torchvision 0.28.0 (the release paired with torch 2.13) is a CUDA build: its
``_C.so`` needs ``libtorch_cuda.so``, so beside torch 2.13.0+cpu it fails to load, and then
``import torchvision`` raises in ``torchvision/_meta_registrations.py``
(``RuntimeError: operator torchvision::nms does not exist``): that file registers fake
kernels for ``nms`` and ``qnms`` without checking ``torchvision.extension._has_ops()``, as it
does for every other op. vLLM's ``qwen3_5.py`` imports the Qwen3-VL code, which imports
transformers' Qwen2-VL image processor, which imports ``torchvision.transforms.v2`` (pure
Python); so Qwen3.5 cannot even load.

``install()`` adds an import hook, nothing else (no torch import at start): right before
``torchvision._meta_registrations`` runs, if torchvision's C++ ops did not load, it declares
the two op schemas (no kernels), so the import completes. Image transforms work; calling
``torchvision.ops.nms`` still raises, as without the shim. Where torchvision's ops load (a
GPU build, or the ``+cpu`` wheel), the hook does nothing.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_libs: list[Any] = []


class _BeforeMetaRegistrations(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "torchvision._meta_registrations":
            sys.meta_path.remove(self)
            _declare_missing_ops()
        return None  # the normal finders load the module


def _declare_missing_ops() -> None:
    import torch
    import torchvision.extension

    if torchvision.extension._has_ops():
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        name = schema.split("(", 1)[0]
        if not hasattr(torch.ops.torchvision, name):
            lib.define(schema)
    _libs.append(lib)


def install() -> None:
    if not any(isinstance(f, _BeforeMetaRegistrations) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeMetaRegistrations())
