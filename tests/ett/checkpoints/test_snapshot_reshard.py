"""The fast tier's snapshots resharded at another world size (ett/snapshots/reshard.py): which old
ranks' shards make each new rank's, and what does not fit. The real runs (torchrun ranks, FSDP2,
experts resharded) are tests/trainer/test_elastic.py and tests/e2e/recovery/test_elastic.py."""

import pytest
import torch
from torch.distributed.tensor import Shard

from ett.snapshots.file_format import Slot
from ett.snapshots.reshard import Plan, Unfit
from ett.state import ShardLayout

WHOLE = (10, 3)


def shard(offset: int, rows: int, offsets: bool = True) -> dict:
    """ModelOptimizerState's form of a DTensor's shard of a (10, 3) tensor, rows from `offset`."""
    layout = ShardLayout((Shard(0),), WHOLE, (3, 1), (offset, 0) if offsets else None)
    return {"shard": Slot(torch.float32, (rows, 3)), "layout": layout}


def rows_of(offset: int, rows: int) -> torch.Tensor:
    return torch.arange(offset * 3, (offset + rows) * 3, dtype=torch.float32).reshape(rows, 3)


def template(weight: dict, lr: float = 0.1, step: int = 7) -> dict:
    scalar = Slot(torch.float32, ())
    return {"model": {"params": [weight], "optim": [{"step": scalar}], "groups": [{"lr": lr}]}, "progress": step}


def filled(old_template: dict, offset: int, rows: int, step_value: float) -> dict:
    """An old rank's snapshot as read: its template with its tensors."""
    layout = old_template["model"]["params"][0]["layout"]
    return {"model": {"params": [{"shard": rows_of(offset, rows), "layout": layout}],
                      "optim": [{"step": torch.tensor(step_value)}], "groups": [{"lr": 0.1}]}, "progress": 7}


# Four old ranks, as torch.chunk splits 10 rows: 3, 3, 3, 1.
OLD = [(0, 3), (3, 3), (6, 3), (9, 1)]
OLDS = [template(shard(offset, rows), lr=0.1, step=7) for offset, rows in OLD]
READ = {rank: filled(OLDS[rank], *OLD[rank], step_value=5.0 + rank) for rank in range(4)}


@pytest.mark.parametrize("new_offset, new_rows, from_ranks", [(0, 4, {0, 1}), (4, 3, {1, 2}), (7, 3, {2, 3})])
def test_each_new_shard_is_copied_from_the_old_shards_it_overlaps(new_offset, new_rows, from_ranks):
    new = template(shard(new_offset, new_rows), lr=0.5, step=0)  # the fresh state's plain values are not kept
    plan = Plan(new, OLDS, local=set())
    assert plan.ranks() == from_ranks | {0}  # rank 0's scalar `step`: replicated, one copy taken
    state = plan.filled({rank: READ[rank] for rank in plan.ranks()})
    weight = state["model"]["params"][0]
    torch.testing.assert_close(weight["shard"], rows_of(new_offset, new_rows))
    assert weight["layout"] is new["model"]["params"][0]["layout"]  # the new layout, to rebuild the DTensor
    assert state["model"]["groups"] == [{"lr": 0.1}] and state["progress"] == 7  # old rank 0's plain values
    assert state["model"]["optim"][0]["step"].item() == 5.0


def test_a_whole_tensor_at_the_new_size_is_made_of_every_old_shard_and_a_replicated_one_read_where_it_lies():
    whole = template(Slot(torch.float32, WHOLE))  # one rank: no DTensor, the whole tensor
    plan = Plan(whole, OLDS, local={2, 3})
    # The scalar every old rank holds alike is read from a rank this node holds.
    assert plan.ranks() == {0, 1, 2, 3}
    assert [rank for rank, _ in plan.pieces[1].sources] == [2]
    state = plan.filled(READ)
    torch.testing.assert_close(state["model"]["params"][0], rows_of(0, 10))
    assert state["model"]["optim"][0]["step"].item() == 7.0


def test_an_optimizer_without_state_takes_whole_tensors_as_saved_and_entries_missing_are_left_out():
    olds = [{"optim": {"state": {0: {"exp_avg": Slot(torch.float32, (2,))}}, "param_groups": [{"lr": 0.1}]},
             "extra": 1} for _ in range(2)]  # fmt: skip
    read = [{"optim": {"state": {0: {"exp_avg": torch.full((2,), float(rank))}}, "param_groups": [{"lr": 0.1}]},
             "extra": 1} for rank in range(2)]  # fmt: skip
    new = {"optim": {"state": {}, "param_groups": [{"lr": 0.2}]}, "data": {"position": 0}}
    plan = Plan(new, olds, local={1})
    state = plan.filled(dict(enumerate(read)))
    torch.testing.assert_close(state["optim"]["state"][0]["exp_avg"], torch.full((2,), 1.0))
    assert "data" not in state  # the state's, not saved: reported missing by the load
    assert state["extra"] == 1  # saved, no place in the state: reported as not restored


def test_what_does_not_fit_is_refused_naming_the_entry():
    with pytest.raises(Unfit, match=r"model.params.0: saved with shape \(10, 3\), the state's is \(12, 3\)"):
        bigger = {"shard": Slot(torch.float32, (12, 3)), "layout": ShardLayout((Shard(0),), (12, 3), (3, 1), (0, 0))}
        Plan(template(bigger), OLDS, local=set())
    with pytest.raises(Unfit, match="model.params.0: the old ranks. shards cover 27 of its 30 elements"):
        Plan(template(Slot(torch.float32, WHOLE)), OLDS[:3] + [template(shard(6, 3))], local=set())
    with pytest.raises(Unfit, match="written before shards kept their offsets"):
        Plan(template(shard(0, 4)), [template(shard(offset, rows, offsets=False)) for offset, rows in OLD], local=set())
    with pytest.raises(Unfit, match="model.params: saved with other entries"):
        two = template(shard(0, 4))
        two["model"]["params"].append(shard(0, 4))
        Plan(two, OLDS, local=set())


def test_a_saved_entry_the_state_no_longer_has_is_left_for_the_load_to_name_but_no_ranks_own():
    """Below the top level too (`{"extra": {"a", "b"}}` saved, `{"extra": {"a"}}` given): as the
    same-size snapshot and the persistent tier name it; an entry of one old rank's own (ett.RNGState's
    `rank1`) is not this rank's, and is not named, as the persistent tier does not."""
    olds = [{"extra": {"a": 1, "b": 2}, "rng": {f"rank{rank}": rank}} for rank in range(2)]
    plan = Plan({"extra": {"a": 0}, "rng": {"rank0": -1}}, olds, local=set())
    assert plan.filled({}) == {"extra": {"a": 1, "b": 2}, "rng": {"rank0": 0}}
