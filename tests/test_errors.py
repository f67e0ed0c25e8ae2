"""User-facing errors are one line whatever they quote; first_line never hides the real error."""

import json

import pytest

from hpc_rl.errors import HpcRlError, RolloutError, first_line
from hpc_rl.rollout.server import service as server
from hpc_rl.rundir import create


def test_first_line_of_any_error():
    assert first_line(ValueError("bad\nsecond")) == "bad"
    assert first_line(ValueError("\n\n  real cause \nmore")) == "real cause"
    assert first_line(KeyError()) == "KeyError"  # empty message: the type, not an IndexError
    assert first_line(RuntimeError("")) == "RuntimeError"
    assert first_line(OSError("x" * 500)) == "x" * 200


def test_hpc_rl_errors_are_one_line():
    e = RolloutError("server 'a\nb' failed\r\nagain")
    assert len(str(e).splitlines()) == 1 and "a\\nb" in str(e)
    assert str(HpcRlError("plain")) == "plain"


@pytest.mark.parametrize("token", ["", "   \n", "short"])
def test_server_refuses_an_empty_or_short_token(tmp_path, capsys, token):
    """`Authorization: Bearer ` with an empty token would otherwise pass: the server does not start."""
    run = create(tmp_path, "t")
    (run.root / "job.yaml").write_text(json.dumps({"model": {"path": str(tmp_path / "no-model")}}))
    run.token_file.write_text(token)
    assert server.main(["--run-dir", str(run.root), "--index", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the run's token is empty or shorter than 16 characters" in err[0], err
    assert not run.rollout_file(0).exists()
