"""``cona ckpt export --format hf``: transformers' ``from_pretrained`` of the export computes CONA's logits.

Everything is local: a small GPT-2-format vocabulary trained on a few sentences, tiny models of the engine's
own class saved with the engine's own checkpoint code, and transformers loading the exported directory.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch

from cona.atomic_files import current_umask
from cona.cli import main
from cona.config import parse_config
from cona.data.small_bpe import train_small_bpe
from cona.data.tokenizer import load_gpt2_tokenizer
from cona.engine.checkpoint.paths import layout_dir
from cona.engine.checkpoint.save import save_checkpoint
from cona.engine.model import GPT
from cona.engine.optim import build_optimizer
from cona.strategy import Strategy

transformers = pytest.importorskip("transformers")

STRATEGY = Strategy(dp=1, tp=1, pp=1, mbs=2, gbs=8, zero_stage=1)
SHAPE = {"layers": 2, "hidden": 32, "heads": 4, "seq": 16, "make_vocab_size_divisible_by": 128}
TEXT = "The cat sat on the mat. A dog ran in the park, and the cat saw it."
CASES = {
    "gpt": {},
    "gpt-untied": {"tie_embeddings": False, "layernorm_epsilon": 1e-6},
    "llama-gqa": {
        "family": "llama",
        "kv_heads": 2,
        "tie_embeddings": False,
        "rope_theta": 500000.0,
        "layernorm_epsilon": 1e-6,
    },
    "llama-tied-bias": {"family": "llama", "bias": True, "ffn_hidden": 48},
}


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("bpe")
    corpus = directory / "corpus.jsonl"
    sentences = [TEXT, "Parks have dogs and cats.", "The mat is on the floor of the park."] * 20
    corpus.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences))
    bpe = train_small_bpe(corpus, directory / "vocab.json", directory / "merges.txt", vocab_size=300)
    return bpe.vocab_file, bpe.merge_file


def _save(tmp_path: Path, model_keys: dict, files: tuple[Path, Path] | None) -> tuple[Path, GPT]:
    """A one-process checkpoint of the engine's model with every tensor random (norms and biases too)."""
    training = {"vocab_file": str(files[0]), "merge_file": str(files[1])} if files else {}
    model_section = {**SHAPE, **model_keys} | ({} if files else {"vocab_size": 200})
    config = parse_config({"model": model_section, "training": training})
    torch.manual_seed(0)
    model = GPT(config.model)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    optimizer = build_optimizer([model], config.training)
    path = save_checkpoint(
        layout_dir(tmp_path, config, STRATEGY, "fp32", run_name="run"),
        iteration=3,
        model_parts=[model],
        optimizer=optimizer,
        trainer_state={"iteration": 3, "consumed_samples": 24, "consumed_tokens": 384, "stage": 1},
        config=config,
        strategy=STRATEGY,
    )
    return path, model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_pretrained_gives_conas_logits(case, tokenizer_files, tmp_path: Path, capsys) -> None:
    path, model = _save(tmp_path, CASES[case], tokenizer_files)
    out = tmp_path / "hf"
    assert main(["ckpt", "export", str(path), str(out), "--format", "hf"]) == 0
    assert "with the tokenizer" in capsys.readouterr().out
    vocab_size = model.config.vocab_size
    assert vocab_size < model.config.padded_vocab_size  # the padding rows are dropped
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    expected_class = "LlamaForCausalLM" if model.config.family == "llama" else "GPT2LMHeadModel"
    assert type(hf).__name__ == expected_class and not hf.training
    # The exported tokenizer encodes like CONA's own (tiktoken over the same vocab.json/merges.txt).
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = load_gpt2_tokenizer(*tokenizer_files).encode(TEXT)[: model.config.seq]
    assert hf_tokenizer(TEXT)["input_ids"][: len(ids)] == ids
    tokens = torch.tensor([ids, list(reversed(ids))])
    with torch.no_grad():
        ours = model(tokens)[..., :vocab_size]
        theirs = hf(tokens).logits
    assert theirs.shape == ours.shape
    difference = (theirs - ours).abs().max().item()
    print(f"{case}: max |logits difference| = {difference:.3g}")
    assert difference <= 1e-5 * ours.abs().max().item()


def test_without_vocab_file_writes_no_tokenizer(tmp_path: Path, capsys) -> None:
    path, model = _save(tmp_path, {}, None)
    out = tmp_path / "hf"
    assert main(["ckpt", "export", str(path), str(out), "--format", "hf"]) == 0
    assert "no tokenizer" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o666 & ~current_umask()
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out))
    tokens = torch.arange(model.config.seq).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens)[..., :200])


def test_refusals_are_one_line(tokenizer_files, tmp_path: Path, capsys) -> None:
    path, _ = _save(tmp_path, {"position_embedding": "rope"}, tokenizer_files)
    assert main(["ckpt", "export", str(path), str(tmp_path / "a"), "--format", "hf"]) == 1
    err = capsys.readouterr().err
    assert (
        "model.position_embedding is 'rope'; GPT2LMHeadModel needs 'learned'" in err and err.count("\n") == 1
    )
    path, _ = _save(tmp_path / "ok", {}, tokenizer_files)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main(["ckpt", "export", str(path), str(tmp_path / "full"), "--format", "hf"]) == 1
    assert "is not empty" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["ckpt", "export", str(path), str(blocker / "sub"), "--format", "hf"]) == 1
    err = capsys.readouterr().err
    assert "OUT_DIR: cannot create" in err and err.count("\n") == 1


def test_bert_is_refused_with_the_reason(tmp_path: Path, capsys) -> None:
    config = {"family": "bert", "vocab_size": 200}
    raw = {"model": {**SHAPE, **config}, "training": {"tokenizer_type": "BertWordPieceLowerCase"}}
    model = GPT(parse_config(raw).model)
    optimizer = build_optimizer([model], parse_config(raw).training)
    path = save_checkpoint(
        layout_dir(tmp_path, parse_config(raw), STRATEGY, "fp32", run_name="run"),
        iteration=1,
        model_parts=[model],
        optimizer=optimizer,
        trainer_state={"iteration": 1},
        config=parse_config(raw),
        strategy=STRATEGY,
    )
    assert main(["ckpt", "export", str(path), str(tmp_path / "hf"), "--format", "hf"]) == 1
    err = capsys.readouterr().err
    assert "BertForMaskedLM is post-norm" in err and "MegatronBertForMaskedLM" in err
    assert not (tmp_path / "hf").exists()
