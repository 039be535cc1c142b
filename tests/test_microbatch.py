from collections import namedtuple

import pytest
import torch

from lightning_pipe.runtime.microbatch import batch_size, signature, split_microbatches


def test_split_nested_structures_with_uneven_sizes():
    Pair = namedtuple("Pair", "a b")
    batch = {"x": torch.arange(10).view(10, 1), "rest": [torch.ones(10, 2), Pair(torch.zeros(10), "tag")], "n": 3}
    parts, weights = split_microbatches(batch, 4)
    assert [p["x"].shape[0] for p in parts] == [3, 3, 2, 2]
    assert torch.equal(torch.cat([p["x"] for p in parts]), batch["x"])
    assert all(isinstance(p["rest"][1], Pair) and p["rest"][1].b == "tag" and p["n"] == 3 for p in parts)
    assert weights == pytest.approx([0.3, 0.3, 0.2, 0.2]) and sum(weights) == pytest.approx(1.0)


def test_weighted_microbatch_gradients_equal_full_batch_gradient():
    torch.manual_seed(0)
    w = torch.randn(4, 1, dtype=torch.float64, requires_grad=True)
    x, y = torch.randn(11, 4, dtype=torch.float64), torch.randn(11, 1, dtype=torch.float64)
    full = torch.autograd.grad(((x @ w - y) ** 2).mean(), w)[0]
    parts, weights = split_microbatches((x, y), 3)
    acc = sum(torch.autograd.grad(((px @ w - py) ** 2).mean() * wt, w)[0] for (px, py), wt in zip(parts, weights))
    assert torch.allclose(acc, full, rtol=1e-12, atol=0)


def test_batch_smaller_than_microbatches_is_a_clear_error():
    with pytest.raises(ValueError, match=r"batch of 3 samples cannot be split into microbatches=4"):
        split_microbatches(torch.zeros(3, 2), 4)


def test_inconsistent_batch_dimension_is_a_clear_error():
    with pytest.raises(ValueError, match="disagree on their dim-0"):
        batch_size((torch.zeros(3), torch.zeros(4)))


def test_signature_tracks_shapes():
    assert signature((torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))) != signature(
        (torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))
    )
