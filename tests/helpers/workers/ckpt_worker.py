"""Checkpoint test worker: saves a model under some layouts and reloads it under others.

Run under ``torchrun --nproc-per-node N`` (gloo) or as a plain script (one process, no process group).

    ckpt_worker.py WORKDIR [--real [--family F]] [--save LAYOUT ...] [--load SRC:DST ...] [--save-loop L]
    ckpt_worker.py WORKDIR --real --plan '{"gpt": {"save": [...], "load": [...]}, "llama": {...}}'

A LAYOUT is ``dp<D>_tp<T>_pp<P>_z<Z>`` with an optional ``_v<V>`` (interleaved 1F1B, V stages per rank);
its D*T*P must equal the world size of the launch that uses it.

Two models. The default is a stand-in with GPT's parameter names, parallelised like the engine does it
(pipeline split by layers with global names, tensor parallel on ``w1``/``w2``, FSDP2 over dp for zero 1/3,
replicated tensors for zero 0); its gradients are an elementwise function of the parameters, so every layout
follows the same trajectory. ``--real`` uses the engine's model (``build_training_model``) on fixed token
batches, of family F (``gpt`` by default; ``llama``: grouped-query attention and an untied head). ``--save``
trains 2 steps, saves at iteration 2, writes (rank 0) ``dumps/<LAYOUT>.pt`` with the full value of every model
and optimizer tensor, then trains 2 more steps and records their losses (or, for the stand-in, the state after
one more step). ``--load`` builds DST from other initial values, loads SRC's checkpoint, requires every tensor
to equal SRC's dump exactly, trains the same 2 steps and requires the losses of the uninterrupted run (1e-5
relative). ``--plan`` runs the saves and loads of several families in one launch, each family in a folder
of its own under WORKDIR. ``--save-loop`` saves a bigger stand-in over and over (iterations 1, 2, ...) until
killed. Without torchrun, the layout must be 1 process: the real model then runs as a plain ``GPT`` with no
process group at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from cona.config import ConaConfig, parse_config
from cona.engine.checkpoint.load import load_checkpoint
from cona.engine.checkpoint.paths import layout_dir
from cona.engine.checkpoint.save import save_checkpoint
from cona.engine.checkpoint.state import model_and_optimizer_state
from cona.engine.optim import build_optimizer, set_lr
from cona.strategy import Strategy

SMALL = {"layers": 4, "hidden": 16, "heads": 2, "seq": 8, "vocab_size": 64, "ffn_hidden": 32}
BIG = {"layers": 2, "hidden": 256, "heads": 4, "seq": 8, "vocab_size": 8192, "ffn_hidden": 1024}
REAL = {
    "layers": 4,
    "hidden": 64,
    "heads": 4,
    "seq": 32,
    "vocab_size": 256,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
}
FAMILY_KEYS = {
    "gpt": {},
    "llama": {"family": "llama", "kv_heads": 2, "tie_embeddings": False},
    "bert": {"family": "bert"},
}
FAMILY_TRAINING = {"bert": {"tokenizer_type": "BertWordPieceLowerCase"}}
SAVED_ITERATION = 2
CONTINUED_STEPS = 2
MBS, GBS = 2, 8


@dataclass
class Run:
    """One layout's model on this rank and a function that trains one step and returns its loss."""

    strategy: Strategy
    model_parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    step: Callable[[int], float]


# ----------------------------------------------------------------------------------------- stand-in


class Block(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(hidden)
        self.w1 = nn.Linear(hidden, ffn)
        self.w2 = nn.Linear(ffn, hidden)


class StandIn(nn.Module):
    def __init__(self, config: ConaConfig) -> None:
        super().__init__()
        model = config.model
        self.tok_embeddings: nn.Module | None = nn.Embedding(model.padded_vocab_size, model.hidden)
        self.layers = nn.ModuleDict(
            {str(i): Block(model.hidden, model.ffn_size) for i in range(model.layers)}
        )
        self.norm: nn.Module | None = nn.LayerNorm(model.hidden)
        self.output: nn.Module | None = nn.Linear(model.hidden, model.padded_vocab_size, bias=False)


def parse_layout(name: str) -> Strategy:
    values = {
        part[:2] if part[:2] in ("dp", "tp", "pp") else part[:1]: int(part.lstrip("dptzv"))
        for part in name.split("_")
    }
    virtual = values.get("v", 1)
    return Strategy(
        dp=values["dp"],
        tp=values["tp"],
        pp=values["pp"],
        mbs=MBS,
        gbs=GBS,
        zero_stage=values["z"],
        virtual_stages=virtual,
        pipeline_schedule="interleaved_1f1b" if virtual > 1 else "1f1b",
    )


@torch.no_grad()
def build_model(config: ConaConfig, strategy: Strategy, mesh: DeviceMesh | None, offset: float) -> StandIn:
    model = StandIn(config)
    for fqn, param in model.named_parameters():
        generator = torch.Generator().manual_seed(zlib.crc32(fqn.encode()))
        param.copy_(torch.randn(param.shape, generator=generator) + offset)
    if mesh is None:
        return model
    pp_rank = mesh["pp"].get_local_rank()
    per_stage = len(model.layers) // strategy.pp
    for key in [k for k in model.layers if int(k) // per_stage != pp_rank]:
        del model.layers[key]
    if pp_rank != 0:
        model.tok_embeddings = None
    if pp_rank != strategy.pp - 1:
        model.norm = model.output = None
    if strategy.tp > 1:
        for block in model.layers.values():
            parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    if strategy.dp > 1 and strategy.zero_stage > 0:
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=strategy.zero_stage == 3)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=strategy.zero_stage == 3)
    return model


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    """A layout-independent update: grad = sin(3 * param + step), elementwise on every shard."""
    for param in model.parameters():
        param.grad = torch.sin(param.detach() * 3.0 + step)
    set_lr(optimizer, 0.01 * step)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return math.nan  # no loss: the stand-in is compared by its state after the step


def stand_in_run(config: ConaConfig, strategy: Strategy, offset: float) -> Run:
    model = build_model(config, strategy, mesh_for(strategy), offset)
    optimizer = build_optimizer([model], config.training)
    return Run(strategy, [model], optimizer, lambda step: train_step(model, optimizer, step))


# --------------------------------------------------------------------------------------- engine GPT


def global_batch(config: ConaConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0,
        config.model.vocab_size,
        (GBS, config.model.seq + 1),
        generator=torch.Generator().manual_seed(1000 + step),
    )
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def real_run(config: ConaConfig, strategy: Strategy, seed: int) -> Run:
    from cona.engine.train_model import build_training_model

    config = dataclasses.replace(config, training=config.training.replace(seed=seed))
    mesh = mesh_for(strategy)
    if mesh is None:
        return plain_gpt_run(config, strategy)
    model = build_training_model(config, strategy, mesh, torch.device("cpu"))
    optimizer = build_optimizer(model.model_parts, config.training)
    dp_rank = mesh.get_local_rank("dp")

    def step(iteration: int) -> float:
        inputs, targets = global_batch(config, iteration)
        rows = [(k * strategy.dp + dp_rank) * MBS for k in range(strategy.micro_batches)]
        out = model.train_step_pending(
            [(inputs[r : r + MBS], targets[r : r + MBS]) for r in rows], iteration=iteration
        ).result()
        model.clip_grad_norm_pending(config.training.optimizer.clip_grad).item()
        set_lr(optimizer, 1e-3)
        bool(model.optimizer_step_pending(optimizer).item())
        return out.loss

    return Run(strategy, model.model_parts, optimizer, step)


def plain_gpt_run(config: ConaConfig, strategy: Strategy) -> Run:
    """The engine's GPT in this process alone: no process group, no parallelism."""
    from cona.engine.model import GPT, init_weights
    from cona.engine.train_model import token_cross_entropy

    model = GPT(config.model)
    init_weights(model, config.model, config.training.runtime.seed)
    optimizer = build_optimizer([model], config.training)

    def step(iteration: int) -> float:
        loss = token_cross_entropy(
            model(global_batch(config, iteration)[0]), global_batch(config, iteration)[1]
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.training.optimizer.clip_grad)
        set_lr(optimizer, 1e-3)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return Run(strategy, [model], optimizer, step)


# ------------------------------------------------------------------------------------------ phases


def full_state(model_parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every model and flattened optimizer tensor at its full (unsharded) value, merged over all ranks."""
    model_state, optim_state = model_and_optimizer_state(model_parts, optimizer)
    local = {}
    for prefix, state in (("model.", model_state), ("optim.", optim_state)):
        for key, value in state.items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if isinstance(value, torch.Tensor):
                local[prefix + key] = value.detach().clone()
    if not dist.is_initialized():
        return local
    everyone: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return {key: value for part in everyone for key, value in (part or {}).items()}


def mesh_for(strategy: Strategy) -> DeviceMesh | None:
    if not dist.is_initialized():
        assert strategy.world_size == 1, f"{strategy.layout} needs torchrun"
        return None
    return init_device_mesh("cpu", (strategy.pp, strategy.dp, strategy.tp), mesh_dim_names=("pp", "dp", "tp"))


def checkpoint_root(workdir: Path, config: ConaConfig, strategy: Strategy) -> Path:
    return layout_dir(workdir, config, strategy, "fp32", run_name="run")


def save(workdir: Path, config: ConaConfig, name: str, make_run: Callable) -> None:
    run = make_run(config, parse_layout(name), 0)
    for step in range(1, SAVED_ITERATION + 1):
        run.step(step)
    state = {"iteration": SAVED_ITERATION, "consumed_samples": SAVED_ITERATION * GBS, "layout": name}
    save_checkpoint(
        checkpoint_root(workdir, config, run.strategy),
        iteration=SAVED_ITERATION,
        model_parts=run.model_parts,
        optimizer=run.optimizer,
        trainer_state=state,
        config=config,
        strategy=run.strategy,
    )
    write_dump(workdir / "dumps" / f"{name}.pt", full_state(run.model_parts, run.optimizer))
    losses = [run.step(SAVED_ITERATION + k) for k in range(1, CONTINUED_STEPS + 1)]
    write_dump(
        workdir / "dumps" / f"{name}.next.pt",
        {**full_state(run.model_parts, run.optimizer), "losses": torch.tensor(losses, dtype=torch.float64)},
    )
    report(f"saved {name}: losses after the save {losses}")


def load(workdir: Path, config: ConaConfig, source: str, target: str, make_run: Callable) -> None:
    run = make_run(config, parse_layout(target), 1)
    checkpoint = checkpoint_root(workdir, config, parse_layout(source))
    trainer_state = load_checkpoint(
        checkpoint, model_parts=run.model_parts, optimizer=run.optimizer, config=config
    )
    assert trainer_state["layout"] == source and trainer_state["iteration"] == SAVED_ITERATION, trainer_state
    expected = torch.load(workdir / "dumps" / f"{source}.pt")
    counts = compare(full_state(run.model_parts, run.optimizer), expected, what=f"{source}->{target} reload")
    losses = torch.tensor(
        [run.step(SAVED_ITERATION + k) for k in range(1, CONTINUED_STEPS + 1)], dtype=torch.float64
    )
    expected_next = torch.load(workdir / "dumps" / f"{source}.next.pt")
    uninterrupted = expected_next.pop("losses")
    if losses.isnan().all():  # the stand-in has no loss: compare the state after the continued steps
        compare(
            full_state(run.model_parts, run.optimizer),
            expected_next,
            what=f"{source}->{target} next",
            rtol=1e-6,
        )
    elif not torch.allclose(losses, uninterrupted, rtol=1e-5, atol=0):
        raise AssertionError(
            f"{source}->{target}: losses {losses.tolist()} != uninterrupted {uninterrupted.tolist()}"
        )
    report(
        f"loaded {source}->{target}: {counts[0]} model and {counts[1]} optimizer tensors equal; "
        f"next losses {losses.tolist()}"
    )


def compare(actual: dict, expected: dict, *, what: str, rtol: float = 0.0) -> tuple[int, int]:
    """Same keys and values (exactly when rtol is 0); returns (model, optimizer) tensor counts."""
    if set(actual) != set(expected):
        raise AssertionError(f"{what}: keys differ: {sorted(set(actual) ^ set(expected))[:5]}")
    for key, value in expected.items():
        same = torch.equal(actual[key], value) if rtol == 0 else torch.allclose(actual[key], value, rtol=rtol)
        if not same:
            raise AssertionError(
                f"{what}: {key} differs (max |diff| {(actual[key] - value).abs().max().item()})"
            )
    state_kinds = {key.rsplit(".", 1)[1] for key in expected if key.startswith("optim.")}
    assert {"exp_avg", "exp_avg_sq", "step"} <= state_kinds, state_kinds
    sections = [key.split(".", 1)[0] for key in expected]
    return sections.count("model"), sections.count("optim")


def save_loop(workdir: Path, config: ConaConfig, name: str) -> None:
    run = stand_in_run(config, parse_layout(name), 0.0)
    iteration = 0
    while True:
        iteration += 1
        run.step(iteration)
        save_checkpoint(
            checkpoint_root(workdir, config, run.strategy),
            iteration=iteration,
            model_parts=run.model_parts,
            optimizer=run.optimizer,
            trainer_state={"iteration": iteration},
            config=config,
            strategy=run.strategy,
        )
        report(f"saved iteration {iteration}")


def write_dump(path: Path, state: dict[str, torch.Tensor]) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)


def report(line: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--real", action="store_true", help="the engine's GPT instead of the stand-in")
    parser.add_argument("--save", nargs="*", default=[])
    parser.add_argument("--load", nargs="*", default=[])
    parser.add_argument("--save-loop")
    parser.add_argument("--family", choices=sorted(FAMILY_KEYS), default="gpt")
    parser.add_argument(
        "--plan",
        type=json.loads,
        help='with --real, several families in one launch: {"FAMILY": {"save": [...], "load": [...]}, ...}, '
        "each in WORKDIR/FAMILY, its lines after a line 'family FAMILY'",
    )
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    make_run = (
        real_run if args.real else lambda cfg, strategy, variant: stand_in_run(cfg, strategy, 0.5 * variant)
    )
    plans = args.plan or {args.family: {"save": args.save, "load": args.load}}
    try:
        for family, plan in plans.items():
            shape = {**REAL, **FAMILY_KEYS[family]} if args.real else BIG if args.save_loop else SMALL
            training = {"device": "cpu", "seed": 7, **FAMILY_TRAINING.get(family, {})}
            config = parse_config({"model": shape, "training": training})
            workdir = args.workdir / family if args.plan else args.workdir
            if args.plan:
                report(f"family {family}")
            for name in plan.get("save", []):
                save(workdir, config, name, make_run)
            for pair in plan.get("load", []):
                load(workdir, config, *pair.split(":"), make_run)
        if args.save_loop:
            save_loop(args.workdir, config, args.save_loop)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    # Skip interpreter teardown: gloo threads can abort it (as cona.engine.worker does, see its docstring).
    sys.stdout.flush()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
