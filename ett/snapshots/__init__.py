"""The fast tier: each rank's snapshot on node-local disk, its copies on peer nodes, and the restore that picks one."""
