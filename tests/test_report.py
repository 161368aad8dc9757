"""perf/report.py turns benchmark JSON lines into RESULTS.md's summary table and PNG charts (no benchmark runs here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINES = {
    "broker": [
        {"bench": "broker", "case": "produce send_table", "records_per_s": 3_000_000, "ratio_vs": "redis", "ratio": 40.0,
         "target": ">= 8x", "meets_target": True, "date": "2026-11-24"},
        {"bench": "broker", "case": "latency linger_ms=0", "p50_ms": 1.4, "p99_ms": 4.0, "target": "p50 <= 3", "meets_target": True},
    ],
    "replication": [{"bench": "replication", "case": "failover (a) new leader, 3 leader-node kills", "p50_s": 0.8, "max_s": 0.9,
                     "reps": [0.7, 0.8, 0.9], "meets_target": True}],
    "scale": [
        {"bench": "scale", "case": "idle cpu per replica, 16 replicas", "value": 0.8, "baseline": 0.6, "ratio": 1.33, "replicas": 16,
         "target": 1.5, "meets_target": True},
        {"bench": "scale", "case": "uss per replica, 16 replicas", "value": 62.0, "baseline": 57.0, "ratio": 1.09, "replicas": 16,
         "target": 1.2, "meets_target": False},
    ],
}


def load_report(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("report", REPO / "perf" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    monkeypatch.setattr(report, "CHARTS_DIR", str(tmp_path / "charts"))
    monkeypatch.setattr(report, "RESULTS_MD", str(tmp_path / "RESULTS.md"))
    (tmp_path / "RESULTS.md").write_text("# Performance results\n\n## Storage\nold text\n")
    return report


def test_summary_table_and_charts_from_results(tmp_path, monkeypatch):
    report = load_report(tmp_path, monkeypatch)
    table = report.summary_table(LINES)
    assert "| broker | produce send_table | 3 000 000 rec/s | 40.00x vs redis | >= 8x | yes |" in table
    assert "| scale | uss per replica, 16 replicas |" in table and "**no**" in table
    report.write_summary(LINES, {"broker": "ok", "spark": "timed out after 10s"})
    report.write_summary(LINES, {"broker": "ok"})  # rewritten in place, not added twice
    text = (tmp_path / "RESULTS.md").read_text()
    assert text.count(report.START) == 1 and text.endswith("## Storage\nold text\n")
    assert report.draw_charts(LINES) == ["throughput.png", "latency.png", "failover.png", "scale.png"]
    for name in ("throughput", "latency", "failover", "scale"):
        assert (tmp_path / "charts" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
