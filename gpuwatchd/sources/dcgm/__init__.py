"""DCGM: what the GPU's engines actually do (profiling fields) and DCGM's device fields.

NVML's utilization only says that some kernel ran. DCGM's profiling fields (1001-1012 by
default; DCGM's profiling range is 1001-1096 and 1532/1533) say how busy the SMs, the
tensor/FP pipes, DRAM and the PCIe/NVLink links were, which is what the starvation rules
about kernels, memory bandwidth and NCCL need.

Bindings. DCGM's Python bindings (`pydcgm`, `dcgm_structs`, `dcgm_agent`, ...) are
not on PyPI; they ship with DCGM (`/usr/share/datacenter-gpu-manager-4/bindings/python3`
for DCGM 4, `/usr/local/dcgm/bindings/python3` for DCGM 3, or `bindings_path`). They
import each other by bare name, so `load_bindings` puts the directory on `sys.path`
only while importing them, then takes it and the modules out of `sys.path` and
`sys.modules` again (restoring any same-named modules it displaced): the source holds
a private copy and the rest of the process never sees them. Bindings that anyone but
root or the daemon's user could change (the directory, a file below it, a directory
above it: gpuwatchd/filetrust.py) are refused, importing nothing: the source is
`not_installed` with the reason, and tries again after its back-off. The simulator
installs its fake bindings (gpuwatchd/sim/fake_dcgm) the same way, under the simulated
node's root (context extras `rootfs`), and names its host engine (extras `dcgm_hostengine`).

Connection. `hostengine` is "localhost" (or "host[:port]"), "unix:///path/to/socket"
or "embedded" (an in-process host engine). One pydcgm.DcgmHandle; groups and field
groups are named `gpuwatchd_<pid>...` so that a dcgm-exporter (or a second gpuwatchd)
can share the host engine. Device fields are watched in field groups of at most 127
(DCGM's limit); profiling fields get field groups of their own (DCGM drops the whole
watch when the profiling module refuses), watched only on GPUs whose supported
profiling metric groups contain them. Since DCGM 4.5 pydcgm keeps handles and field
groups in registries that only its own tests empty; the source untracks its own. Which
fields are profiling ones is DCGM's own rule (its range, and the DCGM_FI_PROF_* names of
the bindings), so a refused profiling watch never holds a device field.

Fields. Only numbers are exported: the config rejects DCGM's text and binary fields,
and once connected the source leaves out any field DCGM's own metadata says is not a
number (or does not know), with one warning; a value that is not a number anyway (a host
engine of another version) is left out, never failing the poll.

GPUs. The `gpu` label is the NVML index (DCGM_FI_DEV_NVML_INDEX), as the NVML source's:
DCGM keeps a GPU's id across re-detection by UUID, so its ids can differ from NVML's.

States (`gpuwatchd_dcgm_state{state}`, logged once per change):
- `not_installed`: no bindings directory, or bindings but no libdcgm;
- `hostengine_down`: cannot connect;
- `connection_lost`: a connected session broke (host engine stopped or restarted);
- `error`: anything else DCGM refused while setting up;
- `connected`: reading. Per GPU, `gpuwatchd_gpu_dcgm_profiling_state{state}` is
  `active`, `paused`, `unsupported` (the GPU cannot profile) or `refused` (the watch
  failed, e.g. another profiler holds the counters; retried every `profiling_retry`).
In every state but `connected` the poll raises `DcgmUnavailable` (a SourceError that
carries the state samples), so `gpuwatchd_source_up{source="dcgm"}` is 0. Reconnects
back off exponentially (from `interval` up to `reconnect_backoff_max`) on the clock the
poll observes; a poll inside the back-off window touches nothing. A connection attempt
is bounded by `connect_timeout`, which must be shorter than the poll's `timeout`.

Blank values (DCGM's INT64/FP64 blank sentinels and their NOT_FOUND/NOT_SUPPORTED/
NOT_PERMISSIONED offsets, or a non-OK status) are absent series, never numbers.

`pause_profiling(seconds)` pauses DCGM's profiling (so Nsight can take the counters)
until the time runs out (at most `max_profiling_pause`); the poll resumes it. Hopper
and newer read profiling through GPM, which does not conflict: DCGM answers
NOT_SUPPORTED and the pause is a no-op there.

With `exporter_compat`, the source also emits dcgm-exporter's default counters (and
every configured field dcgm-exporter has a name for) under dcgm-exporter's names and
labels, with DCGM's raw units; see docs/dcgm.md.

Reading. Each watch is read with one `dcgm_agent.dcgmEntitiesGetLatestValues` call (its
GPUs x its fields, an array of dcgmFieldValue_v2 decoded in bulk), not pydcgm's
`GetLatest_v2` (a Python callback and an object per value); a libdcgm without the symbol
falls back to `dcgmGetLatestValues_v2` with a callback of our own that never raises (a
raise inside libdcgm's walk stops it: the values after it are lost).

Modules: `fields` (what each field becomes, which can be read, how they are grouped),
`bindings` (finding and loading DCGM's bindings; their registries), `session` (one
connection: groups, watches, reading), `latest` (a watch's values in one call), `source`
(states, back-off, connecting, pausing), `xid` (dcgm-exporter's `err_msg` for each Xid).
"""

from gpuwatchd.config import DcgmConfig
from gpuwatchd.sources.dcgm.bindings import (
    BINDINGS_DIRS,
    Bindings,
    UntrustedBindings,
    find_bindings,
    load_bindings,
)
from gpuwatchd.sources.dcgm.fields import (
    COMPAT_DEFAULT_FIELDS,
    DEFAULT_FIELDS,
    FIELD_MAPS,
    FieldMap,
    compat_specs,
)
from gpuwatchd.sources.dcgm.source import DcgmSource, DcgmUnavailable

__all__ = [
    "BINDINGS_DIRS",
    "COMPAT_DEFAULT_FIELDS",
    "DEFAULT_FIELDS",
    "FIELD_MAPS",
    "Bindings",
    "DcgmConfig",
    "DcgmSource",
    "DcgmUnavailable",
    "FieldMap",
    "UntrustedBindings",
    "compat_specs",
    "find_bindings",
    "load_bindings",
]
