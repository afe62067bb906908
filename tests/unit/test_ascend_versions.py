"""The Ascend version readers on real installer files laid out in fake /usr/local/Ascend trees.

The files are copies of what the CANN toolkit, the driver and the firmware write, from public
reports of real machines: tests/fixtures/ascend/README.md names each one's source. The npu-smi
outputs are the captures in tests/fixtures/npu-smi/ (their README names the sources).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mindpulse.frameworks import ascend_versions as av

FIX = Path(__file__).resolve().parent.parent / "fixtures"
ASCEND = FIX / "ascend"
ARCH = "aarch64"


def put(root: Path, rel: str, fixture: str) -> Path:
    dest = root / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ASCEND / fixture, dest)
    return dest


def tree_8_0(root: Path) -> None:
    """CANN <= 8.3: ascend-toolkit/8.0.0/ with `latest` a relative link to it, as the
    toolkit installer makes it."""
    base = "usr/local/Ascend/ascend-toolkit"
    put(root, f"{base}/8.0.0/{ARCH}-linux/ascend_toolkit_install.info", "cann_8.0.0_ascend_toolkit_install.info")
    put(root, f"{base}/8.0.0/version.cfg", "cann_8.0.0_version.cfg")
    os.symlink("8.0.0", root / base / "latest")


def tree_8_5(root: Path, absolute: bool = True) -> None:
    """CANN >= 8.5: cann-8.5.0/ behind the `cann` link, and ascend-toolkit/latest a link to
    the `cann` folder (absolute, as on the node: it must be taken under the root prefix)."""
    put(root, f"usr/local/Ascend/cann-8.5.0/{ARCH}-linux/ascend_toolkit_install.info",
        "cann_8.5.0_ascend_toolkit_install.info")
    os.symlink("cann-8.5.0", root / "usr/local/Ascend/cann")
    (root / "usr/local/Ascend/ascend-toolkit").mkdir(parents=True)
    os.symlink("/usr/local/Ascend/cann" if absolute else "../cann", root / "usr/local/Ascend/ascend-toolkit/latest")


def test_cann_8_0_layout_reads_the_install_info_and_version_cfg(tmp_path):
    tree_8_0(tmp_path)
    c = av.cann_toolkit(tmp_path, ARCH, env={})
    assert c.version == "8.0.0", c
    assert c.layout == "ascend-toolkit"
    assert c.path == f"/usr/local/Ascend/ascend-toolkit/8.0.0/{ARCH}-linux/ascend_toolkit_install.info", c.path
    assert c.version_cfg == "8.0.0"  # toolkit_running_version=[7.6.0.1.220:8.0.0]: the release after the colon
    assert c.detail == "V100R001C20SPC001B251"
    assert c.latest == "/usr/local/Ascend/ascend-toolkit/8.0.0"


def test_cann_8_5_layout_follows_the_absolute_latest_link_into_the_cann_folder(tmp_path):
    tree_8_5(tmp_path)
    c = av.cann_toolkit(tmp_path, ARCH, env={})
    assert c.version == "8.5.0", c
    assert c.layout == "cann"
    assert c.path == f"/usr/local/Ascend/cann-8.5.0/{ARCH}-linux/ascend_toolkit_install.info"
    assert c.latest == "/usr/local/Ascend/cann-8.5.0"
    assert c.version_cfg is None and not any("version.cfg" in m for m in c.missing), \
        "CANN 8.5 has no version.cfg: its absence is not a finding"


def test_cann_8_5_without_the_latest_link(tmp_path):
    """A CANN 8.5 install whose ascend-toolkit/latest link is not there (a container that
    mounts /usr/local/Ascend/cann only) is still found in its own place."""
    put(tmp_path, f"usr/local/Ascend/cann/{ARCH}-linux/ascend_toolkit_install.info",
        "cann_8.5.0_ascend_toolkit_install.info")
    c = av.cann_toolkit(tmp_path, ARCH, env={})
    assert (c.version, c.layout, c.latest) == ("8.5.0", "cann", ""), c
    assert f"/usr/local/Ascend/ascend-toolkit/latest/{ARCH}-linux/ascend_toolkit_install.info" in c.missing


def test_ascend_home_path_is_read_first_as_mindformers_run_check_does(tmp_path):
    tree_8_0(tmp_path)
    put(tmp_path, f"opt/cann83/{ARCH}-linux/ascend_toolkit_install.info", "cann_8.3.RC1_ascend_toolkit_install.info")
    c = av.cann_toolkit(tmp_path, ARCH, env={"ASCEND_HOME_PATH": "/opt/cann83"})
    assert (c.version, c.layout) == ("8.3.RC1", "ASCEND_HOME_PATH"), c
    # the default place's version.cfg is still reported: a user sees the two disagree
    assert c.version_cfg == "8.0.0"


def test_container_with_only_version_cfg(tmp_path):
    """A container that mounts the toolkit's folder without its <arch>-linux part: version.cfg
    alone names the release."""
    base = tmp_path / "usr/local/Ascend/ascend-toolkit"
    put(tmp_path, "usr/local/Ascend/ascend-toolkit/8.0.0/version.cfg", "cann_8.0.0_version.cfg")
    os.symlink("8.0.0", base / "latest")
    c = av.cann_toolkit(tmp_path, ARCH, env={})
    assert c.version == "8.0.0" and c.path.endswith("/8.0.0/version.cfg"), c
    assert any(m.endswith("ascend_toolkit_install.info") for m in c.missing)


def test_nothing_installed_names_every_place_looked_at(tmp_path):
    c = av.cann_toolkit(tmp_path, ARCH, env={})
    assert c.version is None and c.layout == ""
    assert f"/usr/local/Ascend/cann/{ARCH}-linux/ascend_toolkit_install.info" in c.missing
    assert "/usr/local/Ascend/ascend-toolkit/latest/version.cfg" in c.missing
    assert av.driver(tmp_path).version is None
    assert av.driver(tmp_path).missing == ["/usr/local/Ascend/driver/version.info"]
    assert av.firmware(tmp_path).version is None


def test_driver_reads_package_version_before_version(tmp_path):
    put(tmp_path, "usr/local/Ascend/driver/version.info", "driver_25.3.rc1_version.info")
    d = av.driver(tmp_path)
    assert (d.version, d.detail) == ("25.3.rc1", "V100R001C23SPC002B212"), d
    # the two fields disagree on some drivers (Version is then the HAL's number): package_version wins.
    # This file is the real one with its Version line changed to show the order.
    text = (ASCEND / "driver_25.0.rc1.1_version.info").read_text().replace("Version=25.0.rc1.1", "Version=7.35.23")
    (tmp_path / "usr/local/Ascend/driver/version.info").write_text(text)
    assert av.driver(tmp_path).version == "25.0.rc1.1"


def test_older_driver_without_package_version(tmp_path):
    put(tmp_path, "usr/local/Ascend/driver/version.info", "driver_24.1.rc1_version.info")
    assert av.driver(tmp_path).version == "24.1.rc1"


def test_firmware_version_and_its_hdk_package(tmp_path):
    put(tmp_path, "usr/local/Ascend/firmware/version.info", "firmware_7.7.0.1.231_version.info")
    f = av.firmware(tmp_path)
    assert (f.version, f.detail, f.path) == ("7.7.0.1.231", "25.0.rc1.1", "/usr/local/Ascend/firmware/version.info")


def test_container_with_the_driver_file_and_npu_smi_only(tmp_path):
    """The usual container: the driver's version.info and npu-smi mounted, no firmware, no toolkit."""
    put(tmp_path, "usr/local/Ascend/driver/version.info", "driver_25.0.rc1.1_version.info")
    smi = tmp_path / "usr/local/sbin/npu-smi"
    smi.parent.mkdir(parents=True)
    smi.write_text("#!/bin/sh\ncat " + str(FIX / "npu-smi" / "info_910b3_a2_8cards_busy.txt") + "\n")
    smi.chmod(0o755)
    assert av.driver(tmp_path).version == "25.0.rc1.1"
    assert av.firmware(tmp_path).version is None
    assert av.cann_toolkit(tmp_path, ARCH, env={}).version is None
    s = av.npu_smi(tmp_path)
    assert (s.path, s.version, s.error) == ("/usr/local/sbin/npu-smi", "24.1.0", ""), s


def test_npu_smi_version_from_real_headers():
    assert av.npu_smi_version((FIX / "npu-smi" / "info_910b3_a2_8cards_busy.txt").read_text()) == "24.1.0"
    assert av.npu_smi_version((FIX / "npu-smi" / "info_910b4-1_masked_busid_partial.txt").read_text()) == "25.2.0"
    assert av.npu_smi_version((FIX / "npu-smi" / "t_board_910b.txt").read_text()) is None  # no header in -t board


def test_npu_smi_missing_and_failing(tmp_path):
    assert av.npu_smi(tmp_path).path is None and "no npu-smi" in av.npu_smi(tmp_path).error
    smi = tmp_path / "usr/local/bin/npu-smi"
    smi.parent.mkdir(parents=True)
    smi.write_text("#!/bin/sh\necho 'dcmi module initialize failed. ret is -8005' >&2\nexit 1\n")
    smi.chmod(0o755)
    s = av.npu_smi(tmp_path)
    assert s.path == "/usr/local/bin/npu-smi" and s.version is None
    assert "exited 1" in s.error and "-8005" in s.error, s


def test_this_machine_has_none_of_it():
    """The machine the suite runs on has no Ascend software: every reader says so, none raises."""
    if Path("/usr/local/Ascend").exists():
        import pytest

        pytest.skip("this machine has /usr/local/Ascend")
    c = av.cann_toolkit("/", env={})
    assert c.version is None and c.missing
    assert av.driver("/").version is None


def test_round_trip_through_dicts(tmp_path):
    tree_8_5(tmp_path)
    c = av.cann_toolkit(tmp_path, ARCH, env={})
    assert av.CannToolkit.from_dict(c.to_dict()) == c
