"""The fake bindings' one link to the simulator: the stand-in for `CDLL("libdcgm.so.4")`.

Loaded with the other bindings modules (by bare name, privately). It imports the
simulator's DCGM module normally, so every copy of these bindings reaches the same
simulated host engines (see gpuwatchd/sim/dcgm.py).
"""

from gpuwatchd.sim import dcgm as _simulator


def load_library(libDcgmPath=None):
    """A fake libdcgm client library, or None when the simulator says it is not installed."""
    return _simulator.load_library(libDcgmPath)


def bindings_major(module_file):
    """The DCGM major version ("3" or "4") whose bindings a module at `module_file` stands
    for: where DCGM 3 installs its bindings, DCGM 3's (their struct layouts differ)."""
    return _simulator.bindings_major(module_file)
