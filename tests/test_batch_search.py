"""The largest-batch search's arithmetic: doubling, bisection within its tolerance, the ceiling."""

from __future__ import annotations

import pytest

from slurm_ddp_kit.train import largest_batch
from slurm_ddp_kit.train.largest_batch import CEILING, TOLERANCE, search


class Limit:
    """A fits() that holds up to `limit` and records every call."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.calls: list[int] = []

    def __call__(self, batch: int) -> bool:
        self.calls.append(batch)
        return batch <= self.limit


@pytest.mark.parametrize(
    ("limit", "start", "unit"),
    [
        (3000, 128, 4),
        (3000, 4096, 4),  # the first trial already fails: bisect down from it
        (3000, 1001, 8),  # start not a multiple of unit
        (777_777, 64, 8),
        (1023, 1, 1),
        (9, 3, 3),
        (5000, 5000, 4),
    ],
)
def test_search_finds_a_fitting_multiple_within_tolerance(
    limit: int, start: int, unit: int
) -> None:
    fits = Limit(limit)
    found, trials = search(fits, start=start, unit=unit)
    best = limit // unit * unit  # the true answer
    assert found is not None and found % unit == 0 and found <= limit
    assert found >= best * (1 - TOLERANCE) or best - found <= unit
    assert trials == [{"global_batch": b, "fits": b <= limit} for b in fits.calls]
    assert all(t["global_batch"] % unit == 0 and t["global_batch"] > 0 for t in trials)
    assert found == max(t["global_batch"] for t in trials if t["fits"])


def test_search_records_every_trial_in_order() -> None:
    fits = Limit(3000)
    found, trials = search(fits, start=128, unit=4)
    assert [t["global_batch"] for t in trials][:6] == [128, 256, 512, 1024, 2048, 4096]
    assert [t["fits"] for t in trials][:6] == [True] * 5 + [False]
    assert len({t["global_batch"] for t in trials}) == len(trials)  # no size tried twice
    assert found is not None and abs(3000 - found) / 3000 <= TOLERANCE


@pytest.mark.parametrize(("start", "unit"), [(128, 4), (1, 8), (7, 8)])
def test_search_returns_none_when_nothing_fits(start: int, unit: int) -> None:
    fits = Limit(unit - 1)
    found, trials = search(fits, start=start, unit=unit)
    assert found is None
    assert trials and not any(t["fits"] for t in trials)
    assert min(t["global_batch"] for t in trials) == unit  # the smallest size was tried


def test_search_stops_at_the_ceiling() -> None:
    fits = Limit(float("inf"))
    found, trials = search(fits, start=1000, unit=4)
    tried = [t["global_batch"] for t in trials]
    assert all(t["fits"] for t in trials)
    assert max(tried) <= CEILING < max(tried) * 2
    assert found == max(tried) == 1000 * 2 ** (len(tried) - 1)


def test_search_ceiling_is_the_module_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(largest_batch, "CEILING", 1000)
    found, trials = search(Limit(float("inf")), start=100, unit=10)
    assert found == 800 and [t["global_batch"] for t in trials] == [100, 200, 400, 800]


def test_search_starting_past_the_ceiling_starts_at_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(largest_batch, "CEILING", 1000)
    found, trials = search(Limit(float("inf")), start=5000, unit=8)
    assert found == 1000 and [t["global_batch"] for t in trials] == [1000]
    found, trials = search(Limit(600), start=5000, unit=8)
    assert found is not None and 600 * (1 - TOLERANCE) <= found <= 600


def test_search_start_below_unit_starts_at_unit() -> None:
    fits = Limit(100)
    search(fits, start=3, unit=8)
    assert fits.calls[0] == 8
