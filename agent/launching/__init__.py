"""How an attempt's processes start: torchrun's command line, its guard, the rank runner, each rank's log."""
