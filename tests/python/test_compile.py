"""torch.compile(fullgraph=True) over the fusednorm operators: no graph break, same results.

Inductor compiles C++ on the CPU, so these are the slowest tests; they are kept few.
"""

from __future__ import annotations

import torch
from conftest import assert_close_normalized

import fusednorm


class Block(torch.nn.Module):
    """A pre-norm residual block using every fusednorm entry point."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = fusednorm.RMSNorm(d, eps=1e-6)
        self.proj = torch.nn.Linear(d, d)
        self.ln = fusednorm.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(self.norm(x))
        h = fusednorm.rms_norm(h, self.norm.weight, 1e-6, 1.0)  # Gemma-style offset
        return self.ln(h)


def _run(model, x):
    x = x.clone().requires_grad_()
    y = model(x)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return y.detach(), x.grad, grads


def test_compile_fullgraph_forward_backward():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block(64)
    with torch.no_grad():
        model.norm.weight.normal_()
    x = torch.randn(3, 7, 64)
    eager = _run(model, x)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)  # raises on a graph break
    got = _run(compiled, x)
    assert_close_normalized(got[0], eager[0], 1e-5, "y")
    assert_close_normalized(got[1], eager[1], 1e-5, "dx")
    for g, e in zip(got[2], eager[2]):
        assert_close_normalized(g, e, 1e-5, "param grad")
    # the compiled graph calls our kernels, not a decomposition
    from torch._dynamo.utils import counters

    assert counters["stats"]["unique_graphs"] >= 1
    assert not counters["graph_break"]


def test_compile_fused_add_inference_dynamic_shapes():
    torch._dynamo.reset()

    def step(x, residual, w):
        y = fusednorm.fused_add_rms_norm(x, residual, w, 1e-6)
        return y * 2

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    w = torch.randn(32)
    for rows in (3, 5):
        x, residual = torch.randn(rows, 32), torch.randn(rows, 32)
        r1, r2 = residual.clone(), residual.clone()
        with torch.no_grad():
            expected = step(x, r1, w)
            got = compiled(x, r2, w)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(r2, r1)  # the in-place update survives functionalization
