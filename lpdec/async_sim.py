r"""AD-PSGD and Moniqua on AD-PSGD, simulated exactly as their analysis counts iterations.

Seed 003 (section 5) writes Moniqua on AD-PSGD (Lian et al. 2017b) as

.. math::

  X_{k+1} = X_k W_k + (\hat X_k - X_k)(W_k - I) - \alpha_k \tilde G_k(X_{k-\tau_k})
          = X_k + \hat X_k (W_k - I) - \alpha_k \tilde G_k(X_{k-\tau_k}),

with the workers' models as the columns of :math:`X_k`. One iteration k is ONE
gradient update on ONE worker :math:`i_k`, and :math:`W_k` averages along one edge
:math:`(i_k, j_k)`, :math:`W_k = I - (e_i - e_j)(e_i - e_j)^\top / 2`. Column by
column, with every other worker unchanged:

.. math::

  x_i &\leftarrow x_i + \tfrac12(\hat x_{j|i} - \hat x_{i|i}) - \alpha_k d_i,\qquad
  x_j \leftarrow x_j + \tfrac12(\hat x_{i|j} - \hat x_{j|j}),

  d_i &= \tilde g_i\big(x_i^{(k-\tau_k)}\big)\ \text{(through `local_transform` if given)},

where :math:`\hat x_{a|b}` is worker a's model sent through `lpdec.modulo` and decoded
against worker b's own model (Moniqua's Lemma 2; while neighbours differ by less than
θ it does not depend on b, which is the paper's :math:`\hat X_k`), and
:math:`x_i^{(k-\tau)}` is the model worker i held at iteration k - τ: the gradient
applied now was computed τ iterations ago (:math:`\tilde G_k(X_{k-\tau_k})`). In full
precision (no compressor) the edge averages exactly, :math:`x_i, x_j \leftarrow (x_i +
x_j)/2`, and then :math:`x_i` takes its step (Lian et al. 2017b, Algorithm 1).

The schedule (`ad_psgd_schedule`, numpy, one row per iteration):

- the worker :math:`i_k` is drawn with probability proportional to its speed (uniform
  by default): with independent exponential clocks of rates s_i, the order in which
  workers finish their gradients is exactly this i.i.d. draw;
- the peer :math:`j_k` is uniform among :math:`i_k`'s neighbours in the topology (Lian
  et al. 2017b: the active worker "randomly selects a neighbour"); on `complete(n)`
  this is a random edge of the complete graph each iteration;
- the delay :math:`\tau_k \le \min(k, \tau_{max})`, either uniform on
  :math:`\{0..\tau_{max}\}` (``delays="uniform"``) or, with ``delays="speeds"``, the
  number of iterations other workers completed while :math:`i_k` computed its gradient:
  it read its model right after its previous update, at iteration :math:`k'+1`, so
  :math:`\tau_k = k - k' - 1` (k for its first update), capped at :math:`\tau_{max}`.
  Slow workers then apply staler gradients, as in a real asynchronous run. The
  theorem needs bounded delays; the cap is that bound.

Mixing. Theorem 5 asks, instead of a spectral gap, for :math:`t_{mix}` with
:math:`\|\prod_{i=1}^{t_{mix}} W_{k+i}\,\mu - \mathbf 1/n\|_1 \le 1/2` for every k and
every distribution μ (the time-inhomogeneous chain's mixing time, TV distance 1/4).
`mixing_time(expected_mixing_matrix(topo, speeds))` is that time for
:math:`E[W_k]` (the chain averaged over the random edges; by Jensen a lower bound on
the realised constant), and `window_mixing_times(schedule)` measures the realised
products of a schedule, window by window.

Memory: a ring buffer of the last :math:`\tau_{max} + 1` stacked models
(:math:`(\tau_{max} + 1) n d` floats) realises the delay exactly; plus the
`local_transform`'s state per worker.

References:
  Lian, Zhang, Zhang, Liu, Asynchronous Decentralized Parallel Stochastic Gradient
  Descent, ICML 2018, https://arxiv.org/abs/1710.06952

  Lu & De Sa, Moniqua: Modulo Quantized Communication in Decentralized SGD, ICML 2020,
  https://arxiv.org/abs/2002.11787
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lpdec.compress import Modulo
from lpdec.topology import Topology

PyTree = Any
DELAY_MODELS = ("uniform", "speeds")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Who updates, with whom, and how stale its gradient is, one entry per iteration.

    Attributes:
      worker: int32[K], :math:`i_k`, the worker that applies a gradient.
      peer: int32[K], :math:`j_k`, the neighbour it averages with.
      delay: int32[K], :math:`\\tau_k`, iterations since that gradient's model was read.
      max_delay: :math:`\\tau_{max}`, the bound every delay respects.
      num_workers: n.
    """

    worker: np.ndarray
    peer: np.ndarray
    delay: np.ndarray
    max_delay: int
    num_workers: int

    def __len__(self) -> int:
        return len(self.worker)

    def chunk(self, start: int, stop: int) -> Schedule:
        """Iterations start..stop-1 (to run a schedule in pieces with `run`)."""
        return dataclasses.replace(
            self,
            worker=self.worker[start:stop],
            peer=self.peer[start:stop],
            delay=self.delay[start:stop],
        )


def _check_count(value, name: str, minimum: int) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}.")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}.") from None
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value}.")
    return value


def neighbors(topology: Topology) -> list[np.ndarray]:
    """Each worker's neighbours (the off-diagonal support of W), checked for AD-PSGD."""
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be an lpdec.Topology; got {topology!r}.")
    if topology.is_time_varying:
        raise ValueError(
            f"AD-PSGD draws its own edge every iteration: pass a static graph, not {topology}."
        )
    if topology.directed:
        raise ValueError(f"AD-PSGD averages along undirected edges; {topology} is directed.")
    w = topology.mixing_matrix()
    off = (w > 0) & ~np.eye(topology.num_nodes, dtype=bool)
    if not off.any():
        raise ValueError(f"topology {topology} has no edges: AD-PSGD needs at least one.")
    return [np.flatnonzero(row) for row in off]


def _probabilities(speeds, n: int) -> np.ndarray:
    if speeds is None:
        return np.full(n, 1.0 / n)
    s = np.asarray(speeds, np.float64)
    if s.shape != (n,):
        raise ValueError(f"speeds must have one entry per worker ({n}); got shape {s.shape}.")
    if not np.all(np.isfinite(s) & (s > 0)):
        raise ValueError(f"speeds must be finite and > 0; got {s.tolist()}.")
    return s / s.sum()


def ad_psgd_schedule(
    topology: Topology,
    num_iterations: int,
    *,
    max_delay: int,
    speeds=None,
    delays: str = "uniform",
    seed: int = 0,
) -> Schedule:
    """Draws K = `num_iterations` iterations of AD-PSGD (see the module docstring).

    Args:
      topology: a static undirected graph (`ring(n)`, `complete(n)`, ...); its edges
        are what a worker may average along (the weights are not used).
      num_iterations: K >= 1.
      max_delay: τ_max >= 0, the bound on every delay.
      speeds: n positive speeds; worker i updates with probability s_i / sum(s).
        None: all equal.
      delays: "uniform" (τ_k uniform on 0..τ_max) or "speeds" (iterations since the
        worker's previous update, capped at τ_max).
      seed: numpy seed.

    Returns:
      A `Schedule`; every τ_k <= min(k, τ_max).
    """
    nbrs = neighbors(topology)
    k_total = _check_count(num_iterations, "num_iterations", 1)
    tau_max = _check_count(max_delay, "max_delay", 0)
    if delays not in DELAY_MODELS:
        raise ValueError(f"delays must be one of {DELAY_MODELS}; got {delays!r}.")
    n = topology.num_nodes
    p = _probabilities(speeds, n)
    rng = np.random.default_rng(seed)
    worker = rng.choice(n, size=k_total, p=p)
    pick = rng.random(k_total)
    degree = np.array([len(b) for b in nbrs])
    table = np.zeros((n, degree.max()), np.int64)
    for i, b in enumerate(nbrs):
        table[i, : len(b)] = b
    peer = table[worker, np.minimum((pick * degree[worker]).astype(np.int64), degree[worker] - 1)]
    k = np.arange(k_total)
    if delays == "uniform":
        tau = rng.integers(0, tau_max + 1, size=k_total)
    else:
        last = np.full(n, -1)
        tau = np.empty(k_total, np.int64)
        for step, i in enumerate(worker):
            tau[step] = step - last[i] - 1
            last[i] = step
    tau = np.minimum(np.minimum(tau, tau_max), k)
    return Schedule(
        worker=worker.astype(np.int32),
        peer=peer.astype(np.int32),
        delay=tau.astype(np.int32),
        max_delay=tau_max,
        num_workers=n,
    )


def expected_mixing_matrix(topology: Topology, speeds=None) -> np.ndarray:
    r""":math:`E[W_k] = \sum_i p_i \sum_{j \in N(i)} \frac{1}{|N(i)|}
    (I - (e_i - e_j)(e_i - e_j)^\top / 2)`, float64[n, n], symmetric, doubly stochastic."""
    nbrs = neighbors(topology)
    n = topology.num_nodes
    p = _probabilities(speeds, n)
    w = np.eye(n)
    for i, b in enumerate(nbrs):
        for j in b:
            weight = p[i] / len(b) / 2
            w[i, i] -= weight
            w[j, j] -= weight
            w[i, j] += weight
            w[j, i] += weight
    return w


def _worst_l1(product: np.ndarray) -> float:
    """max over distributions μ of ||P μ - 1/n||_1: a convex function of μ, so its
    maximum over the simplex is at a vertex μ = e_i (a column of P)."""
    n = product.shape[0]
    return float(np.abs(product - 1.0 / n).sum(axis=0).max())


def _check_eps(eps: float) -> float:
    if not 0 < eps < 2:
        raise ValueError(f"eps must be in (0, 2) (an l1 distance); got {eps!r}.")
    return float(eps)


def mixing_time(matrix: np.ndarray, eps: float = 0.5, max_t: int = 1_000_000) -> int:
    """Smallest t with max_μ ||M^t μ - 1/n||_1 <= eps (Theorem 5's condition at eps = 1/2).

    `matrix` is a doubly stochastic M, e.g. `expected_mixing_matrix(...)`: t counts
    iterations (single edges). Raises if it does not mix within `max_t`.
    """
    eps = _check_eps(eps)
    m = np.asarray(matrix, np.float64)
    product = np.eye(m.shape[0])
    for t in range(1, max_t + 1):
        product = m @ product
        if _worst_l1(product) <= eps:
            return t
    raise ValueError(f"the matrix does not mix to eps={eps} within {max_t} iterations.")


def window_mixing_times(
    schedule: Schedule, eps: float = 0.5, starts=None, max_t: int | None = None
) -> np.ndarray:
    """For each start k, the smallest t with ||W_{k+t-1}...W_k μ - 1/n||_1 <= eps for all μ.

    The realised products of the schedule's edges (Theorem 5's condition, window by
    window). `starts`: the windows' first iterations (default every 10th). A window
    that reaches the schedule's end, or `max_t`, unmixed is reported as -1.
    """
    eps = _check_eps(eps)
    n, total = schedule.num_workers, len(schedule)
    starts = np.arange(0, total, 10) if starts is None else np.asarray(starts)
    limit = total if max_t is None else max_t
    out = np.full(len(starts), -1, np.int64)
    for s, start in enumerate(starts):
        # Rows of P are what each worker holds of the n unit vectors: averaging
        # rows i and j is P <- W P for the edge (i, j).
        product = np.eye(n)
        for t in range(1, min(limit, total - start) + 1):
            i, j = schedule.worker[start + t - 1], schedule.peer[start + t - 1]
            product[[i, j]] = (product[i] + product[j]) / 2
            if _worst_l1(product) <= eps:
                out[s] = t
                break
    return out


class ADPSGDState(NamedTuple):
    """State of the simulation besides the stacked models.

    Attributes:
      iteration: shape=(), dtype=int32; k, iterations done.
      history: a tree like the stacked models with a leading axis τ_max + 1: slot
        m mod (τ_max + 1) holds X_m for the last τ_max + 1 iterations m.
      local_state: `local_transform`'s state, one per worker (leading axis n).
      key: shape=(2,), dtype=uint32; stochastic rounding draws from it.
    """

    iteration: jax.Array
    history: PyTree
    local_state: PyTree
    key: jax.Array


def init(
    params: PyTree,
    *,
    max_delay: int,
    local_transform: optax.GradientTransformation | None = None,
    seed: int = 0,
) -> ADPSGDState:
    """The state at iteration 0 for `params` stacked over the workers (leading axis n)."""
    tau_max = _check_count(max_delay, "max_delay", 0)
    history = jax.tree.map(lambda x: jnp.repeat(x[None], tau_max + 1, axis=0), params)
    local = optax.identity() if local_transform is None else local_transform
    return ADPSGDState(
        iteration=jnp.zeros((), jnp.int32),
        history=history,
        local_state=jax.vmap(local.init)(params),
        key=jax.random.key_data(jax.random.key(seed)),
    )


def _encode(compressor: Modulo, x: PyTree, key: jax.Array) -> list:
    leaves = jax.tree.leaves(x)
    keys = jax.random.split(key, len(leaves))
    return [compressor.encode(v, k) for v, k in zip(leaves, keys, strict=True)]


def _consensus(compressor: Modulo | None, x_own: PyTree, q_own, q_other, x_other) -> PyTree:
    """x̂_{other|own} - x̂_{own|own}: Moniqua's correction-term difference (or, in full
    precision, x_other - x_own)."""
    if compressor is None:
        return jax.tree.map(jnp.subtract, x_other, x_own)
    leaves, treedef = jax.tree.flatten(x_own)
    return jax.tree.unflatten(
        treedef,
        [
            compressor.decode(b, reference=r) - compressor.decode(a, reference=r)
            for r, a, b in zip(leaves, q_own, q_other, strict=True)
        ],
    )


def _run(params, state, worker, peer, delay, grad_fn, learning_rate, compressor, local_transform):
    """The schedule's rows (worker, peer, delay) from `state.iteration` on: one scan, or
    for one row the iteration alone, without a loop."""
    slots = jax.tree.leaves(state.history)[0].shape[0]
    local = optax.identity() if local_transform is None else local_transform

    def take(tree, i):
        return jax.tree.map(lambda v: v[i], tree)

    def put(tree, i, new):
        return jax.tree.map(lambda v, u: v.at[i].set(u.astype(v.dtype)), tree, new)

    def iteration(carry, row):
        x, history, local_state = carry
        i, j, tau, k = row
        history = put(history, k % slots, x)  # slot k holds X_k
        stale = take(take(history, (k - tau) % slots), i)  # x_i at iteration k - tau
        g = grad_fn(stale, i, k)
        d, s_i = local.update(g, take(local_state, i), stale)
        local_state = put(local_state, i, s_i)
        alpha = learning_rate(k) if callable(learning_rate) else learning_rate
        x_i, x_j = take(x, i), take(x, j)
        if compressor is None:
            avg = jax.tree.map(lambda a, b: (a + b) / 2, x_i, x_j)
            new_i, new_j = avg, avg
        else:
            key_k = jax.random.fold_in(state.key, k)
            q_i = _encode(compressor, x_i, jax.random.fold_in(key_k, i))
            q_j = _encode(compressor, x_j, jax.random.fold_in(key_k, j))
            pull_i = _consensus(compressor, x_i, q_i, q_j, x_j)
            pull_j = _consensus(compressor, x_j, q_j, q_i, x_i)
            new_i = jax.tree.map(lambda a, c: a + c / 2, x_i, pull_i)
            new_j = jax.tree.map(lambda a, c: a + c / 2, x_j, pull_j)
        new_i = jax.tree.map(lambda a, u: a - alpha * u.astype(a.dtype), new_i, d)
        x = put(put(x, i, new_i), j, new_j)
        return (x, history, local_state), None

    ks = state.iteration + jnp.arange(worker.shape[0], dtype=jnp.int32)
    carry = (params, state.history, state.local_state)
    rows = (worker, peer, delay, ks)
    if worker.shape[0] == 1:  # no loop at all (`run` calls one per iteration on CPU)
        (params, history, local_state), _ = iteration(carry, [r[0] for r in rows])
    else:
        (params, history, local_state), _ = jax.lax.scan(iteration, carry, rows)
    return params, state._replace(
        iteration=state.iteration + worker.shape[0], history=history, local_state=local_state
    )


def run(
    params: PyTree,
    state: ADPSGDState,
    schedule: Schedule,
    grad_fn: Callable[[PyTree, jax.Array, jax.Array], PyTree],
    learning_rate: float | optax.Schedule,
    *,
    compressor: Modulo | None = None,
    local_transform: optax.GradientTransformation | None = None,
) -> tuple[PyTree, ADPSGDState]:
    """Runs every iteration of `schedule` from `state.iteration` on (one jitted `lax.scan`;
    on CPU one jitted program per iteration, which XLA:CPU runs several times faster).

    Args:
      params: the workers' models, stacked (leading axis n).
      state: from `init` (with the same `max_delay` and `local_transform`) or `run`.
      schedule: the iterations to run (`ad_psgd_schedule(...)`, or `.chunk(a, b)` of
        it with `state.iteration == a`).
      grad_fn: `grad_fn(x, i, k)` -> the stochastic gradient :math:`\\tilde g_i(x)` of
        worker i's loss at ONE worker's model x (no leading axis), at iteration k
        (draw the minibatch from k); must be hashable (a module-level function or a
        `functools.partial`), as it is a static argument of the compiled program.
      learning_rate: α, a number or a schedule α_k of the iteration k.
      compressor: None (full precision) or `lpdec.modulo(bits, theta, rounding)`:
        Moniqua on AD-PSGD. Stochastic rounding draws worker w's key at iteration k
        as ``fold_in(fold_in(state.key, k), w)``, one split per leaf.
      local_transform: applied to worker i's stale gradient with its own state
        before the step (e.g. ``optax.chain(optax.add_decayed_weights(5e-4),
        optax.trace(0.9))`` for heavy-ball momentum and weight decay at the stale
        model); None: the plain gradient, the paper's recursion.

    Returns:
      (params, state) after the schedule's iterations.
    """
    n = jax.tree.leaves(params)[0].shape[0]
    if schedule.num_workers != n:
        raise ValueError(f"schedule is for {schedule.num_workers} workers; params have {n}.")
    slots = jax.tree.leaves(state.history)[0].shape[0]
    if schedule.max_delay > slots - 1:
        raise ValueError(
            f"schedule has max_delay {schedule.max_delay}; state keeps {slots - 1} (init's)."
        )
    if compressor is not None and not isinstance(compressor, Modulo):
        raise TypeError(f"compressor must be lpdec.modulo(...) or None; got {compressor!r}.")
    if len(schedule) == 0:
        return params, state
    statics = (grad_fn, learning_rate, compressor, local_transform)
    rows = np.stack([schedule.worker, schedule.peer, schedule.delay], axis=1).astype(np.int32)
    if not _on_cpu(params):
        return _scan(params, state, *jnp.asarray(rows.T), *statics)
    # XLA:CPU runs a model's convolutions inside a loop several times slower than the
    # same program without one (jax-ml/jax#12868; 8 workers of MNIST-1D's cnn1d: 6.4 ms
    # an iteration in one scan, 1.1 ms as here), so on CPU each iteration is a program
    # of its own, called once per row, the state updated in place (donated; the
    # caller's arrays are copied once first and stay valid).
    params, state = jax.tree.map(jnp.copy, (params, state))
    for row in rows:
        params, state = _step(params, state, *row[:, None], *statics)
    return params, state


_STATIC = ("grad_fn", "learning_rate", "compressor", "local_transform")
_scan = jax.jit(_run, static_argnames=_STATIC)
_step = jax.jit(_run, static_argnames=_STATIC, donate_argnames=("params", "state"))


def _on_cpu(params: PyTree) -> bool:
    """Whether the simulation runs on CPU devices (numpy input: jax's default device)."""
    leaf = jax.tree.leaves(params)[0]
    devices = leaf.devices() if isinstance(leaf, jax.Array) else {jax.devices()[0]}
    return all(d.platform == "cpu" for d in devices)


def spectral_gap(matrix: np.ndarray) -> float:
    """1 - |λ_2| of a symmetric doubly stochastic matrix (e.g. `expected_mixing_matrix`)."""
    eig = np.sort(np.abs(np.linalg.eigvalsh(np.asarray(matrix, np.float64))))[::-1]
    return float(1.0 - eig[1]) if len(eig) > 1 else 1.0


def mixing_time_bound(gap: float, n: int, eps: float = 0.5) -> int:
    """ceil(log(sqrt(n) / eps) / gap): t_mix implied by a spectral gap (||·||_1 <=
    sqrt(n) ||·||_2 and ||M^t μ - 1/n||_2 <= (1 - gap)^t for symmetric M)."""
    return math.ceil(math.log(math.sqrt(n) / _check_eps(eps)) / gap)
