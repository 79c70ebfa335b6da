"""The device round's acceptance rules (decoding.round.accept) on closed-form cases: a draft never,
always and sometimes accepted, on fixed trees, and the same verdicts as decoding.acceptance."""

import torch

from decoding import acceptance as host
from decoding.round import accept
from decoding.round.shape import RoundShape

V = 5


def one_hot(x, v=V):
    return torch.nn.functional.one_hot(torch.tensor(x), v).float()


def test_shape_rows_parents_and_levels():
    sh = RoundShape((2, 1, 1))
    assert sh.rows == 7 and sh.parents == (0, 0, 0, 1, 2, 3, 4) and sh.depths == (0, 1, 1, 2, 2, 3, 3)
    assert sh.levels == ((1, 3), (3, 5), (5, 7))
    st = sh.tensors("cpu")
    assert st.ancestors[5].nonzero().flatten().tolist() == [0, 1, 3, 5]
    assert st.first_child.tolist() == [1, 3, 4, 5, 6, 0, 0]
    assert RoundShape(()).rows == 1


def test_greedy_walk_accepts_the_matching_branch():
    sh = RoundShape((2, 1))  # rows: 0 pending; 1, 2 level 1; 3 under 1, 4 under 2
    st = sh.tensors("cpu")
    tokens = torch.tensor([9, 3, 4, 1, 2])
    argmax_p = torch.tensor([4, 0, 2, 0, 3])  # row 0 wants 4 (row 2), row 2 wants 2 (row 4), row 4 wants 3
    n, path, bonus = accept.greedy_walk(tokens, argmax_p, st, sh.depth)
    assert (int(n), path.tolist(), int(bonus)) == (2, [2, 4], 3)
    never = torch.tensor([1, 0, 0, 0, 0])  # no child of row 0 is 1
    n, path, bonus = accept.greedy_walk(tokens, never, st, sh.depth)
    assert (int(n), path.tolist(), int(bonus)) == (0, [0, 0], 1)


def test_greedy_walk_equals_the_host_walk_on_random_trees():
    g = torch.Generator().manual_seed(0)
    sh = RoundShape((3, 2, 1))
    st = sh.tensors("cpu")
    children = [[r - 1 for r in range(1, sh.rows) if sh.parents[r] == row] for row in range(sh.rows)]
    for _ in range(200):
        tokens = torch.cat((torch.zeros(1, dtype=torch.long), torch.randint(0, 3, (sh.rows - 1,), generator=g)))
        for row in range(sh.rows):  # siblings differ, as top-k or a draw without replacement gives
            kids = [c + 1 for c in children[row]]
            if kids:
                tokens[kids] = torch.randperm(3, generator=g)[:len(kids)]
        am = torch.randint(0, 3, (sh.rows,), generator=g)
        n, path, bonus = accept.greedy_walk(tokens, am, st, sh.depth)
        w = host.walk_greedy(children, tokens[1:].tolist(), am.tolist())
        assert path.tolist()[:int(n)] == [i + 1 for i in w.path] and int(bonus) == w.next_token


def _walk(p_rows, q_rows, tokens, ks, u, seed=0):
    sh = RoundShape(ks)
    e = torch.empty(V).exponential_(generator=torch.Generator().manual_seed(seed))
    valid = torch.ones(sh.rows, dtype=torch.bool)
    return accept.sampling_walk(p_rows, q_rows, torch.tensor(tokens), valid, sh.tensors("cpu"), ks, u, e)


def test_a_draft_equal_to_the_target_is_always_accepted():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    rows = p.expand(3, V).clone()
    for u in (0.0, 0.5, 0.999):
        n, path, _ = _walk(rows, rows, [0, 3, 2], (1, 1), torch.full((2, 1), u))
        assert int(n) == 2 and path.tolist() == [1, 2]


def test_a_draft_the_target_never_writes_is_never_accepted_and_the_residual_is_p():
    p = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0])
    q = one_hot(4)  # all its mass where p has none
    counts = torch.zeros(V)
    for seed in range(2000):
        n, _, tok = _walk(torch.stack([p, p]), torch.stack([q, q]), [0, 4], (1,), torch.zeros(1, 1), seed)
        assert int(n) == 0
        counts[int(tok)] += 1
    assert counts[2:].sum() == 0 and abs(counts[0] / 2000 - 0.5) < 0.05


def test_sometimes_accepted_with_probability_p_over_q():
    p = torch.tensor([0.3, 0.7, 0.0, 0.0, 0.0])
    q = torch.tensor([0.6, 0.4, 0.0, 0.0, 0.0])
    rows_p, rows_q = torch.stack([p, p]), torch.stack([q, q])
    # token 0: p/q = 0.5 -> accepted iff u < 0.5; on reject the residual is norm(max(0, p - q)) = token 1
    n, _, _ = _walk(rows_p, rows_q, [0, 0], (1,), torch.tensor([[0.49]]))
    assert int(n) == 1
    for seed in range(20):
        n, _, tok = _walk(rows_p, rows_q, [0, 0], (1,), torch.tensor([[0.51]]), seed)
        assert int(n) == 0 and int(tok) == 1


def test_second_candidate_is_tried_against_the_residual_as_the_host_rule():
    p = torch.tensor([0.1, 0.6, 0.3, 0.0, 0.0])
    q = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0])
    rows_p, rows_q = torch.stack([p, p, p]), torch.stack([q, q, q])
    for u1 in (0.1, 0.5, 0.9):
        for u2 in (0.05, 0.5, 0.95):
            idx, _ = host.multi_candidate(p, q, [0, 1], [u1, u2], replacement=False)
            n, path, _ = _walk(rows_p, rows_q, [0, 0, 1], (2,), torch.tensor([[u1, u2]]))
            assert (int(n), int(path[0]) if int(n) else None) == ((1, idx + 1) if idx is not None else (0, None))
