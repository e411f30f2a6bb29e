"""Parallel degrees -> checks and the (pp, dp, tp) DeviceMesh.

:func:`validate_layout` is pure (no process group) so the CLI, the planner and the runner can refuse an
impossible layout before anything is launched. The strategy's own fields (zero stage, recompute, sequence
parallel, schedule, virtual stages) are what the engine runs; the config only supplies the model shape.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cona.config import ModelConfig, TrainingConfig
from cona.errors import LayoutError
from cona.strategy import Strategy

MESH_DIMS = ("pp", "dp", "tp")


def validate_layout(
    model: ModelConfig, training: TrainingConfig, strategy: Strategy, world_size: int | None = None
) -> None:
    """Raise :class:`LayoutError` saying why ``strategy`` cannot train ``model`` (on ``world_size`` ranks)."""
    where = strategy.short()

    def fail(why: str) -> None:
        raise LayoutError(f"strategy {where}: {why}")

    for name in ("dp", "tp", "pp", "mbs", "gbs", "virtual_stages"):
        if getattr(strategy, name) <= 0:
            fail(f"{name} must be positive, got {getattr(strategy, name)}")
    if world_size is not None and strategy.world_size != world_size:
        fail(f"dp*tp*pp = {strategy.world_size} processes, but {world_size} were launched")
    if strategy.zero_stage not in (0, 1, 2, 3):
        fail(f"zero_stage {strategy.zero_stage} is not one of 0, 1, 2, 3")
    _check_tensor_parallel(model, strategy, fail)
    _check_batches(strategy, fail)
    _check_pipeline(model, strategy, fail)


def _check_tensor_parallel(model: ModelConfig, strategy: Strategy, fail) -> None:
    tp = strategy.tp
    if model.heads % tp:
        fail(f"tp={tp} does not divide model.heads={model.heads}")
    if model.kv_heads % tp:
        fail(f"tp={tp} does not divide model.kv_heads={model.kv_heads} (a rank holds whole key/value heads)")
    if model.ffn_size % tp:
        fail(f"tp={tp} does not divide the feed-forward size {model.ffn_size} (model.ffn_hidden)")
    if model.padded_vocab_size % tp:
        fail(
            f"tp={tp} does not divide the padded vocabulary {model.padded_vocab_size} "
            f"(model.make_vocab_size_divisible_by={model.make_vocab_size_divisible_by})"
        )
    if strategy.sequence_parallel and tp > 1 and model.seq % tp:
        fail(f"sequence parallel needs tp={tp} to divide model.seq={model.seq}")


def _check_batches(strategy: Strategy, fail) -> None:
    per_step = strategy.mbs * strategy.dp
    if strategy.gbs % per_step:
        fail(f"gbs={strategy.gbs} is not a multiple of mbs*dp={per_step}")


def _check_pipeline(model: ModelConfig, strategy: Strategy, fail) -> None:
    """Pipeline rules; with pp = 1 there is no pipeline and its schedule settings are ignored (so one config
    serves every strategy of a chain)."""
    pp, virtual = strategy.pp, strategy.virtual_stages
    schedule = strategy.pipeline_schedule
    if pp == 1:
        return
    if virtual > 1 and schedule != "interleaved_1f1b":
        fail(f"virtual_stages={virtual} needs the interleaved_1f1b schedule, not {schedule}")
    if model.layers < pp * virtual:
        fail(f"model.layers={model.layers} is fewer than pp*virtual_stages={pp * virtual} pipeline stages")
    micro = strategy.micro_batches
    if schedule in ("1f1b", "interleaved_1f1b") and micro < pp:
        fail(f"{schedule} needs at least pp={pp} micro-batches per step, got gbs/(mbs*dp)={micro}")
    if schedule == "interleaved_1f1b":
        rounds = max(1, micro // pp)
        if micro % rounds:
            fail(
                f"interleaved_1f1b needs the {micro} micro-batches to be a multiple of {rounds} rounds "
                f"(micro-batches // pp); use a multiple of pp={pp}"
            )


def build_mesh(strategy: Strategy, device_type: str) -> DeviceMesh:
    """The one DeviceMesh of a run, dims ("pp", "dp", "tp") (tp innermost: fastest links)."""
    return init_device_mesh(device_type, (strategy.pp, strategy.dp, strategy.tp), mesh_dim_names=MESH_DIMS)
