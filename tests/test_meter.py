"""Memory is counted exactly from the tensors that exist."""
import torch

from training.meter import ActivationMeter, gradient_bytes, optimizer_bytes, parameter_bytes, tensor_bytes


def test_saved_activations_are_counted_until_backward_frees_them():
    w = torch.nn.Parameter(torch.randn(8, 4, dtype=torch.float64))
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    meter = ActivationMeter([w])
    with meter:
        h = x @ w          # saves x (and w, a parameter: not an activation)
        y = h.tanh()       # saves its output y
        loss = y.sum()
    assert meter.live == x.nbytes + y.nbytes == meter.peak
    loss.backward()
    assert meter.live == 0 and meter.peak == x.nbytes + y.nbytes
    meter.reset_peak()
    assert meter.peak == 0


def test_a_storage_saved_twice_counts_once():
    x = torch.randn(6, 6, requires_grad=True)
    meter = ActivationMeter()
    with meter:
        a, b = x.view(2, 18).unbind(0)  # two views of one storage
        (a * b).sum().backward()
    assert meter.peak == x.nbytes


def test_parameter_gradient_and_optimizer_bytes():
    model = torch.nn.Linear(10, 3)  # 33 float32 parameters in two tensors
    assert parameter_bytes(model.parameters()) == 33 * 4
    assert gradient_bytes(model.parameters()) == 0
    model(torch.randn(2, 10)).sum().backward()
    assert gradient_bytes(model.parameters()) == 33 * 4
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()
    # exp_avg and exp_avg_sq per parameter, plus a one-element float32 step counter per tensor.
    assert optimizer_bytes(optimizer) == 2 * 33 * 4 + 2 * 4
    flat = torch.zeros(10)
    assert tensor_bytes([flat[:5], flat[5:]]) == 40  # views of one bucket count the bucket once
