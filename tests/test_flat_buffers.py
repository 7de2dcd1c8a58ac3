"""A rank's weights and main gradients in flat buffers (runtime.flat_layout): the layout."""

from __future__ import annotations

import pytest
import torch

from hethub.runtime.flat_layout import FlatLayout


def test_buckets_come_first_each_contiguous_and_padded_to_the_shards():
    shapes = {"a": (2, 3), "b": (5,), "c": (4,), "d": (1,), "e": (7,)}
    layout = FlatLayout(shapes, [["c", "a"], ["e"]], shards=4)
    # bucket 0: c then a (10 elements) padded to 12; bucket 1: e (7) padded to 8; then b and d
    assert layout.spans == {"c": (0, 4), "a": (4, 10), "e": (12, 19), "b": (20, 25), "d": (25, 26)}
    assert [(s.start, s.used, s.stop) for s in layout.buckets] == [(0, 10, 12), (12, 19, 20)]
    assert layout.unbucketed == ("b", "d") and layout.numel == 26
    assert layout.padding() == [(10, 12), (19, 20)]
    assert [layout.shard(0, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert [layout.shard(1, r) for r in range(4)] == [(12, 14), (14, 16), (16, 18), (18, 20)]
    flat = torch.arange(26.0)
    assert torch.equal(layout.view(flat, "a"), torch.arange(4.0, 10.0).view(2, 3))
    assert torch.equal(layout.bucket(flat, 1, padded=True), torch.arange(12.0, 20.0))
    assert torch.equal(layout.view(flat[12:20], "e", offset=12), torch.arange(12.0, 19.0))


def test_a_layout_refuses_an_unknown_or_twice_bucketed_parameter():
    with pytest.raises(ValueError, match="z is not one of the rank's"):
        FlatLayout({"a": (1,)}, [["z"]])
    with pytest.raises(ValueError, match="a is in two buckets"):
        FlatLayout({"a": (1,)}, [["a"], ["a"]])
