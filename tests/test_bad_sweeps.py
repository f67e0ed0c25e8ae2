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
