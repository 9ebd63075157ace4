"""post_completion engines: the embedded toy transformer."""

from lmcache_mp.engine._config import EngineConfig
from lmcache_mp.engine._embedded import EmbeddedEngine, EngineStats
from lmcache_mp.engine._vocab import ToyVocab

__all__ = ["EmbeddedEngine", "EngineConfig", "EngineStats", "ToyVocab"]
