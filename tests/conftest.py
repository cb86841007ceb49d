import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """One cache directory of tiny checkpoints shared by the whole test session."""
    path = os.environ.get("RLSTACK_TEST_CACHE") or str(tmp_path_factory.mktemp("tiny_cache"))
    return path


@pytest.fixture(scope="session")
def tiny_llama(tiny_cache):
    from megatron_bridge.tiny import TinySpec, ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(TinySpec(arch="llama", tie_word_embeddings=True), cache_dir=tiny_cache)


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_cache):
    from megatron_bridge.tiny import TinySpec, ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(TinySpec(arch="qwen2", tie_word_embeddings=False), cache_dir=tiny_cache)
