"""The pcie source on real sysfs fixtures (rebuilt into real-shape trees) and garbage."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from series import by_key

from gpuwatchd.config import PcieConfig
from gpuwatchd.sources import REGISTRY, SourceError
from gpuwatchd.sources import pcie as pcie_module
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.pcie import (
    PcieSource,
    aer_total,
    link_generation,
    parse_aer,
    parse_hex,
    parse_link_speed,
    parse_link_width,
    parse_numa_node,
)

FIXTURES = Path(__file__).parent / "fixtures" / "sysfs"

# BDF -> (fixture set, link target below devices/), from tests/fixtures/README.md
LINK_TARGETS = {
    "0000:00:02.1": ("node_exporter", "pci0000:00/0000:00:02.1"),
    "0000:01:00.0": ("node_exporter", "pci0000:00/0000:00:02.1/0000:01:00.0"),
    "0000:45:00.0": ("node_exporter", "pci0000:40/0000:40:01.3/0000:45:00.0"),
    "0000:a2:00.0": ("procfs", "pci0000:a2/0000:a2:00.0"),
}
NVME, ROOT_PORT, I350, E810 = "0000:01:00.0", "0000:00:02.1", "0000:45:00.0", "0000:a2:00.0"
GPU_LABELS = {"vendor": "0x10de\n", "class": "0x030200\n"}


def build_tree(
    root: Path, devices: list[str] | None = None, relabel: dict[str, dict[str, str]] | None = None
) -> Path:
    """A real-shape sysfs under `root` from the resolved fixture directories.

    Each device's files go to devices/<link target>, its `*.symlink` files become real
    (dangling) symlinks, and bus/pci/devices/<BDF> is a relative symlink to it, as in
    the kernel. `relabel` overwrites files of a device, e.g. {NVME: GPU_LABELS}.
    """
    relabel = relabel or {}
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    chosen = devices if devices is not None else list(LINK_TARGETS)
    # parents before children: a child's directory lives inside its parent's
    for bdf in sorted(chosen, key=lambda b: LINK_TARGETS[b][1].count("/")):
        fixture_set, target = LINK_TARGETS[bdf]
        src = FIXTURES / fixture_set / "bus" / "pci" / "devices" / bdf
        dst = root / "devices" / target
        shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.symlink"))
        for link in src.glob("*.symlink"):
            os.symlink(link.read_text(), dst / link.name.removesuffix(".symlink"))
        for path in [dst, *dst.rglob("*")]:
            if not path.is_symlink():
                path.chmod(0o755 if path.is_dir() else 0o644)
        for name, content in relabel.get(bdf, {}).items():
            (dst / name).write_text(content)
        os.symlink(f"../../../devices/{target}", links / bdf)
    return root


def device_dir(root: Path, bdf: str) -> Path:
    return root / "devices" / LINK_TARGETS[bdf][1]


def source_for(root: Path) -> PcieSource:
    return PcieSource(PcieConfig(), Context(sysfs=root))


# --- the fixture tree -----------------------------------------------------------------


def test_the_source_is_registered() -> None:
    assert REGISTRY["pcie"] is PcieSource


def test_real_tree_with_no_nvidia_device_gives_no_series(tmp_path: Path) -> None:
    source = source_for(build_tree(tmp_path))
    assert source.collect() == []
    assert source.gpus() == []


def test_fixture_symlinks_resolve_like_the_kernel(tmp_path: Path) -> None:
    root = build_tree(tmp_path)
    link = root / "bus" / "pci" / "devices" / NVME
    assert os.readlink(link) == "../../../devices/pci0000:00/0000:00:02.1/0000:01:00.0"
    assert (link / "max_link_speed").read_text() == "16.0 GT/s PCIe\n"


def test_relabelled_nvme_under_a_gen3_x8_root_port_is_its_link_at_its_best(
    tmp_path: Path,
) -> None:
    root = build_tree(tmp_path, relabel={NVME: GPU_LABELS})
    source = source_for(root)
    got = by_key(source.collect())
    gpu, bridge = (NVME, NVME, "gpu"), (NVME, ROOT_PORT, "bridge")
    assert got == {
        # the device: 8.0 of 16.0 GT/s (Gen3 of Gen4), x4 of x4; its root port tops out
        # at Gen3: the link trains to Gen3 x4, the lower of both ends, and is not degraded
        ("pcie_link_generation", gpu): 3,
        ("pcie_link_generation_max", gpu): 4,
        ("pcie_link_speed_transfers_per_second", gpu): 8e9,
        ("pcie_link_speed_max_transfers_per_second", gpu): 16e9,
        ("pcie_link_width", gpu): 4,
        ("pcie_link_width_max", gpu): 4,
        ("pcie_link_generation_attainable", gpu): 3,
        ("pcie_link_width_attainable", gpu): 4,
        ("pcie_link_degraded", gpu): 0,
        ("pcie_aer_errors_total", (NVME, NVME, "correctable")): 0,
        ("pcie_aer_errors_total", (NVME, NVME, "nonfatal")): 0,
        ("pcie_aer_errors_total", (NVME, NVME, "fatal")): 0,
        # the AMD root port above it: 8.0 of 8.0 GT/s, x4 of x8; it has no AER files
        ("pcie_link_generation", bridge): 3,
        ("pcie_link_generation_max", bridge): 3,
        ("pcie_link_speed_transfers_per_second", bridge): 8e9,
        ("pcie_link_speed_max_transfers_per_second", bridge): 8e9,
        ("pcie_link_width", bridge): 4,
        ("pcie_link_width_max", bridge): 8,
        ("pcie_link_generation_attainable", bridge): 3,
        ("pcie_link_width_attainable", bridge): 4,
        ("pcie_link_degraded", bridge): 0,
        ("pcie_gpu_numa_node", (NVME,)): -1,
    }
    [path] = source.gpus()
    assert [(fn.bdf, fn.role) for fn in path] == [(NVME, "gpu"), (ROOT_PORT, "bridge")]


def test_relabelled_e810_gives_numa_node_and_a_healthy_link(tmp_path: Path) -> None:
    root = build_tree(tmp_path, relabel={E810: GPU_LABELS})
    got = by_key(source_for(root).collect())
    gpu = (E810, E810, "gpu")
    assert got[("pcie_gpu_numa_node", (E810,))] == 1
    assert got[("pcie_link_generation", gpu)] == 4
    assert got[("pcie_link_width", gpu)] == 8
    assert got[("pcie_link_degraded", gpu)] == 0
    # directly under the host bridge: no bridge series at all
    roles = {labels[2] for (name, labels) in got if name.startswith("pcie_link_")}
    assert roles == {"gpu"}


def test_aer_totals_are_read_from_the_total_lines(tmp_path: Path) -> None:
    correctable = FIXTURES / "node_exporter/bus/pci/devices" / NVME / "aer_dev_correctable"
    text = (
        correctable.read_text()
        .replace("BadTLP 0", "BadTLP 5")
        .replace("TOTAL_ERR_COR 0", "TOTAL_ERR_COR 7")
    )
    root = build_tree(tmp_path, relabel={NVME: {**GPU_LABELS, "aer_dev_correctable": text}})
    got = by_key(source_for(root).collect())
    assert got[("pcie_aer_errors_total", (NVME, NVME, "correctable"))] == 7  # TOTAL, not a sum


def test_a_change_after_polls_that_found_nothing_new_is_seen(tmp_path: Path) -> None:
    """A poll whose files read as the last one did gives the same samples (kept, not made
    anew); the poll after a link retrains or an AER total moves shows it."""
    root = build_tree(tmp_path, relabel={NVME: GPU_LABELS, E810: GPU_LABELS})
    source = source_for(root)
    first = source.collect()
    assert source.collect() == first and source.collect() == first
    nvme = device_dir(root, NVME)
    (nvme / "current_link_speed").write_text("2.5 GT/s PCIe\n")
    aer = nvme / "aer_dev_correctable"
    aer.write_text(aer.read_text().replace("TOTAL_ERR_COR 0", "TOTAL_ERR_COR 3"))
    got = by_key(source.collect())
    gpu = (NVME, NVME, "gpu")
    assert got[("pcie_link_generation", gpu)] == 1 and got[("pcie_link_degraded", gpu)] == 1
    assert got[("pcie_aer_errors_total", (NVME, NVME, "correctable"))] == 3
    assert got[("pcie_link_degraded", (E810, E810, "gpu"))] == 0


def test_a_bridge_without_files_drops_only_its_own_series(tmp_path: Path) -> None:
    # the i350's parent 0000:40:01.3 is not in the fixtures: an empty directory
    root = build_tree(tmp_path, devices=[I350], relabel={I350: GPU_LABELS})
    source = source_for(root)
    got = by_key(source.collect())
    [path] = source.gpus()
    assert [fn.bdf for fn in path] == [I350, "0000:40:01.3"]
    assert {labels[1] for (_, labels) in got if len(labels) == 3} == {I350}
    assert got[("pcie_link_generation", (I350, I350, "gpu"))] == 2
    assert got[("pcie_link_degraded", (I350, I350, "gpu"))] == 0
    assert got[("pcie_gpu_numa_node", (I350,))] == 0


@pytest.mark.parametrize(
    ("vendor", "pci_class", "is_gpu"),
    [
        ("0x10de", "0x030200", True),  # 3D controller (datacenter GPUs)
        ("0x10de", "0x030000", True),  # VGA (GeForce / RTX)
        ("0x10de", "0x068000", False),  # NVSwitch
        ("0x10de", "0x040300", False),  # the HD audio function of a GeForce card
        ("0x1002", "0x030000", False),  # another vendor's GPU
    ],
)
def test_only_nvidia_display_functions_are_gpus(
    tmp_path: Path, vendor: str, pci_class: str, is_gpu: bool
) -> None:
    labels = {"vendor": vendor + "\n", "class": pci_class + "\n"}
    root = build_tree(tmp_path, relabel={NVME: labels})
    source = source_for(root)
    samples = source.collect()
    assert bool(samples) is is_gpu
    assert len(source.gpus()) == int(is_gpu)


def test_missing_bus_directory_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"bus/pci/devices does not exist"):
        source_for(tmp_path / "nowhere").collect()


@pytest.mark.parametrize(
    ("current", "width", "expect_gen", "expect_degraded"),
    [
        ("8 GT/s\n", "4\n", 3, 1),  # pre-5.x kernels: no ".0", no "PCIe"
        ("16 GT/s\n", "4\n", 4, 0),
        ("Unknown speed\n", "4\n", None, None),  # old kernels' unknown
        ("Unknown\n", "0\n", None, None),  # link down
        ("2.5 GT/s PCIe\n", "0\n", 1, 1),  # a port whose link is down: below max anyway
        ("8.0 GT/s PCIe\n", "63\n", 3, 1),  # all-ones width of a device gone from the bus
    ],
)
def test_kernel_variants_of_the_link_files(
    tmp_path: Path,
    current: str,
    width: str,
    expect_gen: int | None,
    expect_degraded: int | None,
) -> None:
    files = {**GPU_LABELS, "current_link_speed": current, "current_link_width": width}
    # a Gen4 root port (the fixture's is Gen3): the link can attain Gen4 x4
    port = {"max_link_speed": "16.0 GT/s PCIe\n"}
    root = build_tree(tmp_path, relabel={NVME: files, ROOT_PORT: port})
    got = by_key(source_for(root).collect())
    gpu = (NVME, NVME, "gpu")
    assert got.get(("pcie_link_generation", gpu)) == expect_gen
    assert got.get(("pcie_link_degraded", gpu)) == expect_degraded


def test_garbage_files_drop_series_and_never_fail_the_poll(tmp_path: Path) -> None:
    root = build_tree(tmp_path, relabel={NVME: GPU_LABELS, E810: GPU_LABELS})
    nvme, rp = device_dir(root, NVME), device_dir(root, ROOT_PORT)
    (nvme / "current_link_speed").write_bytes(b"\xff\xfe\x00garbage GT/s")
    (nvme / "max_link_width").write_bytes(b"")
    (nvme / "aer_dev_fatal").write_bytes(b"TOTAL_ERR_FATAL lots\n")
    (nvme / "aer_dev_nonfatal").unlink()
    (nvme / "aer_dev_correctable").unlink()
    (nvme / "aer_dev_correctable").mkdir()  # a directory where a file should be
    (nvme / "numa_node").write_text("node zero\n")
    (rp / "max_link_speed").unlink()
    (rp / "current_link_width").write_text("-4\n")
    source = source_for(root)
    got = by_key(source.collect())
    gpu, bridge = (NVME, NVME, "gpu"), (NVME, ROOT_PORT, "bridge")
    assert ("pcie_link_generation", gpu) not in got
    assert ("pcie_link_width_max", gpu) not in got
    assert ("pcie_link_degraded", gpu) not in got  # neither pair is complete
    assert got[("pcie_link_generation_max", gpu)] == 4
    assert got[("pcie_link_width", gpu)] == 4
    assert not [k for k in got if k[0] == "pcie_aer_errors_total" and k[1][0] == NVME]
    assert ("pcie_gpu_numa_node", (NVME,)) not in got
    assert ("pcie_link_generation_max", bridge) not in got
    assert ("pcie_link_width", bridge) not in got
    assert ("pcie_link_degraded", bridge) not in got
    assert got[("pcie_link_generation", bridge)] == 3
    # the other GPU is untouched
    assert got[("pcie_link_degraded", (E810, E810, "gpu"))] == 0


def test_unreadable_or_vanished_gpu_never_fails_the_poll(tmp_path: Path) -> None:
    root = build_tree(tmp_path, relabel={NVME: GPU_LABELS, E810: GPU_LABELS})
    source = source_for(root)
    assert source.collect()
    # the device directory disappears under a still-listed link (hot removal race)
    shutil.rmtree(device_dir(root, E810))
    got = by_key(source.collect())
    assert not [k for k in got if k[1][0] == E810]
    assert got[("pcie_link_degraded", (NVME, NVME, "gpu"))] == 0  # Gen3 x4: both ends' best


def test_link_maxima_and_numa_node_are_read_once_per_function_on_the_bus(tmp_path: Path) -> None:
    """LnkCap and the NUMA node do not change while a function is on the bus: read at the
    first poll that could, not again; a function that left and came back is read anew."""
    root = build_tree(tmp_path, relabel={NVME: GPU_LABELS, E810: GPU_LABELS})
    source = source_for(root)
    nvme = device_dir(root, NVME)
    first = by_key(source.collect())
    gpu = ("pcie_link_width_max", (NVME, NVME, "gpu"))
    (nvme / "max_link_width").write_text("1\n")
    (nvme / "numa_node").write_text("7\n")
    (nvme / "current_link_width").write_text("2\n")  # the current width is read every poll
    got = by_key(source.collect())
    assert got[gpu] == first[gpu] and got[("pcie_link_width", (NVME, NVME, "gpu"))] == 2
    assert got[("pcie_gpu_numa_node", (NVME,))] == first[("pcie_gpu_numa_node", (NVME,))]
    listed = root / "bus" / "pci" / "devices" / E810
    target = listed.readlink()
    listed.unlink()  # one function leaves the bus, and is back
    by_key(source.collect())
    listed.symlink_to(target)
    got = by_key(source.collect())
    assert got[gpu] == 1 and got[("pcie_gpu_numa_node", (NVME,))] == 7


@settings(max_examples=50, deadline=None)
@given(
    garbage=st.dictionaries(
        st.sampled_from(
            [
                "current_link_speed",
                "max_link_speed",
                "current_link_width",
                "max_link_width",
                "aer_dev_correctable",
                "aer_dev_fatal",
                "numa_node",
                "vendor",
                "class",
            ]
        ),
        st.binary(max_size=64),
    )
)
def test_collect_on_random_garbage_never_raises(
    tmp_path_factory: pytest.TempPathFactory, garbage: dict[str, bytes]
) -> None:
    root = build_tree(
        tmp_path_factory.mktemp("sys"), devices=[ROOT_PORT, NVME], relabel={NVME: GPU_LABELS}
    )
    for name, content in garbage.items():
        (device_dir(root, NVME) / name).write_bytes(content)
        (device_dir(root, ROOT_PORT) / name).write_bytes(content[::-1])
    samples = source_for(root).collect()
    assert all(isinstance(s.value, float) for s in samples)


# --- caching ----------------------------------------------------------------------------


def test_paths_are_walked_once_and_the_listing_is_rescanned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    walks: list[str] = []
    real_walk = pcie_module.walk_to_root

    def counting_walk(resolved: str) -> tuple[pcie_module.PciFunction, ...]:
        walks.append(os.path.basename(resolved))
        return real_walk(resolved)

    monkeypatch.setattr(pcie_module, "walk_to_root", counting_walk)
    root = build_tree(tmp_path, devices=[ROOT_PORT, NVME], relabel={NVME: GPU_LABELS})
    source = source_for(root)
    for _ in range(3):
        source.collect()
    assert walks == [NVME]

    # a GPU appears: walked once; a GPU leaves: its series go
    build_tree(tmp_path, devices=[E810], relabel={E810: GPU_LABELS})
    assert {s.labels[0] for s in source.collect()} == {NVME, E810}
    (root / "bus" / "pci" / "devices" / NVME).unlink()
    assert {s.labels[0] for s in source.collect()} == {E810}
    assert walks == [NVME, E810]


def test_a_poll_whose_files_read_as_the_last_makes_nothing_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where every polled file reads as at the last poll (and every maximum and NUMA node
    is known), the poll's samples are the last poll's own, not worked out again."""
    root = build_tree(tmp_path, relabel={NVME: GPU_LABELS, E810: GPU_LABELS})
    source = source_for(root)
    first = source.collect()
    partners: list[int] = []
    real_partner = pcie_module.link_partner

    def counting_partner(path: tuple[pcie_module.PciFunction, ...], index: int) -> object:
        partners.append(index)
        return real_partner(path, index)

    monkeypatch.setattr(pcie_module, "link_partner", counting_partner)
    again = source.collect()
    assert again == first and all(a is b for a, b in zip(again, first, strict=True))
    assert partners == []
    (device_dir(root, ROOT_PORT) / "current_link_width").write_text("2\n")  # NVME's port
    got = by_key(source.collect())
    assert got[("pcie_link_width", (NVME, ROOT_PORT, "bridge"))] == 2
    assert got[("pcie_link_degraded", (NVME, ROOT_PORT, "bridge"))] == 1
    assert partners


@pytest.mark.parametrize("unknown", ["max_link_speed", "numa_node"])
def test_what_was_unreadable_is_read_again_while_the_polled_files_stay(
    tmp_path: Path, unknown: str
) -> None:
    """A function's maximum or a GPU's NUMA node unreadable at a poll is read at the next
    although the polled files read the same: such a poll's samples are not kept."""
    root = build_tree(tmp_path, devices=[ROOT_PORT, NVME], relabel={NVME: GPU_LABELS})
    nvme = device_dir(root, NVME)
    good = (nvme / unknown).read_text()
    (nvme / unknown).write_text("garbage\n")
    source = source_for(root)
    source.collect()
    key = {"max_link_speed": ("pcie_link_generation_max", (NVME, NVME, "gpu")),
           "numa_node": ("pcie_gpu_numa_node", (NVME,))}[unknown]  # fmt: skip
    assert key not in by_key(source.collect())
    (nvme / unknown).write_text(good)
    assert key in by_key(source.collect())


def test_an_entry_unreadable_at_a_listing_is_looked_at_again_under_the_same_listing(
    tmp_path: Path,
) -> None:
    root = build_tree(tmp_path, relabel={NVME: {"class": "0x030200\n"}})
    vendor = device_dir(root, NVME) / "vendor"
    vendor.unlink()  # not yet told a GPU or not
    source = source_for(root)
    source.collect()
    assert source.collect() == [] and source.gpus() == []
    vendor.write_text("0x10de\n")
    assert {s.labels[0] for s in source.collect()} == {NVME}


def test_samples_match_the_declared_specs(tmp_path: Path) -> None:
    root = build_tree(tmp_path, relabel={NVME: GPU_LABELS, E810: GPU_LABELS})
    specs = {spec.name: spec for spec in PcieSource.metrics}
    assert all(name.startswith("gpuwatchd_pcie_") for name in specs)
    assert specs["gpuwatchd_pcie_aer_errors_total"].type == "counter"
    samples = source_for(root).collect()
    assert {s.name for s in samples} == set(specs)
    for s in samples:
        assert len(s.labels) == len(specs[s.name].labels), s


# --- parsers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "gt", "gen"),
    [
        ("2.5 GT/s PCIe\n", 2.5, 1),
        ("5.0 GT/s PCIe\n", 5.0, 2),
        ("8.0 GT/s PCIe\n", 8.0, 3),
        ("16.0 GT/s PCIe\n", 16.0, 4),
        ("32.0 GT/s PCIe\n", 32.0, 5),
        ("64.0 GT/s PCIe\n", 64.0, 6),
        ("2.5 GT/s\n", 2.5, 1),
        ("5 GT/s\n", 5.0, 2),
        ("8 GT/s\n", 8.0, 3),
        ("16 GT/s\n", 16.0, 4),
        ("Unknown\n", None, None),
        ("Unknown speed\n", None, None),
        ("33 MHz PCI\n", None, None),
        ("", None, None),
        ("0 GT/s\n", None, None),
        ("20.0 GT/s PCIe\n", 20.0, None),
    ],
)
def test_parse_link_speed(text: str, gt: float | None, gen: int | None) -> None:
    assert parse_link_speed(text) == gt
    assert link_generation(parse_link_speed(text)) == gen


@pytest.mark.parametrize(
    ("text", "width"),
    [
        ("16\n", 16),
        ("4\n", 4),
        ("1\n", 1),
        ("0\n", None),
        ("63\n", None),
        ("x8\n", 8),
        ("", None),
        ("sixteen", None),
        ("-16", None),
    ],
)
def test_parse_link_width(text: str, width: int | None) -> None:
    assert parse_link_width(text) == width


def test_parse_aer_on_the_real_files() -> None:
    for name, total in [
        ("aer_dev_correctable", "TOTAL_ERR_COR"),
        ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL"),
        ("aer_dev_fatal", "TOTAL_ERR_FATAL"),
    ]:
        for fixture in [
            FIXTURES / "node_exporter/bus/pci/devices" / NVME,
            FIXTURES / "procfs/bus/pci/devices" / E810,
        ]:
            counts = parse_aer((fixture / name).read_text())
            assert counts[total] == 0 == aer_total((fixture / name).read_text(), total)
            assert len(counts) > 5
    text = "RxErr 3\nBadTLP 1\ndev_cor_errs_bit[12] 2\nTOTAL_ERR_COR 6\n"
    assert parse_aer(text) == {
        "RxErr": 3,
        "BadTLP": 1,
        "dev_cor_errs_bit[12]": 2,
        "TOTAL_ERR_COR": 6,
    }
    assert parse_aer("TOTAL_ERR_COR 18446744073709551615\n") == {"TOTAL_ERR_COR": 2**64 - 1}
    assert parse_aer("RxErr\nBadTLP x\n 5\n") == {}


@pytest.mark.parametrize(
    ("text", "node"),
    [("-1\n", -1), ("0\n", 0), ("1\n", 1), ("-2\n", -1), ("", None), ("one", None)],
)
def test_parse_numa_node(text: str, node: int | None) -> None:
    assert parse_numa_node(text) == node


def test_parse_hex() -> None:
    assert parse_hex("0x10de\n") == 0x10DE
    assert parse_hex("0x030200\n") == 0x030200
    assert parse_hex("10DE") == 0x10DE
    assert parse_hex("0xzz") is None


_SPEEDS = st.sampled_from(["2.5 GT/s PCIe\n", "16.0 GT/s PCIe\n", "8 GT/s\n", "Unknown\n"])
_AER = st.just((FIXTURES / "node_exporter/bus/pci/devices" / NVME / "aer_dev_fatal").read_text())


def _mangle(draw: st.DrawFn, base: str) -> str:
    cut = draw(st.integers(0, len(base)))
    junk = draw(st.text(max_size=20))
    at = draw(st.integers(0, cut))
    mangled = base[:cut]
    return mangled[:at] + junk + mangled[at:]


@st.composite
def mangled(draw: st.DrawFn, base: st.SearchStrategy[str]) -> str:
    return _mangle(draw, draw(base))


@settings(max_examples=300)
@given(
    text=st.one_of(
        st.text(),
        mangled(_SPEEDS),
        mangled(_AER),
        st.binary().map(lambda b: b.decode("utf-8", "replace")),
    )
)
def test_parsers_never_raise(text: str) -> None:
    speed = parse_link_speed(text)
    assert speed is None or speed > 0
    assert link_generation(speed) in (None, 1, 2, 3, 4, 5, 6)
    assert parse_link_width(text) in (None, 1, 2, 4, 8, 12, 16, 32)
    aer = parse_aer(text)
    assert all(isinstance(v, int) and v >= 0 for v in aer.values())
    for total in ("TOTAL_ERR_COR", "TOTAL_ERR_FATAL"):
        assert aer_total(text, total) == aer.get(total)
    numa = parse_numa_node(text)
    assert numa is None or numa >= -1
    parse_hex(text)


@settings(max_examples=200)
@given(digits=st.text(alphabet="0123456789", min_size=1, max_size=6000))
def test_huge_numbers_do_not_hit_the_int_digit_limit(digits: str) -> None:
    parse_aer(f"TOTAL_ERR_COR {digits}\n")
    parse_numa_node(digits)
    parse_link_width(digits)
    parse_link_speed(f"{digits} GT/s")


# --- a link is judged against both of its ends ------------------------------------------

SPEEDS = {3: "8.0 GT/s PCIe", 4: "16.0 GT/s PCIe", 5: "32.0 GT/s PCIe"}
# a switched path: root port, switch upstream port, downstream port, GPU
SWITCHED = ("0000:10:01.1", "0000:11:00.0", "0000:12:00.0", "0000:13:00.0")


def link_tree(root: Path, functions: dict[str, tuple[int, int, int, int]]) -> Path:
    """A sysfs tree of one path, root port first, the GPU last; per BDF (current gen,
    current width, max gen, max width) as the kernel writes them."""
    bdfs = list(functions)
    rel = "pci0000:10/" + "/".join(bdfs)
    for depth, bdf in enumerate(bdfs):
        d = root / "devices" / "pci0000:10" / "/".join(bdfs[: depth + 1])
        d.mkdir(parents=True)
        gen, width, max_gen, max_width = functions[bdf]
        is_gpu = depth == len(bdfs) - 1
        files = {
            "vendor": "0x10de\n" if is_gpu else "0x10b5\n",
            "class": "0x030200\n" if is_gpu else "0x060400\n",
            "current_link_speed": SPEEDS[gen] + "\n",
            "current_link_width": f"{width}\n",
            "max_link_speed": SPEEDS[max_gen] + "\n",
            "max_link_width": f"{max_width}\n",
        }
        for name, content in files.items():
            (d / name).write_text(content)
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True)
    for depth, bdf in enumerate(bdfs):
        os.symlink("../../../devices/pci0000:10/" + "/".join(bdfs[: depth + 1]), links / bdf)
    assert rel.endswith(bdfs[-1])
    return root


def degraded_devices(got: dict[tuple[str, tuple[str, ...]], float]) -> set[str]:
    return {labels[1] for (name, labels), v in got.items() if name == "pcie_link_degraded" and v}


@pytest.mark.parametrize(
    ("functions", "attainable", "degraded"),
    [
        # an x8 card in an x16 slot: the port reads "x8 of x16", yet x8 is the link's best
        (
            {
                SWITCHED[0]: (4, 16, 4, 16),
                SWITCHED[1]: (4, 16, 4, 16),
                SWITCHED[2]: (4, 8, 4, 16),
                SWITCHED[3]: (4, 8, 4, 8),
            },
            (4, 8),
            set(),
        ),
        # a Gen4 GPU under Gen5 switch ports and root port
        (
            {
                SWITCHED[0]: (5, 16, 5, 16),
                SWITCHED[1]: (5, 16, 5, 16),
                SWITCHED[2]: (4, 16, 5, 16),
                SWITCHED[3]: (4, 16, 4, 16),
            },
            (4, 16),
            set(),
        ),
        # a Gen5 GPU and switch in a Gen4 host: the uplink's best is Gen4
        (
            {
                SWITCHED[0]: (4, 16, 4, 16),
                SWITCHED[1]: (4, 16, 5, 16),
                SWITCHED[2]: (5, 16, 5, 16),
                SWITCHED[3]: (5, 16, 5, 16),
            },
            (5, 16),
            set(),
        ),
        # a real downgrade: GPU link at Gen3 x8 where both ends can do Gen4 x16
        (
            {
                SWITCHED[0]: (4, 16, 4, 16),
                SWITCHED[1]: (4, 16, 4, 16),
                SWITCHED[2]: (3, 8, 4, 16),
                SWITCHED[3]: (3, 8, 4, 16),
            },
            (4, 16),
            {SWITCHED[2], SWITCHED[3]},
        ),
        # the uplink trained to Gen3 between a Gen4 root port and a Gen5 switch
        (
            {
                SWITCHED[0]: (3, 16, 4, 16),
                SWITCHED[1]: (3, 16, 5, 16),
                SWITCHED[2]: (5, 16, 5, 16),
                SWITCHED[3]: (5, 16, 5, 16),
            },
            (5, 16),
            {SWITCHED[0], SWITCHED[1]},
        ),
        # an x16 GPU in an x8 (electrical) slot of a direct root port, Gen5 GPU, Gen4 port
        (
            {SWITCHED[0]: (4, 8, 4, 8), SWITCHED[3]: (4, 8, 5, 16)},
            (4, 8),
            set(),
        ),
    ],
    ids=[
        "x8-card-x16-slot",
        "gen4-gpu-gen5-port",
        "gen5-gpu-gen4-host",
        "gen3-x8-downgrade",
        "uplink-gen3",
        "direct-x8-slot-gen4-port",
    ],
)
def test_links_are_judged_against_the_lower_of_both_ends(
    tmp_path: Path,
    functions: dict[str, tuple[int, int, int, int]],
    attainable: tuple[int, int],
    degraded: set[str],
) -> None:
    root = link_tree(tmp_path, functions)
    source = source_for(root)
    got = by_key(source.collect())
    gpu = list(functions)[-1]
    assert degraded_devices(got) == degraded
    for bdf in functions:  # every function is reported, each with its link's best
        assert ("pcie_link_degraded", (gpu, bdf, "gpu" if bdf == gpu else "bridge")) in got
    own = (gpu, gpu, "gpu")
    assert (
        got[("pcie_link_generation_attainable", own)],
        got[("pcie_link_width_attainable", own)],
    ) == attainable
    [path] = source.gpus()
    # both ends of each link report the same best
    for i, fn in enumerate(path):
        partner = pcie_module.link_partner(path, i)
        if partner is not None:
            for metric in ("pcie_link_generation_attainable", "pcie_link_width_attainable"):
                assert (
                    got[(metric, (gpu, fn.bdf, fn.role))]
                    == got[(metric, (gpu, partner.bdf, partner.role))]
                )


def test_an_unreadable_partner_leaves_the_function_judged_against_its_own_maximum(
    tmp_path: Path,
) -> None:
    functions = {
        SWITCHED[0]: (4, 16, 4, 16),
        SWITCHED[1]: (4, 16, 4, 16),
        SWITCHED[2]: (4, 8, 4, 16),
        SWITCHED[3]: (4, 8, 4, 8),
    }
    root = link_tree(tmp_path, functions)
    gpu_dir = root / "devices" / "pci0000:10" / "/".join(SWITCHED)
    (gpu_dir / "max_link_width").write_text("garbage\n")
    got = by_key(source_for(root).collect())
    # the port no longer knows its partner is an x8 card: x8 of x16 it is, on its own
    assert degraded_devices(got) == {SWITCHED[2]}
    assert ("pcie_link_width_attainable", (SWITCHED[3], SWITCHED[3], "gpu")) not in got


def test_link_partner_pairs_the_path_from_the_gpu_up() -> None:
    fns = tuple(pcie_module.PciFunction(b, b, "bridge") for b in ("g", "dp", "up", "rp", "x"))
    assert [getattr(pcie_module.link_partner(fns, i), "bdf", None) for i in range(5)] == [
        "dp",
        "g",
        "rp",
        "up",
        None,
    ]
