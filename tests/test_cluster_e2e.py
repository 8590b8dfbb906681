"""A run on an existing Ray cluster (`ray.address`) with a reward module that exists only next
to the recipe: the module travels to the workers as a Ray `py_modules` entry (it is on no
worker's path otherwise), the run finishes with a balanced ledger, and every sample was scored by
it. Also: which modules a run ships, and the error a worker gives for one it cannot import."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamkit import (REPO, assert_ledger_balanced, finish_streamrl, pool_stats, ray_head, short_quickstart,
                       start_streamrl)

REWARD = "def score(response, label, **_):\n    return 0.5  # no built-in reward gives 0.5 on this task\n"


def _recipe_with_module(root: Path, module: str, fn: str) -> Path:
    """recipes/quickstart.yaml copied into `root` with `module` (a .py file) next to it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "my_reward.py").write_text(module)
    text = (REPO / "recipes" / "quickstart.yaml").read_text().replace("streamrl.plugins.rewards:exact_match", fn)
    (root / "recipe.yaml").write_text(text)
    return root / "recipe.yaml"


def test_the_modules_a_run_ships_are_the_users_own(tmp_path: Path) -> None:
    from streamrl.recipe import load_recipe
    from streamrl.runtime.user_code import runtime_env

    recipe = load_recipe(_recipe_with_module(tmp_path / "r", REWARD, "my_reward:score"))
    env = runtime_env(recipe, {"OMP_NUM_THREADS": "1"})
    assert env["py_modules"] == [str((tmp_path / "r" / "my_reward.py").resolve())]  # not streamrl's own fns
    assert env["env_vars"]["OMP_NUM_THREADS"] == "1" and env["env_vars"]["STREAMRL_FNS_CHECKED"] == "1"

    pkg = tmp_path / "p" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "rewards.py").write_text(REWARD)
    recipe = load_recipe(_recipe_with_module(tmp_path / "p", "", "mypkg.rewards:score"))
    assert runtime_env(recipe, {})["py_modules"] == [str(pkg.resolve())]  # a package goes as its directory
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml")
    assert "py_modules" not in runtime_env(recipe, {})  # only streamrl's functions: nothing to ship


def test_a_worker_that_cannot_import_a_module_says_the_driver_could(monkeypatch: pytest.MonkeyPatch) -> None:
    from streamrl.recipe import DRIVER_IMPORTED_ENV, resolve_fn

    with pytest.raises(ValueError, match="no_such_module_here.*ModuleNotFoundError") as plain:
        resolve_fn("no_such_module_here:score")
    assert "driver" not in str(plain.value)
    monkeypatch.setenv(DRIVER_IMPORTED_ENV, "1")
    with pytest.raises(ValueError, match="imported on the driver but not on this worker .*recipe's directory"):
        resolve_fn("no_such_module_here:score")


@pytest.mark.slow
def test_a_run_on_a_ray_cluster_ships_a_reward_kept_beside_the_recipe(tmp_path: Path) -> None:
    inputs = short_quickstart(tmp_path / "inputs")
    recipe = _recipe_with_module(tmp_path / "elsewhere", REWARD, "my_reward:score")
    run = tmp_path / "run"
    with ray_head(tmp_path / "ray-start.log", num_cpus=4) as address:
        # from the repository (the cwd is on the workers' path, the recipe's directory is not)
        proc = start_streamrl(["run", str(recipe), *inputs, f"ray.address={address}", "--run-dir", str(run), "--quiet"],
                              tmp_path / "io")
        finish_streamrl(proc, tmp_path / "io", run_dir=run)
    log = (run / "run.log").read_text()
    assert f"joined the cluster at {address}" in log, log[:2000]
    assert f"shipping your modules to every Ray worker: {(recipe.parent / 'my_reward.py').resolve()}" in log
    assert assert_ledger_balanced(run)["ledger"]["consumed"] == 4 * 4
    means = {v["mean_reward"] for v in pool_stats(run)["reward_by_version"]}
    assert means == {0.5}, means  # every sample scored by the shipped module
