"""What holds a job in: the user it runs as, where it may write, its cgroups, every process it started."""
