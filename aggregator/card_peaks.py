"""Peak dense TFLOPS of known cards, and which peak a run's MFU is measured against.

MFU (model FLOPs utilisation) = achieved model TFLOPS / the card's peak TFLOPS. The peak is,
in this order (`resolve_peak`):

1. `world.peak_tflops` when it is above 0 (source `config`);
2. the pre-flight card check's measured matmul figure when it ran (`RUN_DIR/preflight.json`:
   the median `matmul_gflops` over the ranks / 1000; source `preflight`). It measures float32
   products on the card itself, so on a CPU, or a card this table does not know, MFU is still
   measured against something real;
3. this table, by the card name the node's telemetry reports (npu-smi's `910B3`, NVML's
   `NVIDIA H100 80GB HBM3`) and the dtype the job computes in (source `table`);
4. none: MFU is shown as "-" and the reason is logged once.

Every figure is a dense (no structured sparsity) tensor/cube-unit peak per card from the
vendor's public material, named beside it. Huawei publishes one figure per chip generation
(and per Atlas product); the per-SKU 910B figures (B1..B4) are the ones Huawei's channel
material and the Ascend community quote, and vary with the firmware's clock: set
`world.peak_tflops` when you know your cards' figure.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

# name pattern (matched case-insensitively against the telemetry's card name), then the
# peak dense TFLOPS per dtype
CARD_PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    # Ascend 910 (910A): 256 TFLOPS FP16, 512 TOPS INT8 — Huawei's Ascend 910 launch, Aug 2019
    # (huawei.com/en/news/2019/8/huawei-ascend-910-most-powerful-ai-processor), Hot Chips 31
    # "DaVinci: A Scalable Architecture for Neural Network Computing" (32 cores x 4096 MAC/cycle).
    ("Ascend 910A", r"^(ascend\s*)?910(a|prob?|premiuma)?$", {"float16": 256.0}),
    # Ascend 910B1..B4: FP16 414 / 376 / 313 / 280 TFLOPS, as quoted for the Atlas 800T A2 and
    # 300T A2 cards' chips in Huawei channel material and the Ascend community (hiascend.com
    # forum); Huawei's Atlas 800T A2 datasheet gives the server's total only.
    ("Ascend 910B1", r"^(ascend\s*)?910b1$", {"float16": 414.0, "bfloat16": 414.0}),
    ("Ascend 910B2", r"^(ascend\s*)?910b2c?$", {"float16": 376.0, "bfloat16": 376.0}),
    ("Ascend 910B3", r"^(ascend\s*)?910b3$", {"float16": 313.0, "bfloat16": 313.0}),
    ("Ascend 910B4", r"^(ascend\s*)?910b4(-1)?$", {"float16": 280.0, "bfloat16": 280.0}),
    # Ascend 910_93 (Atlas A3 / 910C, two dies per package; npu-smi shows one chip per die):
    # about 752 TFLOPS BF16/FP16 dense per package, 376 per die — Huawei, "Serving Large Language
    # Models on Huawei CloudMatrix384" (arXiv:2506.12708, 2025), section on the Ascend 910C.
    ("Ascend 910_93 (A3)", r"^(ascend\s*)?(910_?93|910c)", {"float16": 376.0, "bfloat16": 376.0}),
    # Ascend 310P3 (Atlas 300I Pro / 300V Pro): 70 TFLOPS FP16, 140 TOPS INT8 per card —
    # Huawei Atlas 300I Pro inference card datasheet (e.huawei.com, Atlas 300I Pro).
    ("Ascend 310P", r"^(ascend\s*)?310p", {"float16": 70.0, "int8": 140.0}),
    # Ascend 310B (Atlas 200I A2 module): 10 TFLOPS FP16, 20 TOPS INT8 — Huawei Atlas 200I A2
    # acceleration module datasheet (e.huawei.com, Atlas 200I A2).
    ("Ascend 310B", r"^(ascend\s*)?310b", {"float16": 10.0, "int8": 20.0}),
    # Ascend 310: 8 TFLOPS FP16, 16 TOPS INT8 — HiSilicon Ascend 310 product page
    # (hisilicon.com/en/products/Ascend/Ascend-310).
    ("Ascend 310", r"^(ascend\s*)?310$", {"float16": 8.0, "int8": 16.0}),
    # NVIDIA H200 SXM: 989 TFLOPS BF16/FP16 dense, 494 TF32, 67 FP32 — NVIDIA H200 Tensor
    # Core GPU datasheet (nvidia.com/en-us/data-center/h200); the NVL variant 835 BF16 dense.
    ("NVIDIA H200 NVL", r"h200\s*nvl", {"bfloat16": 835.0, "float16": 835.0, "tf32": 417.0, "float32": 60.0}),
    ("NVIDIA H200", r"h200", {"bfloat16": 989.0, "float16": 989.0, "tf32": 494.0, "float32": 67.0}),
    # NVIDIA H100: SXM 989 BF16/FP16 dense, 494 TF32, 67 FP32; PCIe 756 / 378 / 51; NVL 835 /
    # 417 / 60 — NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100).
    ("NVIDIA H100 PCIe", r"h100\s*pcie", {"bfloat16": 756.0, "float16": 756.0, "tf32": 378.0, "float32": 51.0}),
    ("NVIDIA H100 NVL", r"h100\s*nvl", {"bfloat16": 835.0, "float16": 835.0, "tf32": 417.0, "float32": 60.0}),
    ("NVIDIA H100", r"h100", {"bfloat16": 989.0, "float16": 989.0, "tf32": 494.0, "float32": 67.0}),
    # NVIDIA A100 (SXM and PCIe): 312 TFLOPS BF16/FP16 dense, 156 TF32, 19.5 FP32 — NVIDIA A100
    # Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100).
    ("NVIDIA A100", r"a100", {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5}),
)


def card_peak(name: str | None, dtype: str = "float16") -> tuple[str, float] | None:
    """(the card's table name, its peak dense TFLOPS in `dtype`) for a telemetry card name;
    None for a card (or a dtype of it) the table does not know. Model training computes its
    matmuls in the half-precision dtype (`float16`/`bfloat16`), the default."""
    if not name:
        return None
    key = re.sub(r"\s+", " ", str(name).strip().lower())
    for label, pattern, peaks in CARD_PEAKS:
        if re.search(pattern, key):
            peak = peaks.get(dtype)
            return (label, peak) if peak else None
    return None


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


def resolve_peak(configured: float, run_dir: Path | str | None, card_names: list[str],
                 dtype: str = "float16") -> tuple[float | None, str]:
    """(peak TFLOPS per card or None, where it came from — or why there is none)."""
    if configured and configured > 0:
        return float(configured), "config (world.peak_tflops)"
    if run_dir is not None:
        measured = preflight_peak(run_dir)
        if measured is not None:
            return measured, "preflight (median float32 matmul, preflight.json)"
    names = sorted({n for n in card_names if n})
    known = [(n, card_peak(n, dtype)) for n in names]
    hits = {hit for _, hit in known if hit is not None}
    if len(hits) == 1:
        (label, peak), = hits
        return peak, f"table ({label}, {dtype})"
    if len(hits) > 1:  # mixed cards: the slowest card's peak (every step waits for it)
        label, peak = min(hits, key=lambda h: h[1])
        return peak, f"table ({label}, {dtype}; mixed cards: the lowest peak)"
    if not names:
        return None, ("no peak: no card name reported yet, no pre-flight check ran and world.peak_tflops is 0; "
                      "set world.peak_tflops or preflight.enabled=true")
    return None, (f"no peak: card {', '.join(names)} is not in the table of known cards, no pre-flight check ran "
                  "and world.peak_tflops is 0; set world.peak_tflops or preflight.enabled=true")


def peak_dtype(script: str = "") -> str:
    """The dtype the job's matmuls run in, for the table: the built-in recipe computes in
    float32 on every device; a script's model is taken to compute in half precision."""
    return "float16" if script else "float32"
