"""König edge colouring of bipartite graphs: how `topology.from_matrix` finds its edge classes.

A gossip round sends one `lax.ppermute` per edge class, and a ppermute may use
each node at most once as a source and at most once as a destination. An edge
class is therefore a matching of the bipartite graph whose left side holds the
senders, whose right side holds the receivers, and whose edges are j -> i for
every W_ij > 0 (i != j). König's edge-colouring theorem says such a graph of
maximum degree D splits into exactly D matchings, and no fewer can do, since a
node of degree D needs D distinct ones. `bipartite_edge_coloring` finds such a
split by recolouring alternating paths (Kempe chains), in O(|E| (D + n)) time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def bipartite_edge_coloring(
    edges: Sequence[tuple[int, int]], num_left: int, num_right: int
) -> np.ndarray:
    """Colours bipartite edges with D colours, D the maximum degree, no two alike at a node.

    Args:
      edges: (left, right) pairs with 0 <= left < num_left and 0 <= right < num_right.
        Parallel edges are allowed (each gets its own colour).
      num_left: number of left nodes.
      num_right: number of right nodes.

    Returns:
      int64[len(edges)] colours in [0, D): edges that share a left node or a right
      node have different colours, and every colour in [0, D) is used.

    Example:
      >>> bipartite_edge_coloring([(0, 1), (1, 0), (0, 0)], 2, 2).tolist()
      [0, 0, 1]
    """
    ends = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    colour = np.full(len(ends), -1, dtype=np.int64)
    if len(ends) == 0:
        return colour
    left, right = ends[:, 0], ends[:, 1]
    degree = max(
        np.bincount(left, minlength=num_left).max(), np.bincount(right, minlength=num_right).max()
    )
    # at_left[u, c] / at_right[v, c]: the edge of colour c at that node, or -1.
    at_left = np.full((num_left, degree), -1, dtype=np.int64)
    at_right = np.full((num_right, degree), -1, dtype=np.int64)

    def paint(e: int, c: int) -> None:
        colour[e] = c
        at_left[left[e], c] = e
        at_right[right[e], c] = e

    for e in range(len(ends)):
        u, v = left[e], right[e]
        # Both ends have fewer than D coloured edges, so each has a free colour.
        a = int(np.flatnonzero(at_left[u] < 0)[0])
        b = int(np.flatnonzero(at_right[v] < 0)[0])
        if at_right[v, a] >= 0:
            # a is taken at v: swap a and b along the a/b path that starts at v.
            # The path enters left nodes through a-edges only, and a is free at
            # u, so it never reaches u; afterwards a is free at both u and v.
            path = []
            node, on_right, c = v, True, a
            while (e_next := (at_right if on_right else at_left)[node, c]) >= 0:
                path.append(int(e_next))
                node = left[e_next] if on_right else right[e_next]
                on_right, c = not on_right, (b if c == a else a)
            for p in path:
                at_left[left[p], colour[p]] = -1
                at_right[right[p], colour[p]] = -1
            for p in path:
                paint(p, b if colour[p] == a else a)
        paint(e, a)
    return colour
