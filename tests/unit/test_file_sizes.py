"""The project's size rule: no Python file git tracks is over 700 lines (a longer one is split
into modules named for what each holds, as bench/ and tests/unit were)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 700


def tracked_python_files() -> list[Path]:
    """The `.py` files git tracks, as paths under the repository root."""
    out = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def line_count(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="not a git checkout: no list of tracked files")
def test_no_tracked_python_file_is_over_700_lines():
    files = tracked_python_files()
    assert files, "git lists no tracked Python file"
    # a file tracked but deleted in the working tree is not there to count
    over = {p.relative_to(ROOT).as_posix(): n for p in files if p.exists() and (n := line_count(p)) > MAX_LINES}
    assert not over, f"over {MAX_LINES} lines (split each by what it holds): " + ", ".join(
        f"{name} ({n} lines)" for name, n in sorted(over.items()))
