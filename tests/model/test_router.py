"""The MoE router logits (models/moe.py Gate.logits): fp32 x @ weight^T; from ROUTER_SPLIT_MIN_T bf16
rows on CUDA through one bf16 GEMM over the weight's three bf16 terms."""
import pytest
import torch

from deepfuse.models import moe as M
from deepfuse.models.config import V4Config


def _gate(E, d, device, seed=0, spread=False):
    g = torch.Generator().manual_seed(seed)
    cfg = V4Config(n_routed_experts=E, hidden_size=d)
    gate = M.Gate(cfg, is_hash=False)
    w = torch.randn(E, d, generator=g) * 0.02
    if spread:  # magnitudes over many binades, tiny and large entries
        w = w * torch.exp2(torch.randint(-40, 20, (E, d), generator=g).float())
    gate.weight = w.to(device)
    return gate


@pytest.mark.parametrize("spread", [False, True])
def test_weight_terms_sum_exactly_to_the_weight(spread):
    gate = _gate(64, 512, "cpu", seed=1, spread=spread)
    t = gate._weight_terms().view(3, 64, 512).float()
    assert gate._weight_terms().dtype == torch.bfloat16
    assert torch.equal((t[0] + t[1]) + t[2], gate.weight)


def test_weight_terms_follow_a_new_weight():
    gate = _gate(8, 256, "cpu", seed=2)
    first = gate._weight_terms().clone()
    gate.weight.mul_(2.0)  # in place: same storage, new version
    assert torch.equal(gate._weight_terms(), first * 2)
    gate.weight = torch.randn(8, 256)
    assert torch.equal(gate._weight_terms().view(3, 8, 256).float().sum(0), gate.weight)


def test_cpu_and_small_t_use_the_fp32_linear():
    gate = _gate(32, 256, "cpu", seed=3)
    x = torch.randn(M.ROUTER_SPLIT_MIN_T + 5, 256).bfloat16()
    assert torch.equal(gate.logits(x), torch.nn.functional.linear(x.float(), gate.weight))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [M.ROUTER_SPLIT_MIN_T - 1, M.ROUTER_SPLIT_MIN_T, 1000, 4096])
@torch.no_grad()
def test_gpu_split_logits_match_fp32(T):
    """Against the float64 product: the split GEMM's error is that of an fp32 GEMM (bound: 4x the fp32
    F.linear's max error plus 1e-6 of the row scale), and top-6 sets match the fp32 ones (ties aside)."""
    gate = _gate(256, 4096, "cuda", seed=4)
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(T, 4096, device="cuda", generator=g).bfloat16()
    got = gate.logits(x)
    fp32 = torch.nn.functional.linear(x.float(), gate.weight)
    exact = torch.nn.functional.linear(x.double(), gate.weight.double())
    assert got.dtype == torch.float32 and got.shape == (T, 256)
    scale = (x.double().abs() @ gate.weight.double().abs().t()).max().item()
    e_got, e_fp32 = (got.double() - exact).abs().max().item(), (fp32.double() - exact).abs().max().item()
    print(f"T={T}: max err split {e_got:.3e}, fp32 linear {e_fp32:.3e}, row scale {scale:.3e}")
    assert e_got <= 4 * e_fp32 + 1e-6 * scale
    same = (got.topk(6).indices.sort(-1).values == fp32.topk(6).indices.sort(-1).values).all(-1).float().mean()
    assert same.item() >= 0.99
