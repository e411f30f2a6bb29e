"""The Python API (:mod:`cona.api`): ``import cona`` is cheap, settings are refused in one line before
anything starts, ``load_model`` gives the saved model's logits, and the example of docs/python-api.md runs.

The example runs as written, in a copy of the project's layout: ``examples/tiny/.conaconfig`` as shipped,
and at its data paths a small tokenizer and dataset made here instead of the demo data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.helpers.paths import RUN_CHAIN_SMALL
from tests.helpers.text_data import ENGLISH_SAMPLE, write_tiny_gpt2_tokenizer
from tests.helpers.tiny import tiny_config

import cona
from cona.data.indexed import IndexedDatasetWriter
from cona.engine.checkpoint.paths import layout_dir
from cona.engine.checkpoint.save import save_checkpoint
from cona.engine.model import GPT
from cona.engine.optim import build_optimizer
from cona.errors import ConaError
from cona.strategy import Strategy

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "python-api.md"


def test_import_cona_imports_neither_torch_nor_the_runner() -> None:
    script = (
        "import sys, cona\n"
        "assert callable(cona.train) and callable(cona.load_model)\n"
        "print(sorted(m for m in ('torch', 'numpy', 'matplotlib', 'cona.runner', 'cona.commands') "
        "if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ({}, r"give one of chain=, online= or fixed= \(got none\)"),
        ({"chain": "c.json", "fixed": {"gbs": 8, "mbs": 2, "iters": 1}}, r"\(got chain= and fixed=\)"),
        ({"online": {"gpus": 2, "systm": "cpu_gloo"}}, r"online=: unknown key systm"),
        ({"online": {"gpus": 2}}, r"online=: .*missing .*'system'"),
        (
            {"online": cona.Online(gpus=2, system="s", initial_gbs=1, search="bo")},
            r"search 'bo' is not one of",
        ),
        ({"fixed": [1, 2]}, r"fixed=: expected cona.Fixed or a dict"),
        ({"fixed": {"gbs": 8, "mbs": 2, "iters": 1}, "gpus": 2}, r"gpus= goes with chain="),
    ],
)
def test_bad_settings_are_refused_in_one_line_before_anything_runs(call: dict, message: str) -> None:
    with pytest.raises(ConaError, match=message):
        cona.train(**call)


def test_a_setting_is_checked_as_its_flag_is(tmp_path: Path, tiny_config_file) -> None:
    config = tiny_config_file(data="random")
    online = {"gpus": 2, "system": "cpu_gloo", "initial_gbs": 4, "max_gbs": 2, "total_iters": 2}
    with pytest.raises(ConaError, match="--max-gbs 2 is below --initial-gbs 4"):
        cona.train(config, online=online, workdir=tmp_path)
    with pytest.raises(ConaError, match="training.base_lr"):
        cona.train(config, fixed={"gbs": 8, "mbs": 2, "iters": 1}, overrides={"training.base_lr": "fast"})


def test_load_model_gives_the_saved_models_logits(tmp_path: Path) -> None:
    config = tiny_config()
    torch.manual_seed(0)
    saved = GPT(config.model)
    with torch.no_grad():
        for param in saved.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    strategy = Strategy(dp=1, tp=1, pp=1, mbs=2, gbs=8)
    layout = layout_dir(tmp_path, config, strategy, "fp32", run_name="run")
    save_checkpoint(
        layout,
        iteration=3,
        model_parts=[saved],
        optimizer=build_optimizer([saved], config.training),
        trainer_state={"iteration": 3, "consumed_samples": 24, "consumed_tokens": 384, "stage": 1},
        config=config,
        strategy=strategy,
    )
    model = cona.load_model(layout)  # through the layout directory's ``latest`` marker
    assert not model.training and model.config == config.model
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), saved.eval()(tokens), rtol=0, atol=0)
    with pytest.raises(ConaError, match="does not exist"):
        cona.load_model(tmp_path / "nowhere")


def test_a_train_result_reads_a_chain_run_directory() -> None:
    run_dir = RUN_CHAIN_SMALL
    result = cona.TrainResult.read(run_dir)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert (result.final_loss, result.iterations, result.tokens) == (
        lines[-1]["loss"],
        lines[-1]["iteration"],
        lines[-1]["consumed_tokens"],
    )
    assert result.final_perplexity == [line["eval_ppl"] for line in lines if "eval_ppl" in line][-1]
    spans = [
        (stage.number, stage.gbs, stage.first_iteration, stage.last_iteration) for stage in result.stages
    ]
    assert spans == [(1, 8, 1, 50), (2, 16, 51, 110), (3, 32, 111, 180)]
    assert sum(stage.tokens for stage in result.stages) == result.tokens
    assert result.checkpoint == Path(
        "work/checkpoints/run_chain_small/gpt-tiny/z1/fp32/tp2_pp1_dp2_sp1/global_step180"
    )
    assert result.realized_chain == Path("realized_chain.json")  # the chain file the run recorded


def doc_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, "docs/python-api.md has one runnable example"
    return blocks[0]


def project_copy(root: Path) -> None:
    """examples/tiny/.conaconfig as shipped, and files at its data paths: a BPE tokenizer learnt from a
    few English sentences, and a dataset of its token ids."""
    example = root / "examples" / "tiny"
    example.mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "tiny" / ".conaconfig", example / ".conaconfig")
    data = root / "data" / "demo"
    vocab, merges = write_tiny_gpt2_tokenizer(data, " ".join(ENGLISH_SAMPLE), num_merges=40)
    vocab.rename(data / "tiny-vocab.json")
    merges.rename(data / "tiny-merges.txt")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(data / "wiki_tiny_text_document", np.uint16) as writer:
        for _ in range(400):
            writer.add_document(rng.integers(0, 256, size=int(rng.integers(100, 300))))


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_documented_example_runs(tmp_path: Path) -> None:
    project_copy(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", doc_example()],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "final loss" in done.stdout and "loss on random tokens" in done.stdout
    assert (tmp_path / "examples" / "tiny" / "logs" / "api-online" / "realized_chain.json").is_file()
