"""Jobs on a Slurm cluster: each in an allocation of its own, whose agents serve it alone (docs/slurm.md)."""
