"""A step's table changes travel in one buffer (one host-to-device copy per update), and a parse
checks what items built per layer share once: the tables and interventions come out as before."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import steerable.steering.tables as tables_module
from steerable import Add, Clamp, SelectSpec, SteeringSpec
from steerable.executor.codec import decode, encode
from steerable.steering.rows import RowTables
from steerable.steering.spec import Intervention, SpecParser, _vector_hash
from steerable.steering.tables import SteeringTables
from steerable.step import NO_CLAMP, NO_GATE

H, LAYERS = 8, 4


def _vec(seed: int) -> torch.Tensor:
    return torch.randn(H, generator=torch.Generator().manual_seed(seed))


def _feature_clamp(layer: int, read: torch.Tensor, write: torch.Tensor) -> Intervention:
    return Intervention("clamp", "post_mlp", layer, read, _vector_hash(read), None, 0.5, 0.5, 1.0, write=write,
                        bias=0.25, threshold=0.0)


def test_one_copy_per_update_sets_every_table_as_written(monkeypatch):
    parser, ledger = SpecParser(H, LAYERS), RowTables(4, H)
    tables = SteeringTables(H, torch.device("cpu"), torch.float64)
    copies = []
    monkeypatch.setattr(tables_module, "to_device", lambda values, device: copies.append(1) or
                        torch.from_numpy(values.copy()))
    a, b, d1, d2 = _vec(1), _vec(2), _vec(3), _vec(4)
    row1 = parser.parse([Add(0, a), Add(0, b), Add(1, a, hook="pre_attn"), Clamp(2, d1, min=-1.0, max=1.0),
                         Clamp(2, d2, max=0.5, strength=0.5)], "s")
    row2 = parser.parse([Clamp(2, d2, min=0.0, max=0.0)], "s") + [_feature_clamp(3, d1, d2)]
    ledger.write(1, row1)
    ledger.write(2, row2)
    update = decode(encode(ledger.take_update()))  # as a worker in another process gets it
    tables.apply(update)
    assert len(copies) == 1
    add = tables.add[("post_mlp", 0)]
    assert torch.equal(add[1], (a + b).double()) and not add[[0, 2]].any()
    assert torch.equal(tables.add[("pre_attn", 1)][1], a.double())
    site = ("post_mlp", 2)
    unit1, unit2 = d1 / d1.norm(), d2 / d2.norm()
    assert torch.equal(tables.clamp_dir[site][1], torch.stack([unit1, unit2]).double())
    assert torch.equal(tables.clamp_dir[site][2], torch.stack([unit2, torch.zeros(H)]).double())
    assert tables.clamp_bounds[site][1].tolist() == [[-1.0, 1.0, 1.0, 1.0], [-math.inf, 0.5, 0.5, 1.0]]
    assert tables.clamp_bounds[site][2].tolist() == [[0.0, 0.0, 1.0, 1.0], list(NO_CLAMP)]
    feature = ("post_mlp", 3)
    assert torch.equal(tables.clamp_write[feature][2, 0], d2.double())
    assert torch.equal(tables.clamp_dir[feature][2, 0], d1.double())
    assert tables.clamp_gate[feature][2].tolist() == [[0.25, 0.0]]
    assert tables.clamp_gate[feature][1].tolist() == [list(NO_GATE)]


def test_a_reused_row_clears_the_slots_and_sites_its_new_contents_leave():
    parser, ledger = SpecParser(H, LAYERS), RowTables(4, H)
    tables = SteeringTables(H, torch.device("cpu"), torch.float32)
    ledger.write(1, parser.parse([Clamp(2, _vec(1), max=0.5), Clamp(2, _vec(2), min=0.0), Add(0, _vec(3))], "s"))
    tables.apply(ledger.take_update())
    ledger.clear(1)
    ledger.write(1, parser.parse([Clamp(2, _vec(4), max=0.0)], "s"))
    update = ledger.take_update()
    assert update.rows(next(w for w in update.writes if w.table == "add")).tolist() == [1]
    tables.apply(update)
    assert not tables.add[("post_mlp", 0)][1].any()
    assert tables.clamp_bounds[("post_mlp", 2)][1, 1].tolist() == list(NO_CLAMP)
    assert not tables.clamp_dir[("post_mlp", 2)][1, 1].any()


def test_items_built_per_layer_parse_as_one_by_one_and_each_is_checked():
    parser = SpecParser(H, LAYERS)
    vector, direction = _vec(5), _vec(6)
    given = [Add(layer, vector, hook="pre_attn", scale=0.5, select=SelectSpec(generation_window=(0, 4)))
             for layer in range(LAYERS)]  # equal selections, one object per layer
    given += [Clamp(layer, direction, min=-1.0, max=1.0, strength=0.5) for layer in range(LAYERS)]
    items = parser.parse(given, "s")
    for item, one in zip(items, given):
        alone = parser.parse([one], "s")[0]
        assert item.digest == alone.digest and item.site == alone.site and item.select == alone.select
        assert torch.equal(item.vector, alone.vector)
    assert [item.layer for item in items] == [*range(LAYERS)] * 2
    zero, minus_zero = 0.0, -0.0
    signed = parser.parse([Clamp(0, direction, min=zero), Clamp(1, direction, min=minus_zero)], "s")
    assert str(signed[1].lo) == "-0.0"  # equal values that are other objects are checked on their own
    with pytest.raises(ValueError, match="scale"):
        parser.parse([Add(0, vector, scale=1.0), Add(1, vector, scale=True)], "s")
    with pytest.raises(ValueError, match=r"s\[1\]\.layer"):
        parser.parse([Add(0, vector), Add(LAYERS, vector)], "s")
    with pytest.raises(ValueError, match=r"s\.interventions\[2\]\.layer: True"):  # a bool is no layer
        parser.parse(SteeringSpec([Add(0, vector), Add(1, vector), Add(True, vector)]), "s")
    by_string = parser.parse(SteeringSpec([Add(0, vector), Add("1", vector)]), "s")  # a digit string is one
    assert [item.layer for item in by_string] == [0, 1]
    assert by_string[1].digest == parser.parse([Add(1, vector)], "s")[0].digest
    assert np.array_equal(items[0].vector.numpy(), (vector * 0.5).numpy())


def test_an_intervention_moved_to_another_layer_equals_one_built_there():
    parser = SpecParser(H, LAYERS)
    for given in (Add(0, _vec(7), hook="post_attn", scale=2.0, select="all_prompt"),
                  Clamp(0, _vec(8), min=-0.5, strength=0.25, select=SelectSpec(generation_positions=[1, 3]))):
        first = parser.parse([given], "s")[0]
        moved, built = first.at_layer(3), parser.parse([dataclasses.replace(given, layer=3)], "s")[0]
        assert moved.digest == built.digest != first.digest and torch.equal(moved.vector, built.vector)
        fields = [f.name for f in dataclasses.fields(Intervention) if f.name != "vector"]
        assert [getattr(moved, f) for f in fields] == [getattr(built, f) for f in fields]
        assert first.layer == 0 and moved.vector is first.vector


def test_a_vector_given_at_every_layer_is_sent_once():
    parser, ledger = SpecParser(H, LAYERS), RowTables(4, H)
    tables = SteeringTables(H, torch.device("cpu"), torch.float32)
    vector, direction = _vec(9), _vec(10)
    ledger.write(1, parser.parse([Add(layer, vector) for layer in range(LAYERS)] +
                                 [Clamp(layer, direction, max=0.0) for layer in range(LAYERS)], "s"))
    update = ledger.take_update()
    assert update.num_pieces == 2 * LAYERS and len(update.data) - update.vectors_at == 2 * H
    tables.apply(update)
    for layer in range(LAYERS):
        assert torch.equal(tables.add[("post_mlp", layer)][1], vector)
        assert torch.equal(tables.clamp_dir[("post_mlp", layer)][1, 0], direction / direction.norm())


def _transcoder_clamp(layer: int, read: torch.Tensor, writes: torch.Tensor, value: float) -> Intervention:
    return Intervention("tclamp", "mlp_in", layer, read, _vector_hash(read), None, value, value, 1.0, write=writes,
                        bias=0.5, threshold=0.0)


def test_transcoder_clamps_pack_their_writes_per_output_layer():
    """Rows with different slot counts and spans at one read site: the tables take the widest, and
    each row's slots hold their read, bounds, gate and a write per output layer (zeros past its span)."""
    ledger = RowTables(4, H)
    tables = SteeringTables(H, torch.device("cpu"), torch.float64)
    a, b, c = _vec(1), _vec(2), _vec(3)
    wide, narrow = torch.stack([_vec(4), _vec(5), _vec(6)]), _vec(7)[None]
    ledger.write(1, [_transcoder_clamp(0, a, wide, 2.0), _transcoder_clamp(0, b, narrow, 0.0)])
    ledger.write(2, [_transcoder_clamp(0, c, narrow, 1.0)])
    version = ledger.version
    tables.apply(decode(encode(ledger.take_update())))
    site = ("mlp_in", 0)
    assert ledger.plan_tclamp_sites() == frozenset({site}) and tables.tclamp_write[site].shape[1:] == (2, 3, H)
    assert torch.equal(tables.tclamp_dir[site][1], torch.stack([a, b]).double())
    assert torch.equal(tables.tclamp_write[site][1, 0], wide.double())
    assert torch.equal(tables.tclamp_write[site][1, 1], torch.cat([narrow, torch.zeros(2, H)]).double())
    assert torch.equal(tables.tclamp_write[site][2, 1], torch.zeros(3, H).double())  # an unused slot
    assert tables.tclamp_bounds[site][2].tolist() == [[1.0, 1.0, 1.0, 1.0], list(NO_CLAMP)]
    assert tables.tclamp_gate[site][1].tolist() == [[0.5, 0.0], [0.5, 0.0]]
    assert tables.tclamp_gate[site][2, 1].tolist() == list(NO_GATE)
    ledger.clear(2)
    ledger.write(2, [_transcoder_clamp(0, a, narrow, 3.0)])  # a reused row: no new table, the same version
    tables.apply(decode(encode(ledger.take_update())))
    assert ledger.version == version and torch.equal(tables.tclamp_dir[site][2, 0], a.double())
