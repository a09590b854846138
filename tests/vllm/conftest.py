"""The fixtures of the vLLM connector's tests: python/tests' daemon (a
real kvxferd on a private socket), a tiny model config and the engines
(harness.Engine) a test makes."""

import importlib.util
import os
import sys
from typing import List, Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))

_spec = importlib.util.spec_from_file_location(
    "kvxfer_python_conftest", os.path.join(REPO, "python", "tests",
                                           "conftest.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

Daemon = _base.Daemon
daemon = _base.daemon
pytest_runtest_makereport = _base.pytest_runtest_makereport


from harness import HEAD, KV_HEADS, LAYERS, Engine  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig
    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(vocab_size=1000, hidden_size=HEAD * 8,
                intermediate_size=256, num_hidden_layers=LAYERS,
                num_attention_heads=8, num_key_value_heads=KV_HEADS,
                max_position_embeddings=1024).save_pretrained(d)
    return str(d)


_n = iter(range(1, 1000))


@pytest.fixture
def engines(daemon, model_dir):
    made: List[Engine] = []

    def make(tp: int = 1, layout: str = "LBNHC", sock: Optional[str] = None,
             **kw) -> Engine:
        role = "prefill" if not made else "decode"
        e = Engine(model_dir, sock or daemon.sock, f"{role}-{next(_n)}",
                   tp=tp, layout=layout, **kw)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


@pytest.fixture
def own_daemon(tmp_path):
    """A daemon of the test's own, to kill and start again."""
    d = Daemon(tmp_path)
    yield d
    d.stop()
