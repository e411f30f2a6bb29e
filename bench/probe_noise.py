"""The paired probe's noise floor and a candidate's effect, measured with the engine on one device.

Builds the config's model at dp = tp = pp = 1 (``--config``: its ``training.data_prefix`` and LR rule), trains
``--warm-tokens`` at ``--gbs``, then ``--repeats`` times: a probe whose candidate is the current batch itself
(equal branches from one state: their probe-loss difference is the comparison's noise floor, 0 where the
device is deterministic) and a probe of ``--candidate-gbs`` at its LR by ``training.lr_scale_strategy``. The
run goes on from each probe's winner, as online mode does. Prints one JSON line per probe (both branches'
numbers, :class:`cona.planner.probe_rule.ProbeOutcome`) and a summary: the equal branches' mean and largest
``|difference|`` (the noise floor, nats), the candidate's differences and speedups, and the probes'
wall time::

    PYTHONPATH=src python3 bench/probe_noise.py --config .conaconfig --gbs 16 --candidate-gbs 32 \\
        --warm-tokens 2000000 --probe-tokens 131072 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from cona.config.file import load_config
from cona.data.gpt_dataset import build_datasets, collate, micro_batch_sample_ids
from cona.engine.optim import build_optimizer, lr_schedule, set_lr
from cona.engine.parallel_dims import build_mesh
from cona.engine.probe_branch import ProbeRequest, run_probe
from cona.engine.train_model import build_training_model
from cona.engine.trainer import Progress, fixed_eval_batches, regrouped_eval_batches
from cona.planner.lr_scaling import scaled_lr
from cona.strategy import Strategy
from engine_vs_ref import init_single_process_group


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=".conaconfig")
    parser.add_argument("--gbs", type=int, default=16)
    parser.add_argument("--candidate-gbs", type=int, default=32)
    parser.add_argument("--mbs", type=int, default=None, help="micro-batch of both (default: each gbs whole)")
    parser.add_argument("--warm-tokens", type=int, default=1_000_000)
    parser.add_argument("--probe-tokens", type=int, default=None, help="default: training.probe_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    config = load_config(args.config)
    training, seq = config.training, config.model.seq
    device_type = "cuda" if training.runtime.device != "cpu" and torch.cuda.is_available() else "cpu"
    init_single_process_group(device_type)
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    current = Strategy(
        dp=1, tp=1, pp=1, mbs=args.mbs or args.gbs, gbs=args.gbs, zero_stage=training.runtime.zero_stage
    )
    candidate = Strategy(
        dp=1,
        tp=1,
        pp=1,
        mbs=args.mbs or args.candidate_gbs,
        gbs=args.candidate_gbs,
        zero_stage=training.runtime.zero_stage,
    )
    model = build_training_model(config, current, build_mesh(current, device_type), device)
    optimizer = build_optimizer(model.model_parts, training)
    splits = build_datasets(config)
    planned = max(training.lr.lr_decay_tokens or 0, args.warm_tokens * 4)

    def schedule(gbs: int):
        lr = scaled_lr(training, gbs)
        min_factor = lr.min_lr / training.lr.base_min_lr if training.lr.base_min_lr > 0 else lr.min_lr_factor
        return lr_schedule(
            training, planned_tokens=planned, lr_factor=lr.lr / training.lr.base_lr, min_lr_factor=min_factor
        )

    def step(strategy: Strategy, sched, progress: Progress) -> torch.Tensor:
        ids = micro_batch_sample_ids(progress.consumed_samples, strategy.gbs, strategy.mbs, 1, 0)
        set_lr(optimizer, sched.lr_at(progress.consumed_tokens))
        out = model.train_step_pending([collate(splits.train, batch) for batch in ids], measure_gns=False)
        model.clip_grad_norm_pending(training.optimizer.clip_grad)
        model.optimizer_step_pending(optimizer)
        progress.iteration += 1
        progress.consumed_samples += strategy.gbs
        progress.consumed_tokens += strategy.gbs * seq
        return out.loss

    valid = splits.valid if splits.valid is not None else splits.train
    probe_set = fixed_eval_batches(
        valid,
        samples=training.logging.eval_iters * training.lr.base_gbs,
        mbs=current.mbs,
        dp=1,
        dp_rank=0,
        device=device,
    )
    progress = Progress()
    while progress.consumed_tokens < args.warm_tokens:
        step(current, schedule(current.gbs), progress)
    tokens = args.probe_tokens or training.online.probe_tokens
    samples = -(-tokens // seq)
    rows: dict[str, list] = {"equal": [], "candidate": []}
    for _ in range(args.repeats):
        for kind, target in (("equal", current), ("candidate", candidate)):
            request = ProbeRequest(
                candidate=target,
                lr_schedule=schedule(target.gbs),
                samples=samples,
                tolerance=training.online.probe_tolerance,
            )
            outcome, progress = run_probe(
                model, optimizer, progress, stage=1, current=current, current_schedule=schedule(current.gbs),
                request=request, step=step,
                evaluate=lambda: model.eval_loss(regrouped_eval_batches(probe_set, model.strategy.mbs)),
            )  # fmt: skip
            if model.strategy != current:  # the run goes on at the current batch for the next pair
                model.rebatch(current)
            rows[kind].append(outcome)
            print(json.dumps({"kind": kind, **outcome.to_dict()}), flush=True)
    equal = [abs(o.loss_difference) for o in rows["equal"]]
    summary = {
        "noise_floor_mean_nats": statistics.fmean(equal),
        "noise_floor_max_nats": max(equal),
        "candidate_difference_nats": [o.loss_difference for o in rows["candidate"]],
        "candidate_speedup": [o.speedup for o in rows["candidate"]],
        "candidate_winner": [o.winner for o in rows["candidate"]],
        "probe_wall_s": statistics.fmean(o.wall_s for o in rows["candidate"]),
        "probe_tokens": tokens,
    }
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
