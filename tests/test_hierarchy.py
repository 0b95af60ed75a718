"""Node grouping arithmetic and the two-level cost model of hierarchical allreduce."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kit import first_plan

from ccoll.collectives import model
from ccoll.collectives.node import grouping_of, grouping_of_leaders, rpn_problem


def test_override_groups_consecutive_ranks():
    got = [grouping_of(6, r, 3) for r in range(6)]
    assert [(g.node, g.local) for g in got] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert {(g.nodes, g.ranks_per_node, g.hierarchical) for g in got} == {(2, 3, True)}
    assert not grouping_of(3, 0, 3).hierarchical  # one node: flat
    assert not grouping_of(3, 2, 1).hierarchical  # one rank per node: flat


@pytest.mark.parametrize("bad", [0, -1, 4, 5, 1.0, "2", True])
def test_bad_ranks_per_node_is_named_with_the_fix(bad):
    msg = rpn_problem(bad, 6)
    assert msg is not None and "ranks_per_node" in msg
    assert rpn_problem(None, 6) is None and rpn_problem(2, 6) is None


def test_leaders_give_nodes_in_order_of_their_lowest_rank():
    # Ranks 0, 2, 4 share node "0", ranks 1, 3, 5 node "1" (interleaved placement).
    leaders = [0, 1, 0, 1, 0, 1]
    g = [grouping_of_leaders(leaders, r, "shared memory") for r in range(6)]
    assert [(x.node, x.local) for x in g] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert g[0].nodes == 2 and g[0].ranks_per_node == 3 and g[0].hierarchical


def test_nodes_of_different_sizes_stay_flat():
    g = grouping_of_leaders([0, 0, 0, 3], 3, "shared memory")
    assert (g.nodes, g.ranks_per_node, g.hierarchical) == (2, 0, False)


SLOW = replace(model.DEFAULTS, beta=1.25e8)  # 1 Gbit/s per node


def test_two_level_prediction_shares_the_node_link():
    # Raw two-level = the node's exact phases + a raw ring of S/R on K ranks at beta/R.
    size, k, r = 64 << 20, 4, 8
    pred = model.predict(size, k * r, SLOW, 10.0, hier=(k, r))
    intra = 2 * (r - 1) / r * size / SLOW.shm + (r - 1) / r * size / SLOW.reduce
    ring = model.predict_raw(size / r, k, replace(SLOW, beta=SLOW.beta / r))
    assert pred.raw == pytest.approx(intra + ring, rel=1e-12)
    assert pred.ranks == k * r
    # Not hierarchical (one node, one rank per node, other collectives): the flat model.
    for hier, coll in [((1, 8), "allreduce"), ((8, 1), "allreduce"), ((4, 8), "allgather")]:
        flat = model.predict(size, 8 if hier != (4, 8) else 32, SLOW, 10.0, collective=coll)
        assert model.predict(size, flat.ranks, SLOW, 10.0, collective=coll, hier=hier) == flat


def test_model_chooses_between_raw_and_compressed_two_level():
    size, k, r = 64 << 20, 2, 2
    slow = first_plan(size // 4, 4, k * r, SLOW, 20.0, 3.0, hier=(k, r))
    assert slow.compress  # 1 Gbit/s: compressing the node sums pays
    fast = first_plan(size // 4, 4, k * r, replace(SLOW, beta=1e12), 20.0, 3.0, hier=(k, r))
    assert not fast.compress  # a link faster than the compressor: raw
    # The chunk is of a ring block of one local rank's share: count / (R K) elements.
    share = -(-(size // 4) // r)
    assert slow.two_level and slow.chunk_elems == model.chunk_elems_for(
        share, 4, k, SLOW, 20.0, width=3.0)


def test_two_level_beats_flat_ring_on_a_shared_link():
    # With R ranks sharing one NIC the flat ring's per-rank link is beta/R too; the
    # hierarchical ring moves S/R per rank over K ranks instead of S over K R ranks.
    size, k, r = 64 << 20, 2, 4
    shared = replace(SLOW, beta=SLOW.beta / r)
    flat = model.predict(size, k * r, shared, 20.0)
    hier = model.predict(size, k * r, SLOW, 20.0, hier=(k, r))
    assert hier.homomorphic < flat.homomorphic


def test_model_picks_the_flat_ring_when_the_node_phases_cost_more():
    # Slow node phases (shared memory at 0.1 GB/s): the flat ring is predicted faster, so
    # the plan is the flat ring's, with the flat ring's chunk of a block of count / N.
    size, k, r = 64 << 20, 2, 2
    count = size // 4
    slow_node = replace(SLOW, shm=1e8)
    flat = model.predict(size, k * r, slow_node, 20.0, width=3.0)
    two = model.predict(size, k * r, slow_node, 20.0, hier=(k, r), width=3.0)
    assert flat.homomorphic < two.homomorphic
    d = first_plan(count, 4, k * r, slow_node, 20.0, 3.0, hier=(k, r), split=0.0)
    assert d.compress and not d.two_level
    assert d.chunk_elems == model.chunk_elems_for(count, 4, k * r, slow_node, 20.0, width=3.0)
    assert "two levels" not in d.reason
    # The default node phases: two levels are faster and chosen, and the reason says so.
    # Raw is priced as what a raw call runs: MPI_Allreduce over all ranks, flat.
    d2 = first_plan(count, 4, k * r, SLOW, 20.0, 3.0, hier=(k, r), split=0.0)
    assert d2.compress and d2.two_level
    assert d2.predicted_raw == pytest.approx(model.predict(size, k * r, SLOW, 1.0).raw)
    assert "in two levels" in d2.reason


def test_plan_is_flat_without_a_hierarchy():
    size = 64 << 20
    for hier in (None, (1, 4), (4, 1)):
        d = first_plan(size // 4, 4, 4, SLOW, 20.0, 3.0, hier=hier)
        assert d.compress and not d.two_level
