"""A critic's save is uploaded with the run's checkpoint only from the run's own critic directory: a critic server
that answers critic_save with another local directory (the run's secrets, the cache, another run's) is refused."""

from __future__ import annotations

import pytest

from components.jobs.rl import own_critic_save
from components.storage.backends import CheckpointError

pytestmark = pytest.mark.fast


def test_a_save_under_the_run_s_critic_directory_is_taken(tmp_path):
    critic = tmp_path / "runs" / "r" / "critic"
    (critic / "step_3").mkdir(parents=True)
    assert own_critic_save(str(critic / "step_3"), critic) == (critic / "step_3").resolve()
    assert own_critic_save(str(critic), critic) == critic.resolve()


@pytest.mark.parametrize("elsewhere", ["/etc", "{tmp}/runs/other/critic", "{tmp}/runs/r/critic/../../other",
                                       "{tmp}/runs/r/critic-sibling"])
def test_a_save_anywhere_else_is_refused_naming_it(tmp_path, elsewhere):
    critic = tmp_path / "runs" / "r" / "critic"
    critic.mkdir(parents=True)
    path = elsewhere.format(tmp=tmp_path)
    with pytest.raises(CheckpointError, match="outside the run's critic directory"):
        own_critic_save(path, critic)


def test_a_link_out_of_the_directory_is_refused(tmp_path):
    critic = tmp_path / "critic"
    critic.mkdir()
    (critic / "step").symlink_to(tmp_path)  # inside by name, outside where it leads
    with pytest.raises(CheckpointError, match="outside"):
        own_critic_save(str(critic / "step"), critic)
