"""Where the MoE layer's GPU time goes: forward+backward of the gpu-moe preset's layer under
torch.profiler, the kernels ranked by CUDA time, and the share of the grouped matmuls.

    python3 bench/gpu/moe_profile.py [--tokens 16384 --dim 1024 --experts 32 --expert-hidden 1024]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from trainer.moe import MoE, MoEConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--expert-hidden", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    moe = MoE(args.dim, MoEConfig(num_experts=args.experts, top_k=2, expert_hidden_dim=args.expert_hidden))
    moe = moe.to("cuda", torch.bfloat16)
    x_TD = torch.randn(args.tokens, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step() -> None:
        out_TD, aux = moe(x_TD)
        (out_TD.float().square().mean() + aux).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.reps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total_us = sum(e.self_device_time_total for e in events)
    grouped_us = sum(e.self_device_time_total for e in events if "grouped" in e.key.lower() or "gemm" in e.key.lower())
    per_step_ms = total_us / args.reps / 1000
    print(f"CUDA time per fwd+bwd: {per_step_ms:.2f} ms; matmul kernels {100 * grouped_us / total_us:.0f}%")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:15]:
        share = 100 * e.self_device_time_total / total_us
        ms = e.self_device_time_total / args.reps / 1000
        print(f"  {share:5.1f}%  {ms:7.3f} ms  x{e.count // args.reps:<4d} {e.key[:90]}")


if __name__ == "__main__":
    main()
