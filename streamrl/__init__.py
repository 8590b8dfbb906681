"""StreamRL: bounded-off-policy streaming RL post-training for LLMs.

Read streamrl/loop.py first (the whole run in one screen). The packages, by role:
core/ (pure rules and data), runtime/ (the running system), producers/ (agent episodes and
external producers), plugins/ (rewards, filters, data, tasks), tools/ (CLI, replay, report),
connectors/ (engines, router, megatron learner), pools/ (the experience pool), recipes/.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

# Module paths from before streamrl/ was grouped by role keep working, for recipes (dotted function
# paths such as `streamrl.rewards:exact_match`) and for user code (`from streamrl.producer import
# ProducerClient`): the old name is the same module object as the new one.
MOVED = {
    "streamrl.types": "streamrl.core.types", "streamrl.spans": "streamrl.core.spans",
    "streamrl.staleness": "streamrl.core.staleness", "streamrl.ledger": "streamrl.core.ledger",
    "streamrl.partial": "streamrl.core.partial", "streamrl.algorithms": "streamrl.core.algorithms",
    "streamrl.agent": "streamrl.producers.episode", "streamrl.openai_proxy": "streamrl.producers.openai_proxy",
    "streamrl.produce": "streamrl.producers.service", "streamrl.producer": "streamrl.producers.sdk",
    "streamrl.intake": "streamrl.producers.intake",
    "streamrl.rewards": "streamrl.plugins.rewards", "streamrl.filters": "streamrl.plugins.filters",
    "streamrl.data": "streamrl.plugins.data", "streamrl.tasks": "streamrl.plugins.tasks",
    "streamrl.cli": "streamrl.tools.cli", "streamrl.replay": "streamrl.tools.replay",
    "streamrl.report": "streamrl.tools.report", "streamrl.loggers": "streamrl.tools.loggers",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> object:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: object) -> None:
        pass  # already imported under its new name


sys.meta_path.append(_MovedModules())
