"""The greedy decode loop (engine) and the main job on the bundled tiny model (CPU)."""
import pytest
import torch

from deepfuse import models
from deepfuse.engine.decode import greedy_decode


@pytest.fixture(scope="module")
def tiny():
    return models.tiny.load()


def test_greedy_decode_matches_full_forward(tiny):
    prompts = torch.randint(0, tiny.cfg.vocab_size, (3, 20))
    res = greedy_decode(tiny, prompts, 6)
    assert res.tokens.shape == (3, 26) and torch.equal(res.tokens[:, :20], prompts)
    with torch.no_grad():
        full = tiny(res.tokens)[:, 19:-1].argmax(-1)
    assert torch.equal(full, res.tokens[:, 20:])
    assert res.decode_tok_per_s > 0


def test_greedy_decode_rejects_zero_tokens(tiny):
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_decode(tiny, torch.zeros(1, 4, dtype=torch.long), 0)


def test_main_job_cpu(capsys):
    from deepfuse.__main__ import main

    assert main(["--device", "cpu", "--batch", "2", "--prompt-len", "16", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "agreement with the decode loop: 100.0%" in out
