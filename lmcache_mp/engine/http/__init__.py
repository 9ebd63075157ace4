"""The HTTP side of the engines: an OpenAI completions client (a
``post_completion`` for vLLM, and teacher-forced scoring through
``prompt_logprobs`` or ``echo``) and an OpenAI-compatible server that puts
the toy engine or a trained model behind ``POST /v1/completions``
(``python -m lmcache_mp.engine.http.server``)."""

from lmcache_mp.engine.http.openai import (
    OpenAICompletions,
    post_completion,
    served_models,
)

__all__ = ["OpenAICompletions", "post_completion", "served_models"]
