"""Shapes of state a user's script passes that DCP alone restores wrong or not at all, through
`run.restore` from each tier (one process): each comes back as it was saved, nothing is named as
not restored, and the next save works (#46; found by writing users' scripts from the docs)."""

import collections

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ett
from ett.checkpoint import CheckpointConfig


@pytest.fixture(autouse=True)
def no_group_left_behind():
    """ett.init makes a one-rank process group in this process: gone after the test, or a later
    test's ranks forked from this worker (tests/trainer/multiprocess.py) would inherit it."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


class Loader:
    """A data loader's state as many are: its sampler None until it starts."""

    def __init__(self):
        self.sampler = None

    def state_dict(self) -> dict:
        return {"sampler": self.sampler}

    def load_state_dict(self, state: dict) -> None:
        self.sampler = state["sampler"]


class OptimizerOfMyOwn:
    """An optimizer wrapped in a Stateful of the script's own: a fresh one's `state` is empty."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def build():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[2, 5])  # keyed by numbers
    loader = Loader()
    # Statefuls below the top (ett/checkpoints/nested.py): DCP alone would load a pickled copy in their place.
    deep = {"pipeline": {"loader": Loader(), "epochs": 0}, "all": [Loader()]}
    state = {"model": model.state_dict(), "optim": OptimizerOfMyOwn(optimizer), "sched": scheduler,
             "loader": loader, "counts": {}, "names": {}, "growing": [], "deep": deep}  # fmt: skip
    return model, optimizer, scheduler, loader, state


def train(model, optimizer, scheduler, loader, state, steps) -> None:
    for step in steps:
        model(torch.full((2, 4), float(step))).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        loader.sampler = {"epoch": 0, "index": step}
        state["deep"]["pipeline"]["loader"].sampler = {"index": 10 * step}
        state["deep"]["pipeline"]["epochs"] = step // 2
        state["deep"]["all"][0].sampler = [step, str(step)]
        state["counts"][step % 3] = state["counts"].get(step % 3, 0) + 1  # a dict keyed by numbers
        state["names"][str(step % 3)] = step  # keyed by digit strings
        state["growing"].append(torch.full((2,), float(step)))


@pytest.mark.parametrize("tier", ["persistent", "snapshot"])
def test_each_shape_comes_back_as_saved_and_the_next_save_works(tmp_path, tier):
    snapshot = tier == "snapshot"  # else the persistent tier: a save at step 3 and no snapshots
    config = CheckpointConfig(dir=str(tmp_path / "ckpt"), local_dir=str(tmp_path / "local"),
                              interval_steps=100 if snapshot else 3, snapshots=snapshot, snapshot_every=1)
    model, optimizer, scheduler, loader, state = build()
    with ett.init(checkpoint_dir=tmp_path / "ckpt") as run:
        run.configure_checkpoints(config)
        for step in range(1, 4):
            train(model, optimizer, scheduler, loader, state, [step])
            run.checkpoint(step, state)
    model2, optimizer2, scheduler2, loader2, state2 = build()
    with ett.init(checkpoint_dir=tmp_path / "ckpt") as run:
        run.configure_checkpoints(config)
        assert run.restore(state2) == 3
        assert run.keys_not_restored == [] and run.keys_missing == []
        assert state2["counts"] == state["counts"] and state2["names"] == state["names"]
        assert [t.tolist() for t in state2["growing"]] == [t.tolist() for t in state["growing"]]
        assert scheduler2.state_dict() == scheduler.state_dict() and loader2.sampler == loader.sampler
        deep, deep2 = state["deep"], state2["deep"]
        assert isinstance(deep2["pipeline"]["loader"], Loader) and isinstance(deep2["all"][0], Loader)  # not dicts
        assert deep2["pipeline"]["loader"].sampler == deep["pipeline"]["loader"].sampler == {"index": 30}
        assert deep2["all"][0].sampler == deep["all"][0].sampler and deep2["pipeline"]["epochs"] == 1
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
        moments, moments2 = optimizer.state_dict()["state"], optimizer2.state_dict()["state"]
        assert moments.keys() == moments2.keys() == {0, 1}
        assert all(torch.equal(moments[p][k], moments2[p][k]) for p in moments for k in moments[p])
        train(model2, optimizer2, scheduler2, loader2, state2, range(4, 5))
        assert run.checkpoint(4, state2, force=True)  # and saving what was restored works


@pytest.mark.parametrize("tier", ["persistent", "snapshot"])
@pytest.mark.parametrize("restored_into", [3, 1])
def test_a_list_of_statefuls_of_another_length_loads_the_entries_both_have_and_names_the_rest(tmp_path, tier,
                                                                                             restored_into):
    """Saved as two Loaders, restored into three (or one): every tier loads the ones both have through
    their own load_state_dict and names the rest, as DCP does (found by a breaker: the snapshot tier
    loaded none and named nothing)."""
    snapshot = tier == "snapshot"
    config = CheckpointConfig(dir=str(tmp_path / "ckpt"), local_dir=str(tmp_path / "local"),
                              interval_steps=100 if snapshot else 1, snapshots=snapshot, snapshot_every=1)
    saved = [Loader(), Loader()]
    saved[0].sampler, saved[1].sampler = {"index": 1}, {"index": 2}
    with ett.init(checkpoint_dir=tmp_path / "ckpt") as run:
        run.configure_checkpoints(config)
        run.checkpoint(1, {"loaders": {"all": saved}})
    loaders = [Loader() for _ in range(restored_into)]
    with ett.init(checkpoint_dir=tmp_path / "ckpt") as run:
        run.configure_checkpoints(config)
        assert run.restore({"loaders": {"all": loaders}}) == 1
        assert [loader.sampler for loader in loaders] == [{"index": 1}, {"index": 2}, None][:restored_into]
        if restored_into == 3:
            assert run.keys_missing == ["loaders.all.2.sampler"] and run.keys_not_restored == []
        else:
            assert run.keys_not_restored == ["loaders.all.1.sampler.index"] and run.keys_missing == []


class TrainState:
    """A Stateful whose state_dict() holds another Stateful itself, not that one's state_dict()."""

    def __init__(self):
        self.step, self.loader = 0, Loader()

    def state_dict(self) -> dict:
        return {"step": self.step, "loader": self.loader}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        assert state["loader"] is self.loader, "handed something other than its own loader"


class Weights:
    """A Stateful that takes the loaded tensor itself (`self.w = ...`), not a copy into its own."""

    def __init__(self):
        self.w = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"w": self.w}

    def load_state_dict(self, state: dict) -> None:
        self.w = state["w"]


@pytest.mark.parametrize("tier", ["persistent", "snapshot"])
def test_a_stateful_in_a_statefuls_state_dict_and_one_in_a_tuple_are_restored_as_themselves(tmp_path, tier):
    """Each tier restores the Stateful a TrainState's state_dict() holds through its own load_state_dict()
    and hands the TrainState that object, at the top of `state` and below it; a Stateful in a tuple gets its
    own tensor back, loaded in place (a breaker's findings: the tiers handed a pickled copy, a dict, a new
    tensor, each tier another)."""
    snapshot = tier == "snapshot"
    config = CheckpointConfig(dir=str(tmp_path / "ckpt"), local_dir=str(tmp_path / "local"),
                              interval_steps=100 if snapshot else 1, snapshots=snapshot, snapshot_every=1)

    def build() -> dict:
        return {"train": TrainState(), "deep": {"train": TrainState()}, "pair": (Weights(), 7)}

    state = build()
    for train in (state["train"], state["deep"]["train"]):
        train.step, train.loader.sampler = 5, {"index": 50}
    state["pair"][0].w += 2
    with ett.init(checkpoint_dir=tmp_path / "ckpt") as run:
        run.configure_checkpoints(config)
        run.checkpoint(1, state)
    state2 = build()
    w2 = state2["pair"][0].w
    with ett.init(checkpoint_dir=tmp_path / "ckpt") as run:
        run.configure_checkpoints(config)
        assert run.restore(state2) == 1 and run.keys_not_restored == [] and run.keys_missing == []
    for train in (state2["train"], state2["deep"]["train"]):
        assert (train.step, train.loader.sampler) == (5, {"index": 50})
    assert state2["pair"][0].w is w2 and w2.tolist() == [2.0, 2.0, 2.0]


Pair = collections.namedtuple("Pair", "first second")


class Buffers:
    """A Stateful that relies on its tensors being loaded in place (as `model.state_dict()` is): its
    state_dict() hands them in a tuple, its load_state_dict() does nothing; it counts its state_dict() calls."""

    def __init__(self):
        self.ts, self.asked = (torch.zeros(2), torch.zeros(3)), 0

    def state_dict(self) -> dict:
        self.asked += 1
        return {"ts": self.ts}

    def load_state_dict(self, state: dict) -> None:
        pass


@pytest.mark.parametrize("tier", ["persistent", "snapshot"])
def test_namedtuples_tuples_of_tensors_and_a_stateful_where_none_was_saved_come_back_alike_on_every_tier(tmp_path,
                                                                                                       tier):
    """A namedtuple of Statefuls is rebuilt as one; a Stateful's tensors handed in a tuple are loaded in place
    (the persistent tier left them as they were, naming nothing); a Stateful where None was saved names its
    entries missing; and each save asks a Stateful for its state_dict() once (the first persistent save asked
    twice). A breaker's findings."""
    snapshot = tier == "snapshot"
    config = CheckpointConfig(dir=str(tmp_path / "ckpt"), local_dir=str(tmp_path / "local"),
                              interval_steps=100 if snapshot else 1, snapshots=snapshot, snapshot_every=1)

    def build(saving: bool) -> dict:
        return {"pair": Pair(Loader(), Loader()), "buffers": Buffers(), "amp": {"scaler": None if saving else Loader()}}

    state = build(saving=True)
    state["pair"].first.sampler, state["pair"].second.sampler = 1, 2
    for t in state["buffers"].ts:
        t.fill_(7.0)
    with ett.init(checkpoint_dir=tmp_path / "ckpt") as run:
        run.configure_checkpoints(config)
        for step in (1, 2, 3):
            run.checkpoint(step, state)
    assert state["buffers"].asked == 3
    state2 = build(saving=False)
    own = state2["buffers"].ts
    with ett.init(checkpoint_dir=tmp_path / "ckpt") as run:
        run.configure_checkpoints(config)
        assert run.restore(state2) == 3
        assert run.keys_missing == ["amp.scaler.sampler"] and run.keys_not_restored == ["amp.scaler"]
    assert type(state2["pair"]) is Pair and (state2["pair"].first.sampler, state2["pair"].second.sampler) == (1, 2)
    assert state2["buffers"].ts is own and [t.tolist() for t in own] == [[7.0, 7.0], [7.0, 7.0, 7.0]]
