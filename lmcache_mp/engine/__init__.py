"""post_completion engines: the embedded toy transformer, a trained model
through Hugging Face ``transformers`` (:class:`HFEngine`), and an OpenAI
client."""

from lmcache_mp.engine._config import EngineConfig
from lmcache_mp.engine._embedded import EmbeddedEngine
from lmcache_mp.engine._hf import HFEngine
from lmcache_mp.engine._hf_load import ModelSource
from lmcache_mp.engine._stats import EngineStats
from lmcache_mp.engine._vocab import ToyVocab
from lmcache_mp.engine.http.openai import OpenAICompletions, post_completion

__all__ = [
    "EmbeddedEngine",
    "EngineConfig",
    "EngineStats",
    "HFEngine",
    "ModelSource",
    "OpenAICompletions",
    "ToyVocab",
    "post_completion",
]
