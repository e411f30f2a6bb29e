"""How long after its metrics line each online decision came, from a run's ``decisions.jsonl``.

A decision is made on a metrics line and carried out at the workers' next step boundary after it is written,
so the time the search takes (``evaluation_s``: the throughput refit, the frontier, the policy) delays every
switch, and one written after the stage's last step is not carried out at all (``not_carried_out``). For
each online run directory given (a ``logs/online`` folder, or any folder above one, e.g. a ``cona demo
--out`` folder), prints the switches' and fallbacks' delays (``decided_at`` less the line's ``time``), the
longest evaluation, and the requests not carried out. Records from before the timing fields (c073c8e's
parent) have no delay to show.

    .venv/bin/python -m cona demo --out /tmp/demo --quiet
    PYTHONPATH=src python3 bench/decision_latency.py /tmp/demo
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cona.jsonl import read_records

DECISIONS = "decisions.jsonl"


def decision_files(root: Path) -> list[Path]:
    """``root``'s own decisions.jsonl, else every one below it (sorted)."""
    own = root / DECISIONS
    return [own] if own.is_file() else sorted(root.rglob(DECISIONS))


def latency(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The delays (s) of the switches and fallbacks, the longest evaluation (s) and the requests not
    carried out."""
    switches = [
        r
        for r in records
        if r.get("decision") in ("switch", "fallback")
        and isinstance(r.get("decided_at"), float)
        and isinstance(r.get("time"), float)
    ]
    evaluations = [r["evaluation_s"] for r in records if isinstance(r.get("evaluation_s"), float)]
    return {
        "switch_delays_s": [round(r["decided_at"] - r["time"], 2) for r in switches],
        "longest_evaluation_s": round(max(evaluations), 3) if evaluations else None,
        "not_carried_out": sum(1 for r in records if r.get("decision") == "not_carried_out"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="online run directories (or folders above them)")
    args = parser.parse_args(argv)
    for root in args.runs:
        for path in decision_files(root):
            records = read_records(path)  # a live run's torn last line is left out
            found = latency(records)
            delays = found["switch_delays_s"]
            print(
                f"{path.parent}: switches {len(delays)}, after their line {delays} s "
                f"(latest {max(delays) if delays else '-'}), longest evaluation "
                f"{found['longest_evaluation_s']} s, not carried out {found['not_carried_out']}"
            )


if __name__ == "__main__":
    main()
