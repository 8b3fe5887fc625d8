"""models.tiny (the bundled random V4 checkpoint) and the MTP layer."""
import torch

from v4_oracle import ids, rel_err, one_thread  # noqa: F401

from deepfuse import models
from deepfuse.models import tiny


def test_tiny_is_deterministic_and_cached(tmp_path):
    a = tiny.tensors(tiny.CONFIG, seed=0)
    b = tiny.tensors(tiny.CONFIG, seed=0)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    p = tiny.path(tmp_path)
    stamp = (p / "model.safetensors.index.json").stat().st_mtime_ns
    assert tiny.path(tmp_path) == p
    assert (p / "model.safetensors.index.json").stat().st_mtime_ns == stamp
    assert len(list(p.glob("*.safetensors"))) == 2
    assert {k.split(".")[0] for k in a} >= {"embed", "head", "norm", "layers", "mtp", "hc_head_fn"}


@torch.no_grad()
def test_tiny_model_covers_the_architecture(tmp_path):
    m = tiny.load(tmp_path)
    assert [layer.attn.layer_type for layer in m.layers] == [
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
        "compressed_sparse_attention"]
    assert [layer.ffn.is_hash for layer in m.layers] == [True, True, False, False]
    assert len(m.mtp) == 1 and m.mtp[0].attn.layer_type == "sliding_attention"
    x = ids(2, 140, m.cfg.vocab_size)
    out = m(x)
    assert out.shape == (2, 140, m.cfg.vocab_size) and out.dtype == torch.float32 and torch.isfinite(out).all()


@torch.no_grad()
def test_mtp_full_forward(tmp_path):
    m = tiny.load(tmp_path)
    T = 150
    x = ids(2, T + 1, m.cfg.vocab_size, seed=9)
    _, streams = m(x[:, :T], return_streams=True)
    full, _ = m.mtp_forward(streams, x[:, 1:T + 1])
    assert full.shape == (2, T, m.cfg.vocab_size) and torch.isfinite(full).all()
