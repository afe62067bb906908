"""Peak dense TFLOPS of known cards, each with its vendor source, and which peak a run's MFU is
measured against.

MFU (model FLOPs utilisation) = achieved model TFLOPS / the card's peak TFLOPS. The peak is,
in this order (`resolve_peak`):

1. `world.peak_tflops` when it is above 0 (source `config`);
2. the pre-flight card check's measured matmul figure when it ran (`RUN_DIR/preflight.json`:
   the median `matmul_gflops` over the ranks / 1000; source `preflight`). It measures float32
   products on the card itself, so on a CPU, or a card this table does not know, MFU is still
   measured against something real;
3. this table, by the card name the node's telemetry reports (npu-smi's `910`, NVML's
   `NVIDIA H100 80GB HBM3`) and the dtype the job computes in (`peak_dtype`; source `table`);
4. none: MFU is shown as "-" and the reason is logged once (a card the table does not know, a
   card it knows without a vendor figure, a dtype it has no figure for).

Every figure in `CARD_PEAKS` is a dense (no structured sparsity) peak per card, as printed in
the vendor's public material named beside it (`Source`): NVIDIA marks its Hopper Tensor Core
rows "with sparsity" (2:4 structured sparsity doubles the rate), so the dense figure there is
the printed one / 2. A dtype the source does not print is absent, never
derived from another dtype (bfloat16 is not assumed equal to float16). A card whose figure no
vendor datasheet, product page, white paper or press release gives is in `NO_PUBLIC_PEAK`
instead: recognised by its name, so the reason MFU has no peak can say so, but with no figure.
docs/compute.md ("The peak") lists the same table.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

DTYPES = ("float32", "tf32", "float16", "bfloat16")
"""The dtypes a peak is kept for: `float32` is the card's plain (non-tensor) FP32 rate, `tf32`
NVIDIA's TF32 Tensor Core rate for float32 matmuls, `float16`/`bfloat16` the half-precision
tensor (cube) rate."""

HALF_PRECISION = "float16"
"""The dtype taken for a job whose compute dtype is not known (a user script)."""


@dataclass(frozen=True)
class Source:
    """Where a card's figures come from: the document's title, its public address, and what it
    prints (so that a reader can check the dense figure against the page)."""

    title: str
    url: str
    prints: str


@dataclass(frozen=True)
class CardPeak:
    """One card: its table name, the pattern its telemetry name matches (case-insensitive,
    whitespace folded), its dense peak TFLOPS per dtype and their source."""

    label: str
    pattern: str
    peaks: Mapping[str, float]
    source: Source


@dataclass(frozen=True)
class NoPublicPeak:
    """A card the table recognises but holds no figure for, and why."""

    label: str
    pattern: str
    why: str


def _peaks(**figures: float) -> Mapping[str, float]:
    return MappingProxyType(dict(figures))


_NVIDIA_SPARSITY = ("Tensor Core rows are printed with sparsity (\"* With sparsity\"); the dense figure is "
                    "one half of the printed one")
_A100 = Source(
    "NVIDIA A100 Tensor Core GPU datasheet",
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
    "A100 40GB/80GB PCIe and SXM (one column of compute figures): FP32 19.5 TFLOPS; TF32 Tensor Core "
    "156 TFLOPS | 312 TFLOPS*; BFLOAT16 Tensor Core 312 | 624*; FP16 Tensor Core 312 | 624* "
    "(* with sparsity: the dense figure is printed before it)")
_H100 = Source(
    "NVIDIA H100 Tensor Core GPU datasheet (its SXM and PCIe columns); NVIDIA H100 product page "
    "(technical specifications, its SXM and NVL columns)",
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet ; "
    "https://www.nvidia.com/en-us/data-center/h100/",
    "H100 SXM: FP32 67 TFLOPS, TF32 Tensor Core 989*, BFLOAT16 1,979*, FP16 1,979*; H100 PCIe: FP32 51, "
    "TF32 756*, BFLOAT16 1,513*, FP16 1,513*; H100 NVL: FP32 60, TF32 835*, BFLOAT16 1,671*, FP16 1,671*. "
    + _NVIDIA_SPARSITY)
_H200 = Source(
    "NVIDIA H200 Tensor Core GPU product page (technical specifications) and datasheet",
    "https://www.nvidia.com/en-us/data-center/h200/",
    "H200 SXM: FP32 67 TFLOPS, TF32 Tensor Core 989*, BFLOAT16 1,979*, FP16 1,979*; H200 NVL: FP32 60, "
    "TF32 835*, BFLOAT16 1,671*, FP16 1,671*. " + _NVIDIA_SPARSITY)
_ASCEND_910 = Source(
    "Huawei, \"Huawei launches Ascend 910, the world's most powerful AI processor, and MindSpore, an "
    "all-scenario AI computing framework\" (press release, 23 Aug 2019)",
    "https://www.huawei.com/en/news/2019/8/huawei-ascend-910-most-powerful-ai-processor",
    "\"For half-precision floating point (FP16) operations, Ascend 910 delivers 256 TeraFLOPS. For "
    "integer precision calculations (INT8), it delivers 512 TeraOPS.\" No BF16 or FP32 figure")
_ASCEND_310 = Source(
    "HiSilicon, \"Huawei Launches the First Full-Stack All-Scenario AI Chip and Solution Ascend 310\" "
    "(news release, 10 Oct 2018)",
    "http://www.hisilicon.com/en/Media-Center/News/Key-Information-About-the-Huawei-Ascend310",
    "\"In typical configuration, 16 TOPS@INT8 and 8 TOPS@FP16 can be output\" (8 trillion FP16 "
    "operations per second). No BF16 or FP32 figure")

# Checked in this order, so that a more specific name (H100 PCIe) is tried before a pattern that
# would also match it (H100).
CARD_PEAKS: tuple[CardPeak, ...] = (
    CardPeak("NVIDIA H200 NVL", r"(?<![a-z0-9])h200\s*nvl",
             _peaks(float32=60.0, tf32=417.5, float16=835.5, bfloat16=835.5), _H200),
    # not GH200: a Grace Hopper superchip has its own datasheet
    CardPeak("NVIDIA H200 SXM", r"(?<![a-z0-9])h200(?![0-9a-z])",
             _peaks(float32=67.0, tf32=494.5, float16=989.5, bfloat16=989.5), _H200),
    CardPeak("NVIDIA H100 PCIe", r"(?<![a-z0-9])h100\s*pcie",
             _peaks(float32=51.0, tf32=378.0, float16=756.5, bfloat16=756.5), _H100),
    CardPeak("NVIDIA H100 NVL", r"(?<![a-z0-9])h100\s*nvl",
             _peaks(float32=60.0, tf32=417.5, float16=835.5, bfloat16=835.5), _H100),
    # NVML names the SXM part "NVIDIA H100 80GB HBM3"
    CardPeak("NVIDIA H100 SXM", r"(?<![a-z0-9])h100(?![0-9a-z])",
             _peaks(float32=67.0, tf32=494.5, float16=989.5, bfloat16=989.5), _H100),
    # PCIe and SXM, 40 and 80 GB: one column of compute figures (the RTX A1000 and the A100X are
    # not matched: the datasheet is not theirs)
    CardPeak("NVIDIA A100", r"(?<![a-z0-9])a100(?![0-9a-z])",
             _peaks(float32=19.5, tf32=156.0, float16=312.0, bfloat16=312.0), _A100),
    # the launched Ascend 910 by its base names (npu-smi `910`, CANN's `Ascend910A`); the 910 Pro
    # and Premium bins are not matched: Huawei prints no figure per bin
    CardPeak("Ascend 910", r"^(ascend\s*)?910a?$", _peaks(float16=256.0), _ASCEND_910),
    CardPeak("Ascend 310", r"^(ascend\s*)?310$", _peaks(float16=8.0), _ASCEND_310),
)

NO_PUBLIC_PEAK: tuple[NoPublicPeak, ...] = (
    NoPublicPeak("Ascend 910B", r"^(ascend\s*)?910b\d",
                 "Huawei publishes no peak per 910B chip (B1, B2, B3, B4) in a datasheet, product page or "
                 "press release"),
    NoPublicPeak("Ascend 910C (910_93)", r"^(ascend\s*)?(910_?93|910c)",
                 "Huawei's public 910C figures are per two-die package and differ between its publications, "
                 "and none is per die, the unit npu-smi reports"),
    NoPublicPeak("Ascend 910 Pro/Premium", r"^(ascend\s*)?910(pro|premium)",
                 "Huawei's Ascend 910 launch figure is for the chip, not per Pro/Premium bin"),
    NoPublicPeak("Ascend 310P", r"^(ascend\s*)?310p",
                 "no Huawei datasheet figure per 310P chip could be verified"),
    NoPublicPeak("Ascend 310B", r"^(ascend\s*)?310b",
                 "no Huawei datasheet figure per 310B chip could be verified"),
)


def _key(name: str) -> str:
    return re.sub(r"\s+", " ", str(name).strip().lower())


def identify(name: str | None) -> CardPeak | NoPublicPeak | None:
    """The table's entry for a telemetry card name: its figures, the reason it has none, or None
    for a card the table does not know."""
    if not name:
        return None
    key = _key(name)
    for entry in (*CARD_PEAKS, *NO_PUBLIC_PEAK):
        if re.search(entry.pattern, key):
            return entry
    return None


def card_peak(name: str | None, dtype: str = HALF_PRECISION) -> tuple[str, float] | None:
    """(the card's table name, its dense peak TFLOPS in `dtype`) for a telemetry card name;
    None for a card the table does not know, one it holds no figure for, or a dtype its vendor
    source does not print."""
    entry = identify(name)
    if not isinstance(entry, CardPeak):
        return None
    peak = entry.peaks.get(dtype)
    return (entry.label, peak) if peak else None


def preflight_peak(run_dir: Path | str) -> float | None:
    """The pre-flight check's measured peak per card in TFLOPS (the median matmul GFLOP/s
    over the ranks that did not fail / 1000), or None when it did not run (or measured none)."""
    try:
        report = json.loads((Path(run_dir) / "preflight.json").read_text())
        gflops = (report.get("median") or {}).get("matmul_gflops")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(gflops, (int, float)) and not isinstance(gflops, bool) and math.isfinite(gflops) and gflops > 0:
        return gflops / 1000.0
    return None


_FIX = "set world.peak_tflops or preflight.enabled=true"


def _why_none(name: str, dtype: str) -> str:
    """Why a card name gives no peak in `dtype`."""
    entry = identify(name)
    if isinstance(entry, NoPublicPeak):
        return f"card {name} ({entry.label}) has no vendor-published peak: {entry.why}"
    if isinstance(entry, CardPeak):
        return (f"card {name} ({entry.label}) has no {dtype} figure in its source (it has "
                f"{', '.join(entry.peaks)})")
    return f"card {name} is not in the table of known cards"


def resolve_peak(configured: float, run_dir: Path | str | None, card_names: list[str],
                 dtype: str = HALF_PRECISION) -> tuple[float | None, str]:
    """(peak TFLOPS per card or None, where it came from — or why there is none)."""
    if configured and configured > 0:
        return float(configured), "config (world.peak_tflops)"
    if run_dir is not None:
        measured = preflight_peak(run_dir)
        if measured is not None:
            return measured, "preflight (median float32 matmul, preflight.json)"
    names = sorted({n for n in card_names if n})
    hits = {hit for hit in (card_peak(n, dtype) for n in names) if hit is not None}
    if len(hits) == 1:
        (label, peak), = hits
        return peak, f"table ({label}, {dtype})"
    if len(hits) > 1:  # mixed cards: the slowest card's peak (every step waits for it)
        label, peak = min(hits, key=lambda h: h[1])
        return peak, f"table ({label}, {dtype}; mixed cards: the lowest peak)"
    if not names:
        return None, f"no peak: no card name reported yet, no pre-flight check ran and world.peak_tflops is 0; {_FIX}"
    reasons = "; ".join(_why_none(n, dtype) for n in names)
    return None, f"no peak: {reasons}; no pre-flight check ran and world.peak_tflops is 0; {_FIX}"


def peak_dtype(script: str = "", mindformers_dtype: str | None = None) -> str:
    """The dtype the job's matmuls run in, for the table.

    - a MindFormers job (`mindformers_dtype` not None: its YAML's `model.model_config.compute_dtype`,
      "" when the YAML does not set it): that dtype when it is float32, float16 or bfloat16, else float16,
      MindFormers' own default compute dtype of its model configs;
    - a user script: float16 (its compute dtype is not known; half precision is assumed);
    - the built-in recipe: float32, what it computes in on every device."""
    if mindformers_dtype is not None:
        dtype = str(mindformers_dtype).strip().lower()
        return dtype if dtype in ("float32", "float16", "bfloat16") else HALF_PRECISION
    return HALF_PRECISION if script else "float32"
