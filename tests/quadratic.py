"""The small problem the algorithm tests run on: worker i minimises
f_i(x) = sum A_i x^2 / 2 - b_i x (gradient A_i x - b_i), one step of the
training loop's protocol at a time, so that a plain reference written in a
test can follow the same equations in matrix form."""

import torch

from lowbit.comm import run_threads


def quadratic_problem(n: int, d: int, seed: int = 0, scale: float = 0.01):
    """Initial models X0 (n, d), curvatures A (n, d) in [0.5, 1.5), offsets b (n, d)."""
    g = torch.Generator().manual_seed(seed)
    X0 = torch.randn(n, d, generator=g, dtype=torch.float64) * scale
    A = torch.rand(n, d, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(n, d, generator=g, dtype=torch.float64)
    return X0, A, b


def quadratic_step(algo, t, k: int, x, A, b, lr: float) -> None:
    """Step k of the training loop's protocol on worker ``t.rank``: g = A_i x - b_i;
    before_update; x -= lr g; after_update."""
    t.set_step(k)
    g = A[t.rank] * x - b[t.rank]
    algo.before_update(k, x, g, lr)
    x -= lr * g
    algo.after_update(k, x, g, lr)


def run_quadratic(make_algo, X0, A, b, steps: int, lr, observe=None, finish: bool = False):
    """Each worker i: x = X0[i], then ``steps`` quadratic steps at step size ``lr`` (a
    number, or a function of k), each followed by ``observe(k, x, algo, transport)``
    (default: a copy of x).
    Returns, per worker, (observations, algo, transport, final x) - the final x
    read after ``finish()`` when ``finish`` is set (asynchronous algorithms keep
    answering neighbours until then)."""
    observe = observe or (lambda k, x, algo, t: x.clone())

    def worker(t):
        x = X0[t.rank].clone()
        algo = make_algo(t)
        algo.setup(x)
        seen = []
        for k in range(steps):
            quadratic_step(algo, t, k, x, A, b, lr(k) if callable(lr) else lr)
            seen.append(observe(k, x, algo, t))
        if finish:
            algo.finish()
        return seen, algo, t, x

    return run_threads(X0.shape[0], worker)
