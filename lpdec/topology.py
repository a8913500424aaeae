r"""Communication topologies: graphs -> mixing weights -> ppermute schedules.

A gossip step mixes each node's vector with its in-neighbours' through a
mixing matrix W whose rows are receivers:

.. math::

  x_i^+ = \sum_j W_{ij} x_j = W_{ii} x_i + \sum_c w^{(c)}_i \, x_{s_c(i)}.

The off-diagonal part of W is split into *edge classes* c. A class is a
partial permutation, a valid `jax.lax.ppermute` perm in which every node sends
to at most one peer and receives from at most one peer, plus the weight
w^{(c)}_i = W_{i, s_c(i)} that each receiver i gives to what its sender s_c(i)
sent (0 where i receives nothing, which also cancels the zeros that ppermute
delivers there). A gossip step is then one ppermute per class, never an
all-gather. A time-varying topology is a period of P such rounds, round
t mod P at step t.

Everything here is static numpy data in frozen, hashable dataclasses, so a
`Topology` can be a static argument of `jax.jit` or a field of an optax
transform. The per-node numpy arrays (`Round.self_weight`,
`EdgeClass.recv_weight`, `EdgeClass.senders`, ...) are meant to be indexed with
`jax.lax.axis_index` at trace time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence

import numpy as np

from lpdec import _edge_coloring

REQUIREMENTS = ("row_stochastic", "column_stochastic", "doubly_stochastic", "symmetric")


def _read_only(array: np.ndarray) -> np.ndarray:
    # The arrays are cached on frozen objects and shared by every caller.
    array.flags.writeable = False
    return array


@dataclasses.dataclass(frozen=True)
class EdgeClass:
    """One ppermute of a gossip round: a partial permutation and its receivers' weights.

    Attributes:
      perm: (source, destination) pairs sorted by source; every node is a source
        at most once and a destination at most once, never its own peer.
      weights: weights[i] = W_{i, source} that receiver i gives to what it
        receives through this class; 0 exactly for nodes that receive nothing.
    """

    perm: tuple[tuple[int, int], ...]
    weights: tuple[float, ...]

    def __post_init__(self):
        pairs = np.asarray(self.perm)
        if pairs.size and (pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype.kind not in "iu"):
            raise ValueError(f"perm must be (source, destination) integer pairs; got {self.perm!r}")
        perm = tuple(sorted((int(s), int(d)) for s, d in pairs.reshape(-1, 2)))
        weights = tuple(float(w) for w in self.weights)
        object.__setattr__(self, "perm", perm)
        object.__setattr__(self, "weights", weights)
        n = len(weights)
        sources = [s for s, _ in perm]
        destinations = [d for _, d in perm]
        if any(not 0 <= i < n for i in sources + destinations):
            raise ValueError(f"perm {perm} names nodes outside [0, {n})")
        if len(set(sources)) < len(sources) or len(set(destinations)) < len(destinations):
            raise ValueError(f"perm {perm} repeats a source or a destination")
        if any(s == d for s, d in perm):
            raise ValueError(f"perm {perm} pairs a node with itself")
        receives = np.zeros(n, dtype=bool)
        receives[destinations] = True
        w = np.asarray(weights)
        if not np.all(np.isfinite(w)) or np.any(w < 0):
            raise ValueError(f"weights must be finite and non-negative; got {weights}")
        if np.any((w > 0) != receives):
            raise ValueError(
                "weights must be positive exactly at the destinations of perm; "
                f"got weights {weights} for perm {perm}"
            )

    @property
    def num_nodes(self) -> int:
        return len(self.weights)

    @functools.cached_property
    def recv_weight(self) -> np.ndarray:
        """float32[n]: the weight receiver i gives to what it receives (0: receives nothing)."""
        return _read_only(np.asarray(self.weights, dtype=np.float32))

    @functools.cached_property
    def senders(self) -> np.ndarray:
        """int32[n]: who sends to node i in this class, -1 where nobody does."""
        senders = np.full(self.num_nodes, -1, dtype=np.int32)
        for s, d in self.perm:
            senders[d] = s
        return _read_only(senders)

    @functools.cached_property
    def receivers(self) -> np.ndarray:
        """int32[n]: whom node j sends to in this class, -1 where it sends nothing."""
        receivers = np.full(self.num_nodes, -1, dtype=np.int32)
        for s, d in self.perm:
            receivers[s] = d
        return _read_only(receivers)

    @functools.cached_property
    def send_weight(self) -> np.ndarray:
        """float32[n]: W_{receiver, j}, the weight node j's message gets (0: j sends nothing).

        Push-sum senders scale what they send by it, so W need only be column stochastic.
        """
        send = np.zeros(self.num_nodes, dtype=np.float32)
        for s, d in self.perm:
            send[s] = self.weights[d]
        return _read_only(send)


@dataclasses.dataclass(frozen=True)
class Round:
    """The mixing matrix of one step as its diagonal plus edge classes.

    Attributes:
      diagonal: W_ii, the weight each node keeps of its own value.
      edge_classes: the off-diagonal part of W, one ppermute each; no edge
        appears in two classes.
    """

    diagonal: tuple[float, ...]
    edge_classes: tuple[EdgeClass, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "diagonal", tuple(float(w) for w in self.diagonal))
        object.__setattr__(self, "edge_classes", tuple(self.edge_classes))
        n = len(self.diagonal)
        d = np.asarray(self.diagonal)
        if not np.all(np.isfinite(d)) or np.any(d < 0):
            raise ValueError(f"diagonal must be finite and non-negative; got {self.diagonal}")
        if any(c.num_nodes != n for c in self.edge_classes):
            raise ValueError(f"every edge class must have {n} weights, one per node")
        if len(set(self.edges)) < len(self.edges):
            raise ValueError("an edge (source, destination) appears in two edge classes")

    @property
    def num_nodes(self) -> int:
        return len(self.diagonal)

    @property
    def edges(self) -> tuple[tuple[int, int], ...]:
        """Every (source, destination) pair of the round, class by class."""
        return tuple(pair for c in self.edge_classes for pair in c.perm)

    @functools.cached_property
    def self_weight(self) -> np.ndarray:
        """float32[n]: W_ii."""
        return _read_only(np.asarray(self.diagonal, dtype=np.float32))

    def mixing_matrix(self) -> np.ndarray:
        """float64[n, n] W, rows are receivers: W[i, j] is what i takes of j's value."""
        w = np.diag(np.asarray(self.diagonal, dtype=np.float64))
        for c in self.edge_classes:
            for s, d in c.perm:
                w[d, s] = c.weights[d]
        return w


def _unreachable(num_nodes: int, edges: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """None if the directed graph is strongly connected, else (a, b) with b unreachable from a."""
    forward: list[list[int]] = [[] for _ in range(num_nodes)]
    backward: list[list[int]] = [[] for _ in range(num_nodes)]
    for s, d in edges:
        forward[s].append(d)
        backward[d].append(s)
    # Strongly connected iff node 0 reaches every node and every node reaches node 0.
    for adjacency, towards_zero in ((forward, False), (backward, True)):
        seen = [False] * num_nodes
        seen[0] = True
        stack = [0]
        while stack:
            for v in adjacency[stack.pop()]:
                if not seen[v]:
                    seen[v] = True
                    stack.append(v)
        if not all(seen):
            missing = seen.index(False)
            return (missing, 0) if towards_zero else (0, missing)
    return None


@dataclasses.dataclass(frozen=True, repr=False)
class Topology:
    """A communication graph as mixing weights and a ppermute schedule.

    Build one with the constructors of this module (`ring`, `torus`,
    `from_matrix`, ...). Construction checks shapes, that weights are finite and
    non-negative, and that the union of the rounds' graphs is strongly
    connected; stochasticity depends on the algorithm, see `validate`.

    Attributes:
      name: how it prints, e.g. ``ring(8)``.
      num_nodes: n, the size of the named axis it runs on.
      directed: False when every round's graph is undirected: j is an
        in-neighbour of i exactly when i is one of j (the weights may differ).
      rounds: the schedule; round t mod len(rounds) is used at step t.
    """

    name: str
    num_nodes: int
    directed: bool
    rounds: tuple[Round, ...]

    def __post_init__(self):
        n = self.num_nodes
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise ValueError(f"topology {self.name}: num_nodes must be an integer >= 1; got {n!r}")
        object.__setattr__(self, "num_nodes", int(n))
        object.__setattr__(self, "directed", bool(self.directed))
        object.__setattr__(self, "rounds", tuple(self.rounds))
        if not self.rounds:
            raise ValueError(f"topology {self.name}: needs at least one round")
        if any(r.num_nodes != n for r in self.rounds):
            raise ValueError(f"topology {self.name}: every round must have {n} nodes")
        if not self.directed:
            for t, r in enumerate(self.rounds):
                edges = set(r.edges)
                for s, d in sorted(edges):
                    if (d, s) not in edges:
                        raise ValueError(
                            f"topology {self.name} is marked undirected but round {t} has the "
                            f"edge {s} -> {d} without {d} -> {s}"
                        )
        unreachable = _unreachable(n, [e for r in self.rounds for e in r.edges])
        if unreachable is not None:
            a, b = unreachable
            raise ValueError(
                f"topology {self.name} is not strongly connected: node {b} cannot be reached "
                f"from node {a} (over the union of its {self.period} round(s))"
            )

    # Hashing walks every weight; jit hashes static arguments on each call.
    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.name, self.num_nodes, self.directed, self.rounds))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return self.name

    @property
    def period(self) -> int:
        """P, the number of rounds before the schedule repeats (1 for a static graph)."""
        return len(self.rounds)

    @property
    def num_rounds(self) -> int:
        """The same number as `period`: len(rounds)."""
        return len(self.rounds)

    @property
    def is_time_varying(self) -> bool:
        return len(self.rounds) > 1

    def round(self, step: int = 0) -> Round:
        """The round used at `step` (a static Python int): rounds[step mod P]."""
        return self.rounds[operator.index(step) % self.period]

    def mixing_matrix(self, step: int = 0) -> np.ndarray:
        """float64[n, n] W of `step`; W[i, j] is the weight node i gives node j's value."""
        return self.round(step).mixing_matrix()

    def spectral_gap(self, step: int | None = None) -> float:
        r"""One minus the second-largest eigenvalue modulus of the mixing operator M.

        .. math::

          \delta = 1 - |\lambda_2(M)|, \qquad
          |\lambda_1(M)| \ge |\lambda_2(M)| \ge \dots \ge |\lambda_n(M)|,

        with M = W for a static topology (or `step` given: that step's W) and
        M = W_{P-1} \cdots W_1 W_0, one whole period, for a time-varying one.
        For symmetric W this is 1 - max(|λ_2|, |λ_n|), the 1 - ρ of Moniqua's
        assumption (A2). For a non-symmetric stochastic W, |λ_2| is the
        asymptotic per-step (per-period) rate at which W^t x reaches consensus,
        as in push-sum analyses; it does not bound a single step. The gap is
        clipped at 0 (no contraction) and is 1 for a single node.
        """
        if self.num_nodes == 1:
            return 1.0
        if step is None:
            m = np.eye(self.num_nodes)
            for r in self.rounds:
                m = r.mixing_matrix() @ m
        else:
            m = self.mixing_matrix(step)
        moduli = np.sort(np.abs(np.linalg.eigvals(m)))[::-1]
        return max(0.0, float(1.0 - moduli[1]))

    def in_degree(self, step: int = 0) -> np.ndarray:
        """int64[n]: how many peers (not counting itself) each node receives from."""
        classes = self.round(step).edge_classes
        return sum((c.senders >= 0 for c in classes), np.zeros(self.num_nodes, np.int64))

    def out_degree(self, step: int = 0) -> np.ndarray:
        """int64[n]: how many peers (not counting itself) each node sends to."""
        classes = self.round(step).edge_classes
        return sum((c.receivers >= 0 for c in classes), np.zeros(self.num_nodes, np.int64))

    @property
    def max_in_degree(self) -> int:
        """The most messages any node receives in one step, over the whole period."""
        return max(int(self.in_degree(t).max()) for t in range(self.period))

    @property
    def max_out_degree(self) -> int:
        """The most messages any node sends in one step, over the whole period."""
        return max(int(self.out_degree(t).max()) for t in range(self.period))

    @property
    def degree(self) -> int:
        """max(max_in_degree, max_out_degree): the most edge classes (ppermutes) a round needs."""
        return max(self.max_in_degree, self.max_out_degree)

    def in_neighbors(self, i: int, step: int = 0) -> tuple[int, ...]:
        """The peers node i receives from at `step` (itself excluded), ascending."""
        i = self._node(i)
        return tuple(sorted(s for s, d in self.round(step).edges if d == i))

    def out_neighbors(self, i: int, step: int = 0) -> tuple[int, ...]:
        """The peers node i sends to at `step` (itself excluded), ascending."""
        i = self._node(i)
        return tuple(sorted(d for s, d in self.round(step).edges if s == i))

    def _node(self, i: int) -> int:
        # Negative indices would silently wrap around, as numpy's do.
        i = operator.index(i)
        if not 0 <= i < self.num_nodes:
            raise ValueError(
                f"topology {self.name} has no node {i}; nodes are 0..{self.num_nodes - 1}"
            )
        return i

    def _first_violation(self, requirement: str, atol: float) -> str | None:
        """Describes the first place where W breaks `requirement`, or None."""
        for t in range(self.period):
            w = self.mixing_matrix(t)
            where = f" (round {t})" if self.is_time_varying else ""
            if requirement == "symmetric":
                asymmetric = np.argwhere(np.abs(w - w.T) > atol)
                if len(asymmetric):
                    i, j = asymmetric[0]
                    return f"W[{i}, {j}] = {w[i, j]:.6g} but W[{j}, {i}] = {w[j, i]:.6g}{where}"
                continue
            axes = {
                "row_stochastic": (("row", 1),),
                "column_stochastic": (("column", 0),),
                "doubly_stochastic": (("row", 1), ("column", 0)),
            }[requirement]
            for label, axis in axes:
                sums = w.sum(axis=axis)
                bad = np.flatnonzero(np.abs(sums - 1.0) > atol)
                if len(bad):
                    k = bad[0]
                    return f"{label} {k} of W sums to {sums[k]:.6g}, expected 1{where}"
        return None

    def is_row_stochastic(self, atol: float = 1e-6) -> bool:
        """Every row of every round's W sums to 1: a weighted average of in-neighbours."""
        return self._first_violation("row_stochastic", atol) is None

    def is_column_stochastic(self, atol: float = 1e-6) -> bool:
        """Every column sums to 1: senders split their mass, as push-sum needs."""
        return self._first_violation("column_stochastic", atol) is None

    def is_doubly_stochastic(self, atol: float = 1e-6) -> bool:
        """Rows and columns sum to 1: gossip preserves the average (D-PSGD, CHOCO, DCD)."""
        return self._first_violation("doubly_stochastic", atol) is None

    def is_symmetric(self, atol: float = 1e-6) -> bool:
        """W = W^T in every round (Moniqua's (A2), D²)."""
        return self._first_violation("symmetric", atol) is None

    def validate(self, require: str | Sequence[str], atol: float = 1e-6) -> Topology:
        """Raises ValueError unless W meets every requirement; returns self.

        Args:
          require: one or more of "row_stochastic", "column_stochastic",
            "doubly_stochastic", "symmetric".
          atol: tolerance on row and column sums and on W - W^T.
        """
        for requirement in (require,) if isinstance(require, str) else tuple(require):
            if requirement not in REQUIREMENTS:
                raise ValueError(f"require must be among {REQUIREMENTS}; got {requirement!r}")
            violation = self._first_violation(requirement, atol)
            if violation is not None:
                kind = requirement.replace("_", " ")
                raise ValueError(f"topology {self.name} is not {kind}: {violation}")
        return self

    def check_axis_size(self, axis_size: int, axis_name: str | tuple[str, ...] = "nodes") -> None:
        """Raises ValueError unless the named axis has one entry per node.

        Call it at trace time, e.g. with ``jax.lax.axis_size(axis_name)``.
        """
        if int(axis_size) != self.num_nodes:
            raise ValueError(
                f"topology {self.name} has {self.num_nodes} nodes but the named axis "
                f"{axis_name!r} has size {int(axis_size)}"
            )

    def with_slack(self, alpha: float) -> Topology:
        r"""The lazier topology of Moniqua's Theorem 3 (1-bit quantization).

        .. math::

          W' = \alpha W + (1 - \alpha) I, \qquad 0 < \alpha \le 1.

        Same edges and edge classes, every off-diagonal weight scaled by α;
        stochasticity and symmetry are kept, and λ_i(W') = α λ_i(W) + 1 - α.
        """
        alpha = float(alpha)
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"with_slack: alpha must be in (0, 1]; got {alpha}")
        if alpha == 1.0:
            return self
        rounds = tuple(
            Round(
                tuple(alpha * d + (1.0 - alpha) for d in r.diagonal),
                tuple(
                    EdgeClass(c.perm, tuple(alpha * w for w in c.weights)) for c in r.edge_classes
                ),
            )
            for r in self.rounds
        )
        name = f"{self.name}.with_slack({alpha:g})"
        return Topology(name, self.num_nodes, self.directed, rounds)


def mixing_matrices(topology: Topology) -> np.ndarray:
    """float64[P, n, n]: W of every round of the period, in order."""
    return np.stack([r.mixing_matrix() for r in topology.rounds])


def _check_count(value: int, arg: str, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{where}: {arg} must be an integer >= {minimum}; got {value!r}")
    return int(value)


def _shift_round(shape: tuple[int, ...], offsets: Sequence[tuple[int, ...]]) -> Round:
    """Node x of the group Z_shape sends to x + d for each distinct nonzero offset d.

    Offsets that coincide modulo the shape (+1 and -1 on a ring of 2) or vanish
    (any offset on a ring of 1) are merged or dropped, and every node weighs
    itself and each distinct in-neighbour 1 / (m + 1) for m distinct offsets,
    so W is a doubly stochastic circulant. Node x is numbered row-major.
    """
    distinct = []
    for d in offsets:
        d = tuple(o % s for o, s in zip(d, shape, strict=True))
        if any(d) and d not in distinct:
            distinct.append(d)
    n = math.prod(shape)
    w = 1.0 / (len(distinct) + 1)
    coords = np.stack(np.unravel_index(np.arange(n), shape), axis=-1)
    classes = []
    for d in distinct:
        destination = np.ravel_multi_index(tuple(((coords + d) % shape).T), shape)
        classes.append(EdgeClass(tuple(zip(range(n), destination, strict=True)), (w,) * n))
    return Round((w,) * n, tuple(classes))


def ring(n: int) -> Topology:
    """Undirected ring: every node averages itself and its two neighbours.

    W_ii = W_{i,i+1} = W_{i,i-1} = 1/3 (indices mod n): symmetric, doubly
    stochastic, in- and out-degree 2, two edge classes (shifts +1 and -1).
    For n = 2 the two neighbours coincide: W = [[1/2, 1/2], [1/2, 1/2]], one
    class; for n = 1, W = [[1]] and no classes.

    Example:
      >>> ring(4).mixing_matrix()[0] * 3
      array([1., 1., 0., 1.])
    """
    n = _check_count(n, "n", "ring")
    return Topology(f"ring({n})", n, False, (_shift_round((n,), [(1,), (-1,)]),))


def directed_ring(n: int) -> Topology:
    """Directed ring (seed 002's one-peer ring): node i sends only to i + 1.

    W_ii = W_{i+1,i} = 1/2: row and column stochastic, not symmetric for
    n >= 3, in- and out-degree 1, one edge class.

    Example:
      >>> directed_ring(4).out_neighbors(3)
      (0,)
    """
    n = _check_count(n, "n", "directed_ring")
    return Topology(f"directed_ring({n})", n, True, (_shift_round((n,), [(1,)]),))


def torus(rows: int, cols: int) -> Topology:
    """2-D torus (seed 002's 4x4 torus): node (r, c) = r * cols + c talks to (r±1, c), (r, c±1).

    W = 1/5 on itself and each of its four neighbours: symmetric, doubly
    stochastic, degree 4, four edge classes. Neighbours that coincide (a side
    of 2, where r+1 = r-1) are merged and a side of 1 adds none, with the
    weight spread uniformly over itself and the m distinct neighbours,
    1 / (m + 1); so torus(1, n) equals ring(n) and torus(2, 2) has W = 1/3
    on itself and two neighbours.

    Example:
      >>> torus(4, 4).in_neighbors(0)
      (1, 3, 4, 12)
    """
    rows = _check_count(rows, "rows", "torus")
    cols = _check_count(cols, "cols", "torus")
    offsets = [(1, 0), (-1, 0), (0, 1), (0, -1)]
    return Topology(
        f"torus({rows}, {cols})", rows * cols, False, (_shift_round((rows, cols), offsets),)
    )


def exponential(n: int) -> Topology:
    """Static exponential graph (SGP, BlueFog): node i sends to i + 2^k mod n for every 2^k < n.

    W = 1/(m + 1) on itself and each of its m = ceil(log2 n) in-peers
    i - 2^k: row and column stochastic circulant, not symmetric in general,
    in- and out-degree m, m edge classes.

    Example:
      >>> exponential(8).out_neighbors(0)
      (1, 2, 4)
    """
    n = _check_count(n, "n", "exponential")
    offsets = [(1 << k,) for k in range(max(n - 1, 1).bit_length())]
    return Topology(f"exponential({n})", n, True, (_shift_round((n,), offsets),))


def complete(n: int) -> Topology:
    """Complete graph: W = 1/n everywhere, one gossip step reaches the exact average.

    Degree n - 1, n - 1 edge classes (the cyclic shifts); spectral gap 1.

    Example:
      >>> complete(2).mixing_matrix()
      array([[0.5, 0.5],
             [0.5, 0.5]])
    """
    n = _check_count(n, "n", "complete")
    return Topology(f"complete({n})", n, False, (_shift_round((n,), [(k,) for k in range(1, n)]),))


def one_peer_exponential(n: int) -> Topology:
    """Time-varying one-peer exponential graph: at step t node i sends only to i + 2^(t mod P).

    P = ceil(log2 n) rounds; round t has W_ii = 1/2 and W_{i + 2^t, i} = 1/2
    (row and column stochastic, degree 1, one edge class). For n a power of
    two the product over a period is exactly the average (1/n) 1 1^T. n = 1
    gives one empty round.

    Example:
      >>> [one_peer_exponential(8).out_neighbors(0, step=t) for t in range(4)]
      [(1,), (2,), (4,), (1,)]
    """
    n = _check_count(n, "n", "one_peer_exponential")
    rounds = tuple(_shift_round((n,), [(1 << t,)]) for t in range(max((n - 1).bit_length(), 1)))
    return Topology(f"one_peer_exponential({n})", n, True, rounds)


def random_matching(n: int, seed: int, period: int = 16) -> Topology:
    """Time-varying pairwise gossip, the synchronous stand-in for AD-PSGD's W_k.

    Each of the `period` rounds pairs the nodes by a random perfect matching
    (one node idles when n is odd); matched nodes average, W = 1/2 on a pair
    and W_ii = 1 for the idle node: symmetric and doubly stochastic, degree 1,
    one edge class. The schedule is a deterministic function of `seed`, and is
    redrawn (deterministically) until the union of its rounds is connected.

    Example:
      >>> random_matching(6, seed=1) == random_matching(6, seed=1)
      True
    """
    n = _check_count(n, "n", "random_matching")
    period = _check_count(period, "period", "random_matching")
    if n >= 3 and period < 2:
        raise ValueError(f"random_matching: one matching cannot connect {n} nodes; use period >= 2")
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        rounds = []
        for _ in range(period):
            order = rng.permutation(n)
            pairs = order[: n - n % 2].reshape(-1, 2)
            diagonal = np.ones(n)
            diagonal[pairs.ravel()] = 0.5
            perm = [(a, b) for a, b in pairs] + [(b, a) for a, b in pairs]
            edges = (EdgeClass(tuple(perm), tuple(1.0 - diagonal)),) if len(perm) else ()
            rounds.append(Round(tuple(diagonal), edges))
        if _unreachable(n, [e for r in rounds for e in r.edges]) is None:
            name = f"random_matching({n}, seed={seed}, period={period})"
            return Topology(name, n, False, tuple(rounds))
    raise ValueError(f"random_matching: no connected schedule of {period} rounds; raise period")


def from_matrix(
    w: np.ndarray | Sequence[np.ndarray], *, name: str = "from_matrix", directed: bool | None = None
) -> Topology:
    """A topology from any non-negative mixing matrix, or a schedule of them.

    W[i, j] >= 0 is the weight node i gives node j's value (rows are
    receivers). The off-diagonal support of each round is split into as few
    edge classes as possible: exactly the round's maximum in- or out-degree
    (König's edge-colouring theorem). W need not be stochastic; check what an
    algorithm needs with `validate`.

    Args:
      w: [n, n], or [P, n, n] (or a list of [n, n]) for a time-varying
        schedule used round t mod P at step t.
      name: how the topology prints and is named in errors.
      directed: whether the graph is directed; None infers it: undirected when
        every round's support (not its weights) is symmetric.

    Example:
      >>> from_matrix([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]]).degree
      1
    """
    try:
        mats = np.asarray(w, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"topology {name}: W must be a numeric [n, n] or [P, n, n] array"
        ) from error
    if mats.ndim == 2:
        mats = mats[None]
    if mats.ndim != 3 or mats.shape[1] != mats.shape[2] or 0 in mats.shape:
        raise ValueError(
            f"topology {name}: W must be a non-empty square [n, n] matrix or a [P, n, n] "
            f"schedule; got shape {np.shape(w)}"
        )
    for label, bad in (("NaN or Inf", ~np.isfinite(mats)), ("negative", mats < 0)):
        if bad.any():
            t, i, j = np.argwhere(bad)[0]
            where = f"round {t}, " if len(mats) > 1 else ""
            raise ValueError(
                f"topology {name}: W has {label} entries, e.g. {where}W[{i}, {j}] = {mats[t, i, j]}"
            )
    if directed is None:
        support = mats > 0
        directed = not np.array_equal(support, support.transpose(0, 2, 1))
    return Topology(name, mats.shape[1], directed, tuple(_dense_round(m) for m in mats))


def _dense_round(w: np.ndarray) -> Round:
    n = len(w)
    receivers, senders = np.nonzero((w > 0) & ~np.eye(n, dtype=bool))
    edges = list(zip(senders.tolist(), receivers.tolist(), strict=True))
    colours = _edge_coloring.bipartite_edge_coloring(edges, n, n)
    classes = []
    for c in range(colours.max(initial=-1) + 1):
        perm = [edge for edge, colour in zip(edges, colours, strict=True) if colour == c]
        weights = np.zeros(n)
        for s, d in perm:
            weights[d] = w[d, s]
        classes.append(EdgeClass(tuple(perm), tuple(weights)))
    return Round(tuple(np.diag(w)), tuple(classes))
