"""Weighted isotonic regression (pool adjacent violators): the closest non-decreasing sequence in weighted
least squares. Calibration maps and step-cost tables are kept monotone with it."""

import numpy as np


def isotonic(values, weights=None) -> np.ndarray:
    """[n] non-decreasing fit of `values` [n] under positive `weights` [n] (default: all ones)."""
    values = np.asarray(values, dtype=np.float64)
    weights = np.ones_like(values) if weights is None else np.asarray(weights, dtype=np.float64)
    means, masses, sizes = [], [], []  # one entry per pooled block
    for value, weight in zip(values, weights):
        means.append(value)
        masses.append(weight)
        sizes.append(1)
        while len(means) > 1 and means[-2] > means[-1]:  # a violation: pool the last two blocks
            mass = masses[-2] + masses[-1]
            mean = (means[-2] * masses[-2] + means[-1] * masses[-1]) / mass
            size = sizes[-2] + sizes[-1]
            del means[-1], masses[-1], sizes[-1]
            means[-1], masses[-1], sizes[-1] = mean, mass, size
    return np.repeat(means, sizes)
