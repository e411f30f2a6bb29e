"""The paired probe restores state exactly and trains each sample once (one CPU process, the tiny GPT)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
import torch
from tests.helpers.tiny import tiny_config, tiny_engine

from cona.data.gpt_dataset import micro_batch_sample_ids
from cona.engine import probe_branch
from cona.engine.optim import LRSchedule, build_optimizer, set_lr
from cona.engine.probe_branch import ProbeRequest, run_probe
from cona.engine.trainer import Progress
from cona.strategy import Strategy

SEQ = 8
SCHEDULE = LRSchedule(peak_lr=3e-3, min_lr=3e-4, warmup_tokens=64, decay_tokens=4096)
CURRENT = Strategy(dp=1, tp=1, pp=1, mbs=2, gbs=4)
CANDIDATE = Strategy(dp=1, tp=1, pp=1, mbs=4, gbs=8)


def sample(index: int) -> torch.Tensor:
    """Sample ``index`` of a synthetic corpus: SEQ + 1 tokens fixed by the index."""
    return torch.randint(0, 64, (SEQ + 1,), generator=torch.Generator().manual_seed(1000 + index))


class Run:
    """The tiny engine, its optimizer, and a log of every sample id each step trained (tagged)."""

    def __init__(self) -> None:
        self.model = tiny_engine(gbs=CURRENT.gbs, mbs=CURRENT.mbs, config=tiny_config(model={"seq": SEQ}))
        self.optimizer = build_optimizer(self.model.model_parts, self.model.config.training)
        self.progress = Progress()
        self.trained: list[tuple[str, int]] = []
        self.tag = "main"
        probe = torch.stack([sample(-1 - k) for k in range(4)])
        self.probe_set = [(probe[:, :-1], probe[:, 1:])]

    def step(self, strategy: Strategy, schedule: LRSchedule, progress: Progress) -> torch.Tensor:
        ids = micro_batch_sample_ids(progress.consumed_samples, strategy.gbs, strategy.mbs, 1, 0)
        self.trained += [(self.tag, int(i)) for batch in ids for i in batch]
        micro = [
            (rows[:, :-1], rows[:, 1:]) for rows in (torch.stack([sample(int(i)) for i in b]) for b in ids)
        ]
        set_lr(self.optimizer, schedule.lr_at(progress.consumed_tokens))
        out = self.model.train_step_pending(micro, iteration=progress.iteration, measure_gns=False)
        self.model.clip_grad_norm_pending(1.0)
        self.model.optimizer_step_pending(self.optimizer)
        progress.iteration += 1
        progress.consumed_samples += strategy.gbs
        progress.consumed_tokens += strategy.gbs * SEQ
        return out.loss

    def train(self, strategy: Strategy, steps: int, schedule: LRSchedule = SCHEDULE) -> list[float]:
        if self.model.strategy != strategy:
            self.model.rebatch(strategy)
        return [self.step(strategy, schedule, self.progress).item() for _ in range(steps)]

    def probe(self, candidate: Strategy, schedule: LRSchedule, samples: int):
        request = ProbeRequest(candidate=candidate, lr_schedule=schedule, samples=samples, tolerance=0.0)
        outcome, self.progress = run_probe(
            self.model,
            self.optimizer,
            self.progress,
            stage=1,
            current=CURRENT,
            current_schedule=SCHEDULE,
            request=request,
            step=self._tagged_step(),
            evaluate=lambda: self.model.eval_loss(self.probe_set),
        )
        self.tag = "main"
        return outcome

    def _tagged_step(self):
        branches = iter(["current", "candidate"])

        def step(strategy, schedule, progress):
            if progress.consumed_samples == start:  # each branch's first step
                self.tag = next(branches)
            return self.step(strategy, schedule, progress)

        start = self.progress.consumed_samples
        return step

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for part in self.model.model_parts for p in part.parameters()]


def test_equal_branches_give_bit_identical_losses_and_the_state_of_a_run_without_probe(
    one_process_group,
) -> None:
    probed, plain = Run(), Run()
    assert probed.train(CURRENT, 3) == plain.train(CURRENT, 3)
    outcome = probed.probe(CURRENT, SCHEDULE, samples=8)
    assert outcome.samples == 8 and outcome.current.steps == outcome.candidate.steps == 2
    assert outcome.current.loss == outcome.candidate.loss  # bit-identical: the restore is exact
    assert outcome.current.train_loss == outcome.candidate.train_loss
    assert outcome.loss_difference == 0.0
    plain.train(CURRENT, 2)
    assert dataclasses.asdict(probed.progress) == dataclasses.asdict(plain.progress)
    assert probed.train(CURRENT, 2) == plain.train(CURRENT, 2)
    for a, b in zip(probed.weights(), plain.weights(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("winner", ["current", "candidate"])
def test_the_run_continues_from_the_winner_and_trains_each_sample_once(
    one_process_group, monkeypatch, winner
) -> None:
    monkeypatch.setattr(probe_branch, "judge", lambda **_: (winner, "forced by the test"))
    candidate_schedule = dataclasses.replace(SCHEDULE, peak_lr=SCHEDULE.peak_lr * 2**0.5)
    probed, plain = Run(), Run()
    probed.train(CURRENT, 2)
    outcome = probed.probe(CANDIDATE, candidate_schedule, samples=6)  # rounded up to both batches: 8
    assert outcome.samples == 8 and (outcome.current.steps, outcome.candidate.steps) == (2, 1)
    assert outcome.winner == winner and probed.model.strategy == (
        CURRENT if winner == "current" else CANDIDATE
    )
    after = probed.train(CURRENT, 3)
    # The same history without a probe: the winner's strategy and LR over the probe's samples.
    plain.train(CURRENT, 2)
    if winner == "current":
        plain.train(CURRENT, 2)
    else:
        plain.train(CANDIDATE, 1, candidate_schedule)
    assert after == plain.train(CURRENT, 3)
    for a, b in zip(probed.weights(), plain.weights(), strict=True):
        assert torch.equal(a, b)
    # Both branches trained samples 8..15 in the same order; the run's history holds each sample once.
    by_tag = {tag: [i for t, i in probed.trained if t == tag] for tag in ("current", "candidate")}
    assert by_tag["current"] == by_tag["candidate"] == list(range(8, 16))
    history = [i for tag, i in probed.trained if tag in ("main", winner)]
    assert Counter(history) == Counter(range(max(history) + 1))


def test_after_a_lost_probe_the_workers_remove_its_request_but_never_a_stop_written_since(tmp_path) -> None:
    from tests.engine.test_trainer import make_spec

    from cona.switch_request import ProbeAsk, SwitchRequest

    spec = make_spec(tmp_path)
    spec.run_dir.mkdir(parents=True)
    ask = ProbeAsk(lr_factor=1.0, min_lr_factor=1.0, samples=8, tolerance=0.01)
    SwitchRequest(action="probe", reason="r", in_place=True, strategy=CANDIDATE, probe=ask).write(
        spec.switch_request_path
    )
    probe_branch.write_outcome(spec, {"stage": 1, "winner": "current"}, request_done=True)
    assert not spec.switch_request_path.exists()
    SwitchRequest(action="stop", reason="target").write(spec.switch_request_path)
    probe_branch.write_outcome(spec, {"stage": 1, "winner": "current"}, request_done=True)
    assert SwitchRequest.read(spec.switch_request_path).action == "stop"
    assert len((spec.run_dir / "probes.jsonl").read_text().splitlines()) == 2


def _judge_on_rank(rank: int, init_file: str, out_dir: str) -> None:
    """One of two gloo ranks whose clocks timed the same branches differently (rank 1's candidate slower)."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from cona.planner.probe_rule import BranchRun, judge

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:

        def run(gbs: int, seconds: float) -> BranchRun:
            return BranchRun(gbs=gbs, mbs=gbs, lr=1e-3, steps=2, loss=7.0, train_loss=7.1, seconds=seconds,
                             steady_seconds=seconds)  # fmt: skip

        current, candidate = probe_branch.rank0_runs(run(8, 1.0), run(16, 0.8 if rank == 0 else 1.2))
        winner, _ = judge(start_loss=7.5, current=current, candidate=candidate, tolerance=0.01)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps([winner, candidate.seconds]))
    finally:
        dist.destroy_process_group()


def test_every_rank_judges_a_probe_on_rank_0_s_numbers(tmp_path) -> None:
    """Equal losses, and a candidate branch faster on rank 0's clock than on rank 1's: judged each on its own
    clock, rank 0 would end the stage for the candidate while rank 1 trained on, and both would hang."""
    import torch.multiprocessing as mp

    mp.spawn(_judge_on_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    verdicts = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert verdicts == [["candidate", 0.8], ["candidate", 0.8]]
