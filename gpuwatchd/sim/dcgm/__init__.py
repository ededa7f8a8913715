"""The simulator's DCGM: a simulated nv-hostengine and a fake libdcgm client library.

Layers, as on a real node:

- `gpuwatchd/sim/fake_dcgm/` is a DCGM Python bindings directory (`pydcgm`,
  `dcgm_structs`, `dcgm_agent`, ...) with the real bindings' module names, classes,
  signatures, ctypes structs and exception classes. Like the real ones it is not a
  package: the modules import each other by bare name, and a consumer loads them
  from the directory (the DCGM source does so without leaving `sys.path` changed).
- Its `dcgm_structs._dcgmInit()` loads the client library. The real one opens
  `libdcgm.so.4` with ctypes; the fake asks its `_sim` module, which returns a
  `FakeDcgmLib` from this module: every DCGM C symbol the bindings call, taking the C
  arguments (`byref(struct)`, `c_void_p` handles, ctypes arrays, enumeration
  callbacks) and returning a `dcgmReturn_t` (library.py).
- `SimHostengine` (hostengine.py) is nv-hostengine for one simulated node: GPU groups, field groups,
  watches, profiling pause, all lost when it restarts. Field values come from the
  scenario's timeline at the node clock's time, sampled on the watch's update interval
  and converted to DCGM's units and blank sentinels.

How the fake finds its node: a `SimHostengine` registers itself under an address
`sim://<n>` (see `register`). The simulated node tells the DCGM source to
connect to that address (context extras `dcgm_hostengine`), and `dcgmConnect_v3`
looks it up; any other address behaves as a host with nothing listening. The registry
lives in a normally imported module, so every private copy of the fake bindings reaches
the same host engines. Embedded mode (`dcgmStartEmbedded`) attaches to
the host engine passed to `use_for_embedded`.

Scenario values that drive DCGM: the GPU values (profiling ratios, NVLink and PCIe
traffic, power, clocks, memory, clock event reasons, Xids, `lost`) and the host value
`dcgm_hostengine_up`: while it is false, connecting fails and every call on an existing
connection answers DCGM_ST_CONNECTION_NOT_VALID; when it comes back, the host engine is
a new process (a new generation) with no groups, field groups, watches or pause.
A GPU model with `dcgm_profiling: false` answers dcgmProfGetSupportedMetricGroups with
DCGM_ST_PROFILING_NOT_SUPPORTED and refuses watches of profiling fields.

What the real bindings do that once hid bugs, modelled on DCGM 4.6's: text fields read
as `str` and binary ones raise inside the enumeration callback (ctypes prints and
swallows it; libdcgm, called back once per value, stops its walk there); a refused
profiling watch undoes every watch of its field group (any field DCGM counts as
profiling: 1001-1096, 1532/1533); a field group holds at most 127 fields and unknown
ids are BADPARAM; `DcgmHandle.Shutdown()` leaves the handle in `DcgmHandle.handles` and a
field group stays in `DcgmFieldGroup.groups` until `Delete()`; DCGM's GPU ids need not
be NVML's indices (`set_gpu_ids`; DCGM_FI_DEV_NVML_INDEX says which GPU is which).

Test hooks on `SimHostengine`: `stop()`/`start()`/`restart()`, `hold_profiling()`
(another profiler holds the counters), `set_value()` (override one field, blanks
included), `inject_xid()`, `set_gpu_ids()`, `unsupported_profiling` ("error" or
"empty"), and `calls`. GPUs in `set_value`/`inject_xid` are NVML indices (the
scenario's); in DCGM calls, DCGM's ids. `library_missing()` makes libdcgm absent, and
`library_without(*symbols)` loads it without some C symbols (an older libdcgm).

Modules: `fields` (DCGM's constants and field table), `hostengine`, `values` (what is
integrated over the timeline), `library` (the client library).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.dcgm.fields import (
    FIELDS,
    FP64_BLANK,
    INT64_BLANK,
    NOT_FOUND,
    NOT_PERMISSIONED,
    NOT_SUPPORTED,
    STR_BLANK,
    blank,
    profiling_defaults,
)
from gpuwatchd.sim.dcgm.hostengine import (
    SimHostengine,
    lookup,
    register,
    unregister,
    use_for_embedded,
)
from gpuwatchd.sim.dcgm.library import (
    FakeDcgmLib,
    library_missing,
    library_without,
    load_library,
)
from gpuwatchd.sim.scenario import Timeline

FAKE_BINDINGS = Path(__file__).resolve().parent.parent / "fake_dcgm"

# Where DCGM installs its Python bindings, relative to the root file system
BINDINGS_DIRS = {
    "4": Path("usr/share/datacenter-gpu-manager-4/bindings/python3"),
    "3": Path("usr/local/dcgm/bindings/python3"),
}


def bindings_major(module_file: str) -> str:
    """The DCGM major version a fake bindings module stands for, from where it was loaded:
    "3" under DCGM 3's install location (`node.dcgm: "3"`, or a test's copy of that path),
    else "4". The fake bindings take DCGM 3.x's struct layouts there (dcgm_fields)."""
    directory = Path(module_file).parent.as_posix()
    return "3" if directory.endswith(BINDINGS_DIRS["3"].as_posix()) else "4"


def install_bindings(bindings: Path) -> None:
    """The fake bindings at `bindings`: a directory of links to their files. Not a link to
    the directory: the source imports from the real path (no link can be swapped after
    its trust check), and the fake `dcgm_fields` tells DCGM 3 from 4 by that path. Their
    `__pycache__` is one shared by every node (else each node compiles them again)."""
    bindings.mkdir(parents=True)
    for module in FAKE_BINDINGS.glob("*.py"):
        (bindings / module.name).symlink_to(module)
    compiled = FAKE_BINDINGS / "__pycache__"
    if not sys.dont_write_bytecode:
        with contextlib.suppress(OSError):  # an install the simulator may not write to
            compiled.mkdir(exist_ok=True)
    if compiled.is_dir():
        (bindings / "__pycache__").symlink_to(compiled, target_is_directory=True)


class SimDcgm:
    """DCGM as installed on one simulated node: bindings under its root, and a host engine.

    `node.dcgm` "4" or "3" puts the fake bindings where that DCGM version installs them
    under `root` and starts a host engine; "none" installs nothing.
    """

    def __init__(self, timeline: Timeline, clock: SimClock, root: Path) -> None:
        version = timeline.scenario.node.dcgm
        self.root = root
        self.hostname = timeline.scenario.node.hostname
        self.hostengine: SimHostengine | None = None
        if version != "none":
            self.hostengine = SimHostengine(timeline, clock, version)
            bindings = root / BINDINGS_DIRS[version]
            if not bindings.exists():
                install_bindings(bindings)

    def context_extras(self) -> dict[str, Any]:
        """What the DCGM source needs to find this node's DCGM (see sources/dcgm.py), and
        its environment: none of the simulator's (no NODE_NAME, so `Hostname` is the node's)."""
        address = self.hostengine.address if self.hostengine else "sim://not-installed"
        return {
            "rootfs": self.root,
            "dcgm_hostengine": address,
            "hostname": self.hostname,
            "environ": {},
        }

    def close(self) -> None:
        if self.hostengine is not None:
            self.hostengine.close()


__all__ = [
    "BINDINGS_DIRS",
    "FAKE_BINDINGS",
    "FIELDS",
    "FP64_BLANK",
    "INT64_BLANK",
    "NOT_FOUND",
    "NOT_PERMISSIONED",
    "NOT_SUPPORTED",
    "STR_BLANK",
    "FakeDcgmLib",
    "SimDcgm",
    "SimHostengine",
    "bindings_major",
    "blank",
    "library_missing",
    "library_without",
    "load_library",
    "lookup",
    "profiling_defaults",
    "register",
    "unregister",
    "use_for_embedded",
]
