"""Jobs: who may see which, the gang scheduler, the checkpoint decisions of a launch, the service's own events."""
