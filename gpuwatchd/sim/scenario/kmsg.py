"""Kernel log lines in a scenario: a phase's `kmsg` entries and the driver's Xid lines.

A phase lists lines the kernel logs during it, in the real lines' shapes, with the
node's addresses left to placeholders: `{pci:N}` GPU N as an Xid names it
("0000:9b:00"), `{bdf:N}` GPU N's PCI function ("0000:9b:00.0"), `{nvswitch:K}` the
board's K-th NVSwitch (where GPUs' NVLinks reach it, as the fake NVML answers). Every Xid
a phase raises (`xid:`) is logged by the driver as it is on a real node, `NVRM: Xid
(PCI:...): N, pid=..., name=..., <text>`, naming the GPU's first process, unless the
phase logs that Xid line itself (its own process and words).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

from pydantic import Field

from gpuwatchd.config import Duration
from gpuwatchd.sim.scenario.base import Strict

# NVSwitches on a board as a GPU's NVLinks reach them (made-up addresses beside the
# GPUs'), by the GPU's compute capability major: HGX A100 boards carry 6 switches
# (device 0x1AF1), Hopper ones 4 (0x22A3)
NVSWITCHES = {8: (6, 0x1AF1), 9: (4, 0x22A3)}
PLACEHOLDER = re.compile(r"\{(pci|bdf|nvswitch):(\d{1,3})\}")
_XID_LINE = re.compile(r"NVRM: Xid \(PCI:\{pci:(\d{1,3})\}\): (\d{1,5}),")
ERR, WARNING, INFO = 3, 4, 6  # printk levels
# What the driver says with an Xid, where a scenario says nothing else: shapes of real
# lines (tests/fixtures/kmsg), "{gpu}" the GPU's index as the driver counts it
XID_TEXTS = {
    13: "Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address",
    31: "Ch 00000010, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ "
    "0x7f_ee000000. Fault is of type FAULT_PDE ACCESS_TYPE_READ",
    43: "Ch 00000010",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer "
    "at partition 6, subpartition 0.",
    63: "Row Remapper: New row marked for remapping, reset gpu to activate.",
    64: "Row Remapper: Failed to remap row, reset gpu to activate.",
    74: "NVLink: fatal error detected on link 12(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    94: "Contained: CE User Channel (0x9). RST: No, D-RST: No",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    119: "Timeout after 6s of waiting for RPC response from GPU{gpu} GSP! Expected function "
    "76 (GSP_RM_CONTROL) (0x20800a4c 0x4).",
    120: "GSP task timeout @ pc:0x4bd36c4, task: 1",
}


class KmsgLine(Strict):
    text: str = Field(min_length=1, max_length=1000)
    at: Duration | Literal[0] = 0  # into the phase
    level: int = Field(WARNING, ge=0, le=7)  # printk level: 3 err, 4 warning, 6 info
    repeat: int = Field(1, ge=1, le=1000)  # logged this many times ...
    every: Duration = 1.0  # ... this far apart


def placeholder_problem(text: str, gpus: int, switches: int) -> str | None:
    """Why a line's placeholders name nothing on the node, or None."""
    for kind, index in PLACEHOLDER.findall(text):
        most = switches if kind == "nvswitch" else gpus
        if int(index) >= most:
            what = "NVSwitches on the board" if kind == "nvswitch" else "node.gpu_count"
            return f"{{{kind}:{index}}}: expected an index below {most} ({what})"
    return None


def render(text: str, gpu_bdf: Callable[[int], str], switch_bdf: Callable[[int], str]) -> str:
    """The line with the node's addresses in place of its placeholders."""

    def one(match: re.Match[str]) -> str:
        kind, index = match.group(1), int(match.group(2))
        if kind == "nvswitch":
            return switch_bdf(index)
        bdf = gpu_bdf(index)
        return bdf.rsplit(".", 1)[0] if kind == "pci" else bdf

    return PLACEHOLDER.sub(one, text)


def nvswitch_bdf(index: int) -> str:
    return f"0000:{0xE0 + index:02x}:00.0"


def explicit_xids(lines: list[KmsgLine]) -> set[tuple[int, int]]:
    """(GPU, Xid) of the Xid lines a phase logs itself."""
    found = set()
    for line in lines:
        if m := _XID_LINE.search(line.text):
            found.add((int(m.group(1)), int(m.group(2))))
    return found


def xid_line(pci: str, xid: int, gpu: int, process: tuple[int, str] | None) -> str:
    """The driver's line for an Xid: R470 and later name the process it hit."""
    who = f"pid={process[0]}, name={process[1]}" if process else "pid='<unknown>', name=<unknown>"
    text = XID_TEXTS.get(xid, "").format(gpu=gpu)
    return f"NVRM: Xid (PCI:{pci}): {xid}, {who}, {text}".rstrip(", ")
