"""The command line (issue 10 part 5, issue 11 item 13): commands named for the hyperdcp format with
the old names as aliases, exports that select and rename keys, quiet exit when the output pipe closes,
escaped control characters and lone surrogates in everything printed, and -v logging."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import hyperdcp
from hyperdcp.cli import EXIT_BROKEN_PIPE
from hyperdcp.cli import main as cli_main

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
EVIL = "evil\x1b]0;pwned\x07\x1b[2J\x9b31m"  # retitles the terminal, clears it, CSI in C1 form


def _cli(*args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.Popen([sys.executable, "-m", "hyperdcp", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, **kw)


def _training_state():
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    return model, {"model": model_sd, "optim": optim_sd, "step": 1}


# -- names and key selection ----------------------------------------------------------------------
def test_export_exactly_the_model_weights_of_a_training_checkpoint(tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    model, state = _training_state()
    ckpt = str(tmp_path / "step-1")
    hyperdcp.save(state, ckpt)
    out = str(tmp_path / "hf")
    assert cli_main(["convert", "hyperdcp-to-hf", ckpt, out, "--include", "model.", "--strip-prefix", "model."]) == 0
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(weights) == sorted(model.state_dict()), "no optimizer tensor, no 'model.' prefix"
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fresh.load_state_dict(weights, strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert "skipped" not in capsys.readouterr().err, "the optimizer's plain values are not selected either"


def test_an_unfiltered_export_says_how_to_select_the_model(tmp_path, capsys):
    _, state = _training_state()
    ckpt = str(tmp_path / "step-1")
    hyperdcp.save(state, ckpt)
    assert cli_main(["convert", "hyperdcp-to-hf", ckpt, str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "model., optim." in out and "--include model. --strip-prefix model." in out


def test_exclude_and_a_selection_that_matches_nothing(tmp_path, capsys):
    from safetensors.numpy import load_file

    ckpt = str(tmp_path / "c")
    hyperdcp.save({"model": {"w": np.ones(3, np.float32), "ema": {"w": np.zeros(3, np.float32)}}}, ckpt)
    assert cli_main(["convert", "hyperdcp-to-hf", ckpt, str(tmp_path / "a"), "--exclude", "model.ema.", "-q"]) == 0
    assert sorted(load_file(str(tmp_path / "a" / "model.safetensors"))) == ["model.w"]
    assert cli_main(["convert", "hyperdcp-to-hf", ckpt, str(tmp_path / "b"), "--include", "modle.", "-q"]) == 1
    assert "no tensor of" in capsys.readouterr().err and not os.path.exists(tmp_path / "b" / "model.safetensors")


def test_new_command_names_and_the_old_aliases_convert_alike(tmp_path, capsys):
    from safetensors.numpy import save_file

    src = str(tmp_path / "m.safetensors")
    save_file({"a.w": np.arange(6, dtype=np.float32).reshape(2, 3)}, src)
    for i, (to, back) in enumerate([("hf-to-hyperdcp", "hyperdcp-to-hf"), ("hf-to-dcp", "dcp-to-hf")]):
        ck, hf_dir = str(tmp_path / f"ck{i}"), str(tmp_path / f"hf{i}")
        assert cli_main(["convert", to, src, ck, "-q"]) == 0
        assert cli_main(["convert", back, ck, hf_dir, "-q"]) == 0
        assert cli_main(["diff", src, hf_dir]) == 0
    with pytest.raises(SystemExit):
        cli_main(["convert", "--help"])
    helptext = capsys.readouterr().out
    assert "hf-to-hyperdcp" in helptext and "hyperdcp-to-hf" in helptext


# -- closed output pipe ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def many_tensors(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("many")
    path = str(tmp_path / "many")
    hyperdcp.save({f"layer{i:05d}.weight": np.full(2, i, np.float32) for i in range(3000)}, path)
    other = str(tmp_path / "other")
    hyperdcp.save({f"layer{i:05d}.weight": np.full(2, i + 1, np.float32) for i in range(3000)}, other)
    return path, other


@pytest.mark.parametrize("command", ["inspect", "inspect --json", "diff"])
def test_a_closed_output_pipe_ends_the_command_quietly(many_tensors, command):
    path, other = many_tensors
    args = command.split() + [path] + ([other] if command == "diff" else [])
    proc = _cli(*args)
    first = proc.stdout.readline()
    proc.stdout.close()  # what `| head -1` does
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert first, "the command printed before the pipe closed"
    assert err == "", err
    assert proc.returncode == EXIT_BROKEN_PIPE


# -- hostile names --------------------------------------------------------------------------------
def test_control_characters_in_names_are_escaped_in_inspect_and_diff(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    hyperdcp.save({EVIL: np.ones(2, np.float32), "cfg": {EVIL: 1}}, a)
    hyperdcp.save({EVIL: np.zeros(2, np.float32)}, b)
    assert cli_main(["inspect", a]) == 0
    assert cli_main(["diff", a, b]) == 1
    out = capsys.readouterr().out
    for c in "\x1b\x07\x9b":
        assert c not in out
    assert "evil\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m" in out
    assert cli_main(["inspect", a, "--json"]) == 0  # JSON escapes them itself, and round-trips the name
    raw = capsys.readouterr().out
    assert "\x1b" not in raw and [t["name"] for t in json.loads(raw)["tensors"]] == [EVIL]


def test_lone_surrogates_in_keys_do_not_crash_inspect_diff_or_convert(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    hyperdcp.save({"bad\ud800key": np.ones(2, np.float32), "ok": np.ones(2, np.float32)}, a)
    hyperdcp.save({"bad\ud800key": np.ones(2, np.float32), "ok": np.ones(2, np.float32)}, b)
    assert cli_main(["inspect", a]) == 0
    assert cli_main(["diff", a, b]) == 0
    assert "bad\\ud800key" in capsys.readouterr().out
    assert cli_main(["convert", "hyperdcp-to-hf", a, str(tmp_path / "hf"), "-q"]) == 1
    err = capsys.readouterr().err
    assert "bad\\ud800key" in err and "lone surrogate" in err and "--exclude" in err
    assert cli_main(["convert", "hyperdcp-to-hf", a, str(tmp_path / "hf"), "-q", "--exclude", "bad"]) == 0


def test_error_messages_are_escaped(tmp_path, capsys):
    assert cli_main(["inspect", str(tmp_path / EVIL)]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "no checkpoint" in err


# -- logging ---------------------------------------------------------------------------------------
def test_verbose_logs_progress_and_the_summary_to_stderr(tmp_path):
    path = str(tmp_path / "c")
    hyperdcp.save({f"t{i}": np.full(1000, i, np.float32) for i in range(20)}, path)
    proc = _cli("-v", "convert", "hyperdcp-to-hf", path, str(tmp_path / "hf"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert b"hyperdcp: hyperdcp -> hf: 100.0%" in err
    proc = _cli("convert", "hyperdcp-to-hf", path, str(tmp_path / "hf2"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and err == b"", "nothing is logged without -v"
