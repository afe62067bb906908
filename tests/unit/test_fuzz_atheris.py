"""Coverage-guided fuzzing with atheris, for a bounded number of runs (skipped where
atheris does not install)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="atheris did not install on this machine (hypothesis fuzzing still runs)")


@pytest.mark.slow  # 20,000 fuzzing runs take seconds; the hypothesis fuzzing runs in the quick suite
def test_atheris_finds_no_crash_in_the_aggregator_input(tmp_path):
    script = Path(__file__).resolve().parents[1] / "fuzz" / "fuzz_aggregator.py"
    seeds = tmp_path / "corpus"
    seeds.mkdir()
    from mindpulse.wire.protocol import StepPacket

    (seeds / "step").write_bytes(StepPacket(rank=1, step=2, loss=0.5, fingerprint="ab", decision=True).encode())
    sys.path.insert(0, str(script.parent))
    try:  # one of every packet kind, and sequences of packets
        from fuzz_aggregator import seeds as all_seeds
    finally:
        sys.path.pop(0)
    for i, seed in enumerate(all_seeds()):
        (seeds / f"seed_{i}").write_bytes(seed)
    proc = subprocess.run([sys.executable, str(script), "-runs=20000", "-max_len=2048", str(seeds)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Done 20000 runs" in proc.stderr
