"""The benchmark scripts refuse a bad ``--modes`` before loading anything: one message, exit 2."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["throughput.py", "decode.py"])
@pytest.mark.parametrize(
    "modes,extra,message",
    [
        ("auto,none,auto", [], "--modes lists auto more than once"),
        ("auto,,none", [], "--modes: comma-separated quantization modes"),
        ("int4", ["--device", "cuda"], "quantized modes run on the CPU only"),
    ],
)
def test_bad_modes_are_refused(script, modes, extra, message):
    result = subprocess.run(
        [sys.executable, str(BENCH / script), "--modes", modes, *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""
