"""profiler.live_bytes: the bytes of tensors held at their peak, what the predictor's memory is
checked against."""

from __future__ import annotations

import torch

from hethub.profiler.live_bytes import LiveBytes


def test_the_peak_counts_what_lived_at_once_and_views_once():
    kept = torch.zeros(1000)  # 4,000 bytes alive before counting starts
    with LiveBytes() as live:
        start = live.current
        assert start >= kept.nbytes
        a = torch.ones(2000)  # +8,000
        view = a[500:]  # a view: no new storage
        b = a * 2  # +8,000: 16,000 above the start at once
        del a, b  # the view keeps a's storage; b's is freed
        c = torch.ones(500)  # +2,000
        assert live.current - start == 8000 + 2000
    assert live.peak - start == 16000
    del view, c


def test_a_backward_s_gradients_and_saved_tensors_count():
    layer = torch.nn.Linear(100, 100)  # 40,000 + 400 bytes of weights, counted at the start
    x = torch.randn(50, 100, requires_grad=True)
    with LiveBytes() as live:
        start = live.current
        y = torch.relu(layer(x))  # saves its output (20,000) for the backward; the matmul's
        y.sum().backward()  # output is the same storage; then the gradients of x and the weights
    grads = x.grad.nbytes + layer.weight.grad.nbytes + layer.bias.grad.nbytes
    assert live.current - start >= grads  # gradients stay
    assert live.peak - start >= grads + y.nbytes  # with the activation still alive
