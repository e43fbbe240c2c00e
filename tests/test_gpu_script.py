"""``benchmarks/gpu.sh`` (``make bench-gpu``), checked on a CPU machine: it parses, its
``--dry-run`` lists every stage with a timeout that keeps the whole under 10 minutes,
runs every CUDA-only test of the suite (found the way the script finds them, checked
here against an independent scan), and writes where ``$OUT`` says; and without a CUDA
torch it stops at once with a message that says so."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env={**os.environ, **(env or {})})


def _cuda_only_tests() -> set[str]:
    """Every test function decorated with a skip when CUDA is missing, as a node id."""
    found = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        text = path.read_text()
        pattern = r"skipif\(not torch\.cuda\.is_available\(\).*?\n(?:\s*@.*\n)*\s*def (test_\w+)"
        for name in re.findall(pattern, text):
            found.add(f"{path.relative_to(ROOT).as_posix()}::{name}")
    return found


def test_script_parses():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_dry_run_lists_the_stages_within_ten_minutes(tmp_path):
    proc = _run("--dry-run", env={"OUT": str(tmp_path / "out")})
    assert proc.returncode == 0, proc.stderr
    stages = re.findall(r"^\s+\d+\. (\S+)\s+timeout\s+(\d+) s: (.*)$", proc.stdout, re.M)
    assert [name for name, _, _ in stages] == ["env", "cuda-tests", "bench-compile"]
    assert sum(int(s) for _, s, _ in stages) <= 600
    budget = int(re.search(r"budget (\d+) s", proc.stdout).group(1))
    assert budget <= 600
    commands = {name: command for name, _, command in stages}
    assert commands["env"].endswith("benchmarks/gpu_env.py")
    assert set(commands["cuda-tests"].split()) >= _cuda_only_tests()
    assert len(_cuda_only_tests()) >= 3  # functional, shard_params offload, remat offload
    bench = commands["bench-compile"]
    assert "benchmarks/bench_compile.py --device cuda --world 1" in bench
    assert "pmean-autocast" in bench
    assert f"--results {tmp_path / 'out'}/bench_compile_cuda.json" in bench
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_unknown_argument_is_refused():
    proc = _run("--fast")
    assert proc.returncode == 2 and "unknown argument '--fast'" in proc.stderr


def test_cpu_torch_stops_at_the_environment_check(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the script would run for minutes")
    proc = _run(env={"OUT": str(tmp_path)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "is the CPU-only wheel (torch.version.cuda is None)" in proc.stdout
    assert "has no usable CUDA torch" in proc.stdout
    summary = (tmp_path / "summary.md").read_text()
    assert "| env | failed (exit 3) |" in summary
    assert "cuda-tests" not in summary  # nothing ran after the failed check
