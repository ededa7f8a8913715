"""The simulator's procfs and sysfs writers: a scenario rendered in the kernel's real formats."""
