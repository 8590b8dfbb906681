"""Recipes: YAML files decoded into typed msgspec Structs, with `key.sub=value` overrides.

    streamrl check recipes/quickstart.yaml rollout.n_samples=4

`schema.py` is the typed tree (every key, its default and meaning), `load.py` reads a file and
reports every problem as `FILE:LINE: key.path: what is wrong` (RecipeError: the CLI exits 2
before any work starts), `functions.py` imports and checks the dotted function paths
`pkg.module:function` that are the extension points, `checks.py` the settings that conflict.
"""

from streamrl.recipe.checks import SECRET_WORDS, conflicts, learner_summary
from streamrl.recipe.functions import DRIVER_IMPORTED_ENV, PLUGGABLE, fn_paths, resolve_fn
from streamrl.recipe.load import apply_overrides, dump_recipe, load_recipe, parse_recipe
from streamrl.recipe.schema import (
    EnginesCfg, FnPath, FnRef, LearnerCfg, PoolCfg, Recipe, RecipeError, RolloutCfg, RunCfg, StalenessCfg,
    learner_layout,
)

__all__ = ["DRIVER_IMPORTED_ENV", "PLUGGABLE", "SECRET_WORDS", "EnginesCfg", "FnPath", "FnRef", "LearnerCfg",
           "PoolCfg", "Recipe", "RecipeError", "RolloutCfg", "RunCfg", "StalenessCfg", "apply_overrides", "conflicts", "dump_recipe", "fn_paths", "learner_layout",
           "learner_summary", "load_recipe", "parse_recipe", "resolve_fn"]
