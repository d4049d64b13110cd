import os

# The persistent compile cache is off for the suite: a test must compile what it tests, not load an entry that an
# earlier run stored. tests/test_cache.py turns it on, in folders of its own.
os.environ["MINDIESD_CACHE_DIR"] = "off"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts from default settings and an empty Dynamo cache."""
    from mindiesd.compilation import CompilationConfig

    CompilationConfig.reset()
    torch._dynamo.reset()
    yield
    CompilationConfig.reset()
    torch._dynamo.reset()
