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
