import pytest
import torch


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """In-process train.py runs set --threads 1; every other test keeps the session's thread count."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
