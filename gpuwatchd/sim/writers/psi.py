"""PSI lines as kernel/sched/psi.c prints them (node-wide /proc/pressure/* and a cgroup's
*.pressure files alike)."""

from __future__ import annotations


def psi_fixed(value: float) -> str:
    """A PSI average as the kernel prints it (LOAD_INT.LOAD_FRAC: truncated)."""
    hundredths = int(max(0.0, min(100.0, value)) * 100 + 1e-9)
    return f"{hundredths // 100}.{hundredths % 100:02d}"


def psi_line(kind: str, avg10: float, avg60: float, avg300: float, total_us: int) -> str:
    return (
        f"{kind} avg10={psi_fixed(avg10)} avg60={psi_fixed(avg60)} "
        f"avg300={psi_fixed(avg300)} total={total_us}\n"
    )
