"""Kaplan scaling-law helpers against hand-computed values (Kaplan et al. 2020; docs/cost-model.md §8)."""

from __future__ import annotations

import math

import pytest

from tessera.planner.scaling import (
    critical_batch,
    data_for_batch,
    loss_from_params,
    min_steps,
    steps_for_batch,
    training_at_critical_batch,
)

REL = 1e-9  # closed-form arithmetic
PUBLISHED_REL = 0.03  # tables in the references are rounded to 2 significant digits


def test_critical_batch_hand_computed() -> None:
    # 2.1e8 / 4^(1/0.21) = 2.1e8 / exp(ln 4 / 0.21)
    assert critical_batch(4.0) == pytest.approx(2.1e8 / math.exp(math.log(4.0) / 0.21), rel=REL)
    assert critical_batch(1.0) == pytest.approx(2.1e8, rel=REL)


@pytest.mark.parametrize(("loss", "tokens"), [(4.0, 0.29e6), (3.0, 1.1e6), (2.5, 2.7e6), (2.0, 7.7e6)])
def test_critical_batch_matches_reference_illustration(loss: float, tokens: float) -> None:
    assert critical_batch(loss) == pytest.approx(tokens, rel=PUBLISHED_REL)


@pytest.mark.parametrize(("n", "loss"), [(1e9, 2.38), (1.3e10, 1.96), (1.75e11, 1.60), (1e12, 1.41)])
def test_loss_from_params_matches_reference_table(n: float, loss: float) -> None:
    assert loss_from_params(n) == pytest.approx(loss, abs=0.01)
    assert loss_from_params(n) == pytest.approx((8.8e13 / n) ** 0.076, rel=REL)


def test_min_steps_inverts_the_loss_law() -> None:
    n, target = 1e9, 2.6
    s_min = min_steps(n, target)
    # L(N, S_min) = L(N) + (S_c/S_min)^α_S must give back the target
    assert loss_from_params(n) + (2.1e3 / s_min) ** 0.76 == pytest.approx(target, rel=REL)


def test_target_below_converged_loss_is_rejected() -> None:
    with pytest.raises(ValueError, match="not above the converged loss"):
        min_steps(1e9, 2.0)


def test_tradeoff_hyperbola_and_critical_batch_doubles_both() -> None:
    s_min, b_crit = 1000.0, 1e6
    e_min = b_crit * s_min
    for batch in (1e5, 1e6, 1e7):
        s, e = steps_for_batch(s_min, batch, b_crit), data_for_batch(e_min, batch, b_crit)
        assert (s / s_min - 1) * (e / e_min - 1) == pytest.approx(1.0, rel=REL)
    est = training_at_critical_batch(1e9, 2.6)
    assert est.steps == pytest.approx(2 * est.min_steps, rel=REL)
    assert est.tokens == pytest.approx(2 * est.min_tokens, rel=REL)
    assert est.min_tokens == pytest.approx(est.critical_batch_tokens * est.min_steps, rel=REL)
    assert est.train_flops == pytest.approx(6 * 1e9 * est.tokens, rel=REL)


def test_larger_batch_fewer_steps_more_tokens() -> None:
    small = training_at_critical_batch(1e9, 2.6, batch_tokens=1e6)
    large = training_at_critical_batch(1e9, 2.6, batch_tokens=1e7)
    assert large.steps < small.steps and large.tokens > small.tokens
