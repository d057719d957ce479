"""Staging buffers of the asynchronous save: a snapshot of the state, reused from save to save.
(DTensor states are staged by every trainer run with ZeRO-3 in test_resume.py; the copy in the
background against the training loop is in test_checkpoint_overlap.py.)"""

from collections import OrderedDict

import torch

from ett.checkpoints.staging import ReusedBufferStager


def make_state() -> dict:
    return {
        "model": OrderedDict(w=torch.arange(6.0).view(2, 3), b=torch.ones(3, dtype=torch.bfloat16)),
        "optim": {"state": {"w": {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": ["w", "b"]}]},
        "data": {"epoch": 1, "batch": 7},
        "pair": (torch.zeros(2), "tag"),
    }


def test_the_staged_copy_is_a_snapshot_and_later_saves_reuse_its_buffers():
    stager = ReusedBufferStager(share_memory=True, pin_memory=False)
    state = make_state()
    stager.copy_in_background([state["model"]["w"]])
    first = stager.stage(state).result()
    assert torch.equal(first["model"]["w"], state["model"]["w"]) and first["model"]["b"].dtype == torch.bfloat16
    assert first["model"]["w"].data_ptr() != state["model"]["w"].data_ptr() and first["model"]["w"].is_shared()
    assert first["optim"]["param_groups"] == state["optim"]["param_groups"] and first["pair"][1] == "tag"

    state["model"]["w"].mul_(10)  # the training loop goes on: the staged copy must not change
    state["data"]["batch"] = 8
    state["optim"]["param_groups"][0]["lr"] = 0.05
    assert first["model"]["w"][1, 2] == 5 and first["data"]["batch"] == 7
    assert first["optim"]["param_groups"][0]["lr"] == 0.1

    pointers = {key: first["model"][key].data_ptr() for key in ("w", "b")}
    second = stager.stage(state).result()
    assert second["model"]["w"][1, 2] == 50 and second["data"]["batch"] == 8
    assert {key: second["model"][key].data_ptr() for key in ("w", "b")} == pointers
    stager.close()
    assert stager.buffers == {}


def test_a_tensor_that_changes_shape_or_dtype_gets_a_new_buffer():
    stager = ReusedBufferStager(share_memory=False, pin_memory=False)
    state = make_state()
    stager.stage(state).result()
    state["model"]["w"] = torch.ones(4, 3)
    state["model"]["b"] = torch.ones(3)
    staged = stager.stage(state).result()
    assert staged["model"]["w"].shape == (4, 3) and staged["model"]["b"].dtype == torch.float32
    assert torch.equal(staged["model"]["w"], state["model"]["w"])
