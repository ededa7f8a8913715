"""gpuwatchd: is this GPU starved, and on what?"""

__version__ = "0.1.0"
