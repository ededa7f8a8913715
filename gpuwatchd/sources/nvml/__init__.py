"""Per-GPU telemetry from NVML, through the real bindings (nvidia-ml-py's `pynvml`).

The binding is `context.pynvml` when set (the simulator passes a private pynvml whose C
library is a fake), else `import pynvml`. NVML is initialised on the first poll; if that
fails (no libnvidia-ml, driver not loaded, ...) the poll raises SourceError with a
one-line reason and the next poll tries again.

What a poll costs is counted in NVML calls, each tens of microseconds of CPU in the
driver. Per GPU and poll:
- one nvmlDeviceGetFieldValues for everything the driver can batch (`FIELDS`): power,
  ECC totals and mode, the state of every NVLink (a field per link, scoped by link
  index), the PCIe TX/RX byte counters (exported as rates between two reads, from the
  driver's own timestamps; 32-bit counters on an H200, taken modulo 2**32, so exact up
  to 2**32 bytes per interval) and, every `SLOW_EVERY` polls, the PCIe replay counter
  (GSP round trips of 150-180 µs each on an H200, the rest of the batch ~1 µs a field)
  and the row remapper's pending and failure flags (Ampere+ datacenter GPUs);
- one call each for what has no field (`READS`): utilization, memory, SM clock,
  P-state, clock event reasons and the running compute processes;
- slow facts (`SLOW`: temperature, memory clock, PCIe link generation and width,
  persistence mode, power limit, the graphics processes, the NVLink fabric registration)
  every `SLOW_EVERY` polls, kept in between;
- static facts (identity, NVLink count, maximum clocks and link) once, and once per
  GPU what its first active NVLink reaches (nvmlDeviceGetNvLinkRemoteDeviceType);
- one event wait that drains pending Xid events without blocking.
nvmlDeviceGetPcieThroughput is never called: it blocks ~21 ms per call to sample a
counter. Where the driver lacks the byte counters (before R555) the PCIe rates are left
out (logged once). A field the driver answers NOT_SUPPORTED is dropped from the batch;
where a classic call reads the same value (power) that call is used instead.

The process lists are shared: the nvml source publishes each poll's lists in a
`ProcessTable` (`context.extras["nvml_processes"]`) that the processes source reads
instead of asking NVML again.

Errors, per GPU and per call (or field):
- NOT_SUPPORTED / FUNCTION_NOT_FOUND: the series is dropped for that GPU and the call
  is never made again on it (logged once). A read with an older alternative (clock
  event reasons -> throttle reasons, the versioned fabric call -> the first one) falls
  back to it on FUNCTION_NOT_FOUND instead, or on ARGUMENT_VERSION_MISMATCH (a binding
  whose struct version the driver does not know yet).
- GPU_IS_LOST: this poll reports only `gpu_lost 1`, `gpu_info` and the Xid counters
  for that GPU (the Xid 79 drained as it fell off is what explains the loss); other
  GPUs go on.
- anything else: that series is missing from this poll only.
A call that blocks (a GPU gone bad inside the driver) cannot be interrupted, so the
calls are made by a reader thread that the poll waits for at most half the source's
timeout. A GPU whose call has not returned by then is reported with its identity, its
Xids and `gpu_nvml_hung_seconds` (how long it has blocked), not its readings; GPUs the
reader had not reached yet keep their last values with `gpu_nvml_stale 1`. The blocked
reader is retired (it ends when its call returns) and a new one makes the next polls'
calls, leaving the hung GPU alone while its call is in flight: the other GPUs are read
as before (where the driver lets them; one that blocks too is left alone in turn, so at
most one thread per GPU is ever stuck). Every other read is made once per poll as
listed above: no call is added.

The NVLink fabric (`nvmlDeviceGetGpuFabricInfoV`, R550+; `nvmlDeviceGetGpuFabricInfo`
before): on NVSwitch boards, Hopper and later, the GPU's registration with the fabric,
as `gpu_fabric_state` (1 not started, 2 in progress, 3 completed) and, where a completed
registration failed, `gpu_fabric_status{status}` (nvml.h: the status is to be read only
once completed). Elsewhere the call answers NOT_SUPPORTED (or SUCCESS with the state
NOT_SUPPORTED, taken alike): asked once, no series. nvml.h's state is an unsigned char
that pynvml reads as 4 bytes: the low byte is taken.

An NVLink is expected up once it has been seen active since
the daemon started, or when the board wires every link: a GPU whose active link reaches
an NVSwitch (HGX/DGX baseboards connect all links of all GPUs to the switches; then so
is every GPU of the node with as many links), or when the config's `expected_nvlinks`
names it. A link never seen active is not otherwise: PCIe boards without an NVLink
bridge report every link inactive, and bridged H100 PCIe cards 6 of their 18 by design.
A link down before the daemon starts is thus known on an NVSwitch board or by config.
Exported per GPU as counts (`gpu_nvlinks_active`, `gpu_nvlinks_expected`), and each
expected link that is down by index (`gpu_nvlink_down{link}`, only while it is).

NVML's event data carries no time, so an Xid is stamped when it is drained, with
`context.extras["now"]` (a wall-clock callable; default time.time) so that a replay in
virtual time stamps it in scenario time. `gpu_info`'s pci_bus_id is in the sysfs form
("0000:34:00.0", as the pcie source's gpu_bus_id), not NVML's "00000000:34:00.0".

Layout
------
The source is split by responsibility into the modules of this package; the package
itself exports the source. Import anything else from the module that defines it.

* `metrics`: the metric specs and the clock event reasons' labels;
* `reads`: what is read per GPU -- the call table (`READS`, `POWER_READ`), the
  field-values batch (`FIELDS`, the NVLink state and count fields), their cadence, and
  `_Gpu`, what the source remembers about one GPU;
* `reader`: the reader thread and one poll's hand-off (`_Reader`, `_Poll`) and the
  polling that waits for it a bounded time, reporting a GPU whose call has blocked
  (`Polling`: `collect`, the hung-GPU handling);
* `nvlink`: the NVLink count and whether each link is expected up (`NvLinks`);
* `mig`: the MIG mode, MIG device discovery and per-instance series (`MigReads`,
  `MIG_SPECS`; docs/mig.md);
* `source`: `NvmlSource` (registered as "nvml"), which wires them: NVML's lifecycle,
  errors, identities, Xid events and each GPU's reads.

Every module logs as `gpuwatchd.sources.nvml`.
"""

from __future__ import annotations

from gpuwatchd.sources.nvml.source import NvmlSource

__all__ = ["NvmlSource"]
