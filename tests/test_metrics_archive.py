"""What dead serving processes counted, folded into the metrics folder's archive
(proxy.metrics.fold_dead_process) while scrapes read the folder (ServerCollector): each value
counted once, whatever the scrape had read when the fold came."""

from __future__ import annotations

import glob
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector

from proxy.metrics import ServerCollector, fold_dead_process

DEAD, LIVE = 4_000_001, 4_000_002


def _count(folder: Path, pid: int, value: float) -> None:
    """A process's counter file, as prometheus-client writes it."""
    values = MmapedDict(str(folder / f"counter_{pid}.db"))
    values.write_value(mmap_key("symgate_hits", "symgate_hits_total", [], [], "Hits"), value, 0)
    values.close()


def _total(folder: Path) -> float:
    registry = CollectorRegistry()
    ServerCollector(registry, str(folder))
    return registry.get_sample_value("symgate_hits_total") or 0.0


def _folder(tmp_path: Path) -> None:
    """A dead process's count (5) and a live one's (7), after an earlier fold (so that an
    archive exists)."""
    _count(tmp_path, DEAD, 5)
    _count(tmp_path, LIVE, 7)
    fold_dead_process(tmp_path, 4_000_000)


@pytest.mark.parametrize("when", ["listing_the_files", "reading_them"])
def test_a_fold_while_a_scrape_reads_the_folder_is_counted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """The supervisor folds the dead process after the scrape has read the archive: before
    it lists the files (it would miss the dead one's, and its values with them), or before it
    reads their values (the dead one's file gone)."""
    _folder(tmp_path)
    folds = []

    def fold_first(original: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any) -> Any:
            if not folds:
                folds.append(DEAD)
                fold_dead_process(tmp_path, DEAD)
            return original(*args)
        return step

    if when == "listing_the_files":
        monkeypatch.setattr(glob, "glob", fold_first(glob.glob))
    else:
        monkeypatch.setattr(MultiProcessCollector, "_read_metrics",
                            staticmethod(fold_first(MultiProcessCollector._read_metrics)))
    assert _total(tmp_path) == 12
    assert folds == [DEAD]
    assert sorted(f.name for f in tmp_path.glob("*.db")) == [f"counter_{LIVE}.db"]


def test_a_scrape_while_a_fold_is_half_done_counts_the_dead_process_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the archive that holds the dead process's values and the removal of its
    files, a scrape finds both."""
    _folder(tmp_path)
    unlink = Path.unlink
    seen = []

    def scrape_first(path: Path, missing_ok: bool = False) -> None:
        if not seen:
            seen.append(_total(tmp_path))
        unlink(path, missing_ok)

    monkeypatch.setattr(Path, "unlink", scrape_first)
    fold_dead_process(tmp_path, DEAD)
    assert seen == [12]


def test_folded_counts_add_up_and_a_new_process_of_a_folded_pid_counts_anew(
    tmp_path: Path,
) -> None:
    for value in (1, 2, 3):
        _count(tmp_path, DEAD, value)
        fold_dead_process(tmp_path, DEAD)
    assert _total(tmp_path) == 6
    _count(tmp_path, DEAD, 10)  # the pid given to another worker
    assert _total(tmp_path) == 16
    (tmp_path / f"counter_{LIVE}.db").touch()  # killed between creating and sizing it
    fold_dead_process(tmp_path, LIVE)
    assert _total(tmp_path) == 16 and not (tmp_path / f"counter_{LIVE}.db").exists()
