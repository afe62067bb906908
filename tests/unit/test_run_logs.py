"""A run log (rank, msrun, scheduler) is opened for appending with the run directory's
mode (aggregator/rundir_io.py, `open_log_fd`)."""

from __future__ import annotations

import os
import stat

import pytest

from mindpulse.rundir.rundir_io import open_log_fd


@pytest.mark.parametrize("folder_mode, file_mode", [(0o700, 0o600), (0o755, 0o644), (0o750, 0o640)])
def test_a_log_takes_its_folders_read_bits_and_never_write_for_others(tmp_path, folder_mode, file_mode):
    logs = tmp_path / "logs"
    logs.mkdir(mode=folder_mode)
    os.chmod(logs, folder_mode)  # not narrowed by the umask
    fd = open_log_fd(logs / "rank_0.log")
    os.close(fd)
    assert stat.S_IMODE((logs / "rank_0.log").stat().st_mode) == file_mode


def test_a_log_appends_and_an_existing_one_gets_the_run_mode_again(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    path = logs / "msrun_node0.log"
    path.write_bytes(b"attempt 0\n")
    os.chmod(path, 0o666)
    fd = open_log_fd(path)
    try:
        os.write(fd, b"attempt 1\n")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"attempt 0\nattempt 1\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_missing_folder_is_made(tmp_path):
    fd = open_log_fd(str(tmp_path / "run" / "logs" / "scheduler.log"))
    os.close(fd)
    assert (tmp_path / "run" / "logs" / "scheduler.log").is_file()
