"""The MoE reference's sync-free form (used under CUDA-graph capture) equals its eager form."""
import torch

from deepfuse.ops import moe


def test_moe_reference_capture_form_matches_eager(monkeypatch):
    g = torch.Generator().manual_seed(0)
    T, d, I, E, k = 9, 32, 16, 6, 2
    x = torch.randn(T, d, generator=g)
    w1, w3 = torch.randn(E, I, d, generator=g) * 0.2, torch.randn(E, I, d, generator=g) * 0.2
    w2 = torch.randn(E, d, I, generator=g) * 0.2
    ids = torch.randint(-1, E + 1, (T, k), generator=g)  # -1 and E: no contribution
    w = torch.rand(T, k, generator=g)
    eager = moe.moe_experts_ref(x, ids, w, w1, w3, w2, None, None, None, "dense", 10.0)
    monkeypatch.setattr(moe, "_capturing", lambda t: True)
    graph = moe.moe_experts_ref(x, ids, w, w1, w3, w2, None, None, None, "dense", 10.0)
    torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)
    assert eager.abs().sum() > 0
