"""Run under torchrun (gloo). For each ZeRO stage, with expert parallelism:
1. loss and every gradient equal those of the same model on one rank, fed all ranks' batches
   as micro-batches (that is what data parallelism averages);
2. one optimizer step gives the same parameters as the single-rank AdamW;
3. model + optimizer saved with DCP (get_state_dict) and loaded into a differently initialised
   model give back the same parameters and optimizer state.
"""

import argparse

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from trainer.model import ModelConfig, Transformer
from trainer.moe import MoEConfig
from trainer.parallel import ParallelConfig, build_mesh, build_optimizer, parallelize

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=2, max_seq_len=16, ffn_type="moe")
MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16, capacity_factor=1.0, shared_expert=True)
ADAMW = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))


def build_model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(MODEL, MOE)
    model.init_weights()
    return model


def batch(rank: int) -> torch.Tensor:
    return torch.randint(0, MODEL.vocab_size, (2, 12), generator=torch.Generator().manual_seed(100 + rank))


def loss_of(model: torch.nn.Module, tokens_BT: torch.Tensor) -> torch.Tensor:
    logits_BTV, aux_loss = model(tokens_BT[:, :-1])
    return F.cross_entropy(logits_BTV.flatten(0, 1), tokens_BT[:, 1:].flatten()) + aux_loss


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6) -> None:
    if not torch.allclose(actual, expected, rtol=1e-4, atol=atol):
        raise AssertionError(f"{name}: max abs diff {(actual - expected).abs().max().item():.3g} ratio {(actual.norm() / expected.norm()).item():.4g}")


def report(check: str, ep: int, zero: int) -> None:
    if dist.get_rank() == 0:
        print(f"OK {check} ep={ep} zero={zero}", flush=True)


def check_stage(zero: int, ep: int, ckpt_dir: str) -> None:
    """Raises on the first mismatch; prints "OK <check> ep=E zero=Z" on rank 0 per passed check."""
    world = dist.get_world_size()
    reference = build_model(seed=0)
    ref_loss = sum(loss_of(reference, batch(r)) for r in range(world)) / world
    ref_loss.backward()
    ref_optim = torch.optim.AdamW(reference.parameters(), **ADAMW)
    ref_optim.step()

    cfg = ParallelConfig(ep=ep, zero=zero, mixed_precision="none")
    model = parallelize(build_model(seed=0), build_mesh(cfg, world, "cpu"), cfg)
    optim = build_optimizer(model, cfg, **ADAMW)
    loss = loss_of(model, batch(dist.get_rank()))
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
    assert_close("loss", mean_loss, ref_loss.detach())
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close(f"grad {name}", full(p.grad), ref_params[name].grad)
    report("gradients", ep, zero)

    optim.step()
    # Adam's first step is g / (|g| + eps): gradients of ~1e-8 differing in the last bits
    # move a weight by up to ~1e-5 with lr 1e-2; a wrong update would be of the order of lr.
    for name, p in model.named_parameters():
        assert_close(f"param {name}", full(p.detach()), ref_params[name].detach(), atol=2e-5)
    report("optimizer-step", ep, zero)

    path = f"{ckpt_dir}/ep{ep}-zero{zero}"
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    restored = parallelize(build_model(seed=1), build_mesh(cfg, world, "cpu"), cfg)
    restored_optim = build_optimizer(restored, cfg, **ADAMW)
    model_sd2, optim_sd2 = get_state_dict(restored, restored_optim)
    state = {"model": model_sd2, "optim": optim_sd2}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(restored, restored_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for (name, p), (_, q) in zip(model.named_parameters(), restored.named_parameters()):
        assert_close(f"restored {name}", full(q.detach()), full(p.detach()))
    saved, loaded = get_state_dict(model, optim)[1]["state"], get_state_dict(restored, restored_optim)[1]["state"]
    for name in sorted(set(saved) | set(loaded)):
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(f"restored {key} {name}", full(loaded[name][key]), full(saved[name][key]))
    report("dcp-roundtrip", ep, zero)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ep", type=int, nargs="+", required=True)
    parser.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--ckpt-dir", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        for ep in args.ep:
            for zero in args.zero:
                check_stage(zero, ep, args.ckpt_dir)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
