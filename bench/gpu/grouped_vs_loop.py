"""The MoE layer's two expert paths side by side: `torch._grouped_mm` (one kernel a matmul for all
experts) and the per-expert loop (trainer/grouped_gemm.py), same weights, same input, same routing.

    python3 bench/gpu/grouped_vs_loop.py                  # CUDA bf16, the gpu-moe preset's layer
    python3 bench/gpu/grouped_vs_loop.py --device cpu --dtype float32 --tokens 512 --dim 64 --hidden 64 --experts 8

Numbers: the output and every gradient (input, w1, w2, w3, router gate) of each path against an
fp32 per-expert-loop reference built from the same (rounded) weights and input, as a relative
Frobenius error ||got - ref|| / ||ref||, and the two paths against each other; the check fails
(exit 1) where a path is off the reference by more than --tol. Then the forward+backward time of
each, alternated, median of --reps after two warm-ups.
"""

import argparse
import copy
import statistics
import sys
import time

import torch

from trainer.moe import MoE, MoEConfig

NAMES = ("output", "grad x", "grad w1", "grad w2", "grad w3", "grad gate")


def run_layer(moe: MoE, x_TD: torch.Tensor, grad_TD: torch.Tensor) -> list[torch.Tensor]:
    """Forward and backward; the output and the gradients, as fp32."""
    moe.zero_grad(set_to_none=True)
    x_TD = x_TD.detach().requires_grad_(True)
    out_TD, aux_loss = moe(x_TD)
    torch.autograd.backward([out_TD, aux_loss], [grad_TD, torch.ones_like(aux_loss)])
    e = moe.experts
    got = [out_TD, x_TD.grad, e.w1_EDF.grad, e.w2_EFD.grad, e.w3_EDF.grad, moe.router.gate.weight.grad]
    return [t.detach().float() for t in got]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tol", type=float, default=2e-2, help="largest relative error against the fp32 reference")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=args.experts, top_k=args.top_k, expert_hidden_dim=args.hidden)
    moe = MoE(args.dim, cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    moe = moe.to(device, dtype)
    reference = copy.deepcopy(moe).float()  # the same rounded weights, in fp32
    reference.experts.use_grouped_mm = False
    x_TD = torch.randn(args.tokens, args.dim, device=device).to(dtype)
    grad_TD = torch.randn_like(x_TD)

    ref = run_layer(reference, x_TD.float(), grad_TD.float())
    results = {}
    for name, flag in (("grouped_mm", True), ("loop", False)):
        moe.experts.use_grouped_mm = flag
        results[name] = run_layer(moe, x_TD, grad_TD)

    print(f"MoE layer {args.tokens} tokens, dim {args.dim}, {args.experts} experts x {args.hidden}, "
          f"top-{args.top_k}, {args.device} {args.dtype}, torch {torch.__version__}")
    print(f"  relative error (Frobenius) against the fp32 loop; tolerance {args.tol:g}")
    print(f"    {'':10s} {'grouped_mm':>11s} {'loop':>11s} {'grouped vs loop':>16s}")
    failed = []
    for i, name in enumerate(NAMES):
        g, lo = rel_err(results["grouped_mm"][i], ref[i]), rel_err(results["loop"][i], ref[i])
        between = rel_err(results["grouped_mm"][i], results["loop"][i])
        print(f"    {name:10s} {g:11.2e} {lo:11.2e} {between:16.2e}")
        failed += [f"{path} {name} {err:.2e}" for path, err in (("grouped_mm", g), ("loop", lo)) if not err <= args.tol]

    def timed(flag: bool):
        def step():
            moe.experts.use_grouped_mm = flag
            run_layer(moe, x_TD, grad_TD)
        return step

    variants = {"grouped_mm": timed(True), "loop": timed(False)}
    times = {name: [] for name in variants}
    for rep in range(args.reps + 2):
        for name, step in variants.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if rep >= 2:
                times[name].append(time.perf_counter() - start)
    flops = 9 * 2 * args.dim * args.hidden * args.top_k * args.tokens  # 3 forward + 6 backward matmuls
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"  forward+backward, median of {args.reps}:")
    for name, seconds in median.items():
        print(f"    {name:10s} {seconds * 1e3:8.2f} ms  {flops / seconds / 1e12:7.1f} TFLOP/s (expert matmuls)")
    print(f"  grouped_mm: {median['loop'] / median['grouped_mm']:.2f}x the loop's speed")
    if failed:
        print("grouped_vs_loop FAILED: " + "; ".join(failed))
        return 1
    print("grouped_vs_loop: both paths within tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
