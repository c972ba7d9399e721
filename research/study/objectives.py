"""The objectives the RPD replay optimises: a coupled quadratic and logistic regression.

Microbatch m's sample (noise, or minibatch rows) depends only on (seed, m), so every method
sees the same data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import numpy as np


class Objective(Protocol):
    name: str
    dim: int
    smoothness: float  # L: step sizes are gamma / L

    def x0(self) -> np.ndarray: ...
    def loss(self, x: np.ndarray) -> float: ...
    def grad(self, x: np.ndarray, mb: int) -> np.ndarray: ...


class Quadratic:
    """f(x) = 1/2 (x - x*)^T A (x - x*), d = 64, A = Q diag(lambda) Q^T with Q a random
    rotation (blocks are coupled) and lambda log-spaced in [1/100, 1] (condition number 100,
    L = 1); stochastic gradient A (x - x*) + sigma xi_m, sigma = 0.3, xi_m ~ N(0, I). x0 = 0,
    ||x*|| = sqrt(d). Loss f(x) - f* = f(x)."""

    name = "quadratic"

    def __init__(self, dim: int = 64, condition: float = 100.0, noise: float = 0.3,
                 seed: int = 0) -> None:
        rng = np.random.default_rng(1000 + seed)
        q, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
        eig = np.logspace(-math.log10(condition), 0.0, dim)
        self.dim, self.noise, self.seed = dim, noise, seed
        self.a = (q * eig) @ q.T
        self.x_star = rng.standard_normal(dim)
        self.x_star *= math.sqrt(dim) / np.linalg.norm(self.x_star)
        self.smoothness = float(eig.max())
        self._xi: np.ndarray = np.zeros((0, dim))

    def x0(self) -> np.ndarray:
        return np.zeros(self.dim)

    def loss(self, x: np.ndarray) -> float:
        e = x - self.x_star
        return float(0.5 * e @ self.a @ e)

    def _noise(self, mb: int) -> np.ndarray:
        if mb >= len(self._xi):  # drawn in one block, so microbatch m's noise is fixed
            rng = np.random.default_rng(self.seed)
            self._xi = rng.standard_normal((max(2 * mb + 1, 4096), self.dim))
        return self._xi[mb]

    def grad(self, x: np.ndarray, mb: int) -> np.ndarray:
        return self.a @ (x - self.x_star) + self.noise * self._noise(mb)


class Logistic:
    """L2-regularised logistic regression (lambda = 1e-3) on scikit-learn's breast_cancer
    (569 x 30, standardised, plus a bias column: 31 parameters); microbatches of `batch` rows
    drawn with replacement by (seed, m). L = lambda_max(X^T X) / (4n) + lambda."""

    name = "logistic"

    def __init__(self, batch: int = 16, reg: float = 1e-3, seed: int = 0) -> None:
        import importlib
        sk = importlib.import_module("sklearn.datasets")
        data = sk.load_breast_cancer()
        x = np.asarray(data.data, dtype=np.float64)
        x = (x - x.mean(0)) / x.std(0)
        self.x = np.hstack([x, np.ones((len(x), 1))])
        self.y = np.asarray(data.target, dtype=np.float64) * 2 - 1  # labels +-1
        self.n, self.dim = self.x.shape
        self.batch, self.reg, self.seed = batch, reg, seed
        top = float(np.linalg.eigvalsh(self.x.T @ self.x / self.n).max())
        self.smoothness = top / 4 + reg
        self._rows: np.ndarray = np.zeros((0, batch), dtype=np.int64)

    def x0(self) -> np.ndarray:
        return np.zeros(self.dim)

    def loss(self, w: np.ndarray) -> float:
        margins = self.y * (self.x @ w)
        return float(np.logaddexp(0.0, -margins).mean() + 0.5 * self.reg * w @ w)

    def grad(self, w: np.ndarray, mb: int) -> np.ndarray:
        if mb >= len(self._rows):
            rng = np.random.default_rng(self.seed)
            self._rows = rng.integers(0, self.n, (max(2 * mb + 1, 4096), self.batch))
        rows = self._rows[mb]
        x, y = self.x[rows], self.y[rows]
        s = -y / (1.0 + np.exp(np.clip(y * (x @ w), -50, 50)))
        return x.T @ s / len(rows) + self.reg * w


OBJECTIVES: dict[str, Callable[..., Objective]] = {"quadratic": Quadratic, "logistic": Logistic}
