"""The pipeline schedule against an independent oracle: every (chunk, micro-batch) forward, input
backward and weight backward exactly once per rank; every dependency satisfied when all ranks are
simulated together (a transfer batch completes only once each of its sends and receives is matched,
in order, by the peer); DualPipeV's order equal to torch.distributed.pipelining's; the layer split;
misconfigurations refused with the numbers."""

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pith_engine.schedule import (
    COSTS,
    P2P,
    Action,
    Op,
    Overlap,
    _simulate,
    check,
    dualpipev,
    forward_schedule,
    rank_chunks,
    schedule,
    split_layers,
    timeline,
)

pp_and_micro = st.integers(1, 7).flatmap(lambda pp: st.tuples(st.just(pp), st.integers(2 * pp, 3 * pp + 5)))


def _rank_of(chunk: int, pp: int) -> int:
    return chunk if chunk < pp else 2 * pp - 1 - chunk  # the V, written out again


def _compute(lst):
    for item in lst:
        if isinstance(item, Overlap):
            yield from item
        elif isinstance(item, Action):
            yield item


@given(pp_and_micro)
def test_every_chunk_and_micro_batch_runs_forward_input_and_weight_backward_once(case):
    pp, M = case
    for rank in range(pp):
        chunks = [0] if pp == 1 else [rank, 2 * pp - 1 - rank]
        seen = {"F": [], "input": [], "weight": []}
        for op, c, m in _compute(schedule(pp, rank, M)):
            if op is Op.F:
                seen["F"].append((c, m))
            if op in (Op.B, Op.I):
                seen["input"].append((c, m))
            if op in (Op.B, Op.W):
                seen["weight"].append((c, m))
        want = sorted((c, m) for c in chunks for m in range(M))
        for kind, got in seen.items():
            assert sorted(got) == want, (pp, rank, M, kind)


def simulate(lists: list[list], pp: int, backward: bool = True) -> list[int]:
    """Run every rank's list together; assert each action finds its inputs and each transfer pairs up
    with the peer's in order. Returns each rank's peak number of live forward activations."""
    last = 2 * pp - 1 if pp > 1 else 0
    done = [set() for _ in lists]  # (op, chunk, micro) computed or received on that rank
    posted = {}  # (src, dst) -> [(key, kind)] in posting order, one list per direction and kind
    matched = {}
    pos = [0] * len(lists)
    live, peak = [0] * len(lists), [0] * len(lists)

    def ready(r, op, c, m):
        if op is Op.F:
            return c == 0 or ("F", c - 1, m) in done[r]
        if op in (Op.B, Op.I):
            return ("F", c, m) in done[r] and (c == last or ("B", c + 1, m) in done[r])
        return ("I", c, m) in done[r]

    while any(p < len(lst) for p, lst in zip(pos, lists)):
        progressed = False
        for r, lst in enumerate(lists):
            if pos[r] >= len(lst):
                continue
            item = lst[pos[r]]
            if isinstance(item, P2P):
                end = pos[r]
                while end < len(lst) and isinstance(lst[end], P2P):
                    end += 1
                batch = lst[pos[r] : end]
                for t in batch:  # post each op once
                    key = (t.op.value, t.chunk, t.micro)
                    if t.send:
                        assert _rank_of(t.chunk, pp) == r, t
                        assert key in done[r], f"rank {r} sends {t} before computing it"
                    pair = (r, t.peer) if t.send else (t.peer, r)
                    side = posted.setdefault((pair, t.send), [])
                    if (id(t), r) not in matched:
                        matched[(id(t), r)] = len(side)
                        side.append(key)
                        progressed = True
                complete = True
                for t in batch:
                    pair = (r, t.peer) if t.send else (t.peer, r)
                    other = posted.get((pair, not t.send), [])
                    i = matched[(id(t), r)]
                    if i >= len(other):
                        complete = False
                    else:
                        assert other[i] == posted[(pair, t.send)][i], f"transfer {i} of {pair} pairs two keys"
                if not complete:
                    continue
                for t in batch:
                    if not t.send:
                        done[r].add((t.op.value, t.chunk, t.micro))
                pos[r] = end
            else:
                parts = item if isinstance(item, Overlap) else (item,)
                for op, c, m in parts:
                    assert _rank_of(c, pp) == r if pp > 1 else c == 0, (r, item)
                    assert ready(r, op, c, m), f"rank {r}: {item} before its inputs"
                    done[r].add((op.value, c, m))
                    if op in (Op.B, Op.I):
                        done[r].add(("B", c, m))
                    live[r] += {Op.F: 1, Op.B: -1, Op.I: -1, Op.W: 0}[op]
                peak[r] = max(peak[r], live[r])
                pos[r] += 1
            progressed = True
        assert progressed, f"deadlock at positions {pos}"
    if backward:
        assert live == [0] * len(lists)
    return peak


@given(pp_and_micro)
def test_all_ranks_simulated_together_meet_every_dependency_and_hold_2pp_activations(case):
    pp, M = case
    peak = simulate([schedule(pp, r, M) for r in range(pp)], pp)
    # 2pp chunks' activations (one micro-batch through every layer) on each rank, counting an
    # overlapped pair's forward and backward at once; the last rank runs its first pair F then B: +1.
    assert peak == ([2 * pp] * (pp - 1) + [2 * pp + 1] if pp > 1 else [1]), peak
    simulate([forward_schedule(pp, r, M) for r in range(pp)], pp, backward=False)


@given(st.integers(1, 7), st.integers(1, 24))
def test_the_forward_schedule_meets_every_dependency_and_pipelines_the_micro_batches(pp, M):
    """Evaluation's schedule: each rank's forwards once each; every dependency met with all ranks
    simulated together; its span 2M + 2pp - 2 forward times (the middle rank busy throughout after the
    V's fill, until its drain), below the serial order's 2pp*M (each micro-batch down the V and back up
    before the next) for M > 1."""
    lists = [forward_schedule(pp, r, M) for r in range(pp)]
    simulate(lists, pp, backward=False)
    compute = [[a for a in lst if isinstance(a, Action)] for lst in lists]
    for r, row in enumerate(compute):
        assert sorted(row) == sorted(Action(Op.F, c, m) for c in rank_chunks(pp, r) for m in range(M))
    serial = [[Action(Op.F, c, m) for m in range(M) for c in rank_chunks(pp, r)] for r in range(pp)]
    span = lambda lists: max(times[-1][1] for times in _simulate(pp, lists, COSTS))
    assert span(serial) == (2 * pp * M if pp > 1 else M)
    assert span(compute) == (2 * M + 2 * pp - 2 if pp > 1 else M)
    assert span(compute) < span(serial) or M == 1 or pp == 1


@pytest.mark.parametrize(
    "break_it, words",
    [
        (lambda lists: lists[0].remove(P2P(True, Op.F, 0, 3, 1)), "pairs two keys"),  # a send lost
        (
            lambda lists: lists[0].remove([a for a in lists[0] if isinstance(a, P2P) and a.send][-1]),
            "deadlock",
        ),
        (lambda lists: lists[1].insert(0, lists[1].pop(1)), "before its inputs"),  # F before its receive
    ],
)
def test_the_oracle_catches_a_broken_schedule(break_it, words):
    lists = [schedule(2, r, 4) for r in range(2)]
    simulate(lists, 2)
    break_it(lists)
    with pytest.raises(AssertionError, match=words):
        simulate(lists, 2)


@pytest.mark.parametrize("pp", [2, 3, 4, 5])
def test_dualpipev_order_is_torchs_schedule_dualpipev(pp):
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    T = schedules._ComputationType
    ops = {T.FORWARD: Op.F, T.FULL_BACKWARD: Op.B, T.BACKWARD_INPUT: Op.I, T.BACKWARD_WEIGHT: Op.W}

    def ours(a):
        if a.computation_type == T.OVERLAP_F_B:
            return Overlap(*(ours(s) for s in a.sub_actions))
        return Action(ops[a.computation_type], a.stage_index, a.microbatch_index)

    for M in range(2 * pp, 3 * pp + 4):
        for rank in range(pp):
            # The per-rank order is computed on a plain object: building the schedule needs real stages.
            state = SimpleNamespace(pp_group_size=pp, _n_microbatches=M)
            theirs = schedules.ScheduleDualPipeV._calculate_single_rank_operations(state, rank)
            assert [ours(a) for a in theirs] == dualpipev(pp, rank, M), (pp, M, rank)
            assert list(_compute(schedule(pp, rank, M))) == list(_compute(dualpipev(pp, rank, M)))


@given(pp_and_micro.filter(lambda c: c[0] > 1), st.sampled_from([(1, 2, 0), (1, 2, 1), (1.3, 2.1, 0.7)]))
def test_bubble_is_pp_minus_1_times_f_plus_2b_minus_3w_within_one_forward(case, fbw):
    pp, M = case
    F, B, W = fbw
    rows = timeline(pp, M, {Op.F: F, Op.B: B, Op.I: B - W, Op.W: W})
    span = max(row[-1][1] for row in rows)
    formula = (pp - 1) * (F + 2 * B - 3 * W)
    for row in rows:
        busy = sum(end - start for start, end, _ in row)
        assert busy == pytest.approx(2 * M * (F + B))
        assert formula - F - 1e-9 <= span - busy <= formula + 1e-9, (pp, M, span - busy, formula)
    assert timeline(pp, M) == timeline(pp, M, COSTS)


@given(st.integers(1, 64), st.integers(1, 8))
def test_layers_split_into_consecutive_even_chunks_extras_nearest_the_middle(layers, pp):
    C = 1 if pp == 1 else 2 * pp
    if layers < C:
        with pytest.raises(ValueError, match=f"{layers} layers cannot fill"):
            split_layers(layers, pp)
        return
    chunks = split_layers(layers, pp)
    assert [i for ch in chunks for i in ch] == list(range(layers))
    sizes = [len(ch) for ch in chunks]
    assert max(sizes) - min(sizes) <= 1
    big = [c for c in range(C) if sizes[c] > min(sizes)]
    distance = lambda c: abs(2 * c + 1 - C)  # half-chunks from the middle of the V
    small = set(range(C)) - set(big)
    assert all(distance(b) <= distance(s) for b in big for s in small), sizes


def test_bad_pipeline_settings_stop_with_the_numbers():
    with pytest.raises(ValueError, match="at least 2\\*pp = 8 micro-batches per step, got 7"):
        check(4, 7)
    with pytest.raises(ValueError, match="6 layers cannot fill 2\\*pp = 8 chunks") as e:
        check(4, 7, 6)
    assert "micro-batches" in str(e.value)  # both problems in one message
    with pytest.raises(ValueError, match="got 3"):
        schedule(2, 0, 3)
    check(1, 1, 1)  # pp=1: one chunk, any number of micro-batches
    assert schedule(1, 0, 2) == [
        Action(Op.F, 0, 0),
        Action(Op.B, 0, 0),
        Action(Op.F, 0, 1),
        Action(Op.B, 0, 1),
    ]
