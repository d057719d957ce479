"""The library's checkpoints and snapshots: resume at every shape, pruning, full disks."""
