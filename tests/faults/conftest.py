"""The checkpointed runs the fault rows resume from, built once per test run (read-only: copy first)."""

from __future__ import annotations

from functools import partial

import pytest

from tests.faults.harness import two_step_run
from tests.helpers import built_once


@pytest.fixture(scope="session")
def run_with_checkpoint(tiny_data, tmp_path_factory):
    """A 2-step run with its checkpoint: what the fault rows resume from (and must leave untouched)."""
    return built_once(tmp_path_factory, "faults_run", partial(two_step_run, tiny_data)) / "run"


@pytest.fixture(scope="session")
def run_with_checkpoint_v1(tiny_data, tmp_path_factory):
    """The same on a version-1 (unindexed) copy of the shards."""
    return built_once(tmp_path_factory, "faults_run_v1", partial(two_step_run, tiny_data, version1=True)) / "run"
