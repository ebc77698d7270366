"""The ext-TSP search in C (tools/relayout/ext_tsp.c) gives the order the Python
search gives (block_order._python_order), on random graphs with and without many
ties, entries other than node 0, both cut limits and explicit counts; relayout
outputs stay byte-identical (checked on lua, zstd and SQLite by the bench; here
the order itself)."""

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_block_order import _graph_with_ties, _random_graph   # noqa: E402

from linepack.relayout.block_order import _native_lib, ext_tsp_order   # noqa: E402


def test_native_core_builds():
    assert _native_lib() is not None      # gcc is a test requirement of the suite


def test_native_order_is_the_python_order():
    rng = random.Random(2211)
    for trial in range(600):
        n = rng.choice((rng.randint(2, 60), rng.randint(2, 300)))
        sizes, edges = (_graph_with_ties(rng, n) if trial % 2 else
                        _random_graph(rng, n, fanout=rng.randint(1, 3)))
        entry = rng.randrange(n) if trial % 3 == 0 else 0
        split_max = rng.choice((4, 128))
        counts = [rng.random() * 10 for _ in range(n)] if trial % 4 == 0 else None
        got = ext_tsp_order(sizes, edges, counts, entry=entry, split_max=split_max)
        want = ext_tsp_order(sizes, edges, counts, entry=entry, split_max=split_max,
                             native=False)
        assert got == want, (trial, n)
        assert sorted(got) == list(range(n)) and got[0] == entry


def test_no_edges_and_single_node():
    assert ext_tsp_order([5], []) == [0]
    assert ext_tsp_order([5, 6, 7], [], entry=1) == \
        ext_tsp_order([5, 6, 7], [], entry=1, native=False)
