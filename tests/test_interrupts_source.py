"""The interrupts source: real /proc/interrupts fixtures, simulator-written tables, garbage."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from series import Clock, by_key

from gpuwatchd.sim.scenario import Scenario, Timeline
from gpuwatchd.sim.writers.interrupts import InterruptsWriter, irq_prec, msi_hwirq, nr_irqs
from gpuwatchd.sources import REGISTRY, SourceError
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.interrupts import (
    CLASSES,
    DEVICE_CLASSES,
    U32,
    InterruptsConfig,
    InterruptsParser,
    InterruptsSource,
    IrqLine,
    ParseError,
    RowCounts,
    classify,
    line_deltas,
    line_total,
    parse_header,
    parse_interrupts,
    parse_line,
    split_tail,
)

FIXTURES = Path(__file__).parent / "fixtures" / "procfs"
X86_OLD = FIXTURES / "node_exporter" / "interrupts"
ARM64 = FIXTURES / "node_exporter" / "interrupts_aarch64"
X86_NEW = FIXTURES / "procfs" / "interrupts"
MLX4 = FIXTURES / "dynolog" / "interrupts"
ALL_FIXTURES = (X86_OLD, ARM64, X86_NEW, MLX4)


def source_for(root: Path, clock: Clock | None = None, **config: Any) -> InterruptsSource:
    extras = {"clock": clock} if clock is not None else {}
    return InterruptsSource(InterruptsConfig(**config), Context(procfs=root, extras=extras))


def bump(text: str, label: str, column: int, by: int) -> str:
    """Add `by` to one count column of the row `label`, keeping the kernel's layout."""
    out = []
    for line in text.splitlines(keepends=True):
        head, colon, rest = line.partition(":")
        if colon and head.strip() == label:
            match = list(re.finditer(r"\d+", rest))[column]
            new = str(int(match.group()) + by)
            new = new.rjust(len(match.group())) if len(new) <= 10 else new
            start = match.end() - len(new) if len(new) <= len(match.group()) else match.start()
            rest = rest[:start] + new + rest[match.end() :]
            line = head + colon + rest
        out.append(line)
    return "".join(out)


def set_count(text: str, label: str, column: int, value: int) -> str:
    current = parse_interrupts(text)
    [row] = [line for line in current.lines if line.irq == label]
    return bump(text, label, column, value - row.counts[column])


def write(root: Path, text: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "interrupts").write_text(text)


# --- parsers on the real fixtures ---------------------------------------------------------


def test_the_source_is_registered() -> None:
    assert REGISTRY["interrupts"] is InterruptsSource


def test_old_x86_format() -> None:
    table = parse_interrupts(X86_OLD.read_text())
    assert table.cpus == (0, 1, 2, 3)
    rows = {line.irq: line for line in table.lines}
    assert rows["0"] == IrqLine("0", ("18", "0", "0", "0"), "IR-IO-APIC", "", "edge", "timer")
    assert rows["16"].name == "ehci_hcd:usb1, mmc0"
    assert rows["16"].actions() == ["ehci_hcd:usb1", "mmc0"]
    assert rows["16"].counts == (328511, 322879, 293782, 351412)
    assert rows["40"].chip == "DMAR_MSI"
    assert rows["46"].counts[0] == 43078464
    assert rows["LOC"].counts == (174326351, 135776678, 168393257, 130980079)
    assert rows["LOC"].name == "Local timer interrupts"
    assert table.totals == {"ERR": 0, "MIS": 0}
    assert "ERR" not in rows
    assert len(table.lines) == 15 + 13


def test_arm64_gic_format_with_hwirq_column_and_glued_ipi_labels() -> None:
    table = parse_interrupts(ARM64.read_text())
    assert table.cpus == tuple(range(8))
    rows = {line.irq: line for line in table.lines}
    assert (rows["10"].chip, rows["10"].hwirq, rows["10"].trigger) == ("GICv3", "27", "Level")
    assert rows["10"].name == "arch_timer"
    assert (rows["50"].chip, rows["50"].hwirq, rows["50"].name) == (
        "ARMH0061:00",
        "3",
        "ACPI:Event",
    )
    assert rows["53"] == IrqLine(
        "53", ("129969327",) + ("0",) * 7, "ITS-MSI", "65537", "Edge", "nvme0q1"
    )
    # "IPI0:2768808080 ..." -- the ten-digit count fills its column up to the colon
    assert rows["IPI0"].counts[0] == 2768808080
    assert rows["IPI3"].name == "CPU stop (for crash dump) interrupts"
    assert table.totals == {"Err": 0}
    assert [classify(rows[i]) for i in ("51", "53", "57", "58", "10", "IPI0")] == [
        "nvme",
        "nvme",
        "nic",
        "nic",
        "other",
        "system",
    ]


def test_new_x86_format_with_hwirq_and_flow_handler() -> None:
    table = parse_interrupts(X86_NEW.read_text())
    rows = {line.irq: line for line in table.lines}
    assert rows["0"] == IrqLine("0", ("49", "0", "0", "0"), "IO-APIC", "2", "edge", "timer")
    assert (rows["25"].chip, rows["25"].hwirq, rows["25"].name) == (
        "PCI-MSI",
        "114689",
        "virtio5-req.0",
    )
    assert rows["29"].name == "ahci[0000:00:1f.2]"
    assert classify(rows["36"]) == "nic"  # virtio0-input.0
    assert classify(rows["37"]) == "nic"  # virtio0-output.0
    assert classify(rows["30"]) == "usb"
    # the blank line after MIS and the KVM rows below it
    assert {"PIN", "NPI", "PIW"} <= set(rows)
    assert table.totals == {"ERR": 0, "MIS": 0}


def test_32_cpu_mlx4_host_with_a_wider_label_column() -> None:
    table = parse_interrupts(MLX4.read_text())
    assert table.cpus == tuple(range(32))
    rows = {line.irq: line for line in table.lines}
    assert rows["30"].name == "mlx4-comp-0@pci:0000:06:00.0"
    assert rows["16"].hwirq == "16"  # "IO-APIC   16-fasteoi" beside "IO-APIC-edge"
    assert (rows["0"].chip, rows["0"].trigger) == ("IO-APIC", "edge")
    assert rows["34"].counts[0] == 2129866239
    assert all(len(line.columns) == 32 for line in table.lines)
    classes = {line.irq: classify(line) for line in table.lines}
    assert [classes[str(i)] for i in range(30, 42)] == ["nic"] * 12
    assert classes["23"] == "usb"
    assert classes["28"] == "other"


def test_rows_with_fewer_columns_than_cpus() -> None:
    text = (
        "           CPU0       CPU1       CPU2       CPU3\n"
        "  9:     398553       2320   IR-IO-APIC-fasteoi   acpi\n"
        " 51:         13   ITS-MSI 65536 Edge      nvme0q0\n"
        "LOC:  174326351  135776678   Local timer interrupts\n"
        "ERR:          0\n"
    )
    rows = {line.irq: line for line in parse_interrupts(text).lines}
    assert rows["9"].counts == (398553, 2320)
    assert (rows["9"].chip, rows["9"].name) == ("IR-IO-APIC", "acpi")
    assert rows["51"].counts == (13,)
    assert (rows["51"].hwirq, rows["51"].name) == ("65536", "nvme0q0")
    assert rows["LOC"].counts == (174326351, 135776678)


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        ("IR-IO-APIC-edge      timer", ("IR-IO-APIC", "", "edge", "timer")),
        ("PCI-MSI-edge      eth0-0", ("PCI-MSI", "", "edge", "eth0-0")),
        ("IO-APIC   2-edge      timer", ("IO-APIC", "2", "edge", "timer")),
        (
            "IR-PCI-MSI 9437184-edge      nvidia",
            ("IR-PCI-MSI", "9437184", "edge", "nvidia"),
        ),
        (
            "IR-PCI-MSIX-0000:3b:00.0    0-edge      mlx5_comp0@pci:0000:3b:00.0",
            ("IR-PCI-MSIX-0000:3b:00.0", "0", "edge", "mlx5_comp0@pci:0000:3b:00.0"),
        ),
        ("GICv3  27 Level     arch_timer", ("GICv3", "27", "Level", "arch_timer")),
        ("GICv3  30 Level -fasteoi  timer", ("GICv3", "30", "Level-fasteoi", "timer")),
        ("xen-pirq    -ioapic-level  acpi", ("xen-pirq", "", "ioapic-level", "acpi")),
        ("xen-percpu-virq      timer0", ("xen-percpu-virq", "", "", "timer0")),
        (
            "IR-PCI-MSI 458752-edge      PCIe PME, pciehp",
            ("IR-PCI-MSI", "458752", "edge", "PCIe PME, pciehp"),
        ),
        ("IO-APIC   9-fasteoi", ("IO-APIC", "9", "fasteoi", "")),
        ("", ("", "", "", "")),
    ],
)
def test_split_tail(tail: str, expected: tuple[str, str, str, str]) -> None:
    assert split_tail(tail) == expected


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("nvidia", "nvidia"),
        ("nvidia-nvswitch0", "nvidia"),
        ("nvme0q0", "nvme"),
        ("nvme12q31", "nvme"),
        ("mlx5_comp7@pci:0000:0c:00.0", "nic"),
        ("mlx5_async0@pci:0000:0c:00.0", "nic"),
        ("mlx4-comp-0@pci:0000:06:00.0", "nic"),
        ("eth0-TxRx-3", "nic"),
        ("ens1f0-TxRx-0", "nic"),
        ("enp65s0f0-TxRx-0", "nic"),
        ("ice-ens2f0-TxRx-12", "nic"),
        ("i40e-eth2-TxRx-0", "nic"),
        ("virtio0-input.0", "nic"),
        ("virtio0-output.3", "nic"),
        ("virtio5-req.0", "other"),
        ("xhci_hcd", "usb"),
        ("ehci_hcd:usb1, mmc0", "usb"),
        ("mmc0, ehci_hcd:usb1", "usb"),
        ("ahci[0000:00:1f.2]", "other"),
        ("timer", "other"),
        ("", "other"),
    ],
)
def test_classify(name: str, cls: str) -> None:
    assert classify(IrqLine("42", ("1",), name=name)) == cls


def test_summary_rows_are_system() -> None:
    assert classify(IrqLine("LOC", ("1",), name="Local timer interrupts")) == "system"


@pytest.mark.parametrize(
    "text",
    ["", "\n\n", "garbage\n", "  0:  1  2  IO-APIC 2-edge timer\n", "CPU0 CPUx\n  0: 1\n"],
)
def test_no_header_is_a_parse_error(text: str) -> None:
    with pytest.raises(ParseError):
        parse_interrupts(text)


def test_parse_header_and_line_reject_garbage() -> None:
    assert parse_header("           CPU0       CPU1       CPU3") == (0, 1, 3)  # CPU2 offline
    assert parse_line("", 4) is None
    assert parse_line("ERR:          0", 4) is None
    assert parse_line("ERR:          0", 1) is None
    assert parse_line("no colon here", 4) is None
    assert parse_line(" 5: -1 2 3 4 IO-APIC 5-edge x", 4) is None
    assert parse_line(" 5: ١٢ 2 3 4 IO-APIC 5-edge x", 4) is None  # non-ASCII digits
    # a column longer than a u64 is garbage: it gives no rate when it moves
    huge = parse_line(" 5: " + "9" * 30 + " 2 3 4 IO-APIC 5-edge x", 4)
    before = parse_line(" 5: 1 2 3 4 IO-APIC 5-edge x", 4)
    assert huge is not None and before is not None
    assert line_deltas(huge, before, 1e9) is None
    assert parse_line(" 5: " + "9" * 5000 + " 2 3 4 IO-APIC 5-edge x", 4) is None


def test_line_deltas_unwrap_u32_and_detect_resets() -> None:
    def row(*counts: int) -> IrqLine:
        return IrqLine("1", tuple(map(str, counts)))

    assert line_deltas(row(10, 5, 7), row(4, 5, 7), 1e9) == [(0, 6)]
    assert line_deltas(row(100, 0), row(U32 - 50, 0), 1e6) == [(0, 150)]
    assert line_deltas(row(100, 0), row(U32 - 50, 0), 10) is None  # too big a wrap: reset
    assert line_deltas(row(100, 0), row(5_000_000, 0), 1e9) is None  # fell: reset
    assert line_deltas(row(1, 2), row(1, 2, 3), 1e9) is None  # shape changed
    many_now, many_before = row(*range(100, 200)), row(*range(100))
    assert line_deltas(many_now, many_before, 1e9) == [(i, 100) for i in range(100)]


counts = st.lists(st.integers(0, U32 - 1) | st.integers(0, 10**21), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(polls=st.lists(st.tuples(st.sampled_from(["LOC", "RES"]), counts), min_size=2, max_size=6))
def test_kept_counts_and_line_total_agree_with_line_deltas(
    polls: list[tuple[str, list[int]]],
) -> None:
    """A summary row's total is the sum of its line_deltas (wraps, resets and all), with
    each row's ints kept from the poll before: never a stale row's."""
    kept = RowCounts()
    last: dict[str, IrqLine] = {}
    for label, row in polls:
        kept.next_poll()
        line = IrqLine(label, tuple(map(str, row)))
        before = last.get(label)
        last[label] = line
        if before is None:
            continue
        deltas = line_deltas(line, before, 1e6)
        assert line_deltas(line, before, 1e6, kept) == deltas
        expected = None if deltas is None else sum(d for _, d in deltas)
        assert line_total(line, before, 1e6, kept) == expected
        assert kept(line) == row and kept(before) == list(map(int, before.columns))


def test_each_poll_converts_a_summary_rows_counts_once(tmp_path: Path) -> None:
    """The module's docstring: a row that moved on many CPUs keeps its counts as ints for
    the next poll, so each count is converted once. Five polls of a 16-CPU LOC row that
    moves on every CPU: five rows, each converted once (not twice: as the newer row, then
    again as the older one at the next poll)."""
    header = "      " + " ".join(f"CPU{i}" for i in range(16)) + "\n"
    clock = Clock()
    source = source_for(tmp_path, clock)
    made: list[list[int]] = []  # each list of ints a conversion returned

    class Recording(RowCounts):
        def __call__(self, line: IrqLine) -> list[int]:
            ints = super().__call__(line)
            if not any(ints is m for m in made):
                made.append(ints)
            return ints

    source._counts = Recording()
    for poll in range(5):
        counts = " ".join(str(1000 * poll + cpu) for cpu in range(16))
        write(tmp_path, f"{header} LOC: {counts}   Local timer interrupts\n")
        source.collect()
        clock.t += 5
    assert source.last_rates is not None and source.last_rates.per_class["system"] == 3200
    assert len(made) == 5


# --- the source on fixture trees -----------------------------------------------------------


def test_first_poll_gives_line_counts_then_rates(tmp_path: Path) -> None:
    text = X86_OLD.read_text()
    write(tmp_path, text)
    clock = Clock()
    source = source_for(tmp_path, clock)
    got = by_key(source.collect())
    assert got == {
        ("interrupt_lines", ("nvidia",)): 0,
        ("interrupt_lines", ("nvme",)): 0,
        ("interrupt_lines", ("nic",)): 0,
        ("interrupt_lines", ("usb",)): 3,
        ("interrupt_lines", ("other",)): 12,
        ("interrupt_lines", ("system",)): 13,
    }
    # 5 s later: iwlwifi +60000 on CPU 0 (12000/s, a storm), xhci +1000 on CPU 3,
    # LOC +1000 on every CPU
    text = bump(text, "46", 0, 60_000)
    text = bump(text, "42", 3, 1000)
    for cpu in range(4):
        text = bump(text, "LOC", cpu, 1000)
    write(tmp_path, text)
    clock.t = 5.0
    got = by_key(source.collect())
    assert got[("interrupts_per_second", ("other",))] == 12_000
    assert got[("interrupts_per_second", ("usb",))] == 200
    assert got[("interrupts_per_second", ("system",))] == 800
    assert got[("interrupts_per_second", ("nic",))] == 0
    assert got[("interrupt_max_line_per_second", ("other",))] == 12_000
    assert got[("interrupt_max_line_per_second", ("usb",))] == 200
    assert got[("interrupt_storm_lines", ("other",))] == 1
    assert got[("interrupt_storm_lines", ("usb",))] == 0
    # the storm's own row, named as the kernel prints it (issue 39: the on-call acts on it)
    storms = {k[1]: v for k, v in got.items() if k[0] == "interrupt_storm_line_per_second"}
    assert storms == {("other", "46", "iwlwifi"): 12_000}
    cpu_series = {k[1]: v for k, v in got.items() if k[0] == "cpu_interrupts_per_second"}
    assert cpu_series == {("0", "other"): 12_000, ("3", "usb"): 200}
    assert ("interrupt_max_line_per_second", ("system",)) not in got


def test_samples_match_the_declared_specs(tmp_path: Path) -> None:
    text = MLX4.read_text()
    write(tmp_path, text)
    clock = Clock()
    source = source_for(tmp_path, clock)
    source.collect()
    write(tmp_path, bump(text, "30", 2, 100_000))
    clock.t = 5
    samples = source.collect()
    specs = {spec.name: spec for spec in InterruptsSource.metrics}
    assert {s.name for s in samples} == set(specs)
    for s in samples:
        assert len(s.labels) == len(specs[s.name].labels), s
        assert s.labels[specs[s.name].labels.index("class")] in CLASSES
    assert by_key(samples)[("cpu_interrupts_per_second", ("2", "nic"))] == 20_000


def test_u32_wrap_gives_the_true_rate(tmp_path: Path) -> None:
    text = set_count(X86_OLD.read_text(), "46", 0, U32 - 1000)
    write(tmp_path, text)
    clock = Clock()
    source = source_for(tmp_path, clock)
    source.collect()
    write(tmp_path, set_count(text, "46", 0, 4000))  # wrapped: +5000
    clock.t = 5
    got = by_key(source.collect())
    assert got[("interrupts_per_second", ("other",))] == 1000
    assert got[("cpu_interrupts_per_second", ("0", "other"))] == 1000


def test_reset_row_gives_no_rate_and_spares_the_others(tmp_path: Path) -> None:
    text = X86_OLD.read_text()
    write(tmp_path, text)
    clock = Clock()
    source = source_for(tmp_path, clock)
    source.collect()
    changed = set_count(text, "46", 0, 5)  # iwlwifi re-registered: from 43 million to 5
    changed = bump(changed, "42", 0, 5000)
    write(tmp_path, changed)
    clock.t = 5
    got = by_key(source.collect())
    assert got[("interrupts_per_second", ("other",))] == 0
    assert got[("interrupts_per_second", ("usb",))] == 1000
    # the reset row is the new baseline
    write(tmp_path, bump(changed, "46", 0, 500))
    clock.t = 10
    assert by_key(source.collect())[("interrupts_per_second", ("other",))] == 100


def test_hot_plug_rows_and_reused_irq_numbers(tmp_path: Path) -> None:
    header = "           CPU0       CPU1\n"

    def table(*rows: str) -> str:
        return header + "".join(rows)

    nvme = " 40:       1000          0  IR-PCI-MSI 1048577-edge      nvme0q1\n"
    nic = " 41:        500          0  IR-PCI-MSI 6291457-edge      mlx5_comp0@pci:0000:0c:00.0\n"
    clock = Clock()
    write(tmp_path, table(nvme))
    source = source_for(tmp_path, clock)
    source.collect()
    # a NIC is hot-plugged: its row is new, no rate yet; the disk goes on
    write(tmp_path, table(nvme.replace("1000", "2000"), nic))
    clock.t = 1
    got = by_key(source.collect())
    assert got[("interrupts_per_second", ("nvme",))] == 1000
    assert got[("interrupts_per_second", ("nic",))] == 0
    assert got[("interrupt_lines", ("nic",))] == 1
    # the disk leaves and its IRQ number is reused by another device: no rate from it
    reused = " 40:       9000          0  IR-PCI-MSI 2097153-edge      nvme1q1\n"
    write(tmp_path, table(reused, nic.replace(" 500", "1500")))
    clock.t = 2
    got = by_key(source.collect())
    assert got[("interrupts_per_second", ("nvme",))] == 0
    assert got[("interrupts_per_second", ("nic",))] == 1000
    write(tmp_path, table(reused.replace("9000", "9100"), nic.replace(" 500", "1500")))
    clock.t = 3
    assert by_key(source.collect())[("interrupts_per_second", ("nvme",))] == 100


def test_rows_are_classed_again_only_when_a_label_or_name_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counts move every poll; which rows there are and what they are rarely change: the
    classes and the interrupt_lines samples are the last poll's while they stay."""
    header = "           CPU0       CPU1\n"
    disk = " 40:       1000          0  IR-PCI-MSI 1048577-edge      nvme0q1\n"
    clock = Clock()
    write(tmp_path, header + disk)
    source = source_for(tmp_path, clock)
    first = source.collect()
    asked: list[str] = []
    real = source._class_of

    def counting(line: IrqLine) -> str | None:
        asked.append(line.irq)
        return real(line)

    monkeypatch.setattr(source, "_class_of", counting)
    write(tmp_path, header + disk.replace("1000", "1500"))
    clock.t = 1
    got = source.collect()
    assert asked == [] and by_key(got)[("interrupts_per_second", ("nvme",))] == 500
    assert [s for s in got if s.name == "gpuwatchd_interrupt_lines"] == first
    assert all(a is b for a, b in zip(got, first, strict=False))
    # the IRQ number reused by a GPU: classed again, counted as nvidia, no rate from it
    gpu = " 40:       1600          0  IR-PCI-MSI 524288-edge      nvidia\n"
    write(tmp_path, header + gpu)
    clock.t = 2
    got = by_key(source.collect())
    assert asked == ["40"]
    assert got[("interrupt_lines", ("nvidia",))] == 1 and got[("interrupt_lines", ("nvme",))] == 0
    assert got[("interrupts_per_second", ("nvidia",))] == 0


def test_cpu_hot_plug_re_baselines(tmp_path: Path) -> None:
    text = X86_OLD.read_text()
    write(tmp_path, text)
    clock = Clock()
    source = source_for(tmp_path, clock)
    source.collect()
    # CPU 3 goes offline: its column disappears from every row
    offline = "\n".join(
        re.sub(r"^(\s*\S+:(?:\s+\d+){3})\s+\d+", r"\1", line) if i else line.rsplit("CPU3", 1)[0]
        for i, line in enumerate(text.splitlines())
    )
    assert parse_interrupts(offline).cpus == (0, 1, 2)
    write(tmp_path, offline)
    clock.t = 5
    got = by_key(source.collect())
    assert not [k for k in got if k[0] != "interrupt_lines"]
    write(tmp_path, bump(offline, "46", 0, 500))
    clock.t = 10
    assert by_key(source.collect())[("interrupts_per_second", ("other",))] == 100


def test_a_clock_that_did_not_move_gives_no_rates(tmp_path: Path) -> None:
    write(tmp_path, X86_OLD.read_text())
    source = source_for(tmp_path, Clock())
    source.collect()
    got = by_key(source.collect())
    assert all(name == "interrupt_lines" for name, _ in got)


def test_without_a_clock_in_the_context_monotonic_time_is_used(tmp_path: Path) -> None:
    write(tmp_path, X86_OLD.read_text())
    source = source_for(tmp_path)
    source.collect()
    got = by_key(source.collect())
    assert got[("interrupts_per_second", ("other",))] == 0  # same file: nothing moved


def test_include_and_exclude_patterns(tmp_path: Path) -> None:
    text = X86_OLD.read_text()
    write(tmp_path, text)
    clock = Clock()
    source = source_for(tmp_path, clock, include=["hcd", "^LOC$"], exclude=["usb2"])
    got = by_key(source.collect())
    lines = {k[1][0]: v for k, v in got.items() if k[0] == "interrupt_lines"}
    assert lines == {"usb": 2, "system": 1, "nvidia": 0, "nvme": 0, "nic": 0, "other": 0}
    text = bump(bump(bump(text, "46", 0, 600), "23", 0, 700), "16", 1, 800)
    write(tmp_path, bump(text, "LOC", 2, 900))
    clock.t = 1
    got = by_key(source.collect())
    assert got[("interrupts_per_second", ("other",))] == 0  # iwlwifi not included
    assert got[("interrupts_per_second", ("usb",))] == 800  # ehci_hcd:usb2 excluded
    assert got[("interrupts_per_second", ("system",))] == 900


def test_cpu_series_floor_hysteresis_and_limit(tmp_path: Path) -> None:
    header = "           CPU0       CPU1       CPU2       CPU3\n"

    def state(counts: list[int]) -> str:
        lines = []
        for q, count in enumerate(counts):  # queue q lands on CPU q
            cells = [0, 0, 0, 0]
            cells[q] = count
            lines.append(
                f" {40 + q}:"
                + "".join(f"{c:11d}" for c in cells)
                + f"  IR-PCI-MSI {q}-edge      nvme0q{q}\n"
            )
        return header + "".join(lines)

    assert parse_interrupts(state([1, 2, 3, 4])).cpus == (0, 1, 2, 3)
    clock = Clock()
    write(tmp_path, state([0, 0, 0, 0]))
    source = source_for(tmp_path, clock, cpu_floor=100, max_cpu_series=2)

    def cpu_series(totals: list[int]) -> dict[str, float]:
        write(tmp_path, state(totals))
        clock.t += 1
        got = by_key(source.collect())
        return {k[1][0]: v for k, v in got.items() if k[0] == "cpu_interrupts_per_second"}

    assert cpu_series([0, 0, 0, 0]) == {}
    assert cpu_series([150, 99, 0, 0]) == {"0": 150}  # CPU 1 under the floor
    assert cpu_series([210, 99, 0, 0]) == {"0": 60}  # kept: over half the floor
    assert cpu_series([250, 99, 0, 0]) == {}  # under half: gone
    # at most two series: the busiest
    assert cpu_series([750, 399, 1299, 1400]) == {"3": 1400, "2": 1299}


def test_missing_and_garbage_files_are_source_errors(tmp_path: Path) -> None:
    source = source_for(tmp_path / "nowhere", Clock())
    with pytest.raises(SourceError, match=r"nowhere/interrupts does not exist"):
        source.collect()
    write(tmp_path, "\x00\xff not an interrupts table\n")
    with pytest.raises(SourceError, match=r"interrupts: not a /proc/interrupts table"):
        source_for(tmp_path, Clock()).collect()
    (tmp_path / "interrupts").unlink()
    (tmp_path / "interrupts").mkdir()
    with pytest.raises(SourceError, match=r"cannot read .*interrupts"):
        source_for(tmp_path, Clock()).collect()


def test_a_garbled_row_is_skipped_not_fatal(tmp_path: Path) -> None:
    text = X86_OLD.read_text().replace(" 46:   43078464", " 46:   43078x64")
    write(tmp_path, text)
    got = by_key(source_for(tmp_path, Clock()).collect())
    assert got[("interrupt_lines", ("other",))] == 11


def test_config_defaults_and_validation() -> None:
    config = InterruptsConfig()
    assert (config.interval, config.cpu_floor, config.storm_threshold) == (5.0, 100.0, 10_000.0)
    assert InterruptsConfig.model_validate({"include": ["mlx5_.*"]}).include == ("mlx5_.*",)
    with pytest.raises(ValidationError, match=r"include[\s\S]*expected a regular expression"):
        InterruptsConfig.model_validate({"include": ["mlx5_(("]})
    with pytest.raises(ValidationError, match="extra"):
        InterruptsConfig.model_validate({"colour": "red"})
    with pytest.raises(ValidationError):
        InterruptsConfig.model_validate({"storm_threshold": 0})


# --- the simulator's table -------------------------------------------------------------------


def scenario(
    values: dict[str, Any] | None = None, hardware: dict[str, Any] | None = None, **node: Any
) -> Scenario:
    """A 2-GPU, 4-CPU node; `values` for its one phase's host, `hardware` for node.host."""
    data: dict[str, Any] = {
        "name": "irq-test",
        "node": {"gpu_count": 2, "cpus": 4, "host": hardware or {}, **node},
        "phases": [{"name": "only", "duration": 3600, "host": values or {}}],
    }
    return Scenario.model_validate(data)


ONE_NIC = {
    "nics": [{"name": "mlx5_0", "queues": 4, "bus_id": "0000:0c:00.0"}],
    "disks": [{"name": "nvme0n1", "queues": 4}, {"name": "sda"}],
}

# kernel/irq/proc.c: "%*d: ", "%10u " per CPU, " %8s" chip, " %*lu" hwirq, "-%-8s", "  %s"
DEVICE_ROW = (
    r"(?P<label> *\d+): (?P<counts>(?: {0,9}\d{1,10} ){N})"
    r"(?P<chip> {0,8}\S+) (?P<hwirq> *\d*)-(?P<handler>\S+ *)  (?P<name>\S.*)"
)
SUMMARY_ROW = r"(?P<label> *[A-Z]{3}): (?P<counts>(?: {0,9}\d{1,10} ){N})  (?P<name>\S.*)"


def row_patterns(ncpus: int) -> tuple[re.Pattern[str], re.Pattern[str]]:
    return (
        re.compile(DEVICE_ROW.replace("{N}", f"{{{ncpus}}}")),
        re.compile(SUMMARY_ROW.replace("{N}", f"{{{ncpus}}}")),
    )


def test_the_row_layout_regexes_match_the_real_new_format_fixture() -> None:
    device, summary = row_patterns(4)
    lines = X86_NEW.read_text().splitlines()
    assert lines[0] == "           CPU0       CPU1       CPU2       CPU3"
    for line in lines[1:]:
        if line and not line.lstrip().startswith(("ERR", "MIS")):
            assert device.fullmatch(line) or summary.fullmatch(line), line


def test_simulated_table_has_the_kernels_layout(tmp_path: Path) -> None:
    timeline = Timeline(scenario(None, ONE_NIC))
    writer = InterruptsWriter(tmp_path, timeline)
    assert writer.write(0.0) == 1
    text = (tmp_path / "interrupts").read_text()
    lines = text.splitlines()
    prec = irq_prec(nr_irqs(4))
    assert prec == 3
    assert lines[0] == " " * 11 + "".join(f"CPU{c:<8d}" for c in range(4))
    device, summary = row_patterns(4)
    labels = []
    for line in lines[1:]:
        if line.startswith(("ERR", "MIS")):
            assert line in ("ERR:          0", "MIS:          0")  # as in the real fixtures
            continue
        match = device.fullmatch(line) or summary.fullmatch(line)
        assert match, line
        assert len(match.group("label")) == prec
        labels.append(match.group("label").strip())
    # IRQ numbers rise, then the summary rows in arch_show_interrupts order
    numbers = [int(label) for label in labels if label.isdigit()]
    assert numbers == sorted(numbers)
    summaries = [label for label in labels if not label.isdigit()]
    assert summaries[:3] == ["NMI", "LOC", "SPU"] and summaries[-3:] == ["PIN", "NPI", "PIW"]
    names = [line.split()[-1] for line in lines if device.fullmatch(line)]
    assert names.count("nvidia") == 2
    assert [n for n in names if n.startswith("nvme0q")] == [f"nvme0q{q}" for q in range(5)]
    assert "ahci[0000:00:17.0]" in names
    assert "mlx5_async0@pci:0000:0c:00.0" in names
    assert [n for n in names if n.startswith("mlx5_comp")] == [
        f"mlx5_comp{q}@pci:0000:0c:00.0" for q in range(4)
    ]


def test_simulated_nvidia_rows_carry_the_gpus_msi_hwirq(tmp_path: Path) -> None:
    timeline = Timeline(scenario())
    InterruptsWriter(tmp_path, timeline).write(0.0)
    rows = [r for r in parse_interrupts((tmp_path / "interrupts").read_text()).lines]
    nvidia = [r for r in rows if r.name == "nvidia"]
    bdfs = [timeline.topology.gpu(i).bdf for i in range(2)]
    assert [int(r.hwirq) for r in nvidia] == [msi_hwirq(bdf, 0) for bdf in bdfs]
    assert [r.chip for r in nvidia] == ["IR-PCI-MSI"] * 2
    assert msi_hwirq("0000:00:1f.2", 0) == 512000  # as the real fixture's ahci row
    assert msi_hwirq("0000:00:07.0", 1) == 114689  # and its virtio5-req.0


def test_a_nic_queue_storm_on_cpu_0_after_two_polls(tmp_path: Path) -> None:
    host = {"interrupts": {"mlx5_comp0": {"rate": 20000, "cpus": [0]}}}
    timeline = Timeline(scenario(host, ONE_NIC))
    writer = InterruptsWriter(tmp_path, timeline)
    clock = Clock()
    source = source_for(tmp_path, clock)
    writer.write(0.0)
    source.collect()
    clock.t = 10.0
    writer.write(10.0)
    got = by_key(source.collect())
    assert got[("interrupt_storm_lines", ("nic",))] == 1
    assert got[("interrupt_max_line_per_second", ("nic",))] == 20000
    assert got[("cpu_interrupts_per_second", ("0", "nic"))] == pytest.approx(20000, abs=5)
    assert got[("interrupt_storm_lines", ("nvme",))] == 0
    assert got[("interrupts_per_second", ("system",))] > 0  # LOC, RES, ... keep ticking
    for cls in DEVICE_CLASSES:
        if cls != "nic":
            assert got[("interrupt_storm_lines", (cls,))] == 0


def test_scenario_keys_pick_rows_most_specific_first(tmp_path: Path) -> None:
    nics = {
        "nics": [
            {"name": "mlx5_0", "queues": 2, "bus_id": "0000:0c:00.0"},
            {"name": "mlx5_1", "queues": 2, "bus_id": "0000:0d:00.0"},
        ]
    }
    host = {
        "interrupts": {
            "mlx5_comp1": {"rate": 300, "cpus": [1, 2]},  # both NICs' comp1 ...
            "mlx5_comp1@pci:0000:0d:00.0": {"rate": 900, "cpus": [3]},  # ... but this one
            "nvidia@pci:" + Timeline(scenario()).topology.gpu(1).bdf: {"rate": 50},
            "LOC": {"rate": 4000},  # summary rows by their label, spread over every CPU
        }
    }
    writer = InterruptsWriter(tmp_path, Timeline(scenario(host, nics)))
    writer.write(0.0)
    writer.write(10.0)
    rows = {
        (r.irq if not r.is_device else r.name + r.hwirq): r.counts
        for r in parse_interrupts((tmp_path / "interrupts").read_text()).lines
    }
    comp1 = {k: v for k, v in rows.items() if k.startswith("mlx5_comp1@")}
    assert sorted(comp1.values()) == [(0, 0, 0, 9000), (0, 1500, 1500, 0)]
    nvidia = [v for k, v in rows.items() if k.startswith("nvidia")]
    assert sorted(sum(v) for v in nvidia) == [50, 500]  # background 5/s; the chosen one 50/s
    assert rows["LOC"] == (10000, 10000, 10000, 10000)


def test_simulated_counts_wrap_at_u32_and_the_source_unwraps_them(tmp_path: Path) -> None:
    host = {"interrupts": {"nvme0q1": {"rate": 4_000_000, "cpus": [0]}}}
    timeline = Timeline(scenario(host))
    writer = InterruptsWriter(tmp_path, timeline)
    clock = Clock()
    source = source_for(tmp_path, clock)
    writer.write(0.0)
    for t in (1072.0, 1076.0):  # 2**32 / 4e6 = 1073.7 s
        writer.write(t)
        clock.t = t
        source.collect()
    rows = {r.name: r for r in parse_interrupts((tmp_path / "interrupts").read_text()).lines}
    assert rows["nvme0q1"].counts[0] == (4_000_000 * 1076) % U32
    assert source.last_rates is not None
    assert source.last_rates.max_line["nvme"] == 4_000_000


def test_writes_only_when_the_table_changes(tmp_path: Path) -> None:
    writer = InterruptsWriter(tmp_path, Timeline(scenario()))
    assert writer.write(0.0) == 1
    assert writer.write(0.0) == 0
    assert writer.write(0.001) == 0  # no count reached the next integer
    assert writer.write(5.0) == 1
    assert not list(tmp_path.glob(".*.tmp"))


def test_other_nic_drivers(tmp_path: Path) -> None:
    nics = {
        "nics": [
            {"name": "ens2f0", "driver": "ice", "queues": 2, "bus_id": "0000:a2:00.0"},
            {"name": "eth0", "driver": "virtio", "queues": 2},
        ]
    }
    InterruptsWriter(tmp_path, Timeline(scenario(None, nics))).write(0.0)
    table = parse_interrupts((tmp_path / "interrupts").read_text())
    nic_names = [r.name for r in table.lines if classify(r) == "nic"]
    assert nic_names == [
        "ice-0000:a2:00.0:misc",
        "ice-ens2f0-TxRx-0",
        "ice-ens2f0-TxRx-1",
        "virtio0-input.0",
        "virtio0-output.0",
        "virtio0-input.1",
        "virtio0-output.1",
    ]


def test_a_128_cpu_table_uses_the_wider_label_column(tmp_path: Path) -> None:
    host = {"disks": [{"name": f"nvme{i}n1", "queues": 2} for i in range(3)]}
    writer = InterruptsWriter(tmp_path, Timeline(scenario(None, host, cpus=128)))
    writer.write(0.0)
    lines = (tmp_path / "interrupts").read_text().splitlines()
    assert lines[0].startswith(" " * 12 + "CPU0 ")
    assert lines[1].startswith("   0: ")
    assert any(line.startswith(" LOC: ") for line in lines)
    assert len(parse_interrupts("\n".join(lines)).cpus) == 128


# --- garbage --------------------------------------------------------------------------------

_TEXTS = st.sampled_from([path.read_text() for path in ALL_FIXTURES])


@st.composite
def mangled(draw: st.DrawFn) -> str:
    text = draw(_TEXTS)
    cut = draw(st.integers(0, len(text)))
    text = text[:cut]
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(text)))
        junk = draw(
            st.text(max_size=30) | st.sampled_from(["\n", ":", " 99999999999999999999999 "])
        )
        text = text[:at] + junk + text[at:]
    return text


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.text(), mangled()))
def test_the_parser_never_raises_anything_but_parse_error(text: str) -> None:
    try:
        table = parse_interrupts(text)
    except ParseError:
        return
    for line in table.lines:
        assert all(c >= 0 for c in line.counts)
        assert 0 < len(line.counts) <= len(table.cpus)
        classify(line)


@settings(max_examples=100, deadline=None)
@given(texts=st.lists(mangled(), min_size=1, max_size=4))
def test_the_caching_parser_equals_the_plain_one(texts: list[str]) -> None:
    parser = InterruptsParser()
    for text in texts:
        try:
            expected = parse_interrupts(text)
        except ParseError:
            with pytest.raises(ParseError):
                parser.parse(text)
            continue
        assert parser.parse(text) == expected


@settings(max_examples=100, deadline=None)
@given(first=mangled(), second=mangled())
def test_collect_on_garbage_never_raises_but_source_error(
    tmp_path_factory: pytest.TempPathFactory, first: str, second: str
) -> None:
    root = tmp_path_factory.mktemp("proc")
    clock = Clock()
    source = source_for(root, clock)
    for t, text in ((0.0, first), (5.0, second)):
        write(root, text)
        clock.t = t
        try:
            samples = source.collect()
        except SourceError:
            continue
        for s in samples:
            assert s.value >= 0 and s.value == s.value and s.value != float("inf")


@settings(max_examples=100, deadline=None)
@given(digits=st.text(alphabet="0123456789", min_size=1, max_size=6000))
def test_huge_numbers_do_not_hit_the_int_digit_limit(
    tmp_path_factory: pytest.TempPathFactory, digits: str
) -> None:
    header = "           CPU0       CPU1\n"
    root = tmp_path_factory.mktemp("proc")
    clock = Clock()
    source = source_for(root, clock)
    write(root, header + " 40:          1          2  PCI-MSI 1-edge  nvme0q1\n")
    source.collect()
    write(root, header + f" 40: {digits}          2  PCI-MSI 1-edge  nvme0q1\n")
    clock.t = 1
    source.collect()
    parse_line(f" 40: {digits} {digits} PCI-MSI 1-edge x", 2)


# --- where interrupts land ------------------------------------------------------------------


def test_the_hardest_hit_cpu_tells_spread_from_concentrated(tmp_path: Path) -> None:
    """Four vectors at 12 000/s, one per CPU, against one vector at 30 000/s on CPU 1."""
    spread = {f"mlx5_comp{q}": {"rate": 12_000, "cpus": [q]} for q in range(4)}
    for irqs, hardest, busiest_line in (
        (spread, 12_000, 12_000),
        ({"mlx5_comp2": {"rate": 30_000, "cpus": [1]}}, 30_000, 30_000),
    ):
        values = {"interrupts": irqs}
        root = tmp_path / str(hardest)
        writer = InterruptsWriter(root, Timeline(scenario(values, ONE_NIC)))
        clock = Clock()
        source = source_for(root, clock)
        writer.write(0.0)
        source.collect()
        clock.t = 10.0
        writer.write(10.0)
        got = by_key(source.collect())
        assert got[("interrupt_cpu_max_per_second", ("nic",))] == pytest.approx(hardest, rel=1e-3)
        assert got[("interrupt_max_line_per_second", ("nic",))] == pytest.approx(
            busiest_line, rel=1e-3
        )
        assert got[("interrupt_cpu_max_per_second", ("usb",))] < 10
