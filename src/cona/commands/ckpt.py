"""``cona ckpt inspect PATH`` and ``cona ckpt export PATH OUT.safetensors`` (or ``--format hf OUT_DIR``):
read checkpoints without starting any distributed process."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cona.config import DTYPES
from cona.errors import CheckpointError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "ckpt", help="Inspect and export checkpoints", description="Inspect and export checkpoints."
    )
    actions = parser.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    inspect = actions.add_parser(
        "inspect",
        help="Layout, iteration, consumed tokens, size and completeness of a checkpoint",
        description="Show a checkpoint's layout, progress, model shape, size on disk and whether it is "
        "complete. PATH is a global_step<N> directory, a layout directory (its 'latest' "
        "marker is followed) or a marker file. Exits 1 when the checkpoint is incomplete.",
    )
    inspect.add_argument("path", type=Path, metavar="PATH")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(func=run_inspect)
    export = actions.add_parser(
        "export",
        help="Write the consolidated model weights to one safetensors file, or a Hugging Face model",
        description="Gather the model tensors of a (possibly sharded) checkpoint into one safetensors file "
        "that loads without torch.distributed (tied weights are written once), or with --format hf into a "
        "transformers model directory OUT_DIR (config.json, model.safetensors and the tokenizer files; gpt: "
        "GPT2LMHeadModel, llama: LlamaForCausalLM).",
    )
    export.add_argument("path", type=Path, metavar="PATH")
    export.add_argument("out", type=Path, metavar="OUT", help="OUT.safetensors, or OUT_DIR with --format hf")
    export.add_argument(
        "--format",
        choices=("safetensors", "hf"),
        default="safetensors",
        help="safetensors (default): CONA's tensor names in one file; hf: a from_pretrained directory",
    )
    export.set_defaults(func=run_export)


def run_inspect(args: argparse.Namespace) -> int:
    report = inspect_checkpoint(args.path)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for key, value in report.items():
            shown = ", ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else value
            print(f"{key:>18}: {shown}")
    return 0 if report["complete"] else 1


def inspect_checkpoint(path: Path) -> dict[str, Any]:
    """What ``cona ckpt inspect`` shows, as a JSON-ready dict."""
    from cona.engine.checkpoint.info import model_shape, read_checkpoint_info, resolve_checkpoint
    from cona.engine.checkpoint.load import verify_checkpoint

    checkpoint = resolve_checkpoint(path)
    try:
        verify_checkpoint(checkpoint)
        problem = None
    except CheckpointError as err:
        problem = str(err)
    report: dict[str, Any] = {"path": str(checkpoint), "complete": problem is None}
    if problem is not None:
        report["problem"] = problem
    report["size_bytes"] = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    report["size"] = _human_size(report["size_bytes"])
    try:
        info = read_checkpoint_info(checkpoint)
    except CheckpointError as err:
        report["unreadable"] = str(err)
        return report
    if info.strategy is not None:
        strategy = info.strategy
        report["layout"] = {
            "dp": strategy.dp,
            "tp": strategy.tp,
            "pp": strategy.pp,
            "zero_stage": strategy.zero_stage,
            "dtype": _dtype_from_path(checkpoint),
        }
    state = info.trainer_state
    for key in ("iteration", "consumed_samples", "consumed_tokens", "stage"):
        report[key] = state.get(key)
    report["model"] = {"name": info.config.model.name, **model_shape(info.config.model)}
    return report


def _dtype_from_path(checkpoint: Path) -> str:
    """The dtype level of ``.../z<zero>/<dtype>/<layout>/global_step<N>``, or "unknown" elsewhere."""
    candidate = checkpoint.parent.parent.name
    return candidate if candidate in DTYPES else "unknown"


def _human_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{size} B"
        value /= 1024
    raise AssertionError("unreachable")


def run_export(args: argparse.Namespace) -> int:
    if args.format == "hf":
        return _run_export_hf(args)
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from cona.atomic_files import give_umask_mode
    from cona.engine.checkpoint.info import read_checkpoint_info, resolve_checkpoint
    from cona.engine.checkpoint.load import load_model_tensors

    checkpoint = resolve_checkpoint(args.path)
    if args.out.suffix != ".safetensors":
        raise CheckpointError(f"OUT: {args.out} should end in .safetensors")
    if not args.out.parent.is_dir():
        raise CheckpointError(f"OUT: directory {args.out.parent} does not exist")
    tensors = load_model_tensors(checkpoint)
    info = read_checkpoint_info(checkpoint)
    tied = (info.manifest or {}).get("tied_parameters", [])
    drop_tied_copies(checkpoint, tensors, tied)
    metadata = {
        "format": "pt",
        "source": str(checkpoint),
        "iteration": str(info.trainer_state.get("iteration")),
        "tied_parameters": json.dumps(tied),
    }
    try:
        save_file(
            {name: tensor.contiguous() for name, tensor in tensors.items()}, str(args.out), metadata=metadata
        )
        give_umask_mode(args.out)
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"OUT: cannot write {args.out}: {err}") from None
    total = sum(t.numel() for t in tensors.values())
    print(f"wrote {args.out}: {len(tensors)} tensors, {total} parameters, from {checkpoint}")
    return 0


def _run_export_hf(args: argparse.Namespace) -> int:
    from cona.engine.hf_export import export_hf

    result = export_hf(args.path, args.out)
    tokenizer = "with the tokenizer" if result.tokenizer else "no tokenizer (training.vocab_file is unset)"
    print(
        f"wrote {result.out_dir}: {result.architecture}, {result.tensors} tensors, {result.parameters} "
        f"parameters, {tokenizer}"
    )
    return 0


def drop_tied_copies(checkpoint: Path, tensors: dict, tied: list[list[str]]) -> None:
    """Keep one tensor per tied group (the first name). Every copy must equal it: a pipeline that keeps tied
    weights as two synchronised copies stores both, and a copy that differs is corruption, never a weight
    to export as untied."""
    for kept, *aliases in tied:
        for alias in aliases:
            if alias not in tensors or kept not in tensors:
                continue
            if not tensors[alias].equal(tensors[kept]):
                raise CheckpointError(
                    f"{checkpoint}: tied weights {kept} and {alias} differ; the checkpoint is corrupt "
                    "(a tied copy is never exported as an untied weight)"
                )
            del tensors[alias]
