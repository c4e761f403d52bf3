"""What both trainers' end-to-end tests check of an elastic run against an uninterrupted one."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Samples = dict[int, list[int]]
Losses = dict[int, float]


def per_step(ranks: Sequence[Mapping[str, list[int]]], order: list[int], global_batch: int) -> Samples:
    """Each step's samples over a generation's dp ranks (``ranks``: each dp rank's recorded ``{step: samples}``), in
    dp order. A SIGKILLed rank can die after its last step and before it recorded it: the other ranks finished that
    step with it (their collectives need every rank) and recorded it. That step, the generation's last, is taken with
    the killed rank's share from the job's ``order``, once every share the other ranks recorded equals its own part
    of the order; any other step missing on a rank is an error."""
    recorded = [set(r) for r in ranks]
    complete = set.intersection(*recorded)
    out = {int(s): sum((r[s] for r in ranks), []) for s in complete}
    partial = set.union(*recorded) - complete
    if partial:
        last = str(max(int(s) for s in set.union(*recorded)))
        assert partial == {last}, f"steps {sorted(partial, key=int)} are missing on some dp rank, not just the last"
        share = global_batch // len(ranks)
        first = (int(last) - 1) * global_batch
        parts = [order[first + r * share:first + (r + 1) * share] for r in range(len(ranks))]
        for r, rank in enumerate(ranks):
            assert rank.get(last, parts[r]) == parts[r], (last, r, rank[last], parts[r])
        out[int(last)] = sum(parts, [])
    return out


def check_like_an_uninterrupted_run(generations: Sequence[tuple[int, str, Samples, Losses]],
                                    base: tuple[Samples, Losses], order: list[int], steps: int, rtol: float,
                                    history: Sequence[Mapping[str, Any]], report: Path) -> None:
    """``generations`` (number, layout, the samples each step took, the losses), in order, against the baseline's:
    the baseline takes the job's sample order; every step the elastic run took again after a rollback took the
    very same samples; stitched together, the steps take the order once (nothing repeated, nothing skipped); each
    loss is within ``rtol`` of the baseline's, and equal in the first layout (the same layout, the same numbers).
    The rows and the history are written to ``report`` (and stderr: pytest -s shows them)."""
    base_samples, base_losses = base
    assert sorted(base_samples) == list(range(1, steps + 1))
    assert sum((base_samples[s] for s in sorted(base_samples)), []) == order
    final: Samples = {}
    rows = []
    for g, layout, samples, losses in generations:
        assert samples, f"generation {g} ({layout}) trained no step"
        for s in sorted(samples):
            if s in final:  # run again after the rollback of the failure: the very same samples
                assert final[s] == samples[s], (g, s)
            final[s] = samples[s]
            assert s in losses, (g, s)
            rel = abs(losses[s] - base_losses[s]) / abs(base_losses[s])
            rows.append({"generation": g, "layout": layout, "step": s, "loss": losses[s], "baseline": base_losses[s],
                         "rel_diff": rel})
    measured = json.dumps({"rows": rows, "history": [{k: r.get(k) for k in ("reason", "from_config", "to_config",
                                                                            "downtime_seconds", "steps_lost")}
                                                      for r in history]}, indent=1)
    report.write_text(measured)
    print(measured, file=sys.stderr)
    assert sorted(final) == list(range(1, steps + 1))
    assert sum((final[s] for s in sorted(final)), []) == order  # nothing repeated, nothing skipped
    worst = max(rows, key=lambda r: r["rel_diff"])
    assert worst["rel_diff"] <= rtol, worst
    first = generations[0][0]
    assert all(r["rel_diff"] == 0 for r in rows if r["generation"] == first)  # same layout, same numbers
