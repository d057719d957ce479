"""The trainer's checkpoints: modes, overlap, staging, tiers, snapshots, resume."""
