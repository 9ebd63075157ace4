"""The HTTP side of the engines, one public module each: an OpenAI
completions client (:mod:`~lmcache_mp.engine.http.openai`: a
``post_completion`` for vLLM, and teacher-forced scoring through
``prompt_logprobs`` or ``echo``) and an OpenAI-compatible server that puts
the toy engine or a trained model behind ``POST /v1/completions``
(:mod:`~lmcache_mp.engine.http.server`, ``lmcache-mp serve``)."""

__all__: list[str] = []
