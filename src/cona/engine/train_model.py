"""One rank's part of a GPT under a strategy: forward/backward over a step's micro-batches, norms, clipping.

``build_training_model`` builds the model on the meta device, splits it into pipeline stages, applies
TP / recompute / compile / FSDP2, materialises it and initialises every parameter from (seed, FQN), so every
layout starts from the same weights. The loss of a step is the mean token cross entropy over all loss
tokens of the whole global batch (:mod:`cona.engine.objective`: every token for GPT, the masked positions
for BERT); gradients are those of that mean, i.e. identical to a 1-process full-batch step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel

from cona.config import ConaConfig
from cona.engine import gns
from cona.engine.compile_cache import use_persistent_compile_caches
from cona.engine.model import GPT, init_weights, parameter_seed, token_cross_entropy
from cona.engine.objective import loss_token_count, micro_batch_share, summed_token_cross_entropy
from cona.engine.parallelize import GradAllReducer, match_grad_placements, parallelize_gpt
from cona.engine.pipeline import PipelineRunner, TiedEmbeddingSync, num_stages, split_stage, stage_ids_of_rank
from cona.engine.shape_warmup import ShapeWarmup, run_mode
from cona.engine.step_modes import compile_options, compile_scope, resolved_dtype, uses_cuda_graphs
from cona.engine.step_noise import HeldPieceGradients, NoiseInputs, local_grads, split_rows
from cona.engine.step_output import LossScaler, PendingStepOutput, StepOutput
from cona.strategy import Strategy

__all__ = [
    "LossScaler", "PendingStepOutput", "StepOutput", "TrainingModel",
    "build_training_model", "token_cross_entropy",
]  # fmt: skip

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Batch = tuple[torch.Tensor, torch.Tensor]


class TrainingModel:
    """This rank's model parts plus everything a training step needs: the trainer runs the ``*_pending`` steps
    and ``eval_loss``, the worker ``probe_loss`` (switch verification) and ``rebatch`` (in-place switch)."""

    def __init__(
        self,
        *,
        config: ConaConfig,
        strategy: Strategy,
        mesh: DeviceMesh,
        device: torch.device,
        model_parts: list[GPT],
        stage_ids: list[int],
    ) -> None:
        self.config, self.strategy, self.mesh, self.device = config, strategy, mesh, device
        self.model_parts, self._stage_ids = model_parts, stage_ids
        self.dtype = resolved_dtype(config.training, device)
        self.scaler = LossScaler(enabled=self.dtype == "fp16")
        self.dp_rank = mesh.get_local_rank("dp")
        self.is_first_stage = 0 in stage_ids
        self.is_last_stage = num_stages(strategy) - 1 in stage_ids  # pp = 1: one stage, first and last
        self._fsdp = strategy.dp > 1 and strategy.zero_stage >= 1
        self._params: list[nn.Parameter] | None = None
        if not self._fsdp:  # FSDP2 swaps the parameters registered on its modules: look them up each time
            self._params = self._unique_params()
        self._grad_reducer = (
            GradAllReducer(self._unique_params(), mesh["dp"])
            if strategy.dp > 1 and strategy.zero_stage == 0
            else None
        )
        self._tied_sync = TiedEmbeddingSync(mesh, model_parts) if strategy.pp > 1 else None
        self._held_pieces = HeldPieceGradients()
        self._compiled: dict[bool, Callable] = {}  # with and without CUDA graphs, kept across rebatch
        self.compile_scope = compile_scope(config.training, config.model, strategy, device.type)
        self._set_batch_parts(strategy)
        self._last_norm_sqr: torch.Tensor | None = None  # of the gradients held now; None: none held
        self.shape_warmup = ShapeWarmup()  # the trainer reads whether each step still warmed up a shape

    def _set_batch_parts(self, strategy: Strategy) -> None:
        """What depends on the micro-batch count: the pipeline schedule, CUDA graphs (single micro-batch
        steps only), the compiled forward's mode and the gradient-noise meter."""
        self.strategy = strategy
        self._pipeline = (
            PipelineRunner(self.model_parts, self._stage_ids, strategy, self.mesh, self.device)
            if strategy.pp > 1
            else None
        )
        self.cuda_graphs = uses_cuda_graphs(self.config.training, self.config.model, strategy, self.device)
        self._forward_loss = self._plain_forward_loss
        if self.compile_scope == "model":
            if self.cuda_graphs not in self._compiled:  # static shapes: one graph per batch size
                options = compile_options(self.cuda_graphs)
                compiled = torch.compile(self._plain_forward_loss, dynamic=False, options=options)
                self._compiled[self.cuda_graphs] = compiled
            self._forward_loss = self._compiled[self.cuda_graphs]
        self._noise = NoiseInputs(
            self.model_parts,
            strategy=strategy,
            tie_embeddings=self.config.model.tie_embeddings,
            is_first_stage=self.is_first_stage,
            fsdp=self._fsdp,
            device=self.device,
            copy_previous=self.cuda_graphs,
        )

    @property
    def measures_noise_in_one_step(self) -> bool:
        return self._noise.in_one_step

    def rebatch(self, strategy: Strategy) -> None:
        """Continue under another gbs and mbs on the same layout (an in-place switch): the parameters, their
        sharding and the graphs compiled so far stay (torch.compile keeps one graph per micro-batch shape);
        what depends on the micro-batch count is rebuilt."""
        if not self.strategy.same_layout(strategy):
            raise ValueError(f"rebatch keeps the layout: {self.strategy.short()} -> {strategy.short()}")
        self._noise.meter.remove()
        self._set_batch_parts(strategy)

    # ---- parameter bookkeeping -------------------------------------------------------------------------
    def _unique_params(self) -> list[nn.Parameter]:
        if self._params is not None:
            return self._params  # walking the module tree costs ~1 ms of host time per call
        return [p for part in self.model_parts for p in part.parameters()]

    # ---- the step ------------------------------------------------------------------------------------
    def seed_dropout(self, iteration: int) -> None:
        """Seed dropout from (seed, iteration, dp rank): TP ranks must draw the same masks on replicated
        activations, and nothing rank-specific has to survive a reshard."""
        torch.manual_seed(
            parameter_seed(self.config.training.runtime.seed, f"dropout/{iteration}/{self.dp_rank}")
        )

    def train_step_pending(
        self, micro_batches: list[Batch], *, iteration: int | None = None, measure_gns: bool = True
    ) -> PendingStepOutput:
        """Forward + backward over this dp rank's micro-batches, nothing waiting for the device (except fp16's
        overflow check); ``.result()`` reads it. On return the grads are fully reduced. ``measure_gns`` False
        leaves out the gradient-noise inputs (NaN) and restarts the difference estimator.

        A measured step with one micro-batch per rank runs it as equal pieces with gradient accumulation
        (:meth:`NoiseInputs.pieces_for`): the same samples, loss and gradient up to float rounding (with
        dropout, other masks of the same distribution).
        """
        if iteration is not None:
            self.seed_dropout(iteration)
        n_micro = len(micro_batches)
        if n_micro != self.strategy.micro_batches:
            raise ValueError(
                f"train_step got {n_micro} micro-batches, the strategy has {self.strategy.micro_batches}"
            )
        if self._last_norm_sqr is not None:  # the last step's gradients, which no optimizer step consumed
            self._drop_grads()
        if self.cuda_graphs:  # the last step's graph outputs are dead: the replay may reuse their memory
            torch.compiler.cudagraph_mark_step_begin()
        scale = self.scaler.scale
        self.shape_warmup.start_step()
        pieces = self._noise.pieces_for(measure_gns) if n_micro == 1 else 1
        if pieces > 1:  # a measured step of one micro-batch: its pieces give small batches (step_noise)
            micro_batches = split_rows(micro_batches[0], pieces)
            n_micro = pieces
        compiled = self.compile_scope != "none"
        if self._pipeline is None:
            measure = self._noise.start_step(n_micro / scale, measure=measure_gns)
            # A measured step's pieces run in the graph compiled for their own (static) shape.
            mode = run_mode(compiled=compiled, eager=False, cuda_graphs=self.cuda_graphs)
            graphs = self.cuda_graphs and pieces > 1
            losses = self._plain_forward_backward(micro_batches, scale, graph_pieces=graphs, mode=mode)
        else:  # the schedule scales the gradient by 1 / n_micro after the per-micro-batch hooks ran
            measure = self._noise.start_step(1 / scale, measure=measure_gns)
            inputs, targets = self._to_device(
                *(torch.cat(parts) for parts in zip(*micro_batches, strict=True))
            )
            share = self._share([targets], n_micro)
            pipeline_mode = run_mode(compiled=compiled, eager=False, cuda_graphs=False)
            self.shape_warmup.note(tuple(inputs.shape), pipeline_mode)
            with self._compute_context():
                losses = self._pipeline.run(inputs, targets, share=share, loss_factor=scale, train=True)
        if self.strategy.tp > 1:
            match_grad_placements(self._unique_params())
        if self._tied_sync is not None:
            self._tied_sync.all_reduce_grad()
        if self._grad_reducer is not None:
            self._grad_reducer.all_reduce()
        if self.scaler.enabled:
            torch._foreach_mul_(local_grads(self._unique_params()), 1 / scale)
        return self._step_output(losses, n_micro, measure)

    def _plain_forward_loss(
        self, inputs: torch.Tensor, targets: torch.Tensor, share: torch.Tensor
    ) -> torch.Tensor:
        """The micro-batch's ``L_k``: summed token loss times ``share`` (:mod:`cona.engine.objective`)."""
        return summed_token_cross_entropy(self.model_parts[0](inputs), targets) * share

    def _share(self, targets: list[torch.Tensor], n_micro: int) -> torch.Tensor:
        """``n / N`` of this step's global batch: ``n = dp * n_micro`` micro-batches, ``N`` loss tokens."""
        dp_group = self.mesh["dp"].get_group() if self.strategy.dp > 1 else None
        return micro_batch_share(loss_token_count(targets, dp_group), self.strategy.dp * n_micro)

    def _plain_forward_backward(
        self, micro_batches: list[Batch], scale: float, *, graph_pieces: bool, mode: str
    ) -> list[torch.Tensor]:
        """``graph_pieces``: the pieces replay CUDA graphs, each overwriting the last one's outputs; ``mode``:
        how the forward runs (:func:`cona.engine.shape_warmup.run_mode`)."""
        model, losses = self.model_parts[0], []
        batches = [self._to_device(inputs, targets) for inputs, targets in micro_batches]
        share = self._share([targets for _, targets in batches], len(batches))
        for index, (inputs, targets) in enumerate(batches):
            if self._fsdp:
                model.set_requires_gradient_sync(index == len(batches) - 1)
            if graph_pieces and index:
                self._held_pieces.hold(self._unique_params())
                torch.compiler.cudagraph_mark_step_begin()
            self.shape_warmup.note(tuple(inputs.shape), mode)
            with self._compute_context():
                loss = self._forward_loss(inputs, targets, share)
                (loss * (scale / len(batches))).backward()
            losses.append(loss.detach().clone() if graph_pieces else loss.detach())
        if graph_pieces:
            self._held_pieces.add_to(self._unique_params())
        return losses

    def _eager_if_compiled(self) -> contextlib.AbstractContextManager:
        """Run eager where the model is compiled (evaluation: a few no-grad forwards per interval, which
        would otherwise compile a graph of their own)."""
        if self.compile_scope != "none":
            return torch.compiler.set_stance("force_eager")
        return contextlib.nullcontext()

    def _compute_context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.dtype != "fp32":
            stack.enter_context(torch.autocast(self.device.type, dtype=TORCH_DTYPES[self.dtype]))
        if self.strategy.tp > 1:
            stack.enter_context(loss_parallel())
        return stack

    def _to_device(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

    def _step_output(self, losses: list[torch.Tensor], n_micro: int, measure: bool) -> PendingStepOutput:
        n_small = self.strategy.dp * n_micro
        sums, grads = self._noise.local_sums(n_small, measure)
        totals = self._all_reduce_sum([self._local_loss(losses), *sums])
        loss, *sums = totals.unbind()
        big_sqr, tied_sqr = sums[0], sums[1]
        self._last_norm_sqr = big_sqr + tied_sqr
        return self._noise.output(
            loss, sums, grads, n_small=n_small, measure=measure, may_overflow=self.scaler.enabled
        )

    def disable_gns(self) -> None:
        """Stop measuring the gradient-noise inputs (their fields become NaN), e.g. to time what they cost."""
        self._noise.disable()

    def _local_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """This rank's share of the global mean loss (the last stage's dp*tp ranks each hold one copy): the
        ``L_k`` average to the global mean over the ``dp * len(losses)`` micro-batches."""
        if not self.is_last_stage:
            return torch.zeros((), device=self.device)
        # Under TP the losses are replicated DTensors (loss_parallel); their local values are the loss.
        local = torch.stack([gns.local_tensor(loss) for loss in losses])
        return local.float().mean() / (self.strategy.dp * self.strategy.tp)

    def _all_reduce_sum(self, values: list[torch.Tensor]) -> torch.Tensor:
        """One collective for all of a step's scalars; the sums stay on the device (no host sync)."""
        stacked = torch.stack([v.float() for v in values])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stacked)
        return stacked

    # ---- after the step ------------------------------------------------------------------------------
    def clip_grad_norm_pending(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm of the last step (all ranks, shards, stages; tied matrix once), clipped in
        place to ``max_norm`` when it is > 0; norm and clipping factor stay on the device (float64 scalar).

        The gradients are multiplied by ``max_norm / (norm + 1e-6)`` where the norm is finite and above
        ``max_norm``, by exactly 1 elsewhere (a no-op on the values), so no host decision is needed.
        """
        if self._last_norm_sqr is None:
            raise RuntimeError("clip_grad_norm_pending called before train_step_pending")
        norm = self._last_norm_sqr.double().sqrt()
        if max_norm > 0:
            clips = torch.isfinite(norm) & (norm > max_norm)
            factor = torch.where(clips, max_norm / (norm + 1e-6), torch.ones_like(norm)).float()
            torch._foreach_mul_(local_grads(self._unique_params()), factor)
            self._noise.previous.note_scaled(factor)
        return norm

    def optimizer_step_pending(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Step unless the gradients are not finite (fp16 overflow: then also lower the loss scale), then drop
        the gradients (a next step without this one drops them first); whether it stepped, as a device bool.

        With an optimizer that takes ``found_inf`` (fused AdamW, as GradScaler uses it) the skip happens in
        its kernel and nothing waits for the device; otherwise (CPU, foreach on DTensor shards) and under
        fp16 (whose loss scale needs the answer) the finiteness is read on the host.
        """
        if self._last_norm_sqr is None:
            raise RuntimeError("optimizer_step_pending called before train_step_pending")
        finite = torch.isfinite(self._last_norm_sqr)
        if self._skips_on_device(optimizer):
            optimizer.found_inf = (~finite).float()
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
        elif bool(finite.item()):
            optimizer.step()
        self._drop_grads()
        if self.scaler.enabled:
            self.scaler.update(found_inf=not bool(finite.item()))
        return finite

    def drop_gradients(self) -> None:
        """Drop the last step's gradients without an optimizer step (a step that only compiles)."""
        self._drop_grads()

    def _drop_grads(self) -> None:
        """The one place gradients are zeroed (set to None, which frees them); see optimizer_step_pending."""
        for param in self._unique_params():
            param.grad = None
        self._last_norm_sqr = None

    def _skips_on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        return (
            self.device.type == "cuda"
            and not self.scaler.enabled
            and getattr(optimizer, "_step_supports_amp_scaling", False)
            and all(group.get("fused") for group in optimizer.param_groups)
        )

    # ---- evaluation ----------------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, micro_batches: list[Batch]) -> float:
        """Mean token loss over the loss tokens of every dp rank's micro-batches (BERT: the masked tokens,
        whose ``exp`` is the masked-token perplexity); the same on every rank."""
        for part in self.model_parts:
            part.eval()
        try:
            with self._eager_if_compiled():
                losses = self._eval_losses(micro_batches)
        finally:
            for part in self.model_parts:
                part.train()
                # Without a backward, FSDP2 (no reshard after forward) would leave the unsharded parameters
                # registered on the modules, hiding the sharded ones and their gradients.
                for module in part.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()
        return self._all_reduce_sum([self._local_loss(losses)]).item()

    def _eval_losses(self, micro_batches: list[Batch]) -> list[torch.Tensor]:
        batches = [self._to_device(*batch) for batch in micro_batches]
        share = self._share([targets for _, targets in batches], len(batches))
        with self._compute_context():
            if self._pipeline is None:
                # eval_loss runs eager: no CUDA graph replay can overwrite these losses
                return [self._forward_loss(inputs, targets, share).detach() for inputs, targets in batches]
            return self._pipeline.eval_losses(batches, self._unique_params(), share=share)

    def probe_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean loss of one fixed batch given whole to every rank (switch verification), in micro-batches of
        ``mbs`` rows as pipeline stages expect (repeated to a multiple of mbs: the mean stays)."""
        mbs = self.strategy.mbs
        repeats = mbs // math.gcd(inputs.shape[0], mbs)
        inputs, targets = inputs.repeat(repeats, 1), targets.repeat(repeats, 1)
        batches = list(zip(inputs.split(mbs), targets.split(mbs), strict=True))
        return self.eval_loss(batches)


def build_training_model(
    config: ConaConfig, strategy: Strategy, mesh: DeviceMesh, device: torch.device
) -> TrainingModel:
    """Build this rank's parts on meta, parallelise, materialise on ``device``, initialise each parameter
    from ``training.seed`` and its name (the worker checked the layout before: ``worker.run_stage``)."""
    dtype = resolved_dtype(config.training, device)
    stage_ids = stage_ids_of_rank(strategy, mesh.get_local_rank("pp"))
    scope = compile_scope(config.training, config.model, strategy, device.type)
    if scope != "none":
        use_persistent_compile_caches()
    compile_blocks = scope == "blocks"
    parts = []
    for stage in stage_ids:
        with torch.device("meta"):
            model = GPT(config.model)
        if strategy.pp > 1:
            split_stage(model, stage, num_stages(strategy))
        param_dtype = TORCH_DTYPES[dtype] if dtype != "fp32" else None
        parallelize_gpt(model, mesh, strategy, compile_blocks=compile_blocks, param_dtype=param_dtype)
        model.to_empty(device=device)
        model.tie_output()  # to_empty makes new tensors per module, which unties plain parameters
        init_weights(model, config.model, config.training.runtime.seed)
        parts.append(model)
    return TrainingModel(
        config=config, strategy=strategy, mesh=mesh, device=device, model_parts=parts, stage_ids=stage_ids
    )
