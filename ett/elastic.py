"""Elastic jobs: the same training at fewer ranks (docs/library.md, "Elastic jobs").

A run that may go on at fewer ranks than its full size (the service shrinks an elastic job when it
loses a node and no spare is free) keeps its optimizer steps the same by keeping two things:

- the global batch: every step trains on `global_batch` samples at any size, each rank
  accumulating gradients over `accumulation_steps` micro batches of `micro_batch` samples;
- the samples: they are numbered globally, step s (from 1) taking samples (s-1)*global_batch to
  s*global_batch - 1, cut into `micro_batches` = global_batch / micro_batch slots. Slot c holds
  the step's samples c, c + K, c + 2K, ... (K slots: at full size without accumulation rank r
  takes every world_size-th sample, as torch's DistributedSampler does). Rank r takes slots
  r*a to r*a + a - 1 (a = accumulation_steps), so a slot is the same samples at any size, and at
  full size rank r's micro batches are its own.

Its averaging: DDP and FSDP average gradients over the ranks, so a rank that scales each micro
batch's mean loss by 1/accumulation_steps ends its step with the mean gradient over the slots,
as at full size, up to the order of the additions.
"""

from dataclasses import dataclass

from ett.errors import UsageError


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"run.elastic: {name} must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class ElasticPlan:
    """What one rank trains on at its present size, the same global batch at every size."""

    global_batch: int  # samples per optimizer step, at any size
    micro_batch: int  # samples per forward and backward
    full_world_size: int  # the job's ranks at full size
    world_size: int  # the ranks of this attempt
    rank: int

    @classmethod
    def declare(cls, global_batch: int, micro_batch: int, world_size: int, full_world_size: int,
                rank: int) -> "ElasticPlan":
        """The plan of `rank`, or a UsageError naming what cannot split: the global batch over the
        full size, or over the present size (a size the run never declared)."""
        global_batch = _positive_int(global_batch, "global_batch")
        micro_batch = _positive_int(micro_batch, "micro_batch")
        if global_batch % (full_world_size * micro_batch):
            raise UsageError(f"run.elastic: global_batch {global_batch} does not split into micro batches of "
                             f"{micro_batch} over the full {full_world_size} ranks: make it a multiple of "
                             f"{full_world_size * micro_batch}")
        if global_batch % (world_size * micro_batch):
            raise UsageError(f"run.elastic: WORLD_SIZE {world_size} is not a size this run keeps its training at "
                             f"(global_batch {global_batch}, micro_batch {micro_batch}, full size {full_world_size})")
        return cls(global_batch, micro_batch, full_world_size, world_size, rank)

    @property
    def micro_batches(self) -> int:
        """Micro batches (slots) per step over all ranks."""
        return self.global_batch // self.micro_batch

    @property
    def accumulation_steps(self) -> int:
        """Micro batches per step on this rank: the gradients of as many backward passes add up."""
        return self.micro_batches // self.world_size

    @property
    def world_sizes(self) -> list[int]:
        """The sizes below the full one at which the global batch splits into whole micro batches on
        every rank: the sizes the service may shrink the job to (the `elastic` event)."""
        return [size for size in range(1, self.full_world_size) if self.micro_batches % size == 0]

    @property
    def slots(self) -> list[int]:
        """This rank's slots of every step, in the order it trains them."""
        first = self.rank * self.accumulation_steps
        return list(range(first, first + self.accumulation_steps))

    def sample_indices(self, step: int) -> list[list[int]]:
        """This rank's micro batches of `step` (from 1): each a list of `micro_batch` global sample
        numbers. Sample n of a dataset of N samples is position n % N of epoch n // N's order."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise UsageError(f"plan.sample_indices({step!r}): a step number is an integer >= 1")
        first = (step - 1) * self.global_batch
        return [list(range(first + slot, first + self.global_batch, self.micro_batches)) for slot in self.slots]
