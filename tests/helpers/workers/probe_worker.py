"""torchrun worker: a paired probe under each requested layout restores its state exactly.

Usage: torchrun --nproc-per-node N tests/helpers/workers/probe_worker.py LAYOUT [LAYOUT ...], a layout being
``name:key=value,...`` over Strategy fields (gbs and mbs are the worker's). Under each layout two engines
train the same steps: one with a probe whose branches are equal (the current batch against itself), one
without. Rank 0 prints one JSON line per layout, prefixed ``PROBE``: whether the branches' probe losses were
bit-identical, and whether the losses of the steps after the probe and the final weights equal the plain
run's to the bit.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from cona.config import ConaConfig, ModelConfig, TrainingConfig
from cona.data.gpt_dataset import micro_batch_sample_ids
from cona.engine.gns import local_tensor
from cona.engine.optim import LRSchedule, build_optimizer, set_lr
from cona.engine.parallel_dims import build_mesh
from cona.engine.probe_branch import ProbeRequest, run_probe
from cona.engine.train_model import build_training_model
from cona.engine.trainer import Progress
from cona.strategy import Strategy

SEQ, GBS, MBS = 16, 8, 2
SCHEDULE = LRSchedule(peak_lr=3e-3, min_lr=3e-4, warmup_tokens=64, decay_tokens=8192)
CONFIG = ConaConfig(
    model=ModelConfig(
        layers=2, hidden=32, heads=4, seq=SEQ, vocab_size=64, attention_dropout=0.0, hidden_dropout=0.0
    ),
    training=TrainingConfig(device="cpu", dtype="fp32", seed=5),
)


def sample(index: int) -> torch.Tensor:
    return torch.randint(0, 64, (SEQ + 1,), generator=torch.Generator().manual_seed(500 + index))


def rows(ids) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.stack([sample(int(i)) for i in ids])
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class Engine:
    def __init__(self, strategy: Strategy) -> None:
        self.model = build_training_model(CONFIG, strategy, build_mesh(strategy, "cpu"), torch.device("cpu"))
        self.optimizer = build_optimizer(self.model.model_parts, CONFIG.training)
        self.progress = Progress()
        self.probe_set = [rows(range(-MBS * (k + 1), -MBS * k)) for k in range(2)]

    def step(self, strategy: Strategy, schedule: LRSchedule, progress: Progress) -> torch.Tensor:
        ids = micro_batch_sample_ids(
            progress.consumed_samples, strategy.gbs, strategy.mbs, strategy.dp, self.model.dp_rank
        )
        set_lr(self.optimizer, schedule.lr_at(progress.consumed_tokens))
        out = self.model.train_step_pending(
            [rows(b) for b in ids], iteration=progress.iteration, measure_gns=False
        )
        self.model.clip_grad_norm_pending(1.0)
        self.model.optimizer_step_pending(self.optimizer)
        progress.iteration += 1
        progress.consumed_samples += strategy.gbs
        progress.consumed_tokens += strategy.gbs * SEQ
        return out.loss

    def train(self, strategy: Strategy, steps: int) -> list[float]:
        return [self.step(strategy, SCHEDULE, self.progress).item() for _ in range(steps)]

    def weights(self) -> list[torch.Tensor]:
        return [
            local_tensor(p).detach().clone() for part in self.model.model_parts for p in part.parameters()
        ]


def check(layout: Strategy) -> dict:
    probed, plain = Engine(layout), Engine(layout)
    probed.train(layout, 2)
    plain.train(layout, 2)
    request = ProbeRequest(candidate=layout, lr_schedule=SCHEDULE, samples=2 * GBS, tolerance=0.0)
    outcome, probed.progress = run_probe(
        probed.model, probed.optimizer, probed.progress, stage=1, current=layout, current_schedule=SCHEDULE,
        request=request, step=probed.step, evaluate=lambda: probed.model.eval_loss(probed.probe_set),
    )  # fmt: skip
    plain.train(layout, 2)
    after_probed, after_plain = probed.train(layout, 2), plain.train(layout, 2)
    same_weights = all(torch.equal(a, b) for a, b in zip(probed.weights(), plain.weights(), strict=True))
    return {
        "branches_equal": outcome.current.loss == outcome.candidate.loss
        and outcome.current.train_loss == outcome.candidate.train_loss,
        "continues_as_plain": after_probed == after_plain
        and dataclasses.asdict(probed.progress) == dataclasses.asdict(plain.progress),
        "weights_equal": same_weights,
    }


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for spec in sys.argv[1:]:
        name, _, fields = spec.partition(":")
        values = {key: int(value) for key, value in (item.split("=") for item in fields.split(",") if item)}
        layout = Strategy(**{"dp": 1, "tp": 1, "pp": 1, "mbs": MBS, "gbs": GBS, **values})
        result = check(layout)
        if dist.get_rank() == 0:
            print("PROBE " + json.dumps({"layout": name, **result}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
