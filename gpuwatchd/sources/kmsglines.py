"""The kernel log's records (/dev/kmsg) and the lines operators act on, parsed.

A read of /dev/kmsg returns one record (Documentation/ABI/testing/dev-kmsg):
`<prio>,<seq>,<usec>,<flags>[,...];<text>\\n` then optional continuation lines
` KEY=value\\n` (the device's dictionary: SUBSYSTEM=, DEVICE=). prio is facility * 8 +
level; seq numbers records without gaps unless some were overwritten; the text escapes
non-printable bytes and backslashes as `\\xNN`.

`classify` turns one line's text into a `Line`, or None for the lines nobody acts on.
The shapes are the drivers' own format strings (the NVIDIA driver's Xid, the NVSwitch
driver's SXid `%05d, Fatal|Non-fatal, Link %02d ...`, the kernel's AER, NVMe, mlx5e and
OOM killer messages), matched on what they keep across versions; tests/fixtures/kmsg
holds real captured lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KERNEL_FACILITY = 0  # /dev/kmsg writers from user space get facility 1 (LOG_USER)
MESSAGE_CHARS = 200  # the driver text kept as evidence

# what a line says about a GPU (kmsg_gpu_events_total's `event`, a closed list)
GPU_EVENTS = (
    "xid", "fallen_off_bus", "aer_correctable", "aer_nonfatal", "aer_fatal",
    "nvswitch_nonfatal", "nvswitch_fatal", "oom_kill_main", "oom_kill_worker",
)  # fmt: skip

_HEX_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")
_BUS = r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}"  # domain:bus:device
_BDF = _BUS + r"\.[0-7]"
# NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, name=nvidia-smi, Timeout after 6s ...
# (a MIG GPU instance's: "(PCI:0000:c1:00 GPU-I:05)"; drivers before R470 have no pid)
_XID = re.compile(
    rf"NVRM: Xid \(PCI:({_BUS})(?:\.[0-7])?(?: GPU-I:\d+)?\): (\d{{1,5}}),\s*"
    r"(?:pid=('?<unknown>'?|\d{1,10}),\s*)?(?:name=([^,]{0,64}),\s*)?(.*)"
)
# nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress ... (the
# lines after it, "..., Severity 0 Engine instance 32 ..." and "..., Data {...}", are
# its details: no severity word, not counted again)
_SXID = re.compile(
    rf"(nvidia-nvswitch\d{{1,3}}): SXid \(PCI:({_BDF})\): (\d{{1,6}}), "
    r"(Fatal|Non-fatal), (?:Link (\d{1,3})\b ?)?(.*)"
)
_FALLEN = re.compile(rf"NVRM: GPU ({_BDF}): GPU has fallen off the bus")
# nvidia 0000:3b:00.0: AER: PCIe Bus Error: severity=Corrected, type=Physical Layer, ...
# (kernels before 6.x say Uncorrected, later Uncorrectable; before 4.19 no "AER: ")
_AER = re.compile(
    rf"\S+ ({_BDF}): (?:AER: )?PCIe Bus Error: "
    r"severity=(Correct\w+|Uncorrect\w+ \((?:Non-)?Fatal\))"
)
_AER_SEVERITY = {"(Non-Fatal)": "aer_nonfatal", "(Fatal)": "aer_fatal"}
# nvme nvme0: I/O 123 QID 4 timeout, aborting  /  I/O tag 12 (...) QID 5 timeout, reset ...
_NVME = re.compile(r"nvme (nvme\d{1,4}): I/O .{0,120}\btimeout\b")
# mlx5_core 0000:0c:00.0 ens1f0np0: Link down
_MLX5 = re.compile(rf"mlx5_core ({_BDF})(?: \S+)?: Link (up|down)$")
# Out of memory: Killed process 3100003 (pt_data_worker) total-vm:..., anon-rss:...
# (a cgroup's limit: "Memory cgroup out of memory: Killed process ...")
_KILLED = re.compile(r"(?:^|: )Killed process (\d{1,10}) \((.{0,64}?)\)(?: total-vm:|,|$)")
# oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=...,task_memcg=/...,
# task=pt_data_worker,pid=3100003,uid=1000 (printed just before the kill)
_OOM_SUMMARY = re.compile(r"oom-kill:(.*)")


@dataclass(frozen=True)
class Record:
    facility: int
    level: int
    seq: int
    usec: int
    text: str


@dataclass(frozen=True)
class Line:
    """A line that matters: its kind and what it names."""

    kind: str  # xid, sxid, fallen_off_bus, aer, nvme_timeout, nic_link, oom_kill, oom_summary
    device: str = ""  # the PCI address (GPU, NVSwitch, function, NIC), NVMe controller
    code: str = ""  # Xid / SXid number; aer: its event; nic_link: up/down
    pid: str = ""
    process: str = ""
    message: str = ""  # the driver's own words
    fatal: bool = False  # SXid: Fatal
    link: str = ""  # SXid: the switch port
    switch: str = ""  # SXid: nvidia-nvswitchN
    fields: tuple[tuple[str, str], ...] = ()  # oom_summary: its key=value pairs


def parse_record(data: bytes) -> Record | None:
    """One /dev/kmsg record, or None if it is not one (the continuation lines dropped)."""
    header, sep, rest = data.partition(b";")
    fields = header.split(b",")
    if not sep or len(fields) < 4:
        return None
    try:
        prio, seq, usec = int(fields[0]), int(fields[1]), int(fields[2])
    except ValueError:
        return None
    if prio < 0 or seq < 0:
        return None
    first = rest.split(b"\n", 1)[0]
    text = _HEX_ESCAPE.sub(lambda m: bytes([int(m.group(1), 16)]), first)
    return Record(prio >> 3, prio & 7, seq, usec, text.decode("utf-8", "replace"))


def bus_id(pci: str) -> str:
    """A PCI address in sysfs form ("0000:9b:00.0"); the Xid's "0000:9b:00" gets .0."""
    domain, _, rest = pci.lower().partition(":")
    address = f"{int(domain, 16):04x}:{rest}"
    return address if "." in rest else address + ".0"


def _text(text: str) -> str:
    return " ".join(text.split())[:MESSAGE_CHARS]


def classify(text: str) -> Line | None:
    """What a kernel line says, if it is one operators act on; else None."""
    if "NVRM" in text:
        return _nvrm(text)
    if "SXid" in text and (m := _SXID.search(text)):
        switch, pci, code, severity, link, rest = m.groups()
        return Line("sxid", bus_id(pci), str(int(code)), message=_text(rest),
                    fatal=severity == "Fatal", link=link or "", switch=switch)  # fmt: skip
    if "PCIe Bus Error" in text and (m := _AER.search(text)):
        severity = m.group(2)
        event = next(
            (e for k, e in _AER_SEVERITY.items() if severity.endswith(k)), "aer_correctable"
        )
        return Line("aer", bus_id(m.group(1)), event, message=_text(text.split(": ", 1)[-1]))
    if text.startswith("nvme ") and (m := _NVME.match(text)):
        return Line("nvme_timeout", m.group(1), message=_text(text))
    if text.startswith("mlx5_core ") and (m := _MLX5.match(text)):
        return Line("nic_link", bus_id(m.group(1)), m.group(2))
    if "Killed process" in text and (m := _KILLED.search(text)):
        return Line("oom_kill", pid=m.group(1), process=m.group(2), message=_text(text))
    if text.startswith("oom-kill:") and (m := _OOM_SUMMARY.match(text)):
        pairs = tuple(
            (key, value)
            for key, _, value in (part.partition("=") for part in m.group(1).split(","))
        )
        return Line("oom_summary", fields=pairs)
    return None


def _nvrm(text: str) -> Line | None:
    if m := _XID.search(text):
        pci, code, pid, name, rest = m.groups()
        pid = pid if pid and pid.isdigit() else ""
        name = (name or "").strip()
        process = "" if name in ("", "<unknown>") else name
        return Line("xid", bus_id(pci), str(int(code)), pid, process, _text(rest))
    if m := _FALLEN.search(text):
        return Line("fallen_off_bus", bus_id(m.group(1)), message="GPU has fallen off the bus")
    return None
