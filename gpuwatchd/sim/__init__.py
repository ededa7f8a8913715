"""The simulator: a scenario file becomes a node (fake NVML, written sysfs/procfs trees)."""
