"""The HTTP side of the engines: an OpenAI completions client (a
``post_completion`` for vLLM) and an OpenAI-compatible server that puts the
embedded engine behind ``POST /v1/completions``
(``python -m lmcache_mp.engine.http.server``)."""

from lmcache_mp.engine.http.openai import OpenAICompletions, post_completion

__all__ = ["OpenAICompletions", "post_completion"]
