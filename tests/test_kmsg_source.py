"""The kernel log source (gpuwatchd/sources/kmsg.py): real lines parsed, the device
followed from its end, bounded, past overwritten records and a restarted ring, refused
without CAP_SYSLOG, and each line tied to the GPU it concerns. The rules that read it
are checked by the scenarios (nvswitch-sxid-*, xid119-*, dataloader-worker-oom-*,
oom-kill-unrelated-*) in the corpus."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from gpuwatchd.config import KmsgConfig
from gpuwatchd.sim.node import SimNode
from gpuwatchd.sim.scenario import Scenario
from gpuwatchd.sim.writers.kmsg import SimKmsg
from gpuwatchd.sources.kmsg import MESSAGE, KmsgDevice, KmsgDown, KmsgSource
from gpuwatchd.sources.kmsglines import classify, parse_record
from gpuwatchd.sources.ties import PidOnGpu, pid_table, switch_table

FIXTURES = Path(__file__).parent / "fixtures" / "kmsg"
DMESG_PREFIX = re.compile(r"^\[[^\]]*\] ")


def test_the_xid_line_of_a_real_log_gives_the_code_process_and_driver_text():
    lines = (FIXTURES / "dmesg-with-xid-119.log").read_text().splitlines()
    found = [classify(DMESG_PREFIX.sub("", line)) for line in lines]
    xids = [f for f in found if f is not None]
    # five timeouts, each with the RPC history dumped after it (no line of its own)
    assert [(f.kind, f.code) for f in xids] == [("xid", "119")] * 5
    xid = xids[0]
    assert (xid.kind, xid.device, xid.code) == ("xid", "0000:9b:00.0", "119")
    assert (xid.pid, xid.process) == ("2024380", "nvidia-smi")
    assert xid.message.startswith("Timeout after 6s of waiting for RPC response from GPU4 GSP!")


def test_real_lines_of_every_kind():
    got = [classify(line) for line in (FIXTURES / "lines.txt").read_text().splitlines()]
    said = [None if g is None else (g.kind, g.device, g.code, g.fatal, g.link) for g in got]
    assert said == [
        ("sxid", "0000:c3:00.0", "20009", False, "28"),
        ("sxid", "0000:c3:00.0", "28006", False, "29"),
        ("sxid", "0000:c3:00.0", "24007", True, "30"),
        ("sxid", "0000:05:00.0", "12028", False, "32"),
        ("sxid", "0000:00:00.0", "11001", True, ""),
        ("xid", "0000:01:00.0", "79", False, ""),
        None,  # the root port's "error received": the device's own line follows
        ("aer", "0000:05:00.0", "aer_correctable", False, ""),
        None,  # AER's detail lines
        ("aer", "0000:01:00.0", "aer_fatal", False, ""),
        ("aer", "0000:00:01.1", "aer_nonfatal", False, ""),
        ("nvme_timeout", "nvme0", "", False, ""),
        ("nvme_timeout", "nvme0", "", False, ""),
        None,  # the abort's status
        ("nvme_timeout", "nvme1", "", False, ""),
        ("nic_link", "0000:01:00.0", "down", False, ""),
        ("nic_link", "0000:01:00.0", "up", False, ""),
        ("oom_summary", "", "", False, ""),
        ("oom_kill", "", "", False, ""),
        ("oom_summary", "", "", False, ""),
        ("oom_kill", "", "", False, ""),
    ]
    kills = [(g.pid, g.process) for g in got if g is not None and g.kind == "oom_kill"]
    assert kills == [("1461102", "ctags"), ("19289", "memcg_process")]
    summary = dict(got[19].fields)  # type: ignore[union-attr]
    assert (summary["constraint"], summary["oom_memcg"]) == ("CONSTRAINT_MEMCG", "/ltp_19257")


def test_a_record_is_its_header_and_first_line_unescaped():
    record = parse_record(
        b"14,5,120,-;NVRM: a\\x5cb\\x09c\n SUBSYSTEM=pci\n DEVICE=+pci:0000:01:00.0\n"
    )
    assert record is not None
    assert (record.facility, record.level, record.seq, record.usec) == (1, 6, 5, 120)
    assert record.text == "NVRM: a\\b\tc"
    assert parse_record(b"no header at all") is None
    assert parse_record(b"x,1,2,-;text") is None


# -- the source over the simulated /dev/kmsg -------------------------------------------

NODE = Scenario.model_validate(
    {
        "name": "kmsg-unit",
        "node": {"gpu_model": "h100-sxm5-80gb", "gpu_count": 2, "dcgm": "none"},
        "phases": [{"name": "idle", "duration": "10m"}],
    }
)


@pytest.fixture(scope="module")
def node():
    sim = SimNode(NODE, virtual=True)
    yield sim
    sim.close()


def source_on(node: SimNode, ring: SimKmsg, **settings: object) -> KmsgSource:
    context = node.context()
    context.extras["kmsg_open"] = ring.open
    return KmsgSource(KmsgConfig(**settings), context)  # type: ignore[arg-type]


def ring_of(node: SimNode, **kw: object) -> SimKmsg:
    return SimKmsg(node.root / "proc", node.timeline, **kw)  # type: ignore[arg-type]


def series(samples, name):
    return {s.labels: s.value for s in samples if s.name == name}


def xid(gpu_bdf: str, code: int = 13) -> str:
    return (
        f"NVRM: Xid (PCI:{gpu_bdf[:-2]}): {code}, pid=41, name=python, Graphics SM Warp Exception"
    )


def test_it_follows_the_log_from_its_end_a_bounded_number_of_records_a_poll(node):
    ring = ring_of(node, permitted=True)
    gpu = node.timeline.topology.gpu(1).bdf
    for _ in range(3):
        ring.log(3, 0.0, xid(gpu, 31))  # logged before the daemon started: never read
    source = source_on(node, ring, max_records=5)
    assert series(source.collect(), "gpuwatchd_kmsg_records_total") == {(): 0.0}
    for _ in range(12):
        ring.log(3, 1.0, xid(gpu))
    counts = []
    for _ in range(4):
        samples = source.collect()
        counts.append(series(samples, "gpuwatchd_kmsg_records_total")[()])
    assert counts == [5, 10, 12, 12]
    assert series(samples, "gpuwatchd_kmsg_xid_errors_total") == {(gpu, "13"): 12.0}
    message = series(samples, MESSAGE.name)
    assert list(message) == [
        (gpu, "xid", "13", "41", "python", "Xid 13 in python (pid 41): Graphics SM Warp Exception")
    ]


def test_a_poll_that_reads_no_record_returns_the_last_polls_samples(node):
    # most polls find the log as it was: the same sample objects, nothing made anew
    ring = ring_of(node, permitted=True)
    gpu = node.timeline.topology.gpu(0).bdf
    source = source_on(node, ring)
    source.collect()
    ring.log(3, 1.0, xid(gpu))
    first = source.collect()
    again = source.collect()
    assert again == first and all(a is b for a, b in zip(again, first, strict=True))
    ring.log(6, 2.0, "usb 1-1: new high-speed USB device")  # read, tied to nothing
    later = source.collect()
    assert series(later, "gpuwatchd_kmsg_records_total") == {(): 2.0}
    assert series(later, "gpuwatchd_kmsg_xid_errors_total") == {(gpu, "13"): 1.0}
    source.close()  # opened again at the log's end: the same series
    assert source.collect() == later


def test_records_overwritten_before_a_poll_are_counted_and_reading_goes_on(node):
    ring = ring_of(node, permitted=True, capacity=4)
    source = source_on(node, ring)
    source.collect()
    ring.log(4, 0.0, "first")
    source.collect()
    for k in range(10):  # a burst between two polls: the ring keeps the last 4
        ring.log(4, 1.0, f"line {k}")
    ring.log(3, 1.0, xid(node.timeline.topology.gpu(0).bdf))
    samples = source.collect()  # EPIPE, then the oldest record kept
    assert series(samples, "gpuwatchd_kmsg_records_lost_total") == {(): 7.0}
    assert series(samples, "gpuwatchd_kmsg_records_total") == {(): 5.0}
    assert sum(series(samples, "gpuwatchd_kmsg_xid_errors_total").values()) == 1


def test_a_ring_that_starts_again_is_followed_from_its_start(node):
    ring = ring_of(node, permitted=True)
    source = source_on(node, ring)
    source.collect()
    for k in range(5):
        ring.log(4, 0.0, f"line {k}")
    source.collect()
    ring.restart()
    ring.log(3, 1.0, xid(node.timeline.topology.gpu(0).bdf))
    samples = source.collect()
    assert source.restarts == 1
    assert sum(series(samples, "gpuwatchd_kmsg_xid_errors_total").values()) == 1
    assert series(samples, "gpuwatchd_kmsg_records_lost_total") == {(): 0.0}


def test_refused_without_cap_syslog_it_is_down_with_the_reason(node):
    ring = ring_of(node, permitted=False)
    opens = []
    context = node.context()
    context.extras["kmsg_open"] = lambda path: opens.append(path) or ring.open(path)
    source = KmsgSource(KmsgConfig(), context)
    with pytest.raises(KmsgDown) as refused:
        source.collect()
    assert "EPERM: kernel.dmesg_restrict=1: reading the kernel log needs CAP_SYSLOG" in str(
        refused.value
    )
    assert series(refused.value.samples, "gpuwatchd_kmsg_state")[("not_permitted",)] == 1.0
    with pytest.raises(KmsgDown):
        source.collect()
    assert len(opens) == 1  # not asked again every second: privileges come with a restart


def test_each_line_is_tied_to_the_gpus_it_concerns(node):
    ring = ring_of(node, permitted=True)
    context = node.context()
    context.extras["kmsg_open"] = ring.open
    gpu0, gpu1 = (node.timeline.topology.gpu(i) for i in (0, 1))
    switch_table(context.extras).link("0000:e1:00.0", gpu0.bdf)  # only GPU 0 reaches it
    pid_table(context.extras).publish(0.0, [(4001, PidOnGpu(gpu1.bdf, "worker"))])
    source = KmsgSource(KmsgConfig(), context)
    source.collect()
    # GPU 1's own switch port: on its PCIe path, not on GPU 0's
    bridge = node.timeline.topology.functions[gpu1.parent or ""].bdf
    for text in (
        "nvidia-nvswitch1: SXid (PCI:0000:e1:00.0): 24007, Fatal, Link 30 sourcetrack timeout",
        "nvidia-nvswitch2: SXid (PCI:0000:e2:00.0): 24007, Fatal, Link 31 sourcetrack timeout",
        f"pcieport {bridge}: AER: PCIe Bus Error: severity=Uncorrectable (Fatal), type=Data",
        "Out of memory: Killed process 4001 (pt_data_worker) total-vm:1kB, anon-rss:2097152kB",
        "Out of memory: Killed process 4999 (chrome) total-vm:1kB, anon-rss:1kB, file-rss:0kB",
        f"NVRM: GPU {gpu0.bdf}: GPU has fallen off the bus.",
    ):
        ring.log(3, 1.0, text)
    ring.log(3, 1.0, xid(gpu0.bdf), facility=1)  # written by user space: not the kernel's
    samples = source.collect()
    assert series(samples, "gpuwatchd_kmsg_gpu_events_total") == {
        (gpu0.bdf, "nvswitch_fatal"): 1.0,
        (gpu1.bdf, "aer_fatal"): 1.0,
        (gpu1.bdf, "oom_kill_worker"): 1.0,
        (gpu0.bdf, "fallen_off_bus"): 1.0,
    }
    assert series(samples, "gpuwatchd_kmsg_oom_kills_total") == {(): 2.0}
    assert len(series(samples, "gpuwatchd_kmsg_nvswitch_errors_total")) == 2  # per switch
    assert not series(samples, "gpuwatchd_kmsg_xid_errors_total")
    texts = {labels[1]: labels[-1] for labels in series(samples, MESSAGE.name)}
    assert texts["oom_kill_worker"] == (
        "pt_data_worker (pid 4001) killed by the OOM killer: out of memory, 2.0 GiB resident"
    )
    assert not MESSAGE.shown(detail=True)  # free text: never exported, even in detail


@pytest.mark.skipif(
    not os.access("/dev/kmsg", os.R_OK), reason="this machine's /dev/kmsg is not readable"
)
def test_the_real_device_opens_at_its_end_and_reads_whole_records():
    try:
        device = KmsgDevice("/dev/kmsg")
    except PermissionError:
        pytest.skip("kernel.dmesg_restrict and no CAP_SYSLOG here")
    try:
        for _ in range(100):  # what the kernel logs meanwhile, then EAGAIN
            try:
                record = parse_record(device.read())
            except BlockingIOError:
                break
            assert record is not None
        else:
            pytest.fail("the device kept returning records: it did not start at the end")
    finally:
        device.close()
