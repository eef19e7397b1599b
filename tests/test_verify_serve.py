"""`prefixvault verify` against real `vllm serve` servers, and `prefixvault serve`.

Five servers on loopback: cold; producer and restored started with `prefixvault serve`
(kv_producer / kv_consumer over one local store); the same model with other weights under
the same name; and a server of another name.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixvault.scenarios.models import build_model, engine_kwargs
from prefixvault.scenarios.servers import free_port
from prefixvault.scenarios.servers import servers as start_servers
from prefixvault.serve import engine_flags, vllm_command

pytestmark = pytest.mark.slow
PROFILE = "shortconv-hybrid"


def _flags(model: Path, name: str) -> list[str]:
    engine = engine_kwargs(PROFILE, model)
    engine.pop("model")
    engine["max_num_batched_tokens"] = 512
    return [*engine_flags(engine), "--served-model-name", name]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("serve")
    same = build_model(PROFILE, root / "m0", seed=0)
    other = build_model(PROFILE, root / "m1", seed=1)
    store = f"local://{root}/store?capacity=1GiB"
    pv = [sys.executable, "-m", "prefixvault.cli", "serve"]
    cmds = {
        "cold": [*vllm_command(str(same)), *_flags(same, "tiny")],
        "producer": [*pv, str(same), "--store", store, "--role", "kv_producer", "--", *_flags(same, "tiny")],
        "restored": [*pv, str(same), "--store", store, "--role", "kv_consumer", "--", *_flags(same, "tiny")],
        "other_weights": [*vllm_command(str(other)), *_flags(other, "tiny")],
        "other_name": [*vllm_command(str(other)), *_flags(other, "tiny-other")],
    }
    with start_servers([(c, root / f"{k}.log") for k, c in cmds.items()],
                       {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}) as found:
        yield {**dict(zip(cmds, found, strict=True)), "log_dir": str(root)}


def _verify(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prefixvault.cli", "verify", *args, "--producer-repeats",
                           "400", "--consumer-repeats", "380", "--json"],
                          capture_output=True, text=True, timeout=600)


def test_verify_passes_for_a_correct_pair(servers: dict[str, str]) -> None:
    res = _verify("--cold", servers["cold"], "--restored", servers["restored"], "--producer",
                  servers["producer"])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["ok"]
    assert out["results"][0]["restored_hit_tokens"] > 0  # it really restored from the store


def test_verify_fails_clearly_for_a_pair_that_differs(servers: dict[str, str]) -> None:
    res = _verify("--cold", servers["cold"], "--restored", servers["other_weights"])
    assert res.returncode == 1
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert not out["ok"] and not out["results"][0]["logprobs_equal"]


@pytest.mark.parametrize("which,needle", [("other_name", "model mismatch"), ("unreachable", "cannot reach")])
def test_verify_bad_input_is_one_clear_line(servers: dict[str, str], which: str, needle: str) -> None:
    restored = servers.get(which, f"http://127.0.0.1:{free_port()}")
    res = _verify("--cold", servers["cold"], "--restored", restored)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], res.stderr


def test_serve_prints_the_vllm_command() -> None:
    res = subprocess.run([sys.executable, "-m", "prefixvault.cli", "serve", "some/model", "--store",
                          "local:///dev/shm/pv", "--dry-run", "--", "--port", "8011"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip()
    assert "some/model --enable-prefix-caching --mamba-cache-mode align --kv-transfer-config " in line
    assert '"kv_connector_module_path": "prefixvault.vllm"' in line and line.endswith("--port 8011")
    assert "--shutdown-timeout 45" in line  # a saving server stores its queued saves on SIGTERM
    assert "capture_outputs" not in line
    res = subprocess.run([sys.executable, "-m", "prefixvault.cli", "serve", "some/model", "--capture-outputs",
                          "last", "--dry-run"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert '"capture_outputs": true, "output_boundaries": "last"' in res.stdout
