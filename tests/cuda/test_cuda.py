"""The CUDA paths, for a machine with an NVIDIA GPU (bench/gpu_check.sh runs them); skipped
without one. NCCL, the bf16 grouped-GEMM experts, pinned-memory checkpoint staging, and the
CUDA generator in a checkpoint, per-rank timing's clock."""

import pytest
import torch
import torch.distributed as dist

from ett.checkpoints.staging import ReusedBufferStager
from ett.state import RNGState
from ett.timing import SyncClock
from tests.support.postgres import free_port
from trainer.grouped_gemm import grouped_mm_supported, routed_swiglu
from trainer.moe import MoE, MoEConfig

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def test_a_nccl_group_all_reduces(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        assert t.tolist() == [1.0] * 4
    finally:
        dist.destroy_process_group()


def test_bf16_grouped_experts_match_the_fp32_per_expert_loop():
    torch.manual_seed(0)
    moe = MoE(512, MoEConfig(num_experts=16, top_k=2, expert_hidden_dim=256, capacity_factor=None)).cuda()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x_TD = torch.randn(2048, 512, device="cuda")
    w1, w2, w3 = moe.experts.w1_EDF, moe.experts.w2_EFD, moe.experts.w3_EDF
    routing = moe.router(x_TD)
    order_S = torch.argsort(routing.experts_TK.flatten(), stable=True)
    counts_E = torch.bincount(routing.experts_TK.flatten(), minlength=16)
    token_S, weights_S = order_S // 2, routing.weights_TK.flatten()[order_S]
    bf16 = [t.bfloat16() for t in (x_TD, w1, w2, w3)]
    assert grouped_mm_supported(bf16[0], bf16[1])
    grouped = routed_swiglu(bf16[0], token_S, weights_S.bfloat16(), *bf16[1:], counts_E)
    loop = routed_swiglu(x_TD, token_S, weights_S, w1, w2, w3, counts_E, use_grouped_mm=False)
    assert torch.allclose(grouped.float(), loop, rtol=5e-2, atol=5e-3), (grouped.float() - loop).abs().max()


def test_pinned_staging_copies_cuda_tensors_exactly():
    stager = ReusedBufferStager(share_memory=False, pin_memory=True)
    state = {"w": torch.randn(1024, 1024, device="cuda"), "step": 7}
    staged = stager.stage(state).result()
    assert staged["w"].device.type == "cpu" and staged["w"].is_pinned()
    assert torch.equal(staged["w"], state["w"].cpu()) and staged["step"] == 7
    stager.close()


def test_the_cuda_generator_is_saved_and_restored():
    rng = RNGState(rank=0)
    saved = rng.state_dict()
    assert "cuda" in saved["rank0"]
    first = torch.rand(4, device="cuda")
    rng.load_state_dict(saved)
    assert torch.equal(torch.rand(4, device="cuda"), first)


def test_background_staging_copies_on_a_stream_of_its_own_after_the_writes_queued_before():
    stager = ReusedBufferStager(share_memory=False, pin_memory=True)
    w = torch.zeros(4096, 4096, device="cuda")
    x = torch.randn(8192, 8192, device="cuda")
    for _ in range(10):  # tens of milliseconds of queued work on the training stream
        x = torch.tanh(x @ x)
    w.add_(1)  # queued after it: the copy must see this write
    stager.copy_in_background([w])
    staged = stager.stage({"w": w})
    stager.wait_for_copies()
    assert stager.stream is not None and stager.stream != torch.cuda.current_stream()
    assert torch.equal(staged.result()["w"], torch.ones(4096, 4096))
    stager.close()


def test_a_steps_stall_on_another_streams_event_is_its_wait_not_its_work():
    """The CUDA clock of per-rank timing (ett/waits.py): the step's stream held up by another
    stream's event (FSDP2's all-gather, here a sleeping kernel) counts as a wait, read from
    events once the GPU has passed them, with no synchronize in the step."""
    torch.cuda.synchronize()  # CUDA in use: the step takes the GPU's clock
    clock, side = SyncClock(time_waits=True), torch.cuda.Stream()
    try:
        clock.begin()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # GPU cycles: about 0.1 s
            gathered = torch.cuda.Event()
            gathered.record()
        torch.cuda.current_stream().wait_event(gathered)
        clock.mark()
        span = clock.end()
    finally:
        clock.stop()
    assert span is not None and len(span.waits) == 1
    torch.cuda.synchronize()
    assert span.ready()
    waited = span.clock.seconds(*span.waits[0])
    assert waited > 0.02 and span.work() < 0.5 * waited
