"""The states of tokens' roles, jobs, attempts, nodes and Slurm allocations, stored as strings."""

import enum


class Role(enum.StrEnum):
    admin = "admin"
    user = "user"
    agent = "agent"


class JobState(enum.StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


class AttemptState(enum.StrEnum):
    allocated = "allocated"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    stopped = "stopped"


ACTIVE_ATTEMPT_STATES = (AttemptState.allocated, AttemptState.running)  # an attempt or share that holds its nodes
# Failures after which an attempt's collectives cannot complete: its other shares are killed at once
# (StopCommand.at_once), not given a grace to save; a straggler's or a growing job's stop saves first.
BROKEN_CAUSES = ("exit", "signal", "hang", "node_lost")


class NodeState(enum.StrEnum):
    idle = "idle"
    busy = "busy"
    leaving = "leaving"  # its agent is stopping (SIGTERM): never given new work, gone when it stops
    reserved = "reserved"  # a spare held for a straggler's replacement (service/stragglers/spares.py)
    lost = "lost"


class SlurmState(enum.StrEnum):
    submitted, running, ended = "submitted", "running", "ended"  # ended: by Slurm, or released (scancel)
