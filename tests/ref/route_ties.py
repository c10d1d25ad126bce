"""Near-tied routing choices as the explanation of a difference between engines.

The same float noise that flips a near-tied token can flip a near-tied expert choice: where a
router's k-th and (k+1)-th choices (or, with group-limited routing, the last chosen and the
first dropped group of experts) are this close at a position, an engine may have taken either.
A difference is explained this way only when the numpy reference (forward_ref.Model), re-run
with some of those choices taken the other way (its route_flips), brings the row in question
within tolerance; a real bug shows at positions with no near tie, or no flip explains it.

One search serves every architecture: forward_ref records the margins of every router it
runs (softmax or sigmoid scores, gpt-oss's biased logits, DeepSeek's expert groups) in the
same form. parity.py (the engine against the reference) and llama_side.py (the engine against
llama.cpp) both ask it.
"""


def near_ties(model, toks, positions, margin, have=frozenset()):
    """The near-tied routing choices of the reference's run over toks (with the flips in have
    taken), at the given positions: route_flips entries (layer, pos) for experts and (layer,
    pos, "group") for groups whose margin is <= margin, not already in have, smallest margin
    first."""
    positions = set(positions)
    model.route_margins = [dict() for _ in range(model.n_layer)]
    model.group_margins = [dict() for _ in range(model.n_layer)]
    model.route_flips = set(have)
    try:
        model.forward(model.new_cache(), toks)
        cand = []
        for li in range(model.n_layer):
            for kind, ms in ((None, model.route_margins[li]), ("group", model.group_margins[li])):
                for p, mg in ms.items():
                    c = (li, p) if kind is None else (li, p, kind)
                    if p in positions and mg <= margin and c not in have:
                        cand.append((mg, c))
    finally:
        model.route_margins = model.group_margins = None
        model.route_flips = set()
    return [c for _, c in sorted(cand)]


def explain(model, toks, dist, tol, cand, have=frozenset(), comb=4):
    """The fewest of the candidate flips cand (on top of those in have) that bring dist(rows)
    within tol, rows the reference's logits (len(toks), n_vocab) with those flips taken.
    Every single flip is tried first, then pairs, triples, ... of the first comb candidates
    (cand comes smallest margin first); of a size the one with the smallest dist wins.
    Returns (flips, rows, d) or None."""
    if not model.n_expert_used or not cand:
        return None
    best = None
    try:
        for size in range(1, len(cand) + 1):
            pool = cand if size == 1 else cand[:comb]
            if size > len(pool):
                break
            for mask in range(1, 1 << len(pool)):
                if bin(mask).count("1") != size:
                    continue
                pick = frozenset(c for j, c in enumerate(pool) if mask >> j & 1)
                model.route_flips = set(have) | pick
                rows = model.forward(model.new_cache(), toks)
                d = float(dist(rows))
                if best is None or d < best[2]:
                    best = (pick, rows, d)
            if best[2] <= tol:
                return best
    finally:
        model.route_flips = set()
    return None


def describe(flip):
    """'layer L position P (expert)' or '(expert group)' for a route_flips entry."""
    return "layer %d position %d (%s)" % (flip[0], flip[1],
                                          "expert group" if len(flip) > 2 else "expert")
