import pytest
import torch

from decoding.tree import (
    ANCHOR, TreeLayout, attention_rows, fork_k_config, k_config_parents, layout_from_k_config,
    parse_k_config,
)


def test_k_config_parents_hand_drawn():
    # [2, 2]:      anchor
    #            /        \
    #           0          1
    #          / \        / \
    #         2   3      4   5
    assert k_config_parents("2,2") == (ANCHOR, ANCHOR, 0, 0, 1, 1)
    # [2, 1, 2]: two chains that fork at the third level
    assert k_config_parents([2, 1, 2]) == (-1, -1, 0, 1, 2, 2, 3, 3)


def test_tree_sizes_are_sums_of_cumulative_products():
    assert layout_from_k_config("4,2,2,1").size == 4 + 8 + 16 + 16
    assert layout_from_k_config(fork_k_config(3, 4)).size == 12


def test_mask_positions_retrieve_hand_drawn():
    lay = layout_from_k_config("2,2")
    expected = torch.tensor([
        # 0  1  2  3  4  5
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 1, 0, 0, 1, 0],
        [0, 1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(lay.mask, expected)
    assert lay.depth_ids.tolist() == [1, 1, 2, 2, 2, 2]
    assert lay.retrieve_indices.tolist() == [[0, 2], [0, 3], [1, 4], [1, 5]]
    assert lay.children[0] == (0, 1) and lay.children[1] == (2, 3) and lay.children[3] == ()
    assert lay.level_ends == (0, 2, 6)
    assert lay.path_to(5) == [1, 5]


def test_fork_tree_chains():
    lay = layout_from_k_config(fork_k_config(2, 3))
    # 0 1 | 2 3 | 4 5 : node 4 continues 2 which continues 0
    assert lay.parents == (-1, -1, 0, 1, 2, 3)
    assert lay.retrieve_indices.tolist() == [[0, 2, 4], [1, 3, 5]]
    assert lay.mask[4].tolist() == [True, False, True, False, True, False]


def test_slices_are_top_left_blocks():
    lay = layout_from_k_config("4,2,2,1")
    for d in range(lay.max_depth + 1):
        s = lay.sliced(d)
        n = lay.level_ends[d]
        assert s.size == n and s.max_depth == d
        assert torch.equal(s.mask, lay.mask[:n, :n])
        assert torch.equal(s.depth_ids, lay.depth_ids[:n])
    assert lay.sliced(2) is lay.sliced(2)  # cached


def test_attention_rows_pending_and_tree():
    lay = layout_from_k_config("2,1")  # 0 1 | 2 3
    m = attention_rows(past=3, pending=2, tree_mask=lay.mask, start=0, end=4)
    assert m.shape == (6, 3 + 2 + 4)
    assert m[:, :3].all()  # the committed past is visible to all
    assert m[0, 3:].tolist() == [True, False, False, False, False, False]  # causal pending
    assert m[1, 3:5].tolist() == [True, True] and not m[1, 5:].any()
    assert m[2:, 3:5].all()  # tree nodes see the pending tokens
    assert m[4, 5:].tolist() == [True, False, True, False]  # node 2 sees 0 and itself
    # a later draft call feeds only level 2, with level 1 already in the cache
    m2 = attention_rows(past=5, pending=0, tree_mask=lay.mask, start=2, end=4)
    assert m2.shape == (2, 9)
    assert m2[1, 5:].tolist() == [False, True, False, True]


@pytest.mark.parametrize("bad", ["", "4,0", "a,b", "-1"])
def test_bad_k_config(bad):
    with pytest.raises(ValueError, match="k-config"):
        parse_k_config(bad)


def test_parents_must_be_bfs():
    with pytest.raises(ValueError):
        TreeLayout((-1, 2, 0))
