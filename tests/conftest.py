"""Shared fixtures (a tiny offline model built once per session) and CI's rules for skips and randomness.

`HPC_RL_REQUIRE_ALL=1` (set by .ci/run; CI=true implies it) means "this machine must run every test": a test
that would skip (no Slurm, vllm does not import, ...) fails with its reason instead, so CI cannot pass by not
testing. There hypothesis is also derandomized: a property test's examples are the same on every run, so CI
never passes or fails by luck; locally they stay random (and new).
"""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster.helpers import slurm_cluster  # noqa: E402,F401 (the session fixture of the Slurm tests)
from scheduling import make_scheduler, order_by_cost, remove_locks, solo_or_shared  # noqa: E402

REQUIRE_ALL = os.environ.get("HPC_RL_REQUIRE_ALL") == "1" or os.environ.get("CI") == "true"

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if REQUIRE_ALL else "dev")


def pytest_collection_modifyitems(config, items):
    order_by_cost(items)


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: `-p no:xdist` runs without it
def pytest_xdist_make_scheduler(config, log):
    return make_scheduler(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"HPC_RL_REQUIRE_ALL=1 (CI) forbids skipping; this test would skip: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Around setup, call and teardown: a module's shared run (set up with its first test) counts as that test's.
    with solo_or_shared(item.get_closest_marker("solo") is not None):
        yield


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        remove_locks()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny Qwen2 (head_dim 64) + byte-level BPE tokenizer trained on the toy task, as an HF folder."""
    from hpc_rl.config import TinyModelConfig
    from hpc_rl.data.toy import repeat_digit_corpus
    from hpc_rl.models.tiny import cached_tiny_model

    return cached_tiny_model(TinyModelConfig(), repeat_digit_corpus(), tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory):
    """The toy task's tiny Bradley-Terry reward model (Qwen2ForSequenceClassification, same tokenizer as tiny_model)."""
    from hpc_rl.data.toy import repeat_digit_corpus
    from hpc_rl.models.tiny_reward import cached_tiny_reward_model

    return cached_tiny_reward_model("toy:repeat_digit", repeat_digit_corpus(), tmp_path_factory.mktemp("rm") / "rm")
