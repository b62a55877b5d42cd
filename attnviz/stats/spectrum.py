"""The matrix-based entropy of a layer's representations from a Gram spectrum (docs/methods.md#the-compression-valley).

Pure numpy, no model: the device-side computation that feeds it is :mod:`attnviz.effects.valley`.
"""

from __future__ import annotations

import numpy as np


def matrix_entropy(eigenvalues, n: int) -> float:
    """H = -sum_i p_i log p_i / log n, p_i = lambda_i / sum_j lambda_j, over the eigenvalues of the Gram matrix
    K = Z Z^T of ``n`` representations (Skean et al. 2025; the compression valley of Queipo-de-Llano et al. 2025).

    The d x d matrix Z^T Z has the same nonzero eigenvalues, so either spectrum gives the same H (zeros count 0).
    Eigenvalues below 0 (rounding) count 0. Between 0 (rank one) and 1 (n equal eigenvalues); Z has rank at most
    min(n, d), so where n > d the most is log d / log n. NaN where n < 2 or every eigenvalue is 0.
    """
    lam = np.clip(np.asarray(eigenvalues, dtype=np.float64).ravel(), 0.0, None)
    total = lam.sum()
    if n < 2 or not total > 0:
        return float("nan")
    p = lam[lam > 0] / total
    return float(-(p * np.log(p)).sum() / np.log(n))


def matrix_entropy_of(z) -> float:
    """:func:`matrix_entropy` of the rows of ``z`` (n, d) directly: the eigenvalues of Z Z^T in float64 (the reference
    the device-side computation is tested against)."""
    z = np.asarray(z, dtype=np.float64)
    return matrix_entropy(np.linalg.eigvalsh(z @ z.T), z.shape[0])
