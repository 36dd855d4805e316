"""Communication graphs and gossip mixing matrices.

This module knows graphs and mixing matrices only: no tensors travel here.

Conventions
-----------
* Workers are numbered ``0 .. n-1``; graphs are undirected and simple (no
  self-loops, no duplicate edges).
* A mixing matrix ``W`` is an ``n x n`` float64 numpy array that is symmetric,
  non-negative and doubly stochastic, with ``W[i, j] > 0`` only if ``i == j``
  or ``{i, j}`` is an edge.
* ``rho = max(|lambda_2|, |lambda_n|)`` (eigenvalues of ``W`` sorted
  descending) is the quantity bounded in Moniqua (Lu & De Sa 2020)
  assumption A2 (``rho < 1``); the *spectral gap* is ``1 - rho``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Optional, Tuple

import numpy as np

__all__ = [
    "Topology",
    "ring",
    "torus",
    "complete",
    "star",
    "exponential",
    "TOPOLOGIES",
    "make_topology",
    "check_mixing_matrix",
    "spectral_rho",
    "spectral_gap",
    "slack_matrix",
    "smallest_nonzero_weight",
]

WEIGHTINGS = ("uniform", "metropolis")


@dataclass(frozen=True)
class Topology:
    """An undirected simple graph on workers ``0 .. n-1``.

    Build with :meth:`from_edges` or one of the builders (:func:`ring`, ...).
    ``adj[i]`` is the sorted tuple of neighbours of ``i`` (excluding ``i``).
    """

    name: str
    n: int
    adj: Tuple[Tuple[int, ...], ...] = field(repr=False)
    shape: Optional[Tuple[int, int]] = None  # (rows, cols) for torus, else None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"workers must be >= 1, got {self.n}")
        if len(self.adj) != self.n:
            raise ValueError(f"adj must have n={self.n} entries, got {len(self.adj)}")
        for i, nb in enumerate(self.adj):
            if list(nb) != sorted(set(nb)):
                raise ValueError(f"neighbours of {i} must be sorted and unique, got {nb}")
            for j in nb:
                if j == i or not 0 <= j < self.n:
                    raise ValueError(f"invalid neighbour {j} of worker {i} (n={self.n})")
                if i not in self.adj[j]:
                    raise ValueError(f"graph not undirected: {i}->{j} but not {j}->{i}")

    @classmethod
    def from_edges(
        cls,
        name: str,
        n: int,
        edges: Iterable[Tuple[int, int]],
        shape: Optional[Tuple[int, int]] = None,
    ) -> "Topology":
        """Build from undirected edges; self-loops and duplicates are dropped."""
        if n < 1:
            raise ValueError(f"workers must be >= 1, got {n}")
        nbs = [set() for _ in range(n)]
        for a, b in edges:
            a, b = int(a), int(b)
            if not (0 <= a < n and 0 <= b < n):
                raise ValueError(f"edge ({a}, {b}) out of range for n={n}")
            if a != b:
                nbs[a].add(b)
                nbs[b].add(a)
        return cls(name=name, n=n, adj=tuple(tuple(sorted(s)) for s in nbs), shape=shape)

    # ----------------------------------------------------------------- graph
    def neighbors(self, i: int) -> Tuple[int, ...]:
        """Sorted neighbours of worker ``i`` (``i`` itself excluded)."""
        return self.adj[i]

    @property
    def edges(self) -> Tuple[Tuple[int, int], ...]:
        """All undirected edges as ``(i, j)`` with ``i < j``, sorted."""
        return tuple((i, j) for i in range(self.n) for j in self.adj[i] if i < j)

    def degree(self, i: int) -> int:
        """Number of neighbours of worker ``i``."""
        return len(self.adj[i])

    @property
    def max_degree(self) -> int:
        """Largest degree ``d_max`` over all workers (0 for ``n == 1``)."""
        return max(len(nb) for nb in self.adj)

    @property
    def adjacency(self) -> np.ndarray:
        """Boolean ``n x n`` adjacency matrix (``False`` on the diagonal)."""
        A = np.zeros((self.n, self.n), dtype=bool)
        for i, nb in enumerate(self.adj):
            A[i, list(nb)] = True
        return A

    # --------------------------------------------------------------- mixing
    def mixing_matrix(self, weights: str = "uniform") -> np.ndarray:
        """Symmetric doubly stochastic float64 mixing matrix ``W``.

        ``weights="uniform"``: ``W_ij = 1/(d_max + 1)`` for every edge
        ``{i, j}`` (``d_max`` = :attr:`max_degree`), ``W_ij = 0`` for
        non-edges and ``W_ii = 1 - sum_{j != i} W_ij = 1 - d_i/(d_max + 1)``.
        On a regular graph every non-zero entry is ``1/(d+1)`` (1/3 on a ring
        with ``n >= 3``; ``J/n`` on the complete graph).

        ``weights="metropolis"`` (Metropolis-Hastings):
        ``W_ij = 1/(1 + max(d_i, d_j))`` for every edge and
        ``W_ii = 1 - sum_{j != i} W_ij``.
        """
        if weights not in WEIGHTINGS:
            raise ValueError(
                f"weights={weights!r} is unknown; choose one of: {', '.join(WEIGHTINGS)}"
            )
        W = np.zeros((self.n, self.n), dtype=np.float64)
        deg = [len(nb) for nb in self.adj]
        dmax = max(deg)
        for i, j in self.edges:
            if weights == "uniform":
                w = 1.0 / (dmax + 1)
            else:
                w = 1.0 / (1 + max(deg[i], deg[j]))
            W[i, j] = W[j, i] = w
        np.fill_diagonal(W, 1.0 - W.sum(axis=1))
        return W

    def mixing_weights(self, i: int, W: np.ndarray) -> Dict[int, float]:
        """``{j: W[i, j]}`` for ``j`` in ``{i} + neighbors(i)`` (self included)."""
        W = np.asarray(W)
        if W.shape != (self.n, self.n):
            raise ValueError(f"W must have shape ({self.n}, {self.n}), got {W.shape}")
        return {j: float(W[i, j]) for j in sorted((i,) + self.adj[i])}


# ------------------------------------------------------------------ builders
def _check_n(n: int, minimum: int = 1) -> int:
    if isinstance(n, bool) or int(n) != n:
        raise ValueError(f"workers must be an integer >= {minimum}, got {n!r}")
    n = int(n)
    if n < minimum:
        raise ValueError(f"workers must be >= {minimum}, got {n}")
    return n


def ring(n: int) -> Topology:
    """Cycle ``i -- i+1 mod n``; ``n=1``: no edges, ``n=2``: a single edge."""
    n = _check_n(n)
    return Topology.from_edges("ring", n, ((i, (i + 1) % n) for i in range(n)))


def _torus_error(n: int) -> ValueError:
    return ValueError(
        f"workers={n}: a 2-D torus needs workers = rows*cols with rows, cols >= 3, "
        "e.g. 9, 12, 16"
    )


def torus(n: int, rows: int | None = None) -> Topology:
    """2-D torus (wrap-around ``rows x cols`` grid) with ``n = rows*cols``.

    Both ``rows, cols >= 3`` so every worker has exactly 4 distinct
    neighbours. With ``rows=None`` the most square factorisation is used
    (``rows <= cols``). Worker ``r*cols + c`` sits at grid cell ``(r, c)``;
    the result has ``name="torus"`` and ``shape=(rows, cols)``.
    """
    n = _check_n(n)
    if rows is None:
        cands = [r for r in range(3, int(np.sqrt(n)) + 1) if n % r == 0 and n // r >= 3]
        if not cands:
            raise _torus_error(n)
        rows = cands[-1]
    else:
        if isinstance(rows, bool) or int(rows) != rows or rows < 3 or n % rows or n // rows < 3:
            raise ValueError(
                f"rows={rows!r} with workers={n}: a 2-D torus needs workers = rows*cols "
                "with rows, cols >= 3"
            )
        rows = int(rows)
    cols = n // rows
    edges = []
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            edges.append((i, r * cols + (c + 1) % cols))
            edges.append((i, ((r + 1) % rows) * cols + c))
    return Topology.from_edges("torus", n, edges, shape=(rows, cols))


def complete(n: int) -> Topology:
    """Complete graph: every pair of workers is connected."""
    n = _check_n(n)
    return Topology.from_edges("complete", n, ((i, j) for i in range(n) for j in range(i + 1, n)))


def star(n: int) -> Topology:
    """Star with centre 0 connected to each of ``1 .. n-1`` (``n >= 2``)."""
    n = _check_n(n, minimum=2)
    return Topology.from_edges("star", n, ((0, j) for j in range(1, n)))


def exponential(n: int) -> Topology:
    """Undirected exponential graph: ``i -- (i +- 2^k) mod n`` for all ``2^k < n``."""
    n = _check_n(n)
    edges = []
    k = 1
    while k < n:
        edges.extend((i, (i + k) % n) for i in range(n))
        k *= 2
    return Topology.from_edges("exponential", n, edges)


TOPOLOGIES: Dict[str, Callable[[int], Topology]] = {
    "ring": ring,
    "torus": torus,
    "complete": complete,
    "star": star,
    "exponential": exponential,
}


def make_topology(name: str, n: int) -> Topology:
    """Build the registered topology ``name`` on ``n`` workers."""
    if name not in TOPOLOGIES:
        raise ValueError(
            f"topology={name!r} is unknown; choose one of: {', '.join(TOPOLOGIES)}"
        )
    _check_n(n)
    return TOPOLOGIES[name](n)


# ------------------------------------------------------------ matrix helpers
def check_mixing_matrix(W: np.ndarray, atol: float = 1e-10) -> None:
    """Raise ValueError unless ``W`` is square, symmetric, non-negative and
    has every row and column summing to 1 (all within ``atol``)."""
    W = np.asarray(W, dtype=np.float64)
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise ValueError(f"mixing matrix is not square: shape {W.shape}")
    if not np.all(np.isfinite(W)):
        raise ValueError("mixing matrix has non-finite entries")
    if not np.allclose(W, W.T, rtol=0.0, atol=atol):
        err = float(np.max(np.abs(W - W.T)))
        raise ValueError(f"mixing matrix is not symmetric (max |W - W^T| = {err:.3g})")
    if W.min() < -atol:
        raise ValueError(f"mixing matrix has negative entries (min = {W.min():.3g})")
    rows, cols = W.sum(axis=1), W.sum(axis=0)
    if not np.allclose(rows, 1.0, rtol=0.0, atol=atol):
        raise ValueError(
            f"mixing matrix rows do not sum to 1 (max error {np.max(np.abs(rows - 1)):.3g})"
        )
    if not np.allclose(cols, 1.0, rtol=0.0, atol=atol):
        raise ValueError(
            f"mixing matrix columns do not sum to 1 (max error {np.max(np.abs(cols - 1)):.3g})"
        )


def spectral_rho(W: np.ndarray) -> float:
    """``rho = max(|lambda_2|, |lambda_n|)`` of symmetric ``W`` (eigenvalues
    sorted descending); Moniqua (Lu & De Sa 2020) assumption A2 needs
    ``rho < 1``. Smaller is faster mixing. ``n == 1`` gives ``0.0``.
    This is rho itself, NOT the gap; see :func:`spectral_gap`."""
    W = np.asarray(W, dtype=np.float64)
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise ValueError(f"mixing matrix is not square: shape {W.shape}")
    if W.shape[0] <= 1:
        return 0.0
    lam = np.sort(np.linalg.eigvalsh(0.5 * (W + W.T)))[::-1]
    return float(max(abs(lam[1]), abs(lam[-1])))


def spectral_gap(W: np.ndarray) -> float:
    """Spectral gap ``1 - rho`` with ``rho`` = :func:`spectral_rho`
    (Moniqua (Lu & De Sa 2020) assumption A2). Larger is faster mixing."""
    return 1.0 - spectral_rho(W)


def slack_matrix(W: np.ndarray, gamma: float) -> np.ndarray:
    """``gamma * W + (1 - gamma) * I`` for ``gamma`` in ``(0, 1]``.

    Eigenvalues map as ``lambda' = gamma * lambda + 1 - gamma``, so the
    result stays symmetric doubly stochastic and has non-negative spectrum
    once ``gamma <= 1/(1 - lambda_n)``.
    """
    gamma = float(gamma)
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    W = np.asarray(W, dtype=np.float64)
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise ValueError(f"mixing matrix is not square: shape {W.shape}")
    return gamma * W + (1.0 - gamma) * np.eye(W.shape[0])


def smallest_nonzero_weight(W: np.ndarray, tol: float = 1e-12) -> float:
    """Smallest entry of ``W`` greater than ``tol`` (``phi`` in Theorem 1 of
    Moniqua, Lu & De Sa 2020); ``tol`` treats round-off as zero.
    Raises ValueError if there is none."""
    W = np.asarray(W, dtype=np.float64)
    pos = W[W > tol]
    if pos.size == 0:
        raise ValueError("mixing matrix has no non-zero entry")
    return float(pos.min())
