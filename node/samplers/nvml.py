"""NVIDIA GPUs through NVML (``pynvml``, from nvidia-ml-py), imported only when used."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .base import MAX_SAMPLE_WARNINGS, Sampler, TelemetryUnavailable, as_float, bytes_to_mb, card_record

__all__ = ["NvmlSampler"]


class NvmlSampler(Sampler):
    """NVIDIA GPUs through NVML (``pynvml``); card ids are NVML indexes (not affected by
    ``CUDA_VISIBLE_DEVICES``)."""

    name = "nvml"
    #: Why NVML is not usable (after :meth:`available` returned False).
    load_error: str | None = None

    def __init__(self) -> None:
        super().__init__()
        try:
            import pynvml
        except ImportError as exc:
            raise TelemetryUnavailable(f"pynvml (nvidia-ml-py) is not installed ({exc})") from None
        self._nv = pynvml
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError subclasses
            raise TelemetryUnavailable(f"NVML could not be initialised: {exc}") from None
        self._open = True
        self._lock = threading.Lock()

    @classmethod
    def available(cls) -> bool:
        try:
            import pynvml
        except ImportError as exc:
            cls.load_error = f"pynvml (nvidia-ml-py) is not installed ({exc})"
            return False
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - any NVML failure means "not available here", said in load_error
            cls.load_error = f"NVML could not be initialised ({exc}); no NVIDIA driver?"
            return False
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - the probe's shutdown: NVML was usable, which is all it asks
            pass
        cls.load_error = None
        return True

    def sample(self) -> list[dict[str, Any]]:
        warnings: list[str] = []
        failed: dict[str, str] = {}
        try:
            with self._lock:
                if not self._open:
                    warnings.append("NVML sampler is closed")
                    return []
                nv = self._nv
                count = nv.nvmlDeviceGetCount()
                records = []
                for i in range(count):
                    records.append(self._read(i, failed))
                return records
        except Exception as exc:  # noqa: BLE001 - a sampler never raises: its failure is a warning of the sample
            warnings.append(f"NVML sampler failed: {type(exc).__name__}: {exc}")
            return []
        finally:
            for what, err in failed.items():
                warnings.append(f"NVML {what} failed ({err}); its values are empty")
            self.last_warnings = warnings[:MAX_SAMPLE_WARNINGS]

    def _read(self, index: int, failed: dict[str, str]) -> dict[str, Any]:
        nv = self._nv

        def get(what: str, fn: Callable[[], Any]) -> Any:
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - NVMLError_NotSupported etc.
                failed.setdefault(what, str(exc))
                return None

        h = get("handle", lambda: nv.nvmlDeviceGetHandleByIndex(index))
        if h is None:
            return card_record(card=index, source=self.name)
        name = get("name", lambda: nv.nvmlDeviceGetName(h))
        if isinstance(name, bytes):
            name = name.decode("utf-8", errors="replace")
        util = get("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h))
        mem = get("memory", lambda: nv.nvmlDeviceGetMemoryInfo(h))
        power = get("power", lambda: nv.nvmlDeviceGetPowerUsage(h))
        temp = get("temperature", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        return card_record(
            card=index,
            name=name,
            util_pct=as_float(getattr(util, "gpu", None)),
            memory_used_mb=bytes_to_mb(getattr(mem, "used", None)),
            memory_total_mb=bytes_to_mb(getattr(mem, "total", None)),
            power_w=None if as_float(power) is None else as_float(power) / 1000.0,
            temp_c=as_float(temp),
            source=self.name,
        )

    def close(self) -> None:
        with self._lock:
            if self._open:
                self._open = False
                try:
                    self._nv.nvmlShutdown()
                except Exception:  # noqa: BLE001 - closing: nothing is left to read, the sampler is done either way
                    pass
