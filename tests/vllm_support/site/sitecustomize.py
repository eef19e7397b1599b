"""Test-only start-up hook for engines of tests/test_vllm_architectures.py (on their
PYTHONPATH, never the product's): the reference Mamba1 kernels (``mamba1_ops``) and the
torchvision import shim that Qwen3.5 needs beside CPU torch (``torchvision_cpu_shim``)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mamba1_ops
import torchvision_cpu_shim

torchvision_cpu_shim.install()
mamba1_ops.register()
