"""NVLinks: how many a GPU has, and whether each is expected up.

A link is expected once it has been seen active since the daemon started, on a GPU of
an NVSwitch board (one active link reaching a switch: then every GPU with as many
links), or where the config's `expected_nvlinks` names it (see the package docstring).
What a link reaches is asked once, when it is first seen active
(nvmlDeviceGetNvLinkRemotePciInfo: the driver knows the far end of a trained link only):
where an expected link is down, `gpu_nvlink_down_peer_gpu` names the GPU it reached
(4-GPU boards and bridged pairs; NVSwitch boards' links reach switches, whose addresses
go to the shared `ties.SwitchTable`: the kmsg source ties an NVSwitch's SXid to the
GPUs behind it with them).
`NvLinks` is a mixin of NvmlSource, which sets the state it declares.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from gpuwatchd.config import NvmlConfig, SourceConfig
from gpuwatchd.metrics import Sample
from gpuwatchd.sources.nvml.metrics import NVLINK, NVLINK_DOWN, NVLINK_DOWN_PEER, NVLINK_EXPECTED
from gpuwatchd.sources.nvml.reads import _Gpu, _GpuLost
from gpuwatchd.sources.nvmlapi import Direct, sysfs_bus_id, text
from gpuwatchd.sources.ties import SwitchTable

log = logging.getLogger("gpuwatchd.sources.nvml")


class NvLinks:
    """NvmlSource's NVLink count per GPU and its links' expectations."""

    config: SourceConfig
    _gpus: list[_Gpu]
    _nv: Any
    _direct: Direct | None
    _nvswitch_links: set[int]
    _switches: SwitchTable
    _describe: Callable[[Any], str]

    def _links(self, gpu: _Gpu, count_field: int) -> int:
        """How many NVLinks the GPU has (0: none, or the driver cannot tell)."""
        nv, direct = self._nv, self._direct
        assert direct is not None
        try:
            ((code, _, count, _),) = direct.field_values(
                gpu.handle, direct.request([(count_field, 0)])
            )
        except nv.NVMLError as e:
            log.debug("nvml: GPU %d: NVLink count: %s", gpu.index, self._describe(e))
            return 0
        return int(count) if code == nv.NVML_SUCCESS and count is not None else 0

    def _nvlink_samples(
        self, gpu: _Gpu, states: Sequence[tuple[int, bool]], out: list[Sample]
    ) -> None:
        """The GPU's active and expected links from this poll's (link, active) states, each
        link down, and the GPU the down links reached (the lowest). The same states as the
        last poll's, with no GPU found on an NVSwitch since (what else makes a link
        expected only grows from the states themselves), give the same samples."""
        if not gpu.nvlinks:
            return
        key = (tuple(states), len(self._nvswitch_links))
        last = gpu.nvlink_last
        if last is None or last[0] != key:
            gpu.nvlink_last = None  # a remake cut short (GPU lost) may have seen links
            expected = [self._nvlink_expected(gpu, link, active) for link, active in states]
            down = [
                link for (link, active), e in zip(states, expected, strict=True) if e and not active
            ]
            samples = [
                Sample(NVLINK.name, gpu.labels, float(sum(a for _, a in states))),
                Sample(NVLINK_EXPECTED.name, gpu.labels, float(sum(expected))),
                *[Sample(NVLINK_DOWN.name, (*gpu.labels, str(link)), 1.0) for link in down],
            ]
            peers = [p for link in down if (p := gpu.nvlink_peer.get(link)) is not None]
            if peers:
                samples.append(Sample(NVLINK_DOWN_PEER.name, gpu.labels, float(min(peers))))
            # keyed by what was known before: a GPU found on an NVSwitch just now (this
            # one's first active link) makes the next poll count its links again
            last = gpu.nvlink_last = (key, samples)
        out += last[1]

    def _nvlink_expected(self, gpu: _Gpu, link: int, active: bool) -> bool:
        """Whether this link should be up (see the module's docstring): no call per poll,
        one nvmlDeviceGetNvLinkRemoteDeviceType per GPU at its first active link."""
        if active:
            gpu.nvlink_seen.add(link)
            if gpu.nvlink_remote is None:
                gpu.nvlink_remote = self._remote_type(gpu, link)
                if gpu.nvlink_remote == self._switch_type:
                    self._nvswitch_links.add(gpu.nvlinks)
            if link not in gpu.nvlink_peer:
                gpu.nvlink_peer[link] = self._remote_gpu(gpu, link)
        configured = self.config.expected_nvlinks if isinstance(self.config, NvmlConfig) else ()
        return (
            active
            or link in gpu.nvlink_seen
            or gpu.nvlinks in self._nvswitch_links
            or configured == "all"
            or link in configured
        )

    def _remote_gpu(self, gpu: _Gpu, link: int) -> int | None:
        """The index of the GPU an active link reaches; None for an NVSwitch, or where the
        driver cannot tell (asked once per link)."""
        nv = self._nv
        function = getattr(nv, "nvmlDeviceGetNvLinkRemotePciInfo", None)
        if function is None:
            return None
        try:
            remote = sysfs_bus_id(text(function(gpu.handle, link).busId))
        except nv.NVMLError as e:
            if e.value == nv.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost from e
            log.debug("nvml: GPU %d: NVLink %d remote: %s", gpu.index, link, self._describe(e))
            return None
        peer = next((g.index for g in self._gpus if g.bus_id == remote and g is not gpu), None)
        if peer is None and gpu.nvlink_remote == self._switch_type and gpu.bus_id:
            self._switches.link(remote, gpu.bus_id)  # the kmsg source ties SXids with it
        return peer

    @property
    def _switch_type(self) -> int:
        return int(getattr(self._nv, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2))

    def _remote_type(self, gpu: _Gpu, link: int) -> int:
        """What an active link reaches (NVML_NVLINK_DEVICE_TYPE_*); UNKNOWN (0xFF) if the
        driver or binding cannot tell (it is not asked again)."""
        nv = self._nv
        function = getattr(nv, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
        if function is None:
            return 0xFF
        try:
            return int(function(gpu.handle, link))
        except nv.NVMLError as e:
            if e.value == nv.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost from e
            log.debug("nvml: GPU %d: NVLink %d remote type: %s", gpu.index, link, self._describe(e))
            return 0xFF
