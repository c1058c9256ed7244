"""Tests for steerable.selection.SelectSpec.

The reference is ``oracle``: a literal, per-row Python loop over the *raw*
keyword arguments a spec was built from (so normalisation bugs in SelectSpec
show up too).  Randomised specs are compared against it over random prompt /
generation lengths, whole-range, chunked and shuffled.
"""

from __future__ import annotations

import copy
import json
import pickle
import random
import zlib
from dataclasses import FrozenInstanceError

import numpy as np
import pytest
import torch

from steerable.selection import SELECT_FIELDS, SHORTCUTS, SelectSpec

INCLUDE = (
    "prompt",
    "generation",
    "prompt_positions",
    "prompt_window",
    "prompt_tokens",
    "generation_positions",
    "generation_window",
    "generation_tokens",
    "positions",
)
EXCLUDE = tuple("exclude_" + f for f in INCLUDE)
VOCAB = 8  # small vocabulary so token terms match often


# --------------------------------------------------------------------- oracle


def _ints(v):
    if isinstance(v, (torch.Tensor, np.ndarray)):
        return [int(x) for x in v.tolist()]
    return [int(x) for x in v]


def _hits(kw, prefix, p, tok, P):
    """Which terms of one side (include: prefix '', exclude: 'exclude_') match
    row p (input token tok) of a request with prompt length P."""
    is_prompt = p < P
    step = p - P
    hits = []
    if kw.get(prefix + "prompt") == "all":
        hits.append(is_prompt)
    if kw.get(prefix + "generation") == "all":
        hits.append(not is_prompt)
    v = kw.get(prefix + "prompt_positions")
    if v is not None:
        hits.append(is_prompt and any(p == (q if q >= 0 else P + q) for q in _ints(v)))
    v = kw.get(prefix + "prompt_window")
    if v is not None:
        start, stop = v
        hits.append(p in list(range(P))[start:stop])  # literally Python slicing
    v = kw.get(prefix + "prompt_tokens")
    if v is not None:
        hits.append(is_prompt and tok in _ints(v))
    v = kw.get(prefix + "generation_positions")
    if v is not None:
        hits.append(not is_prompt and step in _ints(v))
    v = kw.get(prefix + "generation_window")
    if v is not None:
        start, stop = v
        start = 0 if start is None else start
        hits.append(not is_prompt and start <= step and (stop is None or step < stop))
    v = kw.get(prefix + "generation_tokens")
    if v is not None:
        hits.append(not is_prompt and tok in _ints(v))
    v = kw.get(prefix + "positions")
    if v is not None:
        hits.append(p in _ints(v))
    return hits


def oracle(kw, P, tokens):
    """Sorted list of selected positions among rows 0..len(tokens)-1."""
    any_include = any(kw.get(f) is not None for f in INCLUDE)
    out = []
    for p, tok in enumerate(tokens):
        included = any(_hits(kw, "", p, tok, P)) if any_include else True
        excluded = any(_hits(kw, "exclude_", p, tok, P))
        if included and not excluded:
            out.append(p)
    return out


def selected(spec, P, tokens, positions=None):
    """Positions SelectSpec.mask selects (whole range, or the given rows)."""
    if positions is None:
        positions = list(range(len(tokens)))
    pos_t = torch.tensor(positions, dtype=torch.int64)
    tok_t = torch.tensor([tokens[p] for p in positions], dtype=torch.int64)
    m = spec.mask(pos_t, P, tok_t)
    assert m.dtype == torch.bool and m.shape == pos_t.shape
    return sorted(p for p, b in zip(positions, m.tolist()) if b)


# ----------------------------------------------------------- random specs


def _window_valid(kind, w):
    """The contract's validity rule for windows."""
    start, stop = w
    s = 0 if start is None else start
    if kind == "generation_window":
        return s >= 0 and (stop is None or (stop >= 0 and s < stop))
    if stop is None:
        return True
    if stop == 0:
        return False
    if (s >= 0) == (stop >= 0) and s >= stop:
        return False
    return True


def _rand_container(rng, values):
    kind = rng.randrange(6)
    if kind == 0:
        return list(values)
    if kind == 1:
        return tuple(values)
    if kind == 2:
        return np.array(values, dtype=rng.choice([np.int64, np.int32]))
    if kind == 3:
        return torch.tensor(values, dtype=rng.choice([torch.int64, torch.int32]))
    if kind == 4:
        return set(values)
    return [np.int64(v) for v in values]


def _rand_ints(rng, lo, hi):
    n = rng.choice([0, 1, 1, 2, 3, 5])
    vals = [rng.randint(lo, hi) for _ in range(n)]
    if vals and rng.random() < 0.3:
        vals.append(vals[0])  # duplicates
    return _rand_container(rng, vals)


def _rand_window(rng, kind):
    while True:
        if kind == "generation_window":
            start = rng.choice([None, rng.randint(0, 20)])
            stop = rng.choice([None, rng.randint(1, 25)])
        else:
            start = rng.choice([None, rng.randint(-45, 45)])
            stop = rng.choice([None, rng.randint(-45, 45)])
        if _window_valid(kind, (start, stop)):
            return rng.choice([(start, stop), [start, stop]])


def _rand_value(rng, base):
    if base in ("prompt", "generation"):
        return "all"
    if base in ("prompt_window", "generation_window"):
        return _rand_window(rng, base)
    if base == "prompt_positions":
        return _rand_ints(rng, -45, 45)
    if base in ("prompt_tokens", "generation_tokens"):
        return _rand_ints(rng, 0, VOCAB - 1)
    if base == "generation_positions":
        return _rand_ints(rng, 0, 22)
    if base == "positions":
        return _rand_ints(rng, 0, 62)
    raise AssertionError(base)


def rand_kwargs(rng):
    kw = {}
    p_inc = rng.choice([0.0, 0.15, 0.3])
    p_exc = rng.choice([0.0, 0.15, 0.3])
    for f in INCLUDE:
        if rng.random() < p_inc:
            kw[f] = _rand_value(rng, f)
    for f in EXCLUDE:
        if rng.random() < p_exc:
            kw[f] = _rand_value(rng, f[len("exclude_"):])
    return kw


def rand_request(rng):
    P = rng.randint(1, 40)
    G = rng.randint(0, 20)  # generation *input* rows
    tokens = [rng.randrange(VOCAB) for _ in range(P + G)]
    return P, G, tokens


def rand_chunks(rng, n):
    """Split range(n) into random contiguous pieces (including size-1 ones)."""
    cuts, i = [], 0
    while i < n:
        j = min(n, i + rng.choice([1, 1, 2, 3, 7, 16, 64]))
        cuts.append((i, j))
        i = j
    return cuts


# ------------------------------------------------- randomised vs the oracle


@pytest.mark.parametrize("seed", range(8))
def test_random_specs_match_oracle(seed):
    rng = random.Random(seed)
    n_gen_rows_selected = n_prompt_rows_selected = 0
    for _ in range(250):
        kw = rand_kwargs(rng)
        spec = SelectSpec(**kw)
        for _ in range(3):  # the same spec instance across prompt lengths
            P, G, tokens = rand_request(rng)
            want = oracle(kw, P, tokens)
            assert selected(spec, P, tokens) == want, (kw, P, G, tokens)
            n_gen_rows_selected += sum(p >= P for p in want)
            n_prompt_rows_selected += sum(p < P for p in want)

            # Chunked resolution == whole-range resolution.
            pieces = []
            for a, b in rand_chunks(rng, P + G):
                pos = torch.arange(a, b, dtype=torch.int64)
                pieces.append(spec.mask(pos, P, torch.tensor(tokens[a:b], dtype=torch.int64)))
            got = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.bool)
            assert torch.nonzero(got).flatten().tolist() == want, (kw, P, G)

            # Non-contiguous, shuffled rows.
            rows = list(range(P + G))
            rng.shuffle(rows)
            rows = rows[: rng.randint(0, len(rows))]
            assert selected(spec, P, tokens, rows) == sorted(set(want) & set(rows))

            # Admission-time helpers.
            prompt = tokens[:P]
            want_prompt = oracle(kw, P, prompt)
            assert spec.prompt_positions_selected(prompt) == want_prompt
            assert spec.selects_prompt(prompt) == bool(want_prompt)

            # Conservative: must never say False when a generation row is selected.
            if any(p >= P for p in want):
                assert spec.may_select_generation(), kw
            # Sound: every row from selects_all_from on is selected.
            start = spec.selects_all_from(P)
            assert all(p in want for p in range(P + G) if p >= start), (kw, P, start)
    # The generator is not degenerate.
    assert n_gen_rows_selected > 0 and n_prompt_rows_selected > 0


def _field_value(f, P):
    """Deterministic, interesting values for one field."""
    return {
        "prompt": "all",
        "generation": "all",
        "prompt_positions": [0, -1, 2, -3, 7, -50, 60],
        "prompt_window": (1, -1),
        "prompt_tokens": [2, 5],
        "generation_positions": [0, 2, 5, 30],
        "generation_window": (1, 4),
        "generation_tokens": [2, 5],
        "positions": [0, 3, 9, 14, 22],
    }[f]


@pytest.mark.parametrize("field", INCLUDE)
@pytest.mark.parametrize("side", ["include", "exclude", "both"])
def test_each_field_alone(field, side):
    rng = random.Random(zlib.crc32(f"{field}/{side}".encode()))
    effective = nonempty = False
    for P in range(1, 14):
        for G in range(0, 8):
            tokens = [rng.randrange(VOCAB) for _ in range(P + G)]
            v = _field_value(field, P)
            if side == "include":
                kw = {field: v}
            elif side == "exclude":
                kw = {"exclude_" + field: v}
            else:  # include everything explicitly, exclude the field
                kw = {"prompt": "all", "generation": "all", "exclude_" + field: v}
            spec = SelectSpec(**kw)
            want = oracle(kw, P, tokens)
            assert selected(spec, P, tokens) == want, (kw, P, G)
            effective |= want != list(range(P + G))
            nonempty |= bool(want)
    # The chosen value really filters rows (and does not just select nothing).
    assert effective and nonempty


@pytest.mark.parametrize("window", [(-5, None), (None, 3), (2, 6), (-4, -1), (0, -2), (-6, 4), (3, None), (10, 20)])
def test_prompt_window_all_lengths(window):
    for P in range(1, 25):
        tokens = [0] * (P + 5)
        spec = SelectSpec(prompt_window=window)
        assert selected(spec, P, tokens) == list(range(P))[slice(*window)]
        spec = SelectSpec(exclude_prompt_window=window)
        assert selected(spec, P, tokens) == sorted(
            set(range(P + 5)) - set(list(range(P))[slice(*window)])
        )


# Hand-computed expectations (independent of the oracle).
GOLDEN = [
    # kwargs, P, tokens, expected positions
    ({}, 3, [0, 0, 0, 0, 0], [0, 1, 2, 3, 4]),
    ({"prompt": "all"}, 3, [0] * 5, [0, 1, 2]),
    ({"generation": "all"}, 3, [0] * 5, [3, 4]),
    ({"exclude_generation": "all"}, 3, [0] * 5, [0, 1, 2]),
    ({"exclude_prompt": "all"}, 3, [0] * 5, [3, 4]),
    ({"prompt_positions": [-1]}, 5, [0] * 8, [4]),
    ({"prompt_positions": [0, -1]}, 1, [0] * 3, [0]),
    ({"prompt_positions": [5, -6]}, 5, [0] * 8, []),  # out of prompt range: nothing
    ({"prompt_window": (-3, None)}, 10, [0] * 12, [7, 8, 9]),
    ({"prompt_window": (1, -1)}, 5, [0] * 7, [1, 2, 3]),
    ({"prompt_window": (None, 2)}, 5, [0] * 7, [0, 1]),
    ({"prompt_window": (2, 100)}, 4, [0] * 6, [2, 3]),
    ({"prompt_tokens": [7]}, 3, [7, 1, 7, 7, 7], [0, 2]),
    ({"generation_tokens": [7]}, 3, [7, 1, 7, 7, 1, 7], [3, 5]),
    ({"generation_positions": [0]}, 4, [0] * 7, [4]),
    ({"generation_positions": [1, 3]}, 4, [0] * 7, [5]),
    ({"generation_window": (2, 4)}, 3, [0] * 9, [5, 6]),
    ({"generation_window": (1, None)}, 3, [0] * 6, [4, 5]),
    ({"positions": [0, 4, 9]}, 3, [0] * 6, [0, 4]),
    ({"positions": []}, 3, [0] * 6, []),  # an empty include selects nothing
    ({"exclude_positions": []}, 2, [0] * 3, [0, 1, 2]),  # an empty exclude is a no-op
    ({"prompt": "all", "exclude_prompt_positions": [-1]}, 4, [0] * 6, [0, 1, 2]),
    ({"generation": "all", "exclude_generation_positions": [0]}, 2, [0] * 5, [3, 4]),
    ({"generation": "all", "exclude_generation_window": (1, None)}, 2, [0] * 5, [2]),
    ({"exclude_generation_tokens": [3]}, 2, [3, 3, 3, 1, 3], [0, 1, 3]),
    ({"exclude_prompt_tokens": [3]}, 2, [3, 1, 3, 1, 3], [1, 2, 3, 4]),
    ({"exclude_prompt_window": (0, -1)}, 4, [0] * 6, [3, 4, 5]),
    ({"prompt_positions": [0], "generation_positions": [0], "exclude_positions": [0]}, 3, [0] * 5, [3]),
    ({"prompt_tokens": [1], "generation_tokens": [2]}, 2, [1, 2, 1, 2], [0, 3]),
]


@pytest.mark.parametrize("kw,P,tokens,want", GOLDEN)
def test_golden(kw, P, tokens, want):
    assert oracle(kw, P, tokens) == want  # the oracle agrees with hand computation
    assert selected(SelectSpec(**kw), P, tokens) == want


# ------------------------------------------------------- engine-like usage


def test_prefill_chunks_then_decode_steps():
    rng = random.Random(1234)
    for _ in range(200):
        kw = rand_kwargs(rng)
        spec = SelectSpec(**kw)
        P, G, tokens = rand_request(rng)
        got = []
        i = 0
        while i < P:  # chunked prefill
            j = min(P, i + rng.randint(1, 9))
            m = spec.mask(torch.arange(i, j), P, torch.tensor(tokens[i:j]))
            got += [p for p, b in zip(range(i, j), m.tolist()) if b]
            i = j
        for p in range(P, P + G):  # one row per decode step
            m = spec.mask(torch.tensor([p]), P, torch.tensor([tokens[p]]))
            assert m.shape == (1,)
            if m.item():
                got.append(p)
        assert got == oracle(kw, P, tokens), (kw, P, G)


def test_mask_edge_cases():
    spec = SelectSpec(prompt_positions=[-1])
    empty = spec.mask(torch.zeros(0, dtype=torch.int64), 5, torch.zeros(0, dtype=torch.int64))
    assert empty.dtype == torch.bool and empty.shape == (0,)
    # Fast paths still return correctly shaped tensors.
    m = spec.mask(torch.arange(5, 9), 5, torch.zeros(4, dtype=torch.int64))
    assert m.dtype == torch.bool and m.tolist() == [False] * 4
    m = SelectSpec().mask(torch.arange(3), 2, None)
    assert m.tolist() == [True] * 3
    m = SelectSpec(exclude_generation="all").mask(torch.arange(4, 6), 2, None)
    assert m.tolist() == [False, False]
    # token_ids may be omitted when the spec has no token terms...
    assert SelectSpec(generation_window=(0, 2)).mask(torch.arange(4), 2, None).tolist() == [
        False, False, True, True]
    # ...but are required otherwise.
    with pytest.raises(ValueError, match="token_ids"):
        SelectSpec(prompt_tokens=[1]).mask(torch.arange(4), 2, None)
    with pytest.raises(ValueError, match="shape"):
        SelectSpec(prompt_tokens=[1]).mask(torch.arange(4), 2, torch.zeros(3, dtype=torch.int64))
    # Token terms only touch their side of the prompt boundary.
    s = SelectSpec(generation_tokens=[1])
    assert s.mask(torch.arange(3), 5, torch.ones(3, dtype=torch.int64)).tolist() == [False] * 3
    s = SelectSpec(prompt_tokens=[1])
    assert s.mask(torch.arange(5, 8), 5, torch.ones(3, dtype=torch.int64)).tolist() == [False] * 3


# ------------------------------------------------------------------ shortcuts


def test_parse_shortcuts():
    for P in range(1, 41):
        for n_generated in range(0, 21):
            # n generated tokens -> n-1 input rows (the last sampled one is not fed back).
            n_rows = P + max(n_generated - 1, 0)
            tokens = [0] * n_rows
            assert selected(SelectSpec.parse("last_prompt"), P, tokens) == [P - 1]
            assert selected(SelectSpec.parse("all_prompt"), P, tokens) == list(range(P))
            gen = selected(SelectSpec.parse("all_generated"), P, tokens)
            assert gen == list(range(P, P + n_generated - 1))
            assert len(gen) == max(n_generated - 1, 0)
            assert selected(SelectSpec.parse("all"), P, tokens) == list(range(n_rows))
    assert SelectSpec.parse("last_prompt") == SelectSpec(prompt_positions=[-1])
    assert SelectSpec.parse("all") == SelectSpec(prompt="all", generation="all")
    assert SelectSpec.parse("all_prompt") == SelectSpec(prompt="all")
    assert SelectSpec.parse("all_generated") == SelectSpec(generation="all")
    assert set(SHORTCUTS) == {"all", "all_prompt", "last_prompt", "all_generated"}


def test_parse_passthrough_and_wire():
    s = SelectSpec(prompt_tokens=[3, 1])
    assert SelectSpec.parse(s) is s
    assert SelectSpec.parse({"prompt_tokens": [1, 3]}) == s
    assert SelectSpec.parse(s.to_wire()) == s


def test_parse_errors():
    with pytest.raises(ValueError) as e:
        SelectSpec.parse("last")
    for name in ("all", "all_prompt", "last_prompt", "all_generated"):
        assert repr(name) in str(e.value)
    for bad in (None, 3, ["all"], b"all", "ALL", " all"):
        with pytest.raises(ValueError):
            SelectSpec.parse(bad)
    with pytest.raises(ValueError, match="unknown key"):
        SelectSpec.parse({"promt": "all"})


# ----------------------------------------------------------------------- wire


@pytest.mark.parametrize("seed", range(3))
def test_wire_round_trip_random(seed):
    rng = random.Random(100 + seed)
    for _ in range(300):
        kw = rand_kwargs(rng)
        s = SelectSpec(**kw)
        w = s.to_wire()
        assert SelectSpec.from_wire(w) == s
        assert SelectSpec.from_wire(json.loads(json.dumps(w))) == s  # survives JSON
        assert json.loads(s.key) == w
        assert SelectSpec.from_wire(w).key == s.key
        assert hash(SelectSpec.from_wire(w)) == hash(s)
        # Only set fields; canonical lists.
        for k, v in w.items():
            assert k in SELECT_FIELDS and v is not None
            if k.endswith("window"):
                assert isinstance(v, list) and len(v) == 2
            elif isinstance(v, list):
                assert v == sorted(set(v)) and all(type(x) is int for x in v)
        for k in SELECT_FIELDS:
            if kw.get(k) is None:
                assert k not in w
        # eval(repr) rebuilds it.
        assert eval(repr(s), {"SelectSpec": SelectSpec}) == s


def test_wire_canonical_equality():
    a = SelectSpec(prompt_positions=[3, -1, 3, 0], positions=(9, 2, 2), generation_tokens={5, 1})
    b = SelectSpec(
        prompt_positions=np.array([0, -1, 3], dtype=np.int32),
        positions=torch.tensor([2, 9]),
        generation_tokens=[1, 5, 5],
    )
    assert a == b and hash(a) == hash(b) and a.key == b.key and a.to_wire() == b.to_wire()
    assert a.to_wire() == {
        "prompt_positions": [-1, 0, 3],
        "generation_tokens": [1, 5],
        "positions": [2, 9],
    }
    assert a.prompt_positions == (-1, 0, 3)  # stored as tuples
    # Windows: tuple/list and start None/0 are the same thing.
    assert SelectSpec(prompt_window=(None, 4)) == SelectSpec(prompt_window=[0, 4])
    assert SelectSpec(generation_window=[2, None]).to_wire() == {"generation_window": [2, None]}
    assert SelectSpec(prompt_window=(-3, None)).to_wire() == {"prompt_window": [-3, None]}
    # Empty exclude lists are no-ops and vanish; empty includes are kept (select nothing).
    assert SelectSpec(exclude_positions=[]) == SelectSpec()
    assert SelectSpec(positions=[]).to_wire() == {"positions": []}
    assert SelectSpec(positions=[]) != SelectSpec()
    # Different meanings -> different keys.
    assert SelectSpec(prompt_positions=[1]).key != SelectSpec(exclude_prompt_positions=[1]).key
    assert SelectSpec().to_wire() == {} and SelectSpec().key == "{}"
    # usable as dict key
    d = {a: 1, a.key: 2}
    assert d[b] == 1 and d[b.key] == 2


def test_from_wire_rejects_unknown_and_invalid():
    with pytest.raises(ValueError, match="unknown key"):
        SelectSpec.from_wire({"prompt": "all", "bogus": 1})
    with pytest.raises(ValueError):
        SelectSpec.from_wire(["prompt"])
    with pytest.raises(ValueError) as e:
        SelectSpec.from_wire({"generation_window": [-1, None]})
    assert str(e.value).startswith("select.generation_window:")
    assert SelectSpec.from_wire({"prompt": None}) == SelectSpec()


# ----------------------------------------------------------------- validation

INVALID = [
    ({"prompt": "yes"}, "prompt"),
    ({"prompt": True}, "prompt"),
    ({"generation": "ALL"}, "generation"),
    ({"generation": 1}, "generation"),
    ({"exclude_prompt": "none"}, "exclude_prompt"),
    ({"exclude_generation": ["all"]}, "exclude_generation"),
    ({"prompt_positions": [1.0]}, "prompt_positions"),
    ({"prompt_positions": [True]}, "prompt_positions"),
    ({"prompt_positions": [np.bool_(True)]}, "prompt_positions"),
    ({"prompt_positions": 3}, "prompt_positions"),
    ({"prompt_positions": "12"}, "prompt_positions"),
    ({"prompt_positions": [None]}, "prompt_positions"),
    ({"prompt_positions": np.array([1.0])}, "prompt_positions"),
    ({"prompt_positions": np.array([True])}, "prompt_positions"),
    ({"prompt_positions": np.array([[1]])}, "prompt_positions"),
    ({"prompt_positions": torch.tensor([1.0])}, "prompt_positions"),
    ({"prompt_positions": torch.tensor([True])}, "prompt_positions"),
    ({"prompt_positions": torch.tensor([[1, 2]])}, "prompt_positions"),
    ({"prompt_positions": torch.tensor(1)}, "prompt_positions"),
    ({"exclude_prompt_positions": [0.5]}, "exclude_prompt_positions"),
    ({"prompt_window": (1,)}, "prompt_window"),
    ({"prompt_window": (1, 2, 3)}, "prompt_window"),
    ({"prompt_window": 5}, "prompt_window"),
    ({"prompt_window": "ab"}, "prompt_window"),
    ({"prompt_window": (0, 0)}, "prompt_window"),
    ({"prompt_window": (5, 2)}, "prompt_window"),
    ({"prompt_window": (-1, -3)}, "prompt_window"),
    ({"prompt_window": (-2, -2)}, "prompt_window"),
    ({"prompt_window": (-3, 0)}, "prompt_window"),
    ({"prompt_window": (1.0, 3)}, "prompt_window"),
    ({"prompt_window": (True, 3)}, "prompt_window"),
    ({"prompt_window": (0, 2.5)}, "prompt_window"),
    ({"exclude_prompt_window": (4, 4)}, "exclude_prompt_window"),
    ({"generation_window": (-1, 3)}, "generation_window"),
    ({"generation_window": (0, -1)}, "generation_window"),
    ({"generation_window": (-2, None)}, "generation_window"),
    ({"generation_window": (3, 3)}, "generation_window"),
    ({"generation_window": (4, 2)}, "generation_window"),
    ({"generation_window": (1,)}, "generation_window"),
    ({"generation_window": (0.0, None)}, "generation_window"),
    ({"exclude_generation_window": (-1, None)}, "exclude_generation_window"),
    ({"generation_positions": [-1]}, "generation_positions"),
    ({"generation_positions": [1.5]}, "generation_positions"),
    ({"exclude_generation_positions": [2, -2]}, "exclude_generation_positions"),
    ({"positions": [-2]}, "positions"),
    ({"positions": [2 ** 70]}, "positions"),
    ({"exclude_positions": [-1]}, "exclude_positions"),
    ({"prompt_tokens": [-1]}, "prompt_tokens"),
    ({"prompt_tokens": [1.0]}, "prompt_tokens"),
    ({"exclude_prompt_tokens": [-7]}, "exclude_prompt_tokens"),
    ({"generation_tokens": [-5]}, "generation_tokens"),
    ({"generation_tokens": torch.tensor([-5])}, "generation_tokens"),
    ({"exclude_generation_tokens": [False]}, "exclude_generation_tokens"),
]


@pytest.mark.parametrize("kw,field", INVALID, ids=[f"{f}-{i}" for i, (_, f) in enumerate(INVALID)])
def test_invalid_raises_naming_field(kw, field):
    with pytest.raises(ValueError) as e:
        SelectSpec(**kw)
    assert str(e.value).startswith(f"select.{field}: "), str(e.value)
    # Same through the wire path (JSON-able cases only).
    try:
        wire = json.loads(json.dumps(kw))
    except TypeError:
        return
    with pytest.raises(ValueError) as e:
        SelectSpec.from_wire(wire)
    assert str(e.value).startswith(f"select.{field}: ")


def test_every_field_has_invalid_case():
    assert {f for _, f in INVALID} == set(SELECT_FIELDS)


@pytest.mark.parametrize("seed", range(2))
def test_random_windows_validity(seed):
    """Construction fails exactly for windows the contract calls invalid."""
    rng = random.Random(seed)
    for _ in range(2000):
        kind = rng.choice(["prompt_window", "generation_window"])
        w = (rng.choice([None, rng.randint(-8, 8)]), rng.choice([None, rng.randint(-8, 8)]))
        field = rng.choice([kind, "exclude_" + kind])
        if _window_valid(kind, w):
            s = SelectSpec(**{field: w})
            assert getattr(s, field) == (0 if w[0] is None else w[0], w[1])
        else:
            with pytest.raises(ValueError, match=f"^select.{field}: "):
                SelectSpec(**{field: w})


def test_valid_input_types():
    want = (-1, 2, 3)
    for v in (
        [3, -1, 2],
        (3, -1, 2),
        {3, -1, 2},
        np.array([3, -1, 2], dtype=np.int64),
        np.array([3, -1, 2], dtype=np.int16),
        torch.tensor([3, -1, 2]),
        torch.tensor([3, -1, 2], dtype=torch.int32),
        [np.int64(3), np.int32(-1), 2],
        [torch.tensor(3), -1, 2],
    ):
        s = SelectSpec(prompt_positions=v)
        assert s.prompt_positions == want and type(s.prompt_positions) is tuple
        assert all(type(x) is int for x in s.prompt_positions)
    assert SelectSpec(positions=range(2, 5)).positions == (2, 3, 4)
    assert SelectSpec(generation_tokens=torch.tensor([], dtype=torch.int64)).generation_tokens == ()
    assert SelectSpec(prompt_window=(np.int64(1), np.int32(-1))).prompt_window == (1, -1)
    assert SelectSpec(prompt_window=(-3, 5)).prompt_window == (-3, 5)  # mixed signs: depends on P
    assert SelectSpec(prompt_window=(0, -1)).prompt_window == (0, -1)
    with pytest.raises(TypeError):
        SelectSpec("all")  # keyword-only


# -------------------------------------------------------------- misc methods


def test_may_select_generation_cases():
    T, F = True, False
    cases = [
        ({}, T),
        ({"generation": "all"}, T),
        ({"generation_positions": [3]}, T),
        ({"generation_window": (5, None)}, T),
        ({"generation_tokens": [1]}, T),
        ({"positions": [100]}, T),
        ({"prompt_positions": [3], "generation_tokens": [1]}, T),
        ({"exclude_prompt": "all"}, T),
        ({"prompt": "all"}, F),
        ({"prompt_positions": [-1]}, F),
        ({"prompt_window": (0, None)}, F),
        ({"prompt_tokens": [1]}, F),
        ({"generation_positions": []}, F),
        ({"positions": []}, F),
        ({"exclude_generation": "all"}, F),
        ({"generation": "all", "exclude_generation": "all"}, F),
        ({"generation": "all", "exclude_generation_window": (0, None)}, F),
    ]
    for kw, want in cases:
        assert SelectSpec(**kw).may_select_generation() is want, kw
    for name in ("last_prompt", "all_prompt"):
        assert not SelectSpec.parse(name).may_select_generation()
    for name in ("all", "all_generated"):
        assert SelectSpec.parse(name).may_select_generation()


def test_prompt_helpers():
    s = SelectSpec(prompt_tokens=[4], prompt_positions=[-1], exclude_prompt_positions=[0])
    assert s.prompt_positions_selected([4, 4, 1, 4, 2]) == [1, 3, 4]
    assert s.prompt_positions_selected(np.array([4, 1])) == [1]
    assert s.prompt_positions_selected(torch.tensor([4])) == []
    assert s.selects_prompt([4, 1]) and not s.selects_prompt([4])
    assert SelectSpec.parse("all_generated").prompt_positions_selected([1, 2, 3]) == []
    assert not SelectSpec.parse("all_generated").selects_prompt([1, 2, 3])
    assert SelectSpec.parse("last_prompt").prompt_positions_selected(list(range(40))) == [39]
    last = SelectSpec.parse({"prompt_positions": [0, -1], "prompt_window": (-3, None)})
    first = last.prompt_positions_selected(list(range(10)))
    first.append(99)  # the caller's list, not the kept one
    assert last.prompt_positions_selected([5] * 10) == [0, 7, 8, 9] and last.prompt_positions_selected([1]) == [0]
    for everything in ("all_prompt", "all", {"exclude_generation": "all"}):  # no mask is built for these
        assert SelectSpec.parse(everything).prompt_positions_selected(list(range(40))) == list(range(40))
    assert SelectSpec().prompt_positions_selected([]) == []
    assert not SelectSpec().selects_prompt([])


def test_frozen_hashable_picklable_repr():
    s = SelectSpec(prompt_positions=[3, -1], exclude_generation="all", generation_window=(1, None))
    with pytest.raises(FrozenInstanceError):
        s.prompt = "all"
    s.mask(torch.arange(6), 4, None)  # populate caches
    for t in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert t == s and t.key == s.key
        assert t.mask(torch.arange(6), 4, None).tolist() == s.mask(torch.arange(6), 4, None).tolist()
    assert repr(s) == (
        "SelectSpec(prompt_positions=[-1, 3], generation_window=(1, None), exclude_generation='all')"
    )
    assert repr(SelectSpec()) == "SelectSpec()"
    assert len({s, SelectSpec(prompt_positions=(-1, 3), generation_window=[1, None],
                              exclude_generation="all")}) == 1


def test_next_candidate_is_a_lower_bound_on_selected_rows():
    """Never past a selected row (so skipping below it is safe), and tight for position specs."""
    import random as _random
    rng = _random.Random(11)
    specs = [SelectSpec(positions=[3, 40]), SelectSpec.parse("last_prompt"), SelectSpec(generation_window=(2, 5)),
             SelectSpec(prompt_tokens=[7]), SelectSpec(generation_tokens=[9]), SelectSpec(),
             SelectSpec(prompt_window=(1, 4), exclude_prompt_positions=[2]), SelectSpec(generation_positions=[0, 6])]
    for spec in specs:
        for _ in range(30):
            P = rng.randrange(1, 30)
            n = P + 12
            tokens = torch.tensor([rng.choice([7, 9, 1]) for _ in range(n)])
            selected = torch.nonzero(spec.mask(torch.arange(n), P, tokens)).flatten().tolist()
            for at in range(n):
                later = [p for p in selected if p >= at]
                bound = spec.next_candidate(at, P)
                assert not later or bound <= later[0]
    assert SelectSpec(positions=[3, 40]).next_candidate(4, 10) == 40
    assert SelectSpec.parse("last_prompt").next_candidate(10, 10) == float("inf")


def test_selects_all_from_exact_for_common_specs():
    P = 10
    cases = [("all", 0), ("all_generated", P), ("last_prompt", float("inf")), ("all_prompt", float("inf")),
             (SelectSpec(generation_window=(2, None)), P + 2), (SelectSpec(), 0),
             (SelectSpec(generation="all", exclude_generation_positions=[0, 3]), P + 4),
             (SelectSpec(generation="all", exclude_generation_tokens=[5]), float("inf")),
             (SelectSpec(exclude_prompt_tokens=[5]), P), (SelectSpec(generation_window=(1, 4)), float("inf"))]
    for spec, start in cases:
        assert SelectSpec.parse(spec).selects_all_from(P) == start, spec


@pytest.mark.parametrize("spec", [
    SelectSpec(generation_window=(0, 5)),
    SelectSpec(generation_window=(2, 7), exclude_generation_positions=[4]),
    SelectSpec(generation_positions=[0, 3, 9], positions=[15]),
    SelectSpec(generation="all", exclude_generation_window=(3, 6)),
    SelectSpec(prompt="all"),
    SelectSpec(generation="all"),
])
def test_generation_span_is_a_run_of_one_decision(spec):
    """Within the span reported for a generation row, the mask has that row's value; the span's
    ends are where it may change (the planner reuses one decode row over the whole span)."""
    prompt_len = 6
    positions = torch.arange(prompt_len, prompt_len + 20)
    mask = spec.mask(positions, prompt_len, torch.zeros_like(positions))
    for i, position in enumerate(positions.tolist()):
        lo, hi = spec.generation_span(position, prompt_len)
        assert lo <= position < hi
        inside = [j for j, p in enumerate(positions.tolist()) if lo <= p < hi]
        assert all(mask[j] == mask[i] for j in inside), (position, lo, hi)
