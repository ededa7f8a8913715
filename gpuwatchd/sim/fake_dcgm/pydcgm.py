"""Fake DCGM bindings: pydcgm, the object API (handles, systems, groups, field groups).

Covers what gpuwatchd uses of DCGM's pydcgm: DcgmHandle, DcgmSystem (discovery,
fields, profiling pause/resume, groups, field group lookup), DcgmGroup (samples,
profiling) and DcgmFieldGroup. Not faked: config, health, policy, stats and diagnostics.
"""

from DcgmFieldGroup import DcgmFieldGroup  # noqa: F401
from DcgmGroup import DcgmGroup, DcgmGroupProfiling, DcgmGroupSamples  # noqa: F401
from DcgmHandle import DcgmHandle  # noqa: F401
from DcgmSystem import (  # noqa: F401
    DcgmSystem,
    DcgmSystemDiscovery,
    DcgmSystemFields,
    DcgmSystemProfiling,
)


class DcgmException(Exception):
    pass
