"""The Hugging Face Trainer with ETT: a tiny causal LM (built from a config, random weights) on a
synthetic dataset, so nothing is downloaded.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --output-dir /tmp/hf --save-every 5
    ett submit examples/jobs/hf_trainer.toml             # the same script as an ETT job

Needs the extra: pip install 'ett[huggingface]'.
"""

import argparse
import gc
import json
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import ett
from ett.integrations.huggingface import ETTCallback, resume_checkpoint

SEQ_LEN, VOCAB, BATCH = 32, 96, 4


class SyntheticText(torch.utils.data.Dataset):
    """Sequences that follow a simple rule (next = 3 * current + 1 mod VOCAB, from a random start)."""

    def __init__(self, size: int):
        starts = torch.randint(0, VOCAB, (size,), generator=torch.Generator().manual_seed(7))
        positions = torch.arange(SEQ_LEN)
        self.input_ids_NT = (starts[:, None] * 3 ** positions + (3**positions - 1) // 2) % VOCAB

    def __len__(self) -> int:
        return len(self.input_ids_NT)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids_NT[index], "labels": self.input_ids_NT[index]}


class SlowSteps(TrainerCallback):
    """Stands for real compute: sleeps at each step's end (so a fault can land mid-run)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def train(args: argparse.Namespace) -> None:
    with ett.init(checkpoint_dir=args.output_dir, interval_steps=args.save_every) as run:
        with run.initializing():
            config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN)
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
            training = TrainingArguments(
                output_dir=run.checkpoint_dir, max_steps=args.steps, per_device_train_batch_size=BATCH,
                learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=3, logging_steps=1,
                save_strategy="no",  # ETTCallback asks for saves at the job's interval
                save_total_limit=run.keep, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
                disable_tqdm=True, ddp_find_unused_parameters=False,
            )  # fmt: skip
            world = max(1, training.world_size)
            # SlowSteps first: its sleep, standing for compute, then falls inside the step ETTCallback times.
            callbacks = [SlowSteps(args.step_seconds), ETTCallback(run, tokens_per_step=BATCH * SEQ_LEN * world)]
            trainer = Trainer(model=model, args=training, train_dataset=SyntheticText(256), callbacks=callbacks)

        trainer.train(resume_from_checkpoint=resume_checkpoint(run))

        if args.losses and run.rank == 0:
            losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
            with open(args.losses, "w") as f:
                json.dump(losses, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--output-dir", default="hf-out", help="outside ETT: where checkpoints go")
    parser.add_argument("--save-every", type=int, default=5, help="outside ETT: save every N steps")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--losses", default=None, help="rank 0 writes {step: loss} here (JSON)")
    train(parser.parse_args())
    # The Trainer and the DDP model are gone (train() returned; gc for their cycles) while the
    # process group is still registered, so freeing DDP's reducer does not drop the group's last
    # reference: when it did, after destroy_process_group, the group's destructor joined gloo's
    # threads holding the GIL while one of them needed it to free an all-gather's tensor, and the
    # rank hung for ever. Left to interpreter exit, gloo's threads were once torn down unjoined
    # ("terminate called", SIGABRT). The barrier lets every collective before it finish first.
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
