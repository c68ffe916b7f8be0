"""scripts/check/gpu_check.sh --dry: the GPU check's steps on CPU, Triton's kernels under its
interpreter, at tiny shapes (issue 44), so CI keeps the script a GPU machine runs working."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = (
    "doctor",
    "parity and invariance",
    "benchmark, eager (nanokv only)",
    "benchmark, CUDA graphs, against transformers' continuous batching",
    "live view",
)


@pytest.mark.slow
def test_gpu_check_dry_runs_every_step():
    pytest.importorskip("triton", reason="triton is not installed: the dry run interprets it")
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed: the live-view step captures a terminal")
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check" / "gpu_check.sh"), "--dry"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = result.stdout
    assert result.returncode == 0, out[-6000:] + result.stderr[-3000:]
    for step in STEPS:
        assert f"-- {step}: ok" in out, step
    assert "cuda attention  triton" in out or "cuda attention  flash" in out  # doctor
    assert out.count("transformers parity") == 4  # 2 models x 2 dtypes
    assert "triton attention" in out and "continuous batching)" in out  # the benchmark
    assert "0 step(s) failed (dry" in out
    live = out[out.index("the live view, while the run went on") :]
    assert "nanokv generate ·" in live and "hit rate" in live  # a frame of the view itself
