"""``cona ckpt export --format hf``: a checkpoint as a Hugging Face transformers model directory.

OUT_DIR gets ``config.json`` (written by transformers' own config class), ``model.safetensors`` and, when
the checkpoint's config names a GPT-2 ``vocab.json``/``merges.txt``, the tokenizer (those two files plus
what ``GPT2TokenizerFast.save_pretrained`` adds, so ``AutoTokenizer.from_pretrained(OUT_DIR)`` loads it).

- ``gpt`` -> ``GPT2LMHeadModel``: GPT-2's ``Conv1D`` stores ``[in, out]``, so every projection is
  transposed, and ``c_attn`` joins q, k and v along its output; GELU is ``gelu_pytorch_tanh``, the same
  ``F.gelu(approximate="tanh")`` CONA runs.
- ``llama`` -> ``LlamaForCausalLM``: the names change, the tensors do not (CONA's rotary embedding is the
  same non-interleaved "rotate half" convention); ``rope_theta``, the RMSNorm epsilon, ``kv_heads`` and
  ``tie_embeddings`` go into the config.
- ``bert`` is refused: ``BertForMaskedLM`` is post-norm with a LayerNorm on the embeddings, CONA's BERT is
  pre-norm (Megatron's); ``MegatronBertForMaskedLM`` is pre-norm but applies one ``hidden_act`` both in the
  MLP (CONA: tanh GELU) and in the masked-LM head (CONA: exact erf GELU), so no transformers class computes
  CONA's logits.

CONA pads the embedding to ``make_vocab_size_divisible_by``; the export keeps the first ``vocab_size`` rows
(the tokenizer's ids), so HF's logits are CONA's without the padding columns, which no token id reaches.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cona.atomic_files import give_umask_mode
from cona.config import ModelConfig, TrainingConfig
from cona.engine.checkpoint.info import read_checkpoint_info, resolve_checkpoint
from cona.engine.checkpoint.load import load_model_tensors
from cona.errors import CheckpointError

WEIGHTS_FILE = "model.safetensors"
END_OF_TEXT = "<|endoftext|>"
# (key, value CONA's model must have, what the transformers class has) for each exported family.
REQUIRED: dict[str, tuple[tuple[str, object], ...]] = {
    "gpt": (
        ("normalization", "layernorm"),
        ("activation", "gelu"),
        ("position_embedding", "learned"),
        ("bias", True),
    ),
    "llama": (("normalization", "rmsnorm"), ("activation", "swiglu"), ("position_embedding", "rope")),
}
TARGETS = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
BERT_REFUSAL = (
    "model.family 'bert' has no transformers equivalent: BertForMaskedLM is post-norm with an embedding "
    "LayerNorm (CONA's BERT is pre-norm), and MegatronBertForMaskedLM uses one activation for the MLP "
    "(CONA: tanh GELU) and the masked-LM head (CONA: erf GELU); use the default safetensors export"
)


@dataclass(frozen=True)
class HfExport:
    out_dir: Path
    architecture: str
    tensors: int
    parameters: int
    tokenizer: bool


def export_hf(path: Path, out_dir: Path) -> HfExport:
    """Write ``path``'s checkpoint as a transformers model directory ``out_dir`` (new or empty)."""
    checkpoint = resolve_checkpoint(path)
    info = read_checkpoint_info(checkpoint)
    model, training = info.config.model, info.config.training
    check_exportable(model)
    tokenizer_files = _tokenizer_files(training, model)
    _prepare_out_dir(out_dir)
    tensors = load_model_tensors(checkpoint)
    hf_tensors = CONVERTERS[model.family](model, _untie(checkpoint, model, tensors))
    eod = _end_of_text_id(tokenizer_files[0]) if tokenizer_files else None
    config = _hf_config(model, eod)
    try:
        config.save_pretrained(out_dir)
        _save_weights(hf_tensors, out_dir / WEIGHTS_FILE, checkpoint)
        if tokenizer_files:
            _save_tokenizer(tokenizer_files, out_dir)
    except OSError as err:
        raise CheckpointError(f"OUT_DIR: cannot write {out_dir}: {err.strerror or err}") from None
    return HfExport(
        out_dir=out_dir,
        architecture=TARGETS[model.family],
        tensors=len(hf_tensors),
        parameters=sum(t.numel() for t in hf_tensors.values()),
        tokenizer=bool(tokenizer_files),
    )


def check_exportable(model: ModelConfig) -> None:
    """Refuse (one line naming the key) a model whose architecture no transformers class reproduces."""
    if model.family == "bert":
        raise CheckpointError(BERT_REFUSAL)
    target = TARGETS[model.family]
    for key, wanted in REQUIRED[model.family]:
        if getattr(model, key) != wanted:
            raise CheckpointError(
                f"model.{key} is {getattr(model, key)!r}; {target} needs {wanted!r}, so --format hf cannot "
                "export this model"
            )
    if model.family == "gpt" and model.kv_heads != model.heads:
        raise CheckpointError(
            f"model.kv_heads is {model.kv_heads}; GPT2LMHeadModel has no grouped-query attention "
            f"(kv_heads must equal heads={model.heads})"
        )


def _tokenizer_files(training: TrainingConfig, model: ModelConfig) -> tuple[Path, Path] | None:
    """The checkpoint config's GPT-2 vocab.json and merges.txt, or None when it names no vocabulary."""
    if training.data.vocab_file is None:
        return None
    if training.data.tokenizer_type != "GPT2BPETokenizer" or training.data.merge_file is None:
        raise CheckpointError(
            f"training.merge_file: --format hf writes GPT-2 BPE tokenizers only (vocab.json and merges.txt); "
            f"this checkpoint's tokenizer is {training.data.tokenizer_type} without a merge file"
        )
    files = (Path(training.data.vocab_file), Path(training.data.merge_file))
    for key, file in zip(("vocab_file", "merge_file"), files, strict=True):
        if not file.is_file():
            raise CheckpointError(f"training.{key}: {file} (from the checkpoint's config) does not exist")
    try:
        entries = len(json.loads(files[0].read_text(encoding="utf-8")))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"training.vocab_file: {files[0]} is not a JSON vocabulary") from None
    if entries > model.vocab_size:
        raise CheckpointError(
            f"training.vocab_file: {files[0]} has {entries} entries, more than model.vocab_size="
            f"{model.vocab_size}"
        )
    return files


def _end_of_text_id(vocab_file: Path) -> int | None:
    return json.loads(vocab_file.read_text(encoding="utf-8")).get(END_OF_TEXT)


def _prepare_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"OUT_DIR: {out_dir} is a file; --format hf writes a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise CheckpointError(f"OUT_DIR: {out_dir} is not empty; give a new or empty directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"OUT_DIR: cannot create {out_dir}: {err.strerror or err}") from None


def _untie(checkpoint: Path, model: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model tensors with one embedding when tied: a stored second copy must equal the first."""
    if not model.tie_embeddings:
        return tensors
    head = tensors.pop("output.weight", None)
    if head is not None and not head.equal(tensors["tok_embeddings.weight"]):
        raise CheckpointError(
            f"{checkpoint}: model.tie_embeddings is true but output.weight differs from tok_embeddings.weight"
        )
    return tensors


def _vocab_rows(model: ModelConfig, tensor: torch.Tensor) -> torch.Tensor:
    return tensor[: model.vocab_size]


def _gpt2_tensors(model: ModelConfig, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {
        "transformer.wte.weight": _vocab_rows(model, t["tok_embeddings.weight"]),
        "transformer.wpe.weight": t["pos_embeddings.weight"],
        "transformer.ln_f.weight": t["norm.weight"],
        "transformer.ln_f.bias": t["norm.bias"],
    }
    for i in range(model.layers):
        cona, hf = f"layers.{i}.", f"transformer.h.{i}."
        qkv = [f"{cona}attention.{w}" for w in ("wq", "wk", "wv")]
        out[f"{hf}attn.c_attn.weight"] = torch.cat([t[f"{name}.weight"] for name in qkv]).T
        out[f"{hf}attn.c_attn.bias"] = torch.cat([t[f"{name}.bias"] for name in qkv])
        for hf_name, cona_name in (
            ("attn.c_proj", "attention.wo"),
            ("mlp.c_fc", "feed_forward.w1"),
            ("mlp.c_proj", "feed_forward.w2"),
        ):
            out[f"{hf}{hf_name}.weight"] = t[f"{cona}{cona_name}.weight"].T  # Conv1D: [in, out]
            out[f"{hf}{hf_name}.bias"] = t[f"{cona}{cona_name}.bias"]
        for hf_name, cona_name in (("ln_1", "attention_norm"), ("ln_2", "ffn_norm")):
            for leaf in ("weight", "bias"):
                out[f"{hf}{hf_name}.{leaf}"] = t[f"{cona}{cona_name}.{leaf}"]
    if not model.tie_embeddings:
        out["lm_head.weight"] = _vocab_rows(model, t["output.weight"])
    return out


LLAMA_LAYER_NAMES = (
    ("input_layernorm", "attention_norm"),
    ("self_attn.q_proj", "attention.wq"),
    ("self_attn.k_proj", "attention.wk"),
    ("self_attn.v_proj", "attention.wv"),
    ("self_attn.o_proj", "attention.wo"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate_proj", "feed_forward.w1"),
    ("mlp.up_proj", "feed_forward.w3"),
    ("mlp.down_proj", "feed_forward.w2"),
)


def _llama_tensors(model: ModelConfig, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {
        "model.embed_tokens.weight": _vocab_rows(model, t["tok_embeddings.weight"]),
        "model.norm.weight": t["norm.weight"],
    }
    for i in range(model.layers):
        for hf_name, cona_name in LLAMA_LAYER_NAMES:
            for leaf in ("weight", "bias"):
                name = f"layers.{i}.{cona_name}.{leaf}"
                if name in t:  # biases only with model.bias (HF: attention_bias, mlp_bias)
                    out[f"model.layers.{i}.{hf_name}.{leaf}"] = t[name]
    if not model.tie_embeddings:
        out["lm_head.weight"] = _vocab_rows(model, t["output.weight"])
    return out


CONVERTERS: dict[str, Callable[[ModelConfig, dict[str, torch.Tensor]], dict[str, torch.Tensor]]] = {
    "gpt": _gpt2_tensors,
    "llama": _llama_tensors,
}


def _hf_config(model: ModelConfig, eod: int | None):
    """transformers' config object of the exported architecture (it writes config.json itself)."""
    transformers = _import_transformers()
    common = {
        "architectures": [TARGETS[model.family]],
        "vocab_size": model.vocab_size,
        "tie_word_embeddings": model.tie_embeddings,
        "bos_token_id": eod,
        "eos_token_id": eod,
        "dtype": "float32",
    }
    if model.family == "gpt":
        return transformers.GPT2Config(
            n_positions=model.seq,
            n_embd=model.hidden,
            n_layer=model.layers,
            n_head=model.heads,
            n_inner=model.ffn_size,
            activation_function="gelu_pytorch_tanh",
            resid_pdrop=model.hidden_dropout,
            embd_pdrop=model.hidden_dropout,
            attn_pdrop=model.attention_dropout,
            layer_norm_epsilon=model.layernorm_epsilon,
            initializer_range=model.init_std,
            **common,
        )
    return transformers.LlamaConfig(
        hidden_size=model.hidden,
        intermediate_size=model.ffn_size,
        num_hidden_layers=model.layers,
        num_attention_heads=model.heads,
        num_key_value_heads=model.kv_heads,
        head_dim=model.head_dim,
        hidden_act="silu",
        max_position_embeddings=model.seq,
        rms_norm_eps=model.layernorm_epsilon,
        rope_theta=model.rope_theta,
        attention_bias=model.bias,
        mlp_bias=model.bias,
        attention_dropout=model.attention_dropout,
        initializer_range=model.init_std,
        **common,
    )


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise CheckpointError(
            "--format hf needs the transformers package (pip install 'transformers>=5.0')"
        ) from None
    return transformers


def _save_weights(tensors: dict[str, torch.Tensor], out: Path, checkpoint: Path) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(
            {name: tensor.contiguous() for name, tensor in tensors.items()},
            str(out),
            metadata={"format": "pt", "source": str(checkpoint)},
        )
        give_umask_mode(out)
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"OUT_DIR: cannot write {out}: {err}") from None


def _save_tokenizer(files: tuple[Path, Path], out_dir: Path) -> None:
    """Copy vocab.json/merges.txt; transformers adds tokenizer.json and tokenizer_config.json from them."""
    vocab, merges = files
    shutil.copyfile(vocab, out_dir / "vocab.json")
    shutil.copyfile(merges, out_dir / "merges.txt")
    tokenizer = _import_transformers().GPT2TokenizerFast.from_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
