"""post_completion engines: the embedded toy transformer, a trained model
through Hugging Face ``transformers`` (:class:`HFEngine`), and an OpenAI
client."""

from lmcache_mp.engine._config import KV_DTYPES, EngineConfig
from lmcache_mp.engine._embedded import EmbeddedEngine
from lmcache_mp.engine._hf import HFEngine
from lmcache_mp.engine._hf_load import LoadedModel, ModelSource, load_model
from lmcache_mp.engine._hf_load import resolve as resolve_model
from lmcache_mp.engine._stats import EngineStats
from lmcache_mp.engine._vocab import ToyVocab
from lmcache_mp.engine.http.openai import OpenAICompletions, post_completion

__all__ = [
    "KV_DTYPES",
    "EmbeddedEngine",
    "EngineConfig",
    "EngineStats",
    "HFEngine",
    "LoadedModel",
    "ModelSource",
    "OpenAICompletions",
    "ToyVocab",
    "load_model",
    "post_completion",
    "resolve_model",
]
