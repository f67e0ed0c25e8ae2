"""The corpus of bad inputs under tests/data/bad/: each bad job spec, dataset or CLI misuse ends in one line
naming the cause and the fix, exit 2, no traceback and no run dir left behind; a property test mutating a
valid config never gets anything but a config error."""

import copy
import math
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc_rl import cli, config, launch
from hpc_rl.errors import HpcRlError

BAD = Path(__file__).resolve().parent / "data" / "bad"
CONFIGS = sorted((BAD / "configs").glob("*.yaml"))
CLI_CASES = yaml.safe_load((BAD / "cli.yaml").read_text())


def _expect(path: Path) -> str:
    first = path.read_bytes().split(b"\n", 1)[0].decode()
    assert first.startswith("# expect: "), path
    return first[len("# expect: "):]


@pytest.fixture
def in_bad_dir(monkeypatch, tmp_path):
    """cwd = tests/data/bad (datasets are named relative to it); a bad input that is accepted fails the test
    instead of starting a run."""
    monkeypatch.chdir(BAD)

    def accepted(*a, **k):
        raise AssertionError("the bad input was accepted and a run would start")

    monkeypatch.setattr(launch, "run_local", accepted)
    return tmp_path


def _check_one_line_error(capsys, rc: int, expect: str, out: Path) -> str:
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert rc == 2, (rc, cap.out[-2000:], err[-2000:])
    assert "Traceback" not in cap.err + cap.out
    # (The tiny-model builder's progress bar may precede it on stderr.)
    lines = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1 and err.endswith(lines[0]), err
    assert lines[0].startswith("hpc-rl: error: "), lines[0]
    assert expect in lines[0], f"\nexpected: {expect}\ngot:      {lines[0]}"
    # A run that never started leaves no run dir behind.
    assert not (out / "runs").exists() or not any((out / "runs").iterdir()), list((out / "runs").iterdir())
    return lines[0]


def test_the_corpus_is_big_enough():
    datasets = list((BAD / "datasets").iterdir())
    assert len(CONFIGS) + len(CLI_CASES) >= 30 and len(datasets) >= 10


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_bad_job_spec_or_dataset(path, in_bad_dir, capsys):
    out = in_bad_dir
    rel = path.relative_to(BAD)
    rc = cli.main(["run", str(rel), f"output_dir={out / 'runs'}"])
    _check_one_line_error(capsys, rc, _expect(path), out)


@pytest.mark.parametrize("case", CLI_CASES, ids=[" ".join(c["args"])[:60] for c in CLI_CASES])
def test_cli_misuse(case, in_bad_dir, capsys):
    out = in_bad_dir
    args = [a.replace("{out}", str(out / "runs")) for a in case["args"]]
    try:
        rc = cli.main(args)
    except SystemExit as e:  # argparse usage errors exit 2 themselves
        rc = e.code
    _check_one_line_error(capsys, rc, case["expect"], out)


# --------------------------------------------------------------------------- property test

VALID = yaml.safe_load((BAD.parent.parent.parent / "jobs" / "toy-grpo-cpu.yaml").read_text())


def _paths(d: dict, prefix=()) -> list[tuple]:
    out = []
    for k, v in d.items():
        out.append(prefix + (k,))
        if isinstance(v, dict):
            out += _paths(v, prefix + (k,))
    return out


def _known_paths() -> list[tuple]:
    """Every dotted key of the schema (from a default config), plus those of the valid job."""
    d = config.to_dict(config.load_dict(copy.deepcopy(VALID)))
    return sorted(set(_paths(d)) | set(_paths(VALID)))


KEYS = _known_paths()
values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.sampled_from([0, 1, -1, 2**31, 2**64])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
    | st.sampled_from(["", "auto", "grpo", "ppo", "cpu", "1e-3", "toy:repeat_digit", "k3", "hf", "nan"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
mutation = st.tuples(st.sampled_from(["set", "delete", "new_key"]), st.sampled_from(KEYS), values,
                     # New key names: any text, line breaks included (the message shows them escaped).
                     st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8))


def _mutate(data: dict, muts) -> dict:
    data = copy.deepcopy(data)
    for op, path, value, name in muts:
        node = data
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        if op == "set":
            node[path[-1]] = value
        elif op == "delete":
            node.pop(path[-1], None)
        else:
            node[name] = value
    return data


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutation, min_size=1, max_size=4))
def test_mutated_configs_never_raise_anything_but_a_config_error(muts):
    data = _mutate(VALID, muts)
    try:
        cfg = config.load_dict(data)
    except HpcRlError as e:
        msg = str(e)
        assert msg and "\n" not in msg, repr(msg)
        return
    # Accepted: the resolved config round-trips through job.yaml unchanged.
    assert config.to_dict(config.load_dict(yaml.safe_load(config.dump(cfg)))) == config.to_dict(cfg)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=20), max_size=3))
def test_random_overrides_never_raise_anything_but_a_config_error(overrides):
    try:
        config.load_dict(copy.deepcopy(VALID), overrides)
    except HpcRlError as e:
        assert "\n" not in str(e)


def test_numbers_that_are_not_finite_are_rejected():
    for key in ("trainer.lr", "rollout.temperature", "algorithm.clip_ratio"):
        with pytest.raises(HpcRlError, match=re.escape(key)):
            config.load_dict(copy.deepcopy(VALID), [f"{key}=.nan"])
    assert math.isnan(float("nan"))
