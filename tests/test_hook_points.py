"""When the residual add, steering and norm may run as one kernel: only when every write at the
sites is a table lookup to add and no reader needs a value that a later write changes."""

import torch

from steerable.hook_points import POST_ATTN, POST_MLP, PRE_ATTN, HookPoints

TABLE = torch.zeros(2, 4)
INDEX = torch.zeros(3, dtype=torch.int64)


class FakeWriter:
    def __init__(self, adds=(), clamps=()):
        self.adds, self.clamps = set(adds), set(clamps)

    def acts_at(self, point, layer, batch):
        return (point, layer) in self.adds | self.clamps

    def table_add(self, point, layer, batch):
        site = (point, layer)
        return (TABLE, INDEX) if site in self.adds and site not in self.clamps else None


class FakeReader:
    def __init__(self, sites=()):
        self.sites = set(sites)

    def wants(self, point, layer, batch):
        return (point, layer) in self.sites


def plan(writer, reader, sites=((POST_MLP, 0), (PRE_ATTN, 1))):
    hooks = HookPoints()
    hooks.writers.append(writer)
    hooks.readers.append(reader)
    return hooks._table_adds(list(sites), None)


def test_adds_at_both_sites_fuse_into_two_lookups():
    assert len(plan(FakeWriter(adds=[(POST_MLP, 0), (PRE_ATTN, 1)]), FakeReader())) == 2


def test_nothing_to_write_fuses_with_no_lookup():
    assert plan(FakeWriter(), FakeReader([(POST_MLP, 0), (PRE_ATTN, 1)])) == []


def test_read_after_all_writes_fuses():
    writer = FakeWriter(adds=[(POST_MLP, 0), (PRE_ATTN, 1)])
    assert len(plan(writer, FakeReader([(PRE_ATTN, 1)]))) == 2
    # A read of the earlier site is fine when nothing writes after it.
    assert len(plan(FakeWriter(adds=[(POST_MLP, 0)]), FakeReader([(POST_MLP, 0)]))) == 1


def test_read_between_writes_does_not_fuse():
    writer = FakeWriter(adds=[(PRE_ATTN, 1)])
    assert plan(writer, FakeReader([(POST_MLP, 0)])) is None


def test_clamp_does_not_fuse():
    assert plan(FakeWriter(adds=[(POST_ATTN, 0)], clamps=[(POST_ATTN, 0)]), FakeReader(), [(POST_ATTN, 0)]) is None
