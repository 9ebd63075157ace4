"""A trained model on the process pool: prefill speed, decode latency, and
the memory of the parent and its workers with the model loaded.

RSS counts a page once per process that maps it, so it cannot tell weights
shared by every worker from weights copied into each; PSS divides each
shared page between the processes mapping it, so the sum of the PSS of the
parent and its workers is what the machine really holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psutil

from lmcache_mp.batch import LMCacheBatchedStream
from lmcache_mp.engine import HFEngine
from lmcache_mp.executors import ProcessExecutor
from lmcache_mp.kv import connect
from lmcache_mp.request import create_request

__all__ = ["ModelFigures", "filler_prompts", "model_figures", "resident"]

_FILLER = (
    "The river runs past the old mill and under the stone bridge, where the "
    "village children watch the boats go by on market days. "
)


@dataclass(frozen=True)
class ModelFigures:
    """What one run of :func:`model_figures` measured.

    Args:
        model: The model's name or path.
        streams: Streams in the batch.
        prompt_tokens: Tokens per prompt.
        workers: Worker processes.
        prefill_tput: Prompt tokens per second over the prefill phase.
        decode_ms_per_token: Median time per output token (TPOT), ms.
        pss_bytes: Sum of the PSS of the parent and its workers, model
            loaded in each.
        rss_bytes: Sum of their RSS (weights counted once per process).
        weights_bytes: The model's parameters' bytes.
    """

    model: str
    streams: int
    prompt_tokens: int
    workers: int
    prefill_tput: float
    decode_ms_per_token: float
    pss_bytes: int
    rss_bytes: int
    weights_bytes: int


def resident(pids: list[int]) -> tuple[int, int]:
    """Return the summed ``(pss, rss)`` of the processes ``pids``.

    Args:
        pids: Live process ids (the parent and its workers).

    Returns:
        Bytes of PSS and of RSS, summed.
    """
    pss = rss = 0
    for pid in pids:
        info = psutil.Process(pid).memory_full_info()
        pss += int(getattr(info, "pss", info.uss))
        rss += int(info.rss)
    return pss, rss


def filler_prompts(engine: HFEngine, streams: int, tokens: int) -> list[list[int]]:
    """``streams`` different prompts of exactly ``tokens`` tokens of text."""
    base = engine.encode(_FILLER * (tokens // 16 + 2), chat=False)
    return [
        [*engine.encode(f"Story {i}.", chat=False), *base][:tokens]
        for i in range(streams)
    ]


def model_figures(
    model: str = "smollm2-135m",
    *,
    streams: int = 4,
    prompt_tokens: int = 512,
    max_tokens: int = 32,
    workers: int = 2,
) -> ModelFigures:
    """Prefill and decode a batch of a trained model on a process pool.

    Args:
        model: What :meth:`HFEngine.from_pretrained` takes.
        streams: Streams in the batch.
        prompt_tokens: Tokens per prompt.
        max_tokens: Tokens decoded per stream (EOS ignored).
        workers: Worker processes (each loads the model as it starts).

    Returns:
        The figures.
    """
    kv_ctx = connect(chunk_size=64)
    try:
        engine = HFEngine.from_pretrained(model, kv_ctx)
        prompts = filler_prompts(engine, streams, prompt_tokens)
        weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        with LMCacheBatchedStream(
            "process", max_workers=workers, preload=[engine.load]
        ) as batch:
            for prompt in prompts:
                batch.add(create_request([kv_ctx], engine, prompt))
            prefill = _results(batch.prefill({"temperature": 0}))
            executor: Any = batch.executor
            assert isinstance(executor, ProcessExecutor)
            pss, rss = resident([psutil.Process().pid, *executor.pids()])
            decode = batch.decode(
                {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
            ).to_dict()["metrics"]
        return ModelFigures(
            model,
            streams,
            prompt_tokens,
            workers,
            float(prefill["input_tput"]),
            float(decode["latency"]["p50_tpot_ms"]),
            pss,
            rss,
            weights,
        )
    finally:
        kv_ctx.destroy()


def _results(report: Any) -> dict[str, Any]:
    results: dict[str, Any] = report.to_dict()["metrics"]["results"]
    return results
