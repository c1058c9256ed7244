"""The steering plane's per-step caches. Freed table rows are cleared lazily: a request that
finishes sends nothing to the worker, the row's next write clears what it left."""

from __future__ import annotations

from steerable.steering.rows import RowTables
from steerable.steering.spec import SpecParser

H, LAYERS = 8, 4


def test_a_freed_row_sends_nothing_and_its_reuse_clears_what_it_left():
    parser, tables = SpecParser(H, LAYERS), RowTables(4, H)
    tables.write(1, parser.parse({"post_mlp": {0: [1.0] * H}, "pre_attn": {2: [2.0] * H}}, "s"))
    tables.take_update()
    tables.clear(1)
    assert tables.take_update() is None
    tables.write(1, parser.parse({"pre_attn": {2: [3.0] * H}}, "s"))
    update = tables.take_update()
    assert set(update.adds) == {("post_mlp", 0), ("pre_attn", 2)} and not update.clamps
    assert update.adds[("post_mlp", 0)][1].tolist() == [[0.0] * H]
