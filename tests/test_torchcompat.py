"""The one module that knows how torch releases differ: each adaptation checked against a real torch object
where this torch has one, and against a stand-in for the release that lacks the feature."""

from __future__ import annotations

import argparse

from supervisor.torchcompat import torchrun_args

ARGS = ["--nnodes", "1", "--nproc-per-node", "2", "--standalone", "--max-restarts", "0",
        "--shutdown-timeout", "15", "--log-dir", "/l", "--redirects", "3", "-m", "--", "train_entry",
        "--shutdown-timeout", "9", "--local", "x", "--steps", "10"]


def older_torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's parser as releases before --shutdown-timeout build it (the options we pass, less that one)."""
    p = argparse.ArgumentParser()
    for opt in ("--nnodes", "--nproc-per-node", "--max-restarts", "--log-dir", "--redirects"):
        p.add_argument(opt)
    p.add_argument("--standalone", action="store_true")
    p.add_argument("-m", "--module", action="store_true")
    return p


def test_a_tuning_option_torchrun_lacks_is_dropped_with_its_value_and_only_before_the_entry():
    out = torchrun_args(ARGS, older_torchrun_parser())
    assert out == ["--nnodes", "1", "--nproc-per-node", "2", "--standalone", "--max-restarts", "0",
                   "--log-dir", "/l", "--redirects", "3", "-m", "--", "train_entry",
                   "--shutdown-timeout", "9", "--local", "x", "--steps", "10"]  # the entry point's own args
    assert torchrun_args(["--shutdown-timeout=15", "s.py"], older_torchrun_parser()) == ["s.py"]
    assert torchrun_args(["--shutdown-timeout=15", "--", "s.py", "--x", "y"], older_torchrun_parser()) == \
        ["--", "s.py", "--x", "y"]


def test_the_installed_torchrun_gets_every_option_it_knows():
    import torch.distributed.run as torchrun

    parser = torchrun.get_args_parser()
    out = torchrun_args(ARGS, parser)
    knows = "--shutdown-timeout" in parser._option_string_actions
    assert out == ARGS if knows else ("--shutdown-timeout" not in out[:out.index("-m")])
    parsed = parser.parse_args(out)  # whatever we pass, this torchrun accepts
    assert parsed.module and parsed.training_script == "train_entry"
    # `--local` abbreviates two of torchrun's options: after `--` it is the entry point's, as it was written
    assert parsed.training_script_args == ["--shutdown-timeout", "9", "--local", "x", "--steps", "10"]


def test_options_torchrun_does_not_know_and_we_do_not_tune_still_reach_it():
    out = torchrun_args(["--bogus", "x", "--standalone", "s.py"], older_torchrun_parser())
    assert out == ["--bogus", "x", "--standalone", "s.py"]
