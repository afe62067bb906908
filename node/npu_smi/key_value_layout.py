"""The ``key : value`` listings of ``npu-smi info -t usages|power|temp|memory|board|common|
health -i N [-c CHIP]``.

Each listing starts at its ``NPU ID`` line; ``Chip ID`` lines split it into chips (before
or after a chip's values, depending on the driver). These listings give usage *rates*:
used memory is derived as capacity * rate / 100, so it has whole-percent resolution.
Several listings of one card are combined with
:func:`mindpulse.node.npu_smi.merge.merge_cards`.
"""

from __future__ import annotations

from typing import Any

from .values import Converter, NpuCard, WarningLog, excerpt

# Normalised key (lower case, no whitespace) -> internal slot.  Slots starting with
# ``_`` are combined into card fields after a block has been read.
_KV_FIELDS: dict[str, str] = {
    "hbmcapacity(mb)": "hbm_total_mb",
    "hbmusagerate(%)": "_hbm_rate",
    "ddrcapacity(mb)": "memory_total_mb",
    "ddrusagerate(%)": "_mem_rate",
    "memorycapacity(mb)": "memory_total_mb",
    "memoryusagerate(%)": "_mem_rate",
    # -t memory on DDR boards: "Capacity(MB)" is what applications can use and matches
    # "Memory Capacity(MB)" of -t usages; "Total Capacity(MB)" (physical, incl. what the
    # OS reserves) is ignored.
    "capacity(mb)": "memory_total_mb",
    "aicoreusagerate(%)": "aicore_pct",
    "npureal-timepower(w)": "power_w",
    "real-timepower(w)": "power_w",
    "power(w)": "power_w",
    "nputemperature(c)": "temp_c",
    "temperature(c)": "temp_c",
    "chiptemperature(c)": "temp_c",
    "pciebusinfo": "bus_id",
    "productname": "_product_name",
    "chipname": "_chip_name",
    "healthstatus": "health",
    "health": "health",
    "phy-id": "phy_id",
    "phyid": "phy_id",
    "chipphy-id": "phy_id",
    "chipphyid": "phy_id",
}

# Keys that are understood and deliberately not used.
_KV_IGNORED = frozenset(
    {
        "chipcount", "model", "manufacturer", "serialnumber", "softwareversion",
        "firmwareversion", "compatibility", "boardid", "pcbid", "bomid", "slotid",
        "classid", "pcivendorid", "pcideviceid", "subsystemvendorid", "subsystemdeviceid",
        "chiptype", "chipversion", "chippositionid", "vdieid", "ndieid",
        "ddrhugepagestotal(page)", "ddrhugepagesusagerate(%)", "hugepagestotal(page)",
        "hugepagesusagerate(%)", "aivectorusagerate(%)", "aicpuusagerate(%)",
        "ctrlcpuusagerate(%)", "ddrbandwidthusagerate(%)", "hbmbandwidthusagerate(%)",
        "memorybandwidthusagerate(%)", "npuutilization(%)", "aicubeusagerate(%)",
        "vectorcoreusagerate(%)", "powerdissipation(w)", "ratedpower(w)", "lm75a_te(c)",
        "lm75b_te(c)", "lm75c_te(c)", "tec_temp(c)", "ntc_te(c)", "clockspeed(mhz)",
        "ddrclockspeed(mhz)", "hbmclockspeed(mhz)", "hbmtemperature(c)",
        "hbmmanufacturerid", "ddrmanufacturerid", "aicorefreq(mhz)", "aicorecurfreq(mhz)",
        "aicorecount", "aicpucount", "ctrlcpucount", "voltage(v)", "healthstatusdetail",
        "errorcode", "errorinformation", "totalcapacity(mb)",
    }
)

_KV_FLOAT_SLOTS = frozenset(
    {"hbm_total_mb", "_hbm_rate", "memory_total_mb", "_mem_rate", "aicore_pct", "power_w",
     "temp_c"}
)


def _norm_key(key: str) -> str:
    return "".join(key.lower().split())


class _KvGroup:
    def __init__(self, lineno: int, npu: int | None) -> None:
        self.lineno = lineno
        self.npu = npu
        self.entries: list[tuple[int, str, str, str]] = []  # lineno, normkey, rawkey, value


def parse_key_values(lines: list[tuple[int, str]], warn: WarningLog) -> list[NpuCard]:
    """Cards of the ``key : value`` lines (with their line numbers) of one input."""
    conv = Converter(warn)
    groups: list[_KvGroup] = []
    cur: _KvGroup | None = None
    for lineno, s in lines:
        key, _, value = s.partition(":")
        nk = _norm_key(key)
        if not nk or len(nk) > 80:
            warn.add(lambda lineno=lineno, s=s: f"line {lineno}: not understood: {excerpt(s)}")
            continue
        if nk == "npuid":
            cur = _KvGroup(lineno, conv.integer(value, lineno, "NPU ID"))
            groups.append(cur)
            continue
        if nk not in _KV_FIELDS and nk not in _KV_IGNORED and nk != "chipid":
            warn.add(lambda lineno=lineno, key=key:
                     f"line {lineno}: key {excerpt(key.strip())} not recognised; ignored")
            continue
        if cur is None:
            warn.add(
                f"line {lineno}: key:value lines before any 'NPU ID' line; NPU id unknown"
            )
            cur = _KvGroup(lineno, None)
            groups.append(cur)
        cur.entries.append((lineno, nk, key.strip(), value.strip()))

    cards: list[NpuCard] = []
    for g in groups:
        cards.extend(_kv_group_cards(g, conv, warn))
    return cards


def _kv_group_cards(g: _KvGroup, conv: Converter, warn: WarningLog) -> list[NpuCard]:
    entries = g.entries
    chip_pos = [i for i, e in enumerate(entries) if e[1] == "chipid"]
    metric_pos = [i for i, e in enumerate(entries) if e[1] in _KV_FIELDS]
    chip_count: int | None = None
    for lineno, nk, _, value in entries:
        if nk == "chipcount":
            chip_count = conv.integer(value, lineno, "Chip Count")
            break

    # Which chip block does each entry belong to?  Real output puts "Chip ID" either
    # before the chip's values (310B) or after them (910B, 25.x), so look at the order.
    owner: list[int] = [0] * len(entries)  # index into chip_pos, -1 = no chip id at all
    if not chip_pos:
        owner = [-1] * len(entries)
    else:
        trailing = bool(metric_pos) and metric_pos[0] < chip_pos[0]
        j = 0
        if trailing:
            for i in range(len(entries)):
                while j < len(chip_pos) - 1 and chip_pos[j] < i:
                    j += 1
                owner[i] = j
        else:
            for i in range(len(entries)):
                while j < len(chip_pos) - 1 and chip_pos[j + 1] <= i:
                    j += 1
                owner[i] = j

    blocks: dict[int, dict[str, Any]] = {}
    order: list[int] = []
    chips: dict[int, int | None] = {}
    mcu = False
    for i, (lineno, nk, rawkey, value) in enumerate(entries):
        b = owner[i]
        if b not in blocks:
            blocks[b] = {}
            order.append(b)
        slots = blocks[b]
        if nk == "chipid":
            chips[b] = conv.integer(value, lineno, "Chip ID")
            mcu = False
            continue
        slot = _KV_FIELDS.get(nk)
        if slot is None:
            continue
        if slot == "_chip_name" and value.strip().lower() == "mcu":
            # values after "Chip Name : MCU" belong to the board's MCU, not the NPU chip
            mcu = True
            continue
        if mcu:
            continue
        if slot in _KV_FLOAT_SLOTS:
            v: Any = conv.number(value, lineno, rawkey)
        elif slot == "phy_id":
            v = conv.integer(value, lineno, rawkey)
        elif slot == "bus_id":
            v = conv.bus_id(value, lineno)
        elif slot == "health":
            v = conv.health(value, lineno)
        else:
            v = conv.text(value)
        if slot in slots:
            if v is not None and slots[slot] is not None and slots[slot] != v:
                warn.add(
                    f"line {lineno}: {rawkey} given twice for NPU {g.npu}; first value kept"
                )
            if slots[slot] is None:
                slots[slot] = v
            continue
        slots[slot] = v

    if not blocks:
        blocks[-1] = {}
        order.append(-1)
    cards: list[NpuCard] = []
    for b in order:
        slots = blocks[b]
        if b == -1:
            chip = 0 if chip_count == 1 else None
        else:
            chip = chips.get(b)
        card = NpuCard(npu=g.npu, chip=chip)
        for slot, v in slots.items():
            if not slot.startswith("_"):
                setattr(card, slot, v)
        # usages/common only give a rate: used = capacity * rate / 100 (whole-percent
        # resolution, so accurate to about 1% of capacity)
        rate = slots.get("_hbm_rate")
        if rate is not None and card.hbm_total_mb is not None:
            card.hbm_used_mb = card.hbm_total_mb * rate / 100.0
        rate = slots.get("_mem_rate")
        if rate is not None and card.memory_total_mb is not None:
            card.memory_used_mb = card.memory_total_mb * rate / 100.0
        card.name = slots.get("_chip_name") or slots.get("_product_name")
        if not slots:
            warn.add(f"line {g.lineno}: NPU {g.npu}: no values recognised")
        cards.append(card)
    return cards

