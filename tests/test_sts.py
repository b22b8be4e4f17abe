"""STS calibration: ECE, temperature application, fitting on synthetic miscalibrated data."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dspark.spec import calibrated_confidence, expected_calibration_error, fit_sts

TRUE_T = np.array([0.4, 2.5, 1.0])  # the head is over-confident at 0, under-confident at 1
GRID_STEP = np.log(10.0 / 0.1) / 40  # log-spacing of the 41-point grid


def _synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw logits whose TRUE conditional acceptance is sigmoid(logit / TRUE_T[j])."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.5, 2.0, (n, len(TRUE_T)))
    accepted = rng.random((n, len(TRUE_T))) < 1.0 / (1.0 + np.exp(-logits / TRUE_T))
    return logits.astype(np.float32), accepted


def test_ece_matches_per_bin_definition():
    rng = np.random.default_rng(0)
    p = rng.random(500).astype(np.float32)
    y = rng.random(500) < p**2
    bins = np.minimum((p * 15).astype(int), 14)
    expected = sum((bins == b).mean() * abs(p[bins == b].mean() - y[bins == b].mean())
                   for b in range(15) if np.any(bins == b))
    assert float(expected_calibration_error(jnp.asarray(p), jnp.asarray(y))) == pytest.approx(expected, rel=1e-5)


def test_calibrated_confidence_divides_logits_by_position_temperatures():
    logits = jax.random.normal(jax.random.key(1), (4, 3)) * 3
    t = jnp.array([0.5, 1.0, 4.0])
    np.testing.assert_allclose(np.asarray(calibrated_confidence(logits, t)),
                               1 / (1 + np.exp(-np.asarray(logits) / np.asarray(t))), rtol=1e-5)


@pytest.mark.parametrize("temps", [[0.5, 0.0, 1.0], [1.0, 1.0]])
def test_calibrated_confidence_rejects_bad_temperature_tables(temps):
    with pytest.raises(ValueError, match="temperatures"):
        calibrated_confidence(jnp.ones((2, 3)), jnp.asarray(temps))


def test_sts_reduces_ece_on_miscalibrated_data():
    logits, accepted = _synthetic(20_000, 2)
    fit = fit_sts(jnp.asarray(logits), jnp.asarray(accepted))
    before, after = np.asarray(fit.ece_before), np.asarray(fit.ece_after)
    assert before.shape == after.shape == (3,)
    assert np.all(after < before)
    assert after[:2].max() < 0.5 * before[:2].min()
    assert after.max() < 0.02


def test_sts_recovers_the_true_temperatures():
    logits, accepted = _synthetic(20_000, 3)
    fit = fit_sts(jnp.asarray(logits), jnp.asarray(accepted))
    err = np.abs(np.log(np.asarray(fit.temperatures)) - np.log(TRUE_T))
    assert np.all(err <= 3 * GRID_STEP), np.asarray(fit.temperatures)


def test_sts_uses_prefix_labels():
    """An acceptance recorded after a rejection counts as a rejection."""
    logits, accepted = _synthetic(4_000, 4)
    prefix = np.cumprod(accepted, axis=1).astype(bool)
    a = fit_sts(jnp.asarray(logits), jnp.asarray(accepted))
    b = fit_sts(jnp.asarray(logits), jnp.asarray(prefix))
    assert not np.array_equal(accepted, prefix)
    np.testing.assert_array_equal(np.asarray(a.temperatures), np.asarray(b.temperatures))


def test_sts_refuses_fewer_than_1000_samples():
    logits, accepted = _synthetic(999, 5)
    with pytest.raises(ValueError, match="1000"):
        fit_sts(jnp.asarray(logits), jnp.asarray(accepted))
