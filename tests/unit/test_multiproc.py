"""The metrics directory of a multi-worker gateway: made per start, emptied, removed; a dead worker's live
gauges dropped. The counting across real workers is tests/integration/test_workers_metrics.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.metrics.multiprocess import forget_worker, shared_metrics
from gateway.settings import METRICS_DIR_VARIABLE, metrics_dir

pytestmark = pytest.mark.timeout(5)


@pytest.fixture(autouse=True)
def _no_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(METRICS_DIR_VARIABLE, raising=False)


def test_one_worker_keeps_its_own_registry() -> None:
    with shared_metrics(1) as directory:
        assert directory is None and metrics_dir() is None


def test_several_workers_share_a_private_directory_removed_at_the_end() -> None:
    with shared_metrics(2) as directory:
        assert directory is not None and directory.is_dir() and metrics_dir() == directory
    assert not directory.exists() and metrics_dir() is None


def test_the_operators_directory_is_emptied_of_a_previous_runs_values_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(METRICS_DIR_VARIABLE, str(tmp_path))
    (tmp_path / "counter_123.db").write_bytes(b"old")
    (tmp_path / "notes.txt").write_text("not ours")
    with shared_metrics(4) as directory:
        assert directory == tmp_path and not (tmp_path / "counter_123.db").exists()
    assert tmp_path.is_dir() and (tmp_path / "notes.txt").exists() and metrics_dir() == tmp_path


def test_a_dead_workers_live_gauges_go_and_its_counters_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(METRICS_DIR_VARIABLE, str(tmp_path))
    for name in ("gauge_livesum_7.db", "gauge_livemin_7.db", "counter_7.db", "histogram_7.db", "gauge_livesum_8.db"):
        (tmp_path / name).write_bytes(b"x")
    forget_worker(7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counter_7.db", "gauge_livesum_8.db", "histogram_7.db"]
