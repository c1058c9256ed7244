"""When the residual add, steering and norm may run as one kernel: whenever no read needs a value
that a later write changes (additive rows and projection clamps alike)."""

from types import SimpleNamespace

import torch

from steerable.hook_points import POST_ATTN, POST_MLP, PRE_ATTN, HookPoints, SiteWrite

TABLE = torch.zeros(2, 4)
INDEX = torch.zeros(3, dtype=torch.int64)


class FakeSteering:
    def __init__(self, adds=(), clamps=(), reads=()):
        self.adds, self.clamps, self.reads = set(adds), set(clamps), set(reads)

    def acts_at(self, site):
        return site in self.adds | self.clamps

    def reads_at(self, site):
        return site in self.reads

    def site_write(self, site):
        clamped = site in self.clamps
        return SiteWrite(INDEX, TABLE if site in self.adds else None, TABLE[:, None] if clamped else None,
                         TABLE[:, None, :3] if clamped else None)


class FakeCapture:
    def __init__(self, sites=()):
        self.sites = set(sites)

    def wants(self, site):
        return site in self.sites


def plan(steering, capture, sites=((POST_MLP, 0), (PRE_ATTN, 1))):
    return HookPoints._fusable_writes(list(sites), SimpleNamespace(steering=steering, capture=capture))


def test_adds_at_both_sites_fuse_into_two_lookups():
    assert len(plan(FakeSteering(adds=[(POST_MLP, 0), (PRE_ATTN, 1)]), FakeCapture())) == 2


def test_nothing_to_write_fuses_with_no_lookup():
    assert plan(FakeSteering(), FakeCapture([(POST_MLP, 0), (PRE_ATTN, 1)])) == []
    assert plan(None, None) == []


def test_read_after_all_writes_fuses():
    steering = FakeSteering(adds=[(POST_MLP, 0), (PRE_ATTN, 1)])
    assert len(plan(steering, FakeCapture([(PRE_ATTN, 1)]))) == 2
    # A read of the earlier site is fine when nothing writes after it.
    assert len(plan(FakeSteering(adds=[(POST_MLP, 0)]), FakeCapture([(POST_MLP, 0)]))) == 1


def test_read_between_writes_does_not_fuse():
    assert plan(FakeSteering(adds=[(PRE_ATTN, 1)]), FakeCapture([(POST_MLP, 0)])) is None


def test_clamps_fuse_like_adds():
    writes = plan(FakeSteering(adds=[(POST_ATTN, 0)], clamps=[(POST_ATTN, 0)]), FakeCapture(), [(POST_ATTN, 0)])
    assert len(writes) == 1 and writes[0].add is not None and writes[0].clamp_dir is not None
    both = plan(FakeSteering(clamps=[(POST_MLP, 0), (PRE_ATTN, 1)]), FakeCapture([(PRE_ATTN, 1)]))
    assert [w.add is None and w.clamp_dir is not None for w in both] == [True, True]
    assert plan(FakeSteering(clamps=[(PRE_ATTN, 1)]), FakeCapture([(POST_MLP, 0)])) is None


def test_a_transcoder_read_between_writes_does_not_fuse():
    """A transcoder feature clamp reads its feature where the transcoder reads: like a capture, it
    must see the value before a later write."""
    sites = [(POST_MLP, 0), (PRE_ATTN, 1)]
    assert plan(FakeSteering(adds=[(PRE_ATTN, 1)], reads=[(POST_MLP, 0)]), FakeCapture(), sites) is None
    assert len(plan(FakeSteering(adds=[(POST_MLP, 0)], reads=[(POST_ATTN, 0)]), FakeCapture(), sites)) == 1
