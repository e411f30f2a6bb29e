"""Switch verification for Megatron-DeepSpeed: the draw compared, the layout that evaluates it, verdicts."""

from __future__ import annotations

import dataclasses

from cona.backends.megatron_deepspeed.commands import chain_shape
from cona.backends.megatron_deepspeed.log_parse import Evaluation
from cona.backends.megatron_deepspeed.verify import (
    SavedProbe,
    probe_record,
    probe_strategy,
    read_saved_probe,
    verdict_of,
    write_saved_probe,
)
from cona.config import parse_config
from cona.strategy import Strategy

CONFIG = parse_config(
    {
        "model": {"layers": 2, "hidden": 64, "heads": 4, "seq": 64, "normalization": "rmsnorm"},
        "training": {"data_prefix": "/d/docs_text_document", "split": "90,8,2"},
    }
)
SAVING = Strategy(dp=1, tp=1, pp=2, mbs=1, gbs=4)
LOADING = Strategy(dp=1, tp=2, pp=1, mbs=1, gbs=4)
SHAPE = chain_shape(CONFIG, [(SAVING, 4), (LOADING, 8)])
FINAL = [
    Evaluation(iteration=4, split="validation", samples=None, loss=10.1),  # during training: not a final draw
    Evaluation(iteration=4, split="validation", samples=8, loss=10.67650),
    Evaluation(iteration=4, split="test", samples=8, loss=10.69993),
]


def _record(evaluations, strategy=SAVING, eval_iters=2):
    return probe_record(
        evaluations,
        config=CONFIG,
        shape=SHAPE,
        strategy=strategy,
        eval_iters=eval_iters,
        dtype="fp32",
        seconds=7.4,
    )


def test_the_test_draw_is_preferred_and_the_validation_draw_is_the_fallback():
    assert (_record(FINAL).split, _record(FINAL).loss) == ("test", 10.69993)
    assert (_record(FINAL[:2]).split, _record(FINAL[:2]).loss) == ("validation", 10.6765)
    assert _record(FINAL[:1]) is None  # no final draw printed


def test_the_new_layout_evaluates_the_saved_gbs_with_micro_batch_one():
    saved = SavedProbe(record=_record(FINAL), gbs=4, eval_iters=2)
    probe = probe_strategy(saved, Strategy(dp=2, tp=1, pp=1, mbs=4, gbs=16))
    assert (probe.dp, probe.tp, probe.pp, probe.mbs, probe.gbs) == (2, 1, 1, 1, 4)
    assert probe_strategy(saved, Strategy(dp=3, tp=1, pp=1, mbs=1, gbs=6)) is None  # 3 does not divide 4


def test_verdicts():
    saved = SavedProbe(record=_record(FINAL), gbs=4, eval_iters=2)
    same = _record([dataclasses.replace(FINAL[2], loss=10.69993)], strategy=probe_strategy(saved, LOADING))
    assert verdict_of(saved, same, checkpoint="ck").status == "passed"
    noise = _record([dataclasses.replace(FINAL[2], loss=10.69985)], strategy=probe_strategy(saved, LOADING))
    assert verdict_of(saved, noise, checkpoint="ck").status == "passed"
    moved = _record([dataclasses.replace(FINAL[2], loss=10.70302)], strategy=probe_strategy(saved, LOADING))
    failed = verdict_of(saved, moved, checkpoint="ck")
    assert failed.status == "failed" and "switch verification refused checkpoint ck" in failed.message()
    other_draw = _record(FINAL, eval_iters=3)  # another draw cannot vouch for the saved weights
    assert verdict_of(saved, other_draw, checkpoint="ck").status == "failed"
    assert verdict_of(saved, None, checkpoint="ck").status == "failed"


def test_the_saved_probe_travels_with_the_checkpoint_its_universal_copy_came_from(tmp_path):
    saved = SavedProbe(record=_record(FINAL), gbs=4, eval_iters=2)
    (tmp_path / "global_step4").mkdir()
    write_saved_probe(tmp_path / "global_step4", saved)
    assert read_saved_probe(tmp_path / "global_step4_universal") == saved
    assert read_saved_probe(tmp_path / "global_step8_universal") is None
