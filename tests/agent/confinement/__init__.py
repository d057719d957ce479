"""The job's user and cgroups: confinement, escapes, leftovers, Slurm's agents."""
