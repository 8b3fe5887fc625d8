"""The command lines (python -m deepfuse, python -m deepfuse.serve) refuse bad arguments
with argparse's usage error: exit status 2, one `error:` line naming the option, no
traceback, before anything heavy is loaded where the check allows."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deepfuse

PKG_ROOT = str(Path(deepfuse.__file__).resolve().parent.parent)


def run_cli(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PKG_ROOT, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def assert_usage_error(r: subprocess.CompletedProcess, option: str, words: str = ""):
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    last = err.splitlines()[-1]
    assert "error:" in last and option in last and words in last, last


MAIN = [
    (["--device", "bogus"], "--device", "cpu, cuda or cuda:N"),
    (["--model", "nope"], "--model", "nope"),
    (["--num-requests", "0"], "--num-requests", "positive"),
    (["--min-prompt", "9", "--max-prompt", "3"], "--min-prompt", ""),
]
if not torch.cuda.is_available():
    MAIN.append((["--device", "cuda"], "--device", "no CUDA device"))

SERVE = [
    (["--max-num-seqs", "0"], "--max-num-seqs", "positive"),
    (["--port", "70000"], "--port", "65535"),
    (["--log-level", "nope"], "--log-level", "nope"),
    (["--kv-dtype", "bogus"], "--kv-dtype", "bogus"),
    (["--tp", "0"], "--tp", "positive"),
    (["--page-size", "7"], "--page-size", "multiple of 16"),
    (["--page-size", "40"], "--page-size", "multiple of 16"),
    (["--max-pending", "0"], "--max-pending", "positive"),
    (["--num-speculative-tokens", "9"], "--num-speculative-tokens", ""),
    (["--model", "nope"], "--model", "nope"),
    (["--device", "bogus"], "--device", ""),
]
if not torch.cuda.is_available():
    SERVE.append((["--device", "cuda"], "--device", "no CUDA device"))


def parse_error(parse, args, capsys) -> subprocess.CompletedProcess:
    """parse(args) in this process, as a CompletedProcess of its usage error."""
    with pytest.raises(SystemExit) as e:
        parse(list(args))
    return subprocess.CompletedProcess(args, e.value.code, "", capsys.readouterr().err)


@pytest.mark.parametrize("args,option,words", MAIN, ids=[" ".join(a) for a, _, _ in MAIN])
def test_main_job_usage_errors(args, option, words, capsys):
    from deepfuse.__main__ import main

    assert_usage_error(parse_error(main, args, capsys), option, words)


@pytest.mark.parametrize("args,option,words", SERVE, ids=[" ".join(a) for a, _, _ in SERVE])
def test_serve_usage_errors(args, option, words, capsys):
    pytest.importorskip("fastapi")
    from deepfuse.serve.__main__ import parse_args

    assert_usage_error(parse_error(parse_args, args, capsys), option, words)


@pytest.mark.parametrize("module,args,option,words", [
    ("deepfuse", ["--device", "bogus"], "--device", "cpu, cuda or cuda:N"),
    ("deepfuse", ["--model", "nope"], "--model", "nope"),
    ("deepfuse.serve", ["--port", "70000"], "--port", "65535"),
    ("deepfuse.serve", ["--page-size", "7"], "--page-size", "multiple of 16"),
])
def test_cli_processes_exit_2_without_traceback(module, args, option, words):
    if module == "deepfuse.serve":
        pytest.importorskip("fastapi")
    assert_usage_error(run_cli(module, *args), option, words)


def test_main_job_prompt_over_the_context():
    """A prompt length the model's context cannot hold: a usage error once the model says how
    long its context is (the bundled tiny model: 65536 positions)."""
    r = run_cli("deepfuse", "--device", "cpu", "--max-prompt", "70000", "--num-requests", "1")
    assert_usage_error(r, "--max-prompt", "max_model_len")


def test_model_dir_without_config(tmp_path, capsys):
    from deepfuse.__main__ import main

    assert_usage_error(parse_error(main, ["--model", str(tmp_path)], capsys), "--model", "config.json")
