"""The agent launching and watching ranks: launch, guard, workers, hangs, reports."""
