"""Ascend cards through Huawei's ``libdcmi.so`` (the library ``npu-smi`` itself uses), via
ctypes; used only where the library loads and ``dcmi_init`` returns 0."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from typing import Any

from .base import MAX_SAMPLE_WARNINGS, Sampler, TelemetryUnavailable, card_record

log = logging.getLogger(__name__)

__all__ = ["DcmiSampler"]


class _DcmiHbmInfo(ctypes.Structure):
    _fields_ = [
        ("memory_size", ctypes.c_ulonglong),  # MB
        ("freq", ctypes.c_uint),
        ("memory_usage", ctypes.c_ulonglong),  # MB
        ("temp", ctypes.c_int),
        ("bandwith_util_rate", ctypes.c_uint),
        ("_pad", ctypes.c_ubyte * 256),  # room in case a driver's struct is larger
    ]


class _DcmiMemoryInfoV3(ctypes.Structure):
    _fields_ = [
        ("memory_size", ctypes.c_ulonglong),  # MB
        ("memory_available", ctypes.c_ulonglong),
        ("freq", ctypes.c_uint),
        ("hugepagesize", ctypes.c_ulong),
        ("hugepages_total", ctypes.c_ulong),
        ("hugepages_free", ctypes.c_ulong),
        ("utiliza", ctypes.c_uint),  # %
        ("reserve", ctypes.c_ubyte * 60),
        ("_pad", ctypes.c_ubyte * 256),
    ]


class _DcmiChipInfo(ctypes.Structure):
    _fields_ = [
        ("chip_type", ctypes.c_ubyte * 32),
        ("chip_name", ctypes.c_ubyte * 32),
        ("chip_ver", ctypes.c_ubyte * 32),
        ("aicore_cnt", ctypes.c_uint),
        ("_pad", ctypes.c_ubyte * 256),
    ]


_DCMI_HEALTH = {0: "OK", 1: "Warning", 2: "Alarm", 3: "Critical"}
_DCMI_UTIL_AICORE = 2
_DCMI_MAX_CARDS = 64

_INT_P = ctypes.POINTER(ctypes.c_int)
_UINT_P = ctypes.POINTER(ctypes.c_uint)
_DCMI_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "dcmi_init": (),
    "dcmi_get_card_list": (_INT_P, _INT_P, ctypes.c_int),
    "dcmi_get_card_num_list": (_INT_P, _INT_P, ctypes.c_int),
    "dcmi_get_device_num_in_card": (ctypes.c_int, _INT_P),
    "dcmi_get_device_id_in_card": (ctypes.c_int, _INT_P, _INT_P, _INT_P),
    "dcmi_get_device_logic_id": (_INT_P, ctypes.c_int, ctypes.c_int),
    "dcmi_get_device_phyid_from_logicid": (ctypes.c_uint, _UINT_P),
    "dcmi_get_device_utilization_rate": (ctypes.c_int, ctypes.c_int, ctypes.c_int, _UINT_P),
    "dcmi_get_device_power_info": (ctypes.c_int, ctypes.c_int, _INT_P),
    "dcmi_get_device_temperature": (ctypes.c_int, ctypes.c_int, _INT_P),
    "dcmi_get_device_health": (ctypes.c_int, ctypes.c_int, _UINT_P),
    "dcmi_get_device_hbm_info": (ctypes.c_int, ctypes.c_int, ctypes.POINTER(_DcmiHbmInfo)),
    "dcmi_get_device_memory_info_v3": (ctypes.c_int, ctypes.c_int, ctypes.POINTER(_DcmiMemoryInfoV3)),
    "dcmi_get_device_chip_info": (ctypes.c_int, ctypes.c_int, ctypes.POINTER(_DcmiChipInfo)),
}


def _c_text(arr: Any) -> str | None:
    s = bytes(arr).split(b"\0", 1)[0].decode("utf-8", errors="replace").strip()
    return s or None


class DcmiSampler(Sampler):
    """Ascend cards through ``libdcmi.so`` (the library ``npu-smi`` itself uses), via ctypes.

    Opt-in by construction: :meth:`available` is true only when the library loads and
    ``dcmi_init()`` returns 0, and :func:`pick_sampler` keeps it only when a trial read
    returns values. Signatures follow the DCMI API reference (power in 0.1 W, memory in
    MB, utilisation type 2 = AI Core); a call that fails leaves its value ``None``.
    ``lib`` replaces the loaded library (tests).
    """

    name = "dcmi"
    LIBRARY_PATHS: tuple[str, ...] = (
        "/usr/local/Ascend/driver/lib64/driver/libdcmi.so",
        "/usr/local/dcmi/libdcmi.so",
        "/usr/local/Ascend/driver/lib64/libdcmi.so",
    )
    _class_lock = threading.Lock()
    _loaded: Any = None
    _load_tried = False
    #: Why the library is not usable (after :meth:`available` returned False).
    load_error: str | None = None

    def __init__(self, lib: Any = None) -> None:
        super().__init__()
        if lib is None:
            lib = self._load()
            if lib is None:
                raise TelemetryUnavailable(f"DCMI is not usable: {self.load_error}")
        self._lib = lib

    @classmethod
    def _library_candidates(cls) -> list[str]:
        out = [p for p in cls.LIBRARY_PATHS if os.path.exists(p)]
        found = ctypes.util.find_library("dcmi")
        if found:
            out.append(found)
        return out

    @classmethod
    def _load(cls) -> Any:
        with cls._class_lock:
            if cls._load_tried:
                return cls._loaded
            cls._load_tried = True
            candidates = cls._library_candidates()
            if not candidates:
                cls.load_error = ("libdcmi.so not found (looked in " + ", ".join(cls.LIBRARY_PATHS)
                                  + " and the linker's search path)")
                return None
            errors = []
            for path in candidates:
                try:
                    lib = ctypes.CDLL(path)
                except OSError as exc:
                    errors.append(f"{path}: {exc}")
                    continue
                for fn, argtypes in _DCMI_SIGNATURES.items():
                    f = getattr(lib, fn, None)
                    if f is not None:
                        f.argtypes = list(argtypes)
                        f.restype = ctypes.c_int
                if getattr(lib, "dcmi_init", None) is None:
                    errors.append(f"{path}: no dcmi_init")
                    continue
                try:
                    rc = lib.dcmi_init()
                except Exception as exc:  # noqa: BLE001 - a library that fails to start is one reason among the paths tried
                    errors.append(f"{path}: dcmi_init failed ({exc})")
                    continue
                if rc != 0:
                    errors.append(f"{path}: dcmi_init returned {rc}")
                    continue
                cls._loaded = lib
                cls.load_error = None
                return lib
            cls.load_error = "; ".join(errors)
            return None

    @classmethod
    def available(cls) -> bool:
        return cls._load() is not None

    def _call(self, fn: str, *args: Any, errors: dict[str, int]) -> bool:
        f = getattr(self._lib, fn, None)
        if f is None:
            errors.setdefault(fn, -1)
            return False
        try:
            rc = f(*args)
        except Exception:  # noqa: BLE001 - wrong argument types and the like
            errors.setdefault(fn, -2)
            return False
        if rc != 0:
            errors.setdefault(fn, int(rc))
            return False
        return True

    def sample(self) -> list[dict[str, Any]]:
        warnings: list[str] = []
        try:
            with self._class_lock:
                return self._sample(warnings)
        except Exception as exc:  # noqa: BLE001 - a sampler never raises: its failure is a warning of the sample
            log.exception("DCMI sampler failed")
            warnings.append(f"DCMI sampler failed: {type(exc).__name__}: {exc}")
            return []
        finally:
            self.last_warnings = warnings[:MAX_SAMPLE_WARNINGS]

    def _card_ids(self, errors: dict[str, int]) -> list[int]:
        num = ctypes.c_int(0)
        ids = (ctypes.c_int * _DCMI_MAX_CARDS)()
        for fn in ("dcmi_get_card_list", "dcmi_get_card_num_list"):
            if getattr(self._lib, fn, None) is None:
                continue
            if self._call(fn, ctypes.byref(num), ids, _DCMI_MAX_CARDS, errors=errors):
                errors.pop("dcmi_get_card_list", None)
                n = max(0, min(num.value, _DCMI_MAX_CARDS))
                return [ids[i] for i in range(n)]
        return []

    def _chip_ids(self, card: int, errors: dict[str, int]) -> list[int]:
        # device_id_max NPU chips (0..max-1); the MCU and CPU have their own ids
        dmax, mcu, cpu = ctypes.c_int(0), ctypes.c_int(-1), ctypes.c_int(-1)
        if getattr(self._lib, "dcmi_get_device_id_in_card", None) is not None and self._call(
            "dcmi_get_device_id_in_card", card, ctypes.byref(dmax), ctypes.byref(mcu),
            ctypes.byref(cpu), errors=errors
        ):
            skip = {mcu.value, cpu.value}
            return [d for d in range(max(0, min(dmax.value, 64))) if d not in skip]
        errors.pop("dcmi_get_device_id_in_card", None)
        num = ctypes.c_int(0)
        if self._call("dcmi_get_device_num_in_card", card, ctypes.byref(num), errors=errors):
            return list(range(max(0, min(num.value, 64))))
        return []

    def _sample(self, warnings: list[str]) -> list[dict[str, Any]]:
        errors: dict[str, int] = {}
        records = []
        for card in self._card_ids(errors):
            for dev in self._chip_ids(card, errors):
                records.append(self._read_chip(card, dev, errors))
        for fn, rc in errors.items():
            what = {-1: "missing from the library", -2: "could not be called"}.get(rc, f"returned {rc}")
            warnings.append(f"DCMI {fn} {what}; its values are empty")
        if not records and not errors:
            warnings.append("DCMI lists no NPU cards")
        return records

    def _read_chip(self, card: int, dev: int, errors: dict[str, int]) -> dict[str, Any]:
        logic, phy = ctypes.c_int(-1), ctypes.c_uint(0)
        card_id: int | None = None
        if self._call("dcmi_get_device_logic_id", ctypes.byref(logic), card, dev, errors=errors):
            card_id = logic.value
            if self._call("dcmi_get_device_phyid_from_logicid", ctypes.c_uint(logic.value),
                          ctypes.byref(phy), errors=errors):
                card_id = int(phy.value)
        u = ctypes.c_uint(0)
        util = float(u.value) if self._call("dcmi_get_device_utilization_rate", card, dev,
                                            _DCMI_UTIL_AICORE, ctypes.byref(u), errors=errors) else None
        p = ctypes.c_int(0)
        power = p.value / 10.0 if self._call("dcmi_get_device_power_info", card, dev,
                                             ctypes.byref(p), errors=errors) else None
        t = ctypes.c_int(0)
        temp = float(t.value) if self._call("dcmi_get_device_temperature", card, dev,
                                            ctypes.byref(t), errors=errors) else None
        h = ctypes.c_uint(0)
        health = (_DCMI_HEALTH.get(h.value, "UNKNOWN")
                  if self._call("dcmi_get_device_health", card, dev, ctypes.byref(h), errors=errors)
                  else None)
        used = total = None
        hbm = _DcmiHbmInfo()
        if self._call("dcmi_get_device_hbm_info", card, dev, ctypes.byref(hbm), errors=errors) \
                and hbm.memory_size > 0:
            total, used = float(hbm.memory_size), float(hbm.memory_usage)
        else:
            errors.pop("dcmi_get_device_hbm_info", None)  # DDR boards have no HBM
            mem = _DcmiMemoryInfoV3()
            if self._call("dcmi_get_device_memory_info_v3", card, dev, ctypes.byref(mem),
                          errors=errors) and mem.memory_size > 0:
                total = float(mem.memory_size)
                used = round(total * min(mem.utiliza, 100) / 100.0, 1)
        chip = _DcmiChipInfo()
        name = None
        if self._call("dcmi_get_device_chip_info", card, dev, ctypes.byref(chip), errors=errors):
            name = _c_text(chip.chip_name)
        return card_record(card=card_id, chip=dev, name=name, health=health, util_pct=util,
                           memory_used_mb=used, memory_total_mb=total, power_w=power,
                           temp_c=temp, source=self.name)
