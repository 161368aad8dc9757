"""The fault run's CI form: a minute of every fault kind on a namespace cluster, then heal and judge (fault_run.py).

A seed fixes the faults' order, targets and timing; ``tools/fault_run.py``
runs the long form (300 s, seeds as arguments). What must hold: no
acknowledged record lost, none written twice, never two values at one
offset (acknowledgements, polls and every replica's files together), the
consumers saw every acknowledged record in order, replicas agree record for
record up to the high watermark, and every partition is back to its full
ISR after the last heal (bounded wait).
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.cluster.fault_run import FAULT_KINDS, FULL_ISR_TIMEOUT_S, FaultRun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

SEED = 20261126
DURATION_S = 60.0


def test_every_fault_kind_mixed_by_a_seed_loses_nothing_and_heals(netns_cluster, tmp_path):
    result = FaultRun(netns_cluster, SEED, DURATION_S, tmp_path / "run").run()
    print(json.dumps(result.as_dict(), default=str), file=sys.stderr)
    assert {fault["kind"] for fault in result.faults} == set(FAULT_KINDS)
    assert result.counts["acked"] > 0, result.counts
    violations = result.violations()
    assert not any(violations.values()), (violations, result.report["examples"], result.replicas)
    assert result.report["violations"]["unseen"] == 0
    assert not result.offline_partitions and result.final_read, (result.offline_partitions, result.errors)
    assert result.full_isr, f"no full ISR {FULL_ISR_TIMEOUT_S:.0f} s after the last heal: {json.dumps(result.last_describe)}"
