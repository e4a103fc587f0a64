"""The time model's constants are fitted from per-action times: on synthetic data with known
constants the fit recovers them, and the planner prices with what was fitted."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from seq1f1b._runtime import ir as rt
from seq1f1b.planning.calibration import (
    Sample,
    fit_action_costs,
    fit_coefficients,
    load_action_costs,
    save_action_costs,
)
from seq1f1b.planning.costmodel import ActionCosts, Coefficients, Hardware, Work, action_work
from seq1f1b.planning.planner import Setting, main, price
from seq1f1b.schedules.partition import ModelShape

pytestmark = pytest.mark.fast

SHAPE = ModelShape(128, 2, 4, 1024, ffn_hidden=516)


def _works() -> list[Work]:
    """Segments of several lengths at several positions, on inner and last stages."""
    out = []
    for n, end in ((4096, 4096), (2048, 2048), (2048, 4096), (512, 4096), (1024, 3072)):
        for last in (False, True):
            out.append(action_work(SHAPE, 2, last, n, end))
    return out


def test_fit_recovers_known_constants() -> None:
    truth = Coefficients(linear=2e-11, attention=5e-11, elements=3e-10, overhead=4e-4)
    samples = [Sample("F", w, truth.seconds(w)) for w in _works()]
    got = fit_coefficients(samples)
    assert got.linear == pytest.approx(truth.linear, rel=1e-6)
    assert got.attention == pytest.approx(truth.attention, rel=1e-6)
    assert got.elements == pytest.approx(truth.elements, rel=1e-6)
    assert got.overhead == pytest.approx(truth.overhead, rel=1e-6)
    assert got.per_module == pytest.approx(0.0, abs=1e-12)


def test_fit_is_non_negative_under_noise_and_per_kind() -> None:
    """Noisy times: no negative constant, predictions within the noise; each kind its own."""
    rng = random.Random(0)
    f = Coefficients(3e-11, 6e-11, 0.0, 2e-4)
    b = f.scaled(2.2)
    samples = [
        Sample(kind, w, c.seconds(w) * (1 + rng.uniform(-0.03, 0.03)))
        for w in _works() * 4
        for kind, c in (("F", f), ("B", b))
    ]
    costs = fit_action_costs(samples)
    for c in (costs.forward, costs.backward):
        assert min(c.linear, c.attention, c.elements, c.overhead, c.per_module) >= 0
    for w in _works():
        assert costs.of(rt.FORWARD).seconds(w) == pytest.approx(f.seconds(w), rel=0.05)
        assert costs.of(rt.FULL_BACKWARD).seconds(w) == pytest.approx(b.seconds(w), rel=0.05)
    # no split backward measured: I and W are half of B each
    w = _works()[0]
    assert costs.of(rt.BACKWARD_INPUT).seconds(w) == pytest.approx(
        costs.of(rt.FULL_BACKWARD).seconds(w) / 2
    )
    with pytest.raises(ValueError, match="need forward and backward"):
        fit_action_costs([s for s in samples if s.kind == "F"])


def test_planner_prices_with_the_fitted_constants(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A per-action overhead makes many short units dear: with it, K=8 loses to K=2 at a
    length where the hardware model (FLOPs only) prefers K=8; the CLI reads the JSON."""
    hw = Hardware(2, 1e6, reserve_gb=0.0)

    def step(k: int, costs: ActionCosts | None) -> float:
        s = Setting(2, 1, 1, k, 2, "compute", False, name="Seq1F1B")
        return price(s, SHAPE, 4096, hw, actions=costs).step_seconds

    flops_only = ActionCosts.from_throughput(1e10)
    assert step(8, flops_only) < step(2, flops_only)
    dear = ActionCosts(
        Coefficients(1e-10, 1e-10, overhead=0.05), Coefficients(2e-10, 2e-10, overhead=0.1)
    )
    assert step(8, dear) > step(2, dear)
    path = tmp_path / "cal.json"
    save_action_costs(dear, str(path))
    assert load_action_costs(str(path)) == dear
    argv = "--model llama3-8b --seq-len 8192 --gpus 2 --gpu-memory-gb 80 --pp 2 --ac none"
    per_action = ["--calibration-model", "per-action", "--calibration", str(path)]
    assert main([*argv.split(), *per_action, "--schedules", "1F1B"]) == 0
    assert "time model: calibrated" in capsys.readouterr().out
