"""The evaluation behind ``lmcache-mp eval``: what each edit keeps of a
model's output at each budget, beside its modify time.

The uncompressed run's greedy continuation of each document is the
reference; every edit at every keep is scored teacher-forced along it
(top-1 agreement and KL), and its passkey haystacks are decoded greedily::

    from lmcache_mp.eval import EvalConfig, evaluate

    result = evaluate(EvalConfig(edits=("snapkv", "knorm"), keeps=(0.25, 0.5)))
    print(result.format())

With ``EvalConfig(generate=G, every=N)`` it scores compression while
generating instead: a :class:`GenerateResult` (``GENERATE_SCHEMA``); with
``EvalConfig(tasks=(...), lengths=(...))``, RULER-style tasks generated
from the seed, each accuracy with its bootstrap interval: a
:class:`TasksResult` (``TASKS_SCHEMA``; :data:`TASKS` names the tasks).

See ``docs/eval.md`` for the tasks and the JSON schema (``EVAL_SCHEMA``).
"""

from lmcache_mp.eval._cli import add_eval_parser, run_eval_command
from lmcache_mp.eval._config import EvalConfig
from lmcache_mp.eval._evaluate import evaluate
from lmcache_mp.eval._generate import (
    GENERATE_SCHEMA,
    GenerateResult,
    GenerateRow,
    Speed,
)
from lmcache_mp.eval._intervals import Interval
from lmcache_mp.eval._ruler import TASKS_SCHEMA, TaskRow, TasksResult
from lmcache_mp.eval._table import EVAL_SCHEMA, EvalResult, EvalRow
from lmcache_mp.eval._tasks import TASKS

__all__ = [
    "EVAL_SCHEMA",
    "GENERATE_SCHEMA",
    "TASKS",
    "TASKS_SCHEMA",
    "EvalConfig",
    "EvalResult",
    "EvalRow",
    "GenerateResult",
    "GenerateRow",
    "Interval",
    "Speed",
    "TaskRow",
    "TasksResult",
    "add_eval_parser",
    "evaluate",
    "run_eval_command",
]
