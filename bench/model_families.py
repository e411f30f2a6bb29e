"""Training throughput and MFU of the model families' example shapes on one device.

Builds the ``model`` section of ``examples/<family>/.conaconfig`` (Llama-3.2-1B shape, BERT-Large shape, and
the GPT 1.3B of ``examples/gpt`` for comparison) under dp = tp = pp = 1 and times the engine's real step path
(``bench/engine_vs_ref.py``'s ``engine_step`` logic: pending train step, clipping, fused AdamW, the
trainer's gradient-noise steps) on random tokens. BERT's targets mark 15% of the positions (-100 elsewhere),
as its masked-LM samples do. MFU = tokens/s x ``training_flops_per_token`` (of the family) / 989 TFLOP/s.

There is no reference implementation to compare against here: the rows give what a user of these shapes
gets from the engine on the machine, and the GPT row ties them to the GPT rows of ``engine_vs_ref``.

    PYTHONPATH=src python3 bench/model_families.py --rows llama:4,bert:16,gpt:8 --out $OUT/families.json
    PYTHONPATH=src python3 bench/model_families.py --device cpu --tiny --no-compile   # smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cona.config import parse_config  # noqa: E402
from cona.engine.optim import build_optimizer  # noqa: E402
from cona.engine.parallel_dims import build_mesh  # noqa: E402
from cona.engine.train_model import build_training_model  # noqa: E402
from cona.engine.trainer import IntervalSums, gns_steps_per_line  # noqa: E402
from cona.planner.flops import training_flops_per_token  # noqa: E402
from cona.strategy import Strategy  # noqa: E402
from engine_vs_ref import PEAK_BF16_TFLOPS, init_single_process_group, measure  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
BERT_VOCAB = 30522  # BERT's WordPiece vocabulary (the example's vocab file is made at set-up time)
MASKED_FRACTION = 0.15
TINY_SHAPE = {"layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 256, "seq": 64, "vocab_size": 256}


def model_section(family: str, tiny: bool) -> dict:
    raw = json.loads((EXAMPLES / family / ".conaconfig").read_text())["model"]
    raw = {**raw, "attention_dropout": 0.0, "hidden_dropout": 0.0}
    if family == "bert":
        raw["vocab_size"] = BERT_VOCAB
    if family == "gpt":
        raw["vocab_size"] = 50257
    if tiny:
        raw.update(TINY_SHAPE)
        if "kv_heads" in raw:
            raw["kv_heads"] = 2
    return raw


def build_config(family: str, args: argparse.Namespace):
    training = {
        "device": args.device,
        "dtype": "bf16",
        "zero_stage": 0,
        "compile": not args.no_compile,
        "clip_grad": 1.0,
    }
    if family == "bert":  # the tokenizer decides the samples' specials; random tokens stand in here
        training["tokenizer_type"] = "BertWordPieceLowerCase"
    return parse_config({"model": model_section(family, args.tiny), "training": training})


def random_batch(config, mbs: int, device: str, family: str) -> tuple[torch.Tensor, torch.Tensor]:
    model = config.model
    tokens = torch.randint(0, model.vocab_size, (mbs, model.seq + 1), device=device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if family == "bert":
        unmasked = torch.rand(targets.shape, device=device) >= MASKED_FRACTION
        targets = targets.masked_fill(unmasked, -100)
    return inputs, targets


def engine_step(family: str, mbs: int, args: argparse.Namespace):
    config = build_config(family, args)
    strategy = Strategy(
        dp=1, tp=1, pp=1, mbs=mbs, gbs=mbs, zero_stage=0, recompute=config.training.runtime.recompute
    )
    mesh = build_mesh(strategy, args.device)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    model = build_training_model(config, strategy, mesh, device)
    optimizer = build_optimizer(model.model_parts, config.training)
    for group in optimizer.param_groups:
        group["lr"] = 1e-4
    log_interval = config.training.logging.log_interval
    measured_steps = gns_steps_per_line(log_interval, single_step=model.measures_noise_in_one_step)
    batch = [random_batch(config, mbs, args.device, family)]
    state = {"iteration": 0, "interval": IntervalSums()}

    def step() -> object:
        upcoming = state["iteration"] + 1
        out = model.train_step_pending(batch, measure_gns=(-upcoming) % log_interval < measured_steps)
        grad_norm = model.clip_grad_norm_pending(config.training.optimizer.clip_grad)
        stepped = model.optimizer_step_pending(optimizer)
        optimizer.zero_grad(set_to_none=True)
        state["interval"].add(out, grad_norm, stepped)
        state["iteration"] = upcoming
        if upcoming % log_interval == 0:
            state["interval"].means()
            state["interval"] = IntervalSums()
        return out

    return step


def row(family: str, mbs: int, args: argparse.Namespace) -> dict:
    config = build_config(family, args)
    measured = measure(f"{family}-mbs{mbs}", lambda: engine_step(family, mbs, args), args)
    tokens_per_s = mbs * config.model.seq / (measured["step_ms"] / 1e3)
    flops_per_token = training_flops_per_token(config.model)
    return {
        "family": family,
        "name": config.model.name,
        "mbs": mbs,
        "seq": config.model.seq,
        "parameters_b": round(sum_parameters(config) / 1e9, 3),
        **measured,
        "tokens_per_s": round(tokens_per_s),
        "mfu": round(tokens_per_s * flops_per_token / (PEAK_BF16_TFLOPS * 1e12), 3),
    }


def sum_parameters(config) -> int:
    from cona.planner.flops import parameter_count

    return parameter_count(config.model)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", default="llama:4,bert:16", help="FAMILY:MBS,... (families: gpt, llama, bert)"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape of each family (CPU smoke run)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    init_single_process_group(args.device)
    rows = []
    for item in args.rows.split(","):
        family, mbs = item.split(":")
        rows.append(row(family, int(mbs), args))
        print(json.dumps(rows[-1]), flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{'model':16s} {'mbs':>4s} {'seq':>5s} {'params B':>8s} {'tok/s':>10s} {'MFU':>6s} {'GiB':>6s}")
    for r in rows:
        print(
            f"{r['name']:16s} {r['mbs']:4d} {r['seq']:5d} {r['parameters_b']:8.3f} {r['tokens_per_s']:10,d} "
            f"{r['mfu']:6.3f} {r['peak_gib'] if r['peak_gib'] is not None else '-':>6}"
        )


if __name__ == "__main__":
    main()
