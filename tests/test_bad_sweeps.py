"""Bad sweep files (tests/data/bad/sweeps/): `hpc-rl sweep FILE --dry-run` ends in one line naming the cause
and the fix, exit 2, no traceback and no sweep dir left behind."""

from pathlib import Path

import pytest

from hpc_rl import cli

SWEEPS = sorted((Path(__file__).resolve().parent / "data" / "bad" / "sweeps").glob("*.yaml"))


def test_the_sweep_corpus_exists():
    assert len(SWEEPS) >= 10


@pytest.mark.parametrize("path", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_bad_sweep_file(path, tmp_path, monkeypatch, capsys):
    expect = path.read_text().split("\n", 1)[0].removeprefix("# expect: ")
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["sweep", str(path), "--dry-run"])
    cap = capsys.readouterr()
    assert rc == 2, (cap.out[-2000:], cap.err[-2000:])
    assert "Traceback" not in cap.out + cap.err
    err = cap.err.strip().splitlines()[-1]
    assert err.startswith("hpc-rl: error: ") and expect in err, f"\nexpected: {expect}\ngot:      {err}"
    assert not (tmp_path / "runs").exists() and not (path.parent / "runs").exists()


REPO = Path(__file__).resolve().parents[1]


def test_a_sweep_file_given_to_run_says_to_use_sweep(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["run", str(REPO / "jobs" / "sweep-kl.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "this is a sweep file (base + grid/list), not a job spec: run it with `hpc-rl sweep " in err[0], err
    assert not (tmp_path / "runs").exists()


def test_a_common_override_the_grid_shadows_is_named(tmp_path, monkeypatch, capsys, caplog):
    """sweep-kl's grid sets algorithm.kl.coef on every point: an override of it on the command line would be
    replaced by each point's value; the warning names it, the other override is applied."""
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING", logger="hpc_rl"):
        rc = cli.main(["sweep", str(REPO / "jobs" / "sweep-kl.yaml"), "--dry-run", "algorithm.kl.coef=0.3",
                       "trainer.lr=2e-3"])
    assert rc == 0, capsys.readouterr().err[-2000:]
    assert "the override(s) of algorithm.kl.coef are replaced by every point's own value" in caplog.text
    assert "trainer.lr" not in caplog.text
