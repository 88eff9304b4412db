"""The pipeline schedule as data: for (pp, rank, micro-batches), the ordered list of what the rank runs.

Placement (the V). 2*pp chunks of consecutive layers; rank r holds chunks r and 2pp-1-r, so the
embedding's and the loss's chunks are both on rank 0. Under pp=1 one chunk: the whole model.

DualPipeV (DeepSeek-V3's DualPipe "cut in half"; torch.distributed.pipelining.ScheduleDualPipeV runs
the same order), for rank r of n with chunks a = r (down the V) and b = 2n-1-r (back up) and M >= 2n
micro-batches, in eight phases:
  1. 2(n-r-1) x F(a)                      warm-up: fill the down leg
  2. (r+1)    x F(a) F(b)
  3. (n-r-1)  x I(b) W F(b)               zero-bubble: split backward, its weight work at once
  4. (M-2n+r+1) x [F(a)+B(b)] [F(b)+B(a)] steady state: overlapped forward+backward pairs (on the
                                          last rank the first pair runs unoverlapped, F(a) then B(b))
  5. (n-r-1)  x B(b) [F(b)+B(a)]
  6. (r+1)    x B(b) B(a)                 cool-down; from the middle on (r odd: before B(b), r even:
                                          after it) the backward splits into I, its W left queued
  7. (n-r-1)  x W B(a)                    the queued weight work fills the bubbles
  8. (r+1)    x W
([F+B]: one overlapped action; Op says the rest.) Transfers are explicit entries (P2P); the tests
simulate every rank: sends and receives pair up in order, no rank waits forever.
"""

import enum
from typing import NamedTuple


class Op(enum.Enum):
    F = "F"
    B = "B"  # input gradients, then weight gradients
    I = "I"  # input gradients; the weight-gradient work waits for a W
    W = "W"


class Action(NamedTuple):
    op: Op
    chunk: int  # 0 .. 2pp-1 (0 under pp=1)
    micro: int


class Overlap(NamedTuple):
    """One action: a forward and a backward of other (chunk, micro-batch)s, interleaved stage by stage."""

    forward: Action
    backward: Action


class P2P(NamedTuple):
    """A transfer between pipeline neighbours, named by what it carries on both ends: the output
    activations of F(chunk, micro) (op F), or the input gradient of its backward (op B)."""

    send: bool
    op: Op  # F or B
    chunk: int
    micro: int
    peer: int


def num_chunks(pp: int) -> int:
    return 1 if pp == 1 else 2 * pp


def chunk_rank(chunk: int, pp: int) -> int:
    """The pipeline rank holding `chunk` (the V: 0, 1, .., pp-1, pp-1, .., 1, 0)."""
    return min(chunk, num_chunks(pp) - 1 - chunk)


def rank_chunks(pp: int, rank: int) -> tuple[int, ...]:
    return (0,) if pp == 1 else (rank, 2 * pp - 1 - rank)


def split_layers(num_layers: int, pp: int) -> list[range]:
    """Consecutive layers per chunk, as even as the count allows; the chunks nearest the middle of the
    V (without the embedding and the loss) take the extra ones."""
    check(pp, 2 * pp, num_layers)
    C = num_chunks(pp)
    q, rem = divmod(num_layers, C)
    by_middle = sorted(range(C), key=lambda c: (abs(2 * c + 1 - C), c))
    sizes = [q + (c in by_middle[:rem]) for c in range(C)]
    starts = [sum(sizes[:c]) for c in range(C)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


def check(
    pp: int, micro_batches: int, num_layers: int | None = None,
    more: str = "raise train.global_batch or lower train.micro_batch",
) -> None:  # fmt: skip
    problems = []
    if pp > 1 and micro_batches < 2 * pp:
        problems.append(
            f"DualPipeV needs at least 2*pp = {2 * pp} micro-batches per step, got {micro_batches} ({more})"
        )
    if num_layers is not None and num_layers < num_chunks(pp):
        problems.append(
            f"{num_layers} layers cannot fill 2*pp = {num_chunks(pp)} chunks of at least one layer"
            f" (use pp <= {max(1, num_layers // 2)} or more layers)"
        )
    if problems:
        raise ValueError("pipeline: " + "; ".join(problems))


def dualpipev(pp: int, rank: int, micro_batches: int) -> list[Action | Overlap]:
    n, r, M = pp, rank, micro_batches
    a, b = r, 2 * n - 1 - r
    done = {}  # (op, chunk) -> micro-batches issued so far; I and B share one count, B and W another
    queue = []  # (chunk, micro) of input-backwards whose weight work is pending
    out = []

    def take(op: Op, chunk: int) -> Action:
        key = (Op.B if op is Op.I else op, chunk)
        m = done.get(key, 0)
        done[key] = m + 1
        if op is Op.I:
            queue.append((chunk, m))
        return Action(op, chunk, m)

    def weight() -> None:
        if queue:
            out.append(Action(Op.W, *queue.pop(0)))

    out += [take(Op.F, a) for _ in range(2 * (n - r - 1))]
    for _ in range(r + 1):
        out += [take(Op.F, a), take(Op.F, b)]
    for _ in range(n - r - 1):
        out.append(take(Op.I, b))
        weight()
        out.append(take(Op.F, b))
    for i in range(M - 2 * n + r + 1):
        if i == 0 and r == n - 1:  # the bottom of the V: its first pair runs back to back
            out += [take(Op.F, a), take(Op.B, b)]
        else:
            out.append(Overlap(take(Op.F, a), take(Op.B, b)))
        out.append(Overlap(take(Op.F, b), take(Op.B, a)))
    for _ in range(n - r - 1):
        out += [take(Op.B, b), Overlap(take(Op.F, b), take(Op.B, a))]
    split = False
    for i in range(r + 1):
        split |= i == (r + 1) // 2 and r % 2 == 1
        out.append(take(Op.I if split else Op.B, b))
        split |= i == (r + 1) // 2 and r % 2 == 0
        out.append(take(Op.I if split else Op.B, a))
    for _ in range(n - r - 1):
        weight()
        out.append(take(Op.I if split else Op.B, a))
    for _ in range(r + 1):
        weight()
    return out


COSTS = {Op.F: 1.0, Op.B: 2.0, Op.I: 1.0, Op.W: 1.0}  # relative times: a backward is ~two forwards


def _transfers(pp: int, rank: int, op: Op, c: int) -> tuple[int | None, int | None]:
    """For `op` of chunk c on `rank`: (the chunk on another rank whose result it consumes, the other
    rank its result goes to), None where that stays here (or, for W, there is none)."""
    last = num_chunks(pp) - 1
    src = c - 1 if op is Op.F else c + 1  # F consumes the previous chunk's output, B the next one's grad
    dst = c + 1 if op is Op.F else c - 1
    remote = lambda chunk: op is not Op.W and 0 <= chunk <= last and chunk_rank(chunk, pp) != rank
    return (src if remote(src) else None), (chunk_rank(dst, pp) if remote(dst) else None)


def _parts(item: Action | Overlap) -> tuple[Action, ...]:
    return tuple(item) if isinstance(item, Overlap) else (item,)


def _simulate(pp: int, lists: list[list[Action | Overlap]], costs) -> list[list[tuple[float, float]]]:
    """(start, end) of every compute action; transfers take no time."""
    ready = {}  # (F or B, chunk, micro) -> when its result exists
    pos, clock = [0] * pp, [0.0] * pp
    times = [[] for _ in range(pp)]
    while any(p < len(lst) for p, lst in zip(pos, lists)):
        progressed = False
        for r, lst in enumerate(lists):
            while pos[r] < len(lst):
                parts = _parts(lst[pos[r]])
                needs = [(Op.F if op is Op.F else Op.B, _transfers(pp, r, op, c)[0], m) for op, c, m in parts]
                keys = [k for k in needs if k[1] is not None]
                if any(k not in ready for k in keys):
                    break
                start = max([clock[r], *(ready[k] for k in keys)])
                clock[r] = start + sum(costs[p.op] for p in parts)
                for op, c, m in parts:
                    if op is not Op.W:
                        ready[(Op.F if op is Op.F else Op.B, c, m)] = clock[r]
                times[r].append((start, clock[r]))
                pos[r] += 1
                progressed = True
        assert progressed, f"pipeline schedule deadlocks at {pos}"
    return times


def _with_p2p(pp: int, lists: list[list[Action | Overlap]], rank: int) -> list[Action | Overlap | P2P]:
    """`rank`'s list with its transfers: each send right after its action, each receive where the
    neighbour sends it in the simulated timeline, so receives keep the send order."""
    times = _simulate(pp, lists, COSTS)
    recvs = []  # (sent at, sender's sequence number, transfer) for this rank
    for r, lst in enumerate(lists):
        seq = 0
        for (_, end), item in zip(times[r], lst):
            for op, c, m in _parts(item):
                if _transfers(pp, r, op, c)[1] == rank:
                    recvs.append((end, seq, P2P(False, Op.F if op is Op.F else Op.B, c, m, r)))
                    seq += 1
    recvs.sort(key=lambda t: t[:2])
    out, i = [], 0
    for (start, _), item in zip(times[rank], lists[rank]):
        while i < len(recvs) and recvs[i][0] <= start:
            out.append(recvs[i][2])
            i += 1
        out.append(item)
        for op, c, m in _parts(item):
            peer = _transfers(pp, rank, op, c)[1]
            if peer is not None:
                out.append(P2P(True, Op.F if op is Op.F else Op.B, c, m, peer))
    assert i == len(recvs)
    return out


def schedule(
    pp: int, rank: int, micro_batches: int, overlap: bool = False, wgrad: bool = False
) -> list[Action | Overlap | P2P]:
    """What pipeline rank `rank` runs in one training step, transfers included. Under pp=1 overlap:
    F(0), [F(m+1)+B(m)] for each m, B(last) (Megatron-LM's EP all-to-all overlap); wgrad: each B an I
    with its W right after (pp=1 has no bubble to move W into)."""
    if pp == 1:
        M = micro_batches
        back = lambda m: [Action(Op.I, 0, m), Action(Op.W, 0, m)] if wgrad else [Action(Op.B, 0, m)]
        if not overlap:
            return [x for m in range(M) for x in (Action(Op.F, 0, m), *back(m))]
        out = [Action(Op.F, 0, 0)]
        for m in range(M - 1):
            b, *w = back(m)
            out += [Overlap(Action(Op.F, 0, m + 1), b), *w]
        return out + back(M - 1)
    check(pp, micro_batches)
    return _with_p2p(pp, [dualpipev(pp, r, micro_batches) for r in range(pp)], rank)


def forward_schedule(pp: int, rank: int, micro_batches: int) -> list[Action | P2P]:
    """Forwards only (evaluation): rank r runs 2(pp-1-r) micro-batches down its first chunk, then
    alternates its two: 2M + 2pp - 2 forward times for M micro-batches (one at a time: 2pp*M)."""
    M = micro_batches
    if pp == 1:
        return [Action(Op.F, 0, m) for m in range(M)]
    lists = []
    for r in range(pp):
        a, b = rank_chunks(pp, r)
        warm = min(M, 2 * (pp - 1 - r))
        down, up = [Action(Op.F, a, m) for m in range(M)], [Action(Op.F, b, m) for m in range(M)]
        lists.append(down[:warm] + [x for pair in zip(down[warm:], up) for x in pair] + up[M - warm :])
    return _with_p2p(pp, lists, rank)


def timeline(pp: int, micro_batches: int, costs=COSTS) -> list[list[tuple[float, float, Action | Overlap]]]:
    lists = [dualpipev(pp, r, micro_batches) if pp > 1 else schedule(1, 0, micro_batches) for r in range(pp)]
    return [[(*t, a) for t, a in zip(ts, lst)] for ts, lst in zip(_simulate(pp, lists, costs), lists)]
