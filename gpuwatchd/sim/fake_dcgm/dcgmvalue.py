"""Fake DCGM bindings: blank sentinels and DcgmValue, as in DCGM's dcgmvalue.py.

DCGM reports a missing value in the value itself: the largest int64/int32/double values
are reserved, and small offsets above the base say why (not found, not supported, not
permissioned). Anything at or above the base is blank.
"""

DCGM_INT8_BLANK = 0x70
DCGM_INT32_BLANK = 0x7FFFFFF0
DCGM_INT64_BLANK = 0x7FFFFFFFFFFFFFF0
DCGM_FP64_BLANK = 140737488355328.0  # 2**47: still counts up in steps of 1
DCGM_STR_BLANK = "<<<NULL>>>"

DCGM_INT32_NOT_FOUND = DCGM_INT32_BLANK + 1
DCGM_INT64_NOT_FOUND = DCGM_INT64_BLANK + 1
DCGM_FP64_NOT_FOUND = DCGM_FP64_BLANK + 1.0
DCGM_STR_NOT_FOUND = "<<<NOT_FOUND>>>"

DCGM_INT32_NOT_SUPPORTED = DCGM_INT32_BLANK + 2
DCGM_INT64_NOT_SUPPORTED = DCGM_INT64_BLANK + 2
DCGM_FP64_NOT_SUPPORTED = DCGM_FP64_BLANK + 2.0
DCGM_STR_NOT_SUPPORTED = "<<<NOT_SUPPORTED>>>"

DCGM_INT32_NOT_PERMISSIONED = DCGM_INT32_BLANK + 3
DCGM_INT64_NOT_PERMISSIONED = DCGM_INT64_BLANK + 3
DCGM_FP64_NOT_PERMISSIONED = DCGM_FP64_BLANK + 3.0
DCGM_STR_NOT_PERMISSIONED = "<<<NOT_PERM>>>"


def DCGM_INT8_IS_BLANK(val):
    return val >= DCGM_INT8_BLANK


def DCGM_INT32_IS_BLANK(val):
    return val >= DCGM_INT32_BLANK


def DCGM_INT64_IS_BLANK(val):
    return val >= DCGM_INT64_BLANK


def DCGM_FP64_IS_BLANK(val):
    return val >= DCGM_FP64_BLANK


def DCGM_STR_IS_BLANK(val):
    return val.startswith("<<<") and ">>>" in val


class DcgmValue:
    """One value (int, float or str) that may be a blank sentinel."""

    def __init__(self, value):
        self.value = value

    def SetFromInt32(self, i32Value):
        value = int(i32Value)
        if not DCGM_INT32_IS_BLANK(value):
            self.value = value
        else:
            self.value = {
                DCGM_INT32_NOT_FOUND: DCGM_INT64_NOT_FOUND,
                DCGM_INT32_NOT_SUPPORTED: DCGM_INT64_NOT_SUPPORTED,
                DCGM_INT32_NOT_PERMISSIONED: DCGM_INT64_NOT_PERMISSIONED,
            }.get(value, DCGM_INT64_BLANK)

    def IsBlank(self):
        if self.value is None:
            return True
        if isinstance(self.value, int):
            return DCGM_INT64_IS_BLANK(self.value)
        if isinstance(self.value, float):
            return DCGM_FP64_IS_BLANK(self.value)
        if isinstance(self.value, str):
            return DCGM_STR_IS_BLANK(self.value)
        raise Exception(f"Unknown type: {type(self.value)}")

    def __str__(self):
        return str(self.value)
