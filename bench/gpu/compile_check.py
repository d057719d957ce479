"""torch.compile of the transformer blocks against eager: the gpu-moe preset's training step on
one GPU (bf16, ZeRO-3 on a one-rank mesh, built as trainer/train.py builds it), tokens/s and MFU
per mode, compile time, peak memory, and the first step's loss against eager's.

    python3 bench/gpu/compile_check.py [--steps 30 --warmup 10 --modes eager,compiled,parts]
    .venv/bin/python bench/gpu/compile_check.py --tiny --device cpu --steps 3 --warmup 1

Modes, each on a freshly built model from the same seed and the same random byte batches:
- eager: the trainer as it is.
- compiled: each TransformerBlock wrapped in torch.compile before `parallelize` and registered
  back in model.layers (torchtitan's apply_compile for dense blocks). fullgraph is off by default:
  the MoE's bincount (data-dependent shape), the expert load's all-reduce and the FSDP hooks of
  the nested experts module break the graph; the breaks are counted and their reasons printed.
  If its first step raises, the `parts` mode runs in its place.
- parts: torchtitan's apply_compile for MoE blocks: the norms, the attention and the router
  compiled one by one, and the experts' routed SwiGLU (trainer.moe.routed_swiglu, patched in this
  process only), leaving the MoE's dispatch and the FSDP-wrapped experts module eager.

MFU is the trainer's own (trainer/metrics.py): Transformer.flops_per_token x tokens/s / peak_flops.
--tiny runs the `tiny` preset (CPU smoke test); --compile-layers N compiles only the first N blocks.
"""

import argparse
import gc
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import trainer.moe  # noqa: E402
from trainer.config import JobConfig, gpu_moe, tiny  # noqa: E402
from trainer.metrics import peak_flops, peak_memory_bytes  # noqa: E402
from trainer.model import Transformer  # noqa: E402
from trainer.moe import MoE  # noqa: E402
from trainer.parallel import build_mesh, build_optimizer, parallelize  # noqa: E402

try:  # the trainer's step clips the global gradient norm; keep that cost in the step
    from trainer.train import clip_grad_norm_
except Exception as error:  # trainer.train imports the ett library; the bench does not need it
    print(f"note: trainer.train not importable ({error!r}); steps run without gradient clipping")
    clip_grad_norm_ = None


def init_distributed(device: torch.device) -> None:
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def compile_blocks(model: Transformer, mode: str, count: int, fullgraph: bool) -> None:
    """Before parallelize, as torchtitan does, so FSDP's hooks sit outside the compiled code."""
    for name, block in list(model.layers.named_children())[:count]:
        if mode == "compiled":
            model.layers.register_module(name, torch.compile(block, fullgraph=fullgraph))
        else:  # parts
            for child_name, child in list(block.named_children()):
                if isinstance(child, MoE):
                    child.router = torch.compile(child.router, fullgraph=fullgraph)
                elif not isinstance(child, torch.nn.Dropout):
                    setattr(block, child_name, torch.compile(child, fullgraph=fullgraph))


def build(cfg: JobConfig, device: torch.device, mode: str, args) -> tuple[Transformer, torch.optim.Optimizer]:
    torch.manual_seed(cfg.train.seed)
    with device:
        model = Transformer(cfg.model, cfg.moe)
    model.init_weights()
    count = cfg.model.n_layers if args.compile_layers is None else args.compile_layers
    if mode != "eager":
        compile_blocks(model, mode, count, args.fullgraph)
    model = parallelize(model, build_mesh(cfg.parallel, 1, device.type), cfg.parallel)
    optimizer = build_optimizer(model, cfg.parallel, cfg.train.lr, cfg.train.weight_decay, (cfg.train.beta1, cfg.train.beta2))
    return model, optimizer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(cfg: JobConfig, device: torch.device, mode: str, batches, args) -> dict:
    torch._dynamo.reset()
    counters.clear()
    original_swiglu = trainer.moe.routed_swiglu
    if mode == "parts":  # GroupedExperts.forward calls it through trainer.moe's namespace
        trainer.moe.routed_swiglu = torch.compile(original_swiglu, fullgraph=args.fullgraph)
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t_build = time.perf_counter()
        model, optimizer = build(cfg, device, mode, args)
        build_s = time.perf_counter() - t_build
        flops_per_token = model.flops_per_token(cfg.train.seq_len)
        tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
        for group in optimizer.param_groups:
            group["lr"] = cfg.train.lr

        def step(i: int) -> float:
            inputs_BT, targets_BT = batches[i % len(batches)]
            logits_BTV, aux_loss = model(inputs_BT)
            loss = F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten())
            (loss + aux_loss).backward()
            if clip_grad_norm_ is not None and cfg.train.grad_clip > 0:
                clip_grad_norm_(model, cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()  # the trainer reads the loss every step too (a sync)

        warm_times, losses = [], []
        for i in range(args.warmup):
            sync(device)
            t0 = time.perf_counter()
            losses.append(step(i))
            sync(device)
            warm_times.append(time.perf_counter() - t0)
            if i == 0:
                print(f"  [{mode}] first step {warm_times[0]:.1f} s, loss {losses[0]:.6f}", flush=True)
        step_times = []
        sync(device)
        start = time.perf_counter()
        for i in range(args.warmup, args.warmup + args.steps):
            t0 = time.perf_counter()
            losses.append(step(i))
            step_times.append(time.perf_counter() - t0)
        sync(device)
        elapsed = time.perf_counter() - start
        tokens_per_s = args.steps * tokens_per_step / elapsed
        peak = peak_flops(device)
        median_step = statistics.median(step_times)
        result = dict(
            mode=mode,
            build_s=build_s,
            first_step_s=warm_times[0] if warm_times else float("nan"),
            # the first step's wall time less a steady step: dynamo + AOT autograd + inductor, fwd and bwd
            compile_s=(warm_times[0] - median_step) if warm_times else float("nan"),
            warmup_s=sum(warm_times),
            median_step_ms=1e3 * median_step,
            tokens_per_s=tokens_per_s,
            mfu=100 * flops_per_token * tokens_per_s / peak if peak else None,
            peak_mem_mib=peak_memory_bytes(device) / 2**20,
            first_loss=losses[0],
            last_loss=losses[-1],
            graph_breaks=sum(counters["graph_break"].values()),
            break_reasons=dict(counters["graph_break"]),
            unique_graphs=counters["stats"].get("unique_graphs", 0),
        )
        del model, optimizer
        return result
    finally:
        trainer.moe.routed_swiglu = original_swiglu
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def report(r: dict, eager: dict | None) -> None:
    mfu = f"{r['mfu']:.2f}%" if r["mfu"] is not None else "n/a (no GPU peak)"
    line = (f"RESULT {r['mode']}: tokens/s {r['tokens_per_s']:.0f}  MFU {mfu}  step {r['median_step_ms']:.1f} ms (median)  "
            f"peak_mem {r['peak_mem_mib']:.0f} MiB  first step {r['first_step_s']:.1f} s (compile ~{r['compile_s']:.1f} s)  "
            f"warm-up {r['warmup_s']:.1f} s  build {r['build_s']:.1f} s  loss first {r['first_loss']:.6f} last {r['last_loss']:.6f}")
    if r["mode"] != "eager":
        line += f"  graphs {r['unique_graphs']} graph_breaks {r['graph_breaks']}"
    if eager is not None and r is not eager:
        rel = abs(r["first_loss"] - eager["first_loss"]) / abs(eager["first_loss"])
        line += f"  first-loss rel diff vs eager {rel:.2e}  speed-up x{r['tokens_per_s'] / eager['tokens_per_s']:.3f}"
    print(line, flush=True)
    for reason, count in list(r["break_reasons"].items())[:12]:
        short = " ".join(reason.split("Developer debug context")[0].split())
        print(f"    graph break x{count}: {short[:400]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (the compile happens in the first)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: the preset's)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    parser.add_argument("--modes", default="eager,compiled", help="comma-separated: eager, compiled, parts")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--tiny", action="store_true", help="the tiny preset (CPU smoke test)")
    parser.add_argument("--compile-layers", type=int, default=None, help="compile only the first N blocks")
    parser.add_argument("--fullgraph", action="store_true", help="torch.compile(fullgraph=True): fail on a graph break")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first step compiles)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in ("eager", "compiled", "parts") for m in modes):
        parser.error(f"--modes: eager, compiled, parts; got {args.modes!r}")

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    cfg = tiny() if args.tiny else gpu_moe()
    if args.batch:
        cfg.train.batch_size = args.batch
    if args.seq_len:
        cfg.train.seq_len = args.seq_len
    cfg.validate(1)
    # 12 blocks, each its own torch.compile'd module (and the parts' submodules): room for them all.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
        torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 1024)

    init_distributed(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}; torch {torch.__version__}; {'tiny' if args.tiny else 'gpu-moe'} preset: "
          f"{cfg.model.n_layers} layers dim {cfg.model.dim}, {cfg.moe.num_experts} experts top-{cfg.moe.top_k}, "
          f"batch {cfg.train.batch_size} x {cfg.train.seq_len}, zero {cfg.parallel.zero}, {cfg.parallel.mixed_precision}; "
          f"steps {args.steps} after {args.warmup} warm-up; modes {modes}; peak {peak_flops(device)}", flush=True)

    gen = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=gen)
        batches.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))

    results = []
    eager = None
    for mode in modes:
        print(f"== {mode}", flush=True)
        try:
            r = run_mode(cfg, device, mode, batches, args)
        except Exception as error:
            print(f"FAILED {mode}: {type(error).__name__}: {str(error)[:2000]}", flush=True)
            traceback.print_exc(limit=8)
            if mode == "compiled" and "parts" not in modes:
                modes.append("parts")
                print("   (compiled failed: running 'parts' in its place)", flush=True)
            continue
        if mode == "eager":
            eager = r
        results.append(r)
        report(r, eager)

    print("== summary", flush=True)
    for r in results:
        report(r, eager)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip torch's finalization (see trainer/train.py)
