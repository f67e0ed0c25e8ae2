"""The README holds: every `hpc-rl ...` command in its code blocks parses with the real argument parser (options,
choices, arity), the job files it passes load as jobs, and every repository path it names exists."""

import argparse
import re
import shlex
from pathlib import Path

import pytest

from hpc_rl.cli import build_parser, parse_args
from hpc_rl.config import load

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
# Placeholders the README writes in upper case, and what stands in for each when parsing.
PLACEHOLDERS = {"JOB.yaml": "jobs/toy-grpo-cpu.yaml", "RUN": "runs/x", "SWEEP": "sweeps/x", "OUT/": "out/", "N": "3",
                "JOBID": "123", "FILE": "jobs/sweep-kl.yaml", "DIR": "out/"}


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M)


def commands(text: str) -> list[str]:
    """Each `hpc-rl ...` command of the code blocks: comments cut, continuation lines joined, `a ; b` split, the
    README's `[--option VALUE]` optional parts taken in and `a | b` alternatives as their first."""
    out = []
    for block in code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            for part in line.split(" ; "):
                part = part.strip()
                if part.startswith("hpc-rl "):
                    part = re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(" | ")[0], part)
                    out.append(part)
    return out


CMDS = commands(README)


def test_the_readme_has_commands_to_check():
    assert len(CMDS) >= 15, CMDS  # the test can fail: a change to the block syntax would leave nothing checked


@pytest.mark.parametrize("cmd", CMDS)
def test_every_readme_command_parses_with_the_real_parser(cmd):
    argv = [PLACEHOLDERS.get(tok, tok) for tok in shlex.split(cmd)[1:] if tok != "..."]
    parser = build_parser()
    try:
        args = parse_args(parser, argv)
    except SystemExit as e:
        raise AssertionError(f"README command does not parse: {cmd}") from e
    job = getattr(args, "job", None)
    if isinstance(job, str) and job.endswith(".yaml") and "sweep" not in job:
        overrides = [a for a in argv if "=" in a and not a.startswith("-")]
        load(REPO / job, overrides)  # a ConfigError names what the README got wrong


def test_every_repository_path_the_readme_names_exists():
    named = set(re.findall(r"(?<![\w/.-])((?:jobs|tests|hpc_rl|bench|templates|envs|docs|\.ci)/[\w./*-]*[\w*])", README))
    named |= {p for p in re.findall(r"`([\w-]+\.(?:sh|toml|md))`", README)}
    # A glob names at least one file; X.Y is the README's placeholder for a version.
    missing = sorted(p for p in named if "X.Y" not in p and not (list(REPO.glob(p)) if "*" in p else (REPO / p).exists()))
    assert not missing, f"the README names paths that do not exist: {missing}"
    assert len(named) >= 20, named  # the test can fail: a regex that finds nothing checks nothing


def test_every_option_of_every_command_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    missing = [f"{name} {'/'.join(action.option_strings) or action.dest}"
               for name, p in sub.choices.items() for action in p._actions
               if action.help is None and not isinstance(action, argparse._HelpAction)]
    assert not missing, f"options without help: {missing}"
