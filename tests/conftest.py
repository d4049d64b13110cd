import os

import pytest
import torch

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
