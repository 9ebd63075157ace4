"""post_completion engines: the embedded toy transformer, a trained model
through Hugging Face ``transformers`` (:class:`HFEngine`), and an OpenAI
client (:mod:`lmcache_mp.engine.http.openai`, the home of
``OpenAICompletions`` and ``post_completion``)."""

from lmcache_mp.engine._config import KV_DTYPES, EngineConfig
from lmcache_mp.engine._embedded import EmbeddedEngine
from lmcache_mp.engine._hf import HFEngine
from lmcache_mp.engine._hf_load import LoadedModel, ModelSource, load_model
from lmcache_mp.engine._hf_load import resolve as resolve_model
from lmcache_mp.engine._stats import EngineStats
from lmcache_mp.engine._vocab import ToyVocab

__all__ = [
    "KV_DTYPES",
    "EmbeddedEngine",
    "EngineConfig",
    "EngineStats",
    "HFEngine",
    "LoadedModel",
    "ModelSource",
    "ToyVocab",
    "load_model",
    "resolve_model",
]
