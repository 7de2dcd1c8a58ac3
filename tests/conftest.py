"""Settings every test shares."""

import pytest
import torch

from hethub.memo import memo_scope

# The single-process references run in the pytest process. torch's default of a thread per core
# makes its thread pool spin against the ranks' processes (and anything else) on a 2-core
# machine: one reference took 12 to 17 s with 2 threads under load, about 1 s with 1. The ranks
# run one thread each too, so the references sum in the same order they do.
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def profiles_outside_the_home(tmp_path_factory):
    """The commands keep this machine's profiles in the user's cache folder
    (hethub.profiles.machine): every test's, and every process a test starts, use a temporary
    one, so that a test never writes the real home (CI runs as root, HOME=/root) nor reads a
    developer's profiles."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        patch.delenv("HETHUB_PROFILES", raising=False)
        yield


@pytest.fixture(autouse=True)
def memo_of_the_test():
    """Each test's memoized answers (hethub.memo) in a Memo of its own, as a search's or a
    run's are: a test that drives the planner's or the runtime's parts directly shares them
    within itself, and no test reads another's."""
    with memo_scope():
        yield
