"""MoE layer forward+backward: ours (one sort, grouped experts) against a Mixtral-style per-expert
masked loop and a dense SwiGLU FFN with the same active FLOPs, in one run.

    .venv/bin/python bench/moe_layer.py                     # CPU fp32
    .venv/bin/python bench/moe_layer.py --device cuda --dtype bfloat16

The variants run in turn inside each repetition (so load changes hit them alike);
the median time per variant is reported, with tokens/s, TFLOP/s and the ratios. The input
requires a gradient, as it does for every layer but the first (--no-input-grad: it does not).
On a shared CPU the ratios are also given in CPU time of the (single) computing thread,
which leaves out the time the thread waited for a core. On CPU a fourth variant, "products
only", runs just the per-expert matmuls that ours and the loop both run: no implementation
that runs those products beats the loop by more than loop / products (the bound). Like the
trainer on CPU, the bench first makes glibc keep freed buffers (trainer/allocator.py), for all
variants alike (--glibc-default-allocator: it does not).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from trainer.allocator import keep_freed_memory
from trainer.moe import FeedForward, MoE, MoEConfig


def masked_loop_moe(moe: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """The common reference, as HF transformers' MixtralSparseMoeBlock writes it: per expert,
    find its tokens through a mask, gather them, run the expert, add the weighted result in
    place (`index_add_`) into one output."""
    routing = moe.router(x_TD)
    out_TD = torch.zeros_like(x_TD)
    expert_mask_EKT = F.one_hot(routing.experts_TK, moe.cfg.num_experts).permute(2, 1, 0)
    # Per-expert weights as separate tensors, like Mixtral's nn.Linear per expert.
    weights = zip(moe.experts.w1_EDF.unbind(0), moe.experts.w2_EFD.unbind(0), moe.experts.w3_EDF.unbind(0))
    for e, (w1_DF, w2_FD, w3_DF) in enumerate(weights):
        slot, token_idx = torch.where(expert_mask_EKT[e])
        x_e = x_TD[token_idx]
        y_e = (F.silu(x_e @ w1_DF) * (x_e @ w3_DF)) @ w2_FD
        out_TD.index_add_(0, token_idx, y_e * routing.weights_TK[token_idx, slot, None].to(y_e.dtype))
    return out_TD


def expert_products_only(moe: MoE, x_TD: torch.Tensor, grad_TD: torch.Tensor):
    """The 9 matmuls per expert that ours and the loop's autograd both run (3 forward, 6 backward,
    same layouts), at this input's routed row counts, on contiguous operands gathered beforehand,
    into buffers allocated beforehand: nothing else. Returns the function that runs them."""
    with torch.no_grad():
        experts_A = moe.router(x_TD).experts_TK.flatten()
        token_S = torch.argsort(experts_A, stable=True) // moe.cfg.top_k
        counts = torch.bincount(experts_A, minlength=moe.cfg.num_experts).tolist()
        x_SD, g_SD = x_TD.detach()[token_S], grad_TD[token_S]
    w1_EDF, w2_EFD, w3_EDF = (w.detach() for w in (moe.experts.w1_EDF, moe.experts.w2_EFD, moe.experts.w3_EDF))
    # a, b stand for the pre-activations in the forward and for their gradients in the backward.
    a_SF, b_SF, h_SF, grad_h_SF = torch.randn(4, x_SD.shape[0], w1_EDF.shape[2], dtype=x_SD.dtype, device=x_SD.device)
    y_SD, grad_x_SD = torch.empty_like(x_SD), torch.empty_like(x_SD)
    grad_w1_EDF, grad_w2_EFD, grad_w3_EDF = (torch.empty_like(w) for w in (w1_EDF, w2_EFD, w3_EDF))
    slices = list(zip(*(t.split(counts) for t in (x_SD, g_SD, a_SF, b_SF, h_SF, grad_h_SF, y_SD, grad_x_SD))))

    def run() -> None:
        for e, (x_nD, g_nD, a_nF, b_nF, h_nF, grad_h_nF, y_nD, grad_x_nD) in enumerate(slices):
            torch.mm(x_nD, w1_EDF[e], out=a_nF)
            torch.mm(x_nD, w3_EDF[e], out=b_nF)
            torch.mm(h_nF, w2_EFD[e], out=y_nD)
            torch.mm(g_nD, w2_EFD[e].t(), out=grad_h_nF)
            torch.mm(h_nF.t(), g_nD, out=grad_w2_EFD[e])
            torch.mm(x_nD.t(), a_nF, out=grad_w1_EDF[e])
            torch.mm(x_nD.t(), b_nF, out=grad_w3_EDF[e])
            torch.mm(a_nF, w1_EDF[e].t(), out=grad_x_nD)
            grad_x_nD.addmm_(b_nF, w3_EDF[e].t())

    return run


# Where a step of ours spends its time (--profile): each op's own time, by kind.
OP_KINDS = {
    "expert and router matmuls": ("aten::mm", "aten::addmm_", "aten::addmm", "aten::bmm"),
    "row gathers and scatter-adds": ("aten::index_select", "aten::index_add_", "aten::scatter_add_", "aten::gather",
                                     "aten::index"),
    "elementwise (silu, weights, zero fills)": ("aten::silu", "aten::silu_backward", "aten::mul", "aten::mul_",
                                                "aten::add_", "aten::add", "aten::sum", "aten::fill_", "aten::zero_",
                                                "aten::div", "aten::copy_"),
    "routing (softmax, top-k, sort, counts)": ("aten::topk", "aten::sort", "aten::bincount", "aten::_softmax",
                                               "aten::_softmax_backward_data", "aten::logsumexp", "aten::cumsum"),
}


def profile_ours(ours, reps: int) -> None:
    """Each op's own CPU time in a step of ours, summed by kind; the rest is Python and autograd."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            ours()
    own_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(own_us.values()) / reps / 1e3
    print(f"  ours, by kind of op (profiled, {total:.1f} ms a step with the profiler's overhead):")
    accounted = 0.0
    for kind, ops in OP_KINDS.items():
        ms = sum(own_us.get(op, 0.0) for op in ops) / reps / 1e3
        accounted += ms
        print(f"    {kind:42s} {ms:7.1f} ms  {ms / total:5.1%}")
    rest = total - accounted
    print(f"    {'the rest (Python, autograd, views)':42s} {rest:7.1f} ms  {rest / total:5.1%}")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--expert-hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--no-input-grad", action="store_true", help="the input needs no gradient")
    parser.add_argument("--profile", action="store_true", help="also print where a step of ours spends its time")
    parser.add_argument("--glibc-default-allocator", action="store_true",
                        help="leave glibc's malloc thresholds as they are (freed large buffers are unmapped)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    # As the trainer does on CPU: freed large buffers stay mapped for the next step.
    kept_freed_memory = False
    if device.type == "cpu" and not args.glibc_default_allocator:
        kept_freed_memory = keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    moe = MoE(args.dim, MoEConfig(num_experts=args.experts, top_k=args.top_k, expert_hidden_dim=args.expert_hidden))
    dense = FeedForward(args.dim, args.top_k * args.expert_hidden)  # same active expert FLOPs per token
    for p in [*moe.parameters(), *dense.parameters()]:
        torch.nn.init.normal_(p, std=0.02)
    moe, dense = moe.to(device, dtype), dense.to(device, dtype)
    x_TD = torch.randn(args.tokens, args.dim, device=device, dtype=dtype, requires_grad=not args.no_input_grad)
    grad_TD = torch.randn_like(x_TD)

    def ours():
        out_TD, aux_loss = moe(x_TD)
        torch.autograd.backward([out_TD, aux_loss], [grad_TD, torch.ones_like(aux_loss)])

    variants = {
        "ours": ours,
        "masked loop": lambda: masked_loop_moe(moe, x_TD).backward(grad_TD),
        "dense FFN": lambda: dense(x_TD).backward(grad_TD),
    }
    if device.type == "cpu":  # on CUDA ours runs grouped kernels, not these per-expert products
        variants["products only"] = expert_products_only(moe, x_TD, grad_TD)
    times = {name: [] for name in variants}
    cpu_times = {name: [] for name in variants}
    for rep in range(args.reps + 2):  # two warm-up repetitions
        for name, run in variants.items():
            synchronize(device)
            start, cpu_start = time.perf_counter(), time.thread_time()
            run()
            synchronize(device)
            if rep >= 2:
                times[name].append(time.perf_counter() - start)
                cpu_times[name].append(time.thread_time() - cpu_start)
            moe.zero_grad(set_to_none=True)
            dense.zero_grad(set_to_none=True)
            x_TD.grad = None

    # SwiGLU = 3 matmuls of D x F per token and expert; the backward runs 6 more (4 without input grad).
    matmuls = 7 if args.no_input_grad else 9
    expert_flops = matmuls * 2 * args.dim * args.expert_hidden * args.top_k * args.tokens
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"MoE layer fwd+bwd: {args.tokens} tokens, dim {args.dim}, {args.experts} experts x hidden "
          f"{args.expert_hidden}, top-{args.top_k}, {args.device} {args.dtype}, input grad "
          f"{not args.no_input_grad}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"median of {args.reps}, freed memory kept: {kept_freed_memory}")
    for name, seconds in median.items():
        print(f"  {name:12s} {seconds * 1e3:9.1f} ms  {args.tokens / seconds:10.0f} tokens/s  "
              f"{expert_flops / seconds / 1e12:7.3f} TFLOP/s (expert matmuls)")
    print(f"  speed-up over the masked loop: {median['masked loop'] / median['ours']:.2f}x (target >= 2x on CPU, >= 5x on GPU)")
    print(f"  time relative to the dense FFN: {median['ours'] / median['dense FFN']:.2f}x (target <= 1.5x on CPU)")
    if "products only" in median:
        print(f"  bound: the expert products alone take {median['products only'] / median['ours']:.0%} of ours; "
              f"nothing that runs them beats the loop by more than {median['masked loop'] / median['products only']:.2f}x")
    if args.profile:
        def ours_and_reset():
            ours()
            moe.zero_grad(set_to_none=True)
            x_TD.grad = None
        profile_ours(ours_and_reset, args.reps)
    if device.type == "cpu" and torch.get_num_threads() == 1:
        cpu = {name: statistics.median(t) for name, t in cpu_times.items()}
        print(f"  in thread CPU time: ours {cpu['ours'] * 1e3:.1f} ms, {cpu['masked loop'] / cpu['ours']:.2f}x faster "
              f"than the masked loop, {cpu['ours'] / cpu['dense FFN']:.2f}x the dense FFN, bound "
              f"{cpu['masked loop'] / cpu['products only']:.2f}x")


if __name__ == "__main__":
    main()
