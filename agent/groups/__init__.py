"""Each attempt's worker group, watched: states, rank records, progress, hangs, faults, its end; the supervisor."""
