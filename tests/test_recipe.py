"""Recipes: loading, defaults, overrides, dump round trip, error messages and the `check` CLI.

Long file: one table-driven test per kind of recipe error, each naming file, line and key.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import yaml

from streamrl.core import routing
from streamrl.plugins.rewards import exact_match
from streamrl.recipe import (
    EnginesCfg,
    FnRef,
    LearnerCfg,
    PoolCfg,
    Recipe,
    RecipeError,
    RolloutCfg,
    RunCfg,
    StalenessCfg,
    apply_overrides,
    dump_recipe,
    learner_layout,
    learner_summary,
    load_recipe,
    parse_recipe,
    resolve_fn,
)

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
RECIPES = Path(__file__).resolve().parent / "recipes"
GOOD_FULL = RECIPES / "good_full.yaml"

MINIMAL = "model:\n  path: m\ndata:\n  path: d\n"


def _error(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(RecipeError) as ei:
        load_recipe(path, overrides)
    return str(ei.value)


# ---------------------------------------------------------------- (a) good recipes


def _subset(raw, loaded, path=""):
    """Every key the YAML file sets has that value in the loaded recipe."""
    if isinstance(raw, dict):
        for k, v in raw.items():
            assert k in loaded, f"{path}.{k} missing from the loaded recipe"
            _subset(v, loaded[k], f"{path}.{k}")
    else:
        assert loaded == raw, f"{path}: file says {raw!r}, loaded {loaded!r}"


def test_quickstart_loads_with_file_values():
    r = load_recipe(QUICKSTART)
    assert isinstance(r, Recipe)
    raw = yaml.safe_load(QUICKSTART.read_text())
    _subset(raw, msgspec.to_builtins(r))
    assert r.run.name == "quickstart" and r.run.mode == "stream"
    assert resolve_fn(r.reward.fn) is exact_match


def test_quickstart_defaults_are_filled():
    r = load_recipe(QUICKSTART)
    raw = yaml.safe_load(QUICKSTART.read_text())
    # keys the file does not set get the schema defaults
    defaults = {"run": RunCfg(), "rollout": RolloutCfg(), "staleness": StalenessCfg(), "pool": PoolCfg(),
                "learner": LearnerCfg(), "engines": EnginesCfg()}
    for section, default in defaults.items():
        got, want = msgspec.to_builtins(getattr(r, section)), msgspec.to_builtins(default)
        for k in want:
            if k not in raw.get(section, {}):
                assert got[k] == want[k], f"{section}.{k}"
    assert r.model.tokenizer is None and r.filters == [] and r.env is None and not r.producer_api.enabled
    assert r.run_dir == Path("runs/quickstart")
    assert r.pool_uri == str(Path("runs/quickstart") / "pool")


def test_minimal_recipe_gets_default_sections():
    r = parse_recipe(MINIMAL)
    assert r.run.name == "run" and r.run_dir == Path("runs/run")
    assert r.reward == FnRef(fn="streamrl.plugins.rewards:exact_match")
    assert r.staleness.max_staleness == 1 and r.staleness.policy == "drop"


def test_explicit_dirs_win_over_derived_ones():
    r = load_recipe(GOOD_FULL)
    assert r.run_dir == Path("runs/full-test")
    assert r.pool_uri == "/tmp/streamrl-test-pool"


def test_good_full_recipe_values():
    r = load_recipe(GOOD_FULL)
    assert r.run.mode == "lockstep" and r.run.checkpoint_every == 0
    assert r.data.shuffle is False
    assert r.rollout.temperature == pytest.approx(0.7) and isinstance(r.rollout.temperature, float)
    assert r.staleness.policy == "mask" and r.staleness.partial_rollout == "in_place"
    assert [f.fn for f in r.filters] == ["streamrl.plugins.filters:nonzero_std"] * 2
    assert r.filters[0].args == {"threshold": 0.5} and r.filters[1].args == {}
    assert r.env.args == {"count": 2, "names": ["a", "b"]}
    assert r.pool.commit_linger_ms == 0.0 and isinstance(r.pool.commit_linger_ms, float)
    assert r.engines.backend == "sglang" and r.engines.router_policy == "cache_aware"


def test_empty_document_reports_missing_model():
    with pytest.raises(RecipeError, match=r"^empty\.yaml:1: model: missing required key"):
        parse_recipe("# nothing here\n", "empty.yaml")


def test_missing_file_is_a_recipe_error(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(RecipeError, match="nope.yaml: cannot read recipe"):
        load_recipe(missing)


# ---------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    "override, get, expected",
    [
        ("rollout.n_samples=4", lambda r: r.rollout.n_samples, 4),
        ("rollout.temperature=0.25", lambda r: r.rollout.temperature, 0.25),
        ("rollout.temperature=0", lambda r: r.rollout.temperature, 0.0),
        ("rollout.top_k=-1", lambda r: r.rollout.top_k, -1),
        ("data.shuffle=false", lambda r: r.data.shuffle, False),
        ("data.shuffle=true", lambda r: r.data.shuffle, True),
        ("run.dir=/tmp/elsewhere", lambda r: r.run.dir, "/tmp/elsewhere"),
        ("run.mode=one_step_off", lambda r: r.run.mode, "one_step_off"),
        ("model.tokenizer=null", lambda r: r.model.tokenizer, None),
        ("staleness.policy=keep", lambda r: r.staleness.policy, "keep"),
        # a section the file does not have is created
        ("learner.lr=0.5", lambda r: r.learner.lr, 0.5),
        ("engines.num=3", lambda r: r.engines.num, 3),
        # values are YAML: lists and mappings
        ("reward.args.labels=[a, 2, 3.5]", lambda r: r.reward.args, {"labels": ["a", 2, 3.5]}),
        ("reward.args={k: 1}", lambda r: r.reward.args, {"k": 1}),
        ("reward.fn=streamrl.plugins.rewards:exact_match", lambda r: r.reward.fn, "streamrl.plugins.rewards:exact_match"),
    ],
)
def test_override_parses_yaml_scalars(override, get, expected):
    r = load_recipe(QUICKSTART, [override])
    value = get(r)
    assert value == expected
    assert type(value) is type(expected)


def test_override_wins_over_file_and_keeps_siblings():
    base = load_recipe(QUICKSTART)
    r = load_recipe(QUICKSTART, [f"rollout.n_samples={base.rollout.n_samples + 1}", "staleness.max_staleness=0"])
    assert r.rollout.n_samples == base.rollout.n_samples + 1
    assert r.staleness.max_staleness == 0 != base.staleness.max_staleness
    # untouched siblings keep the file's values
    assert (r.rollout.groups_per_step, r.rollout.max_new_tokens) == (base.rollout.groups_per_step,
                                                                     base.rollout.max_new_tokens)
    assert r.staleness.policy == base.staleness.policy


def test_overrides_apply_in_order_last_wins():
    r = load_recipe(QUICKSTART, ["rollout.n_samples=2", "rollout.n_samples=5"])
    assert r.rollout.n_samples == 5


def test_override_value_may_contain_equals_sign():
    r = load_recipe(QUICKSTART, ["run.name=a=b"])
    assert r.run.name == "a=b"


def test_override_list_items():
    r = load_recipe(
        GOOD_FULL,
        ["filters.0.args.threshold=0.25", "filters.1.args={k: [1, 2]}", "env.args.count=5"],
    )
    assert r.filters[0].args == {"threshold": 0.25}
    assert r.filters[1].args == {"k": [1, 2]}
    assert r.filters[1].fn == "streamrl.plugins.filters:nonzero_std"
    assert r.env.args == {"count": 5, "names": ["a", "b"]}


def test_override_replaces_a_list_item_function_and_checks_it():
    r = load_recipe(GOOD_FULL, ["filters.1.fn=streamrl.recipe:resolve_fn"])
    assert r.filters[1].fn == "streamrl.recipe:resolve_fn"
    msg = _error(GOOD_FULL, ["filters.1.fn=streamrl.plugins.rewards:nope"])
    assert msg.startswith("override 'filters.1.fn=streamrl.plugins.rewards:nope': filters[1].fn: ")
    assert "no attribute 'nope'" in msg


def test_override_whole_list():
    r = load_recipe(QUICKSTART, ["filters=[{fn: 'streamrl.plugins.filters:nonzero_std'}]"])
    assert r.filters == [FnRef(fn="streamrl.plugins.filters:nonzero_std")]


def test_apply_overrides_reports_origin_paths():
    data = {"filters": [{"fn": "a:b"}], "rollout": {"n_samples": 1}}
    origin = apply_overrides(data, ["filters.0.fn=c:d", "rollout.n_samples=3", "learner.lr=0.1"])
    assert data == {"filters": [{"fn": "c:d"}], "rollout": {"n_samples": 3}, "learner": {"lr": 0.1}}
    assert origin == {
        "filters[0].fn": "filters.0.fn=c:d",
        "rollout.n_samples": "rollout.n_samples=3",
        "learner.lr": "learner.lr=0.1",
    }


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("nokey", "expected key.sub=value"),
        ("=4", "expected key.sub=value"),
        ("rollout..n_samples=4", "expected key.sub=value"),
        ("rollout.n-samples=4", "expected key.sub=value"),
        ("rollout.bogus=1", "rollout.bogus: unknown key `bogus`"),
        ("bogus=1", "bogus: unknown key `bogus`"),
        ("rollout.n_samples=abc", "rollout.n_samples: Expected `int`, got `str`"),
        ("rollout.n_samples=0", "rollout.n_samples: Expected `int` >= 1"),
        ("rollout.n_samples=[1, 2]", "rollout.n_samples: Expected `int`, got `array`"),
        ("staleness.policy=sometimes", "staleness.policy: Invalid enum value 'sometimes'"),
        ("reward.fn=no_colon", "reward.fn: must be a dotted function path"),
        ("reward.fn=streamrl_no_such_module_for_tests:f", "reward.fn: cannot import module"),
        ("rollout.n_samples.deeper=1", "rollout.n_samples is a value, not a section"),
        ("filters.7.fn=streamrl.plugins.rewards:exact_match", "filters has no item 7"),
        ("filters.x.fn=streamrl.plugins.rewards:exact_match", "filters has no item x"),
    ],
)
def test_malformed_override_names_the_override(override, fragment):
    msg = _error(GOOD_FULL, [override])
    assert msg.startswith(f"override {override!r}: "), msg
    assert fragment in msg
    assert "good_full.yaml" not in msg  # blamed on the override, not on a line of the file


def test_bad_override_is_reported_even_when_file_is_fine_otherwise():
    with pytest.raises(RecipeError, match=r"^override 'rollout\.n_samples=abc': rollout\.n_samples: "):
        parse_recipe(MINIMAL, "m.yaml", ["rollout.n_samples=abc"])


def test_override_into_missing_list_names_the_override():
    ov = "filters.0.fn=streamrl.plugins.rewards:exact_match"
    msg = _error(QUICKSTART, [ov])
    assert msg.startswith(f"override {ov!r}: "), msg


def test_override_scientific_notation_float():
    r = load_recipe(QUICKSTART, ["learner.lr=1e-5"])
    assert r.learner.lr == pytest.approx(1e-5)


def test_file_scientific_notation_float():
    r = parse_recipe(MINIMAL + "learner:\n  lr: 3e-6\n", "sci.yaml")
    assert r.learner.lr == pytest.approx(3e-6)


# ---------------------------------------------------------------- dump round trip


@pytest.mark.parametrize(
    "path, overrides",
    [
        (QUICKSTART, []),
        (QUICKSTART, ["rollout.n_samples=3", "learner.lr=0.125", "reward.args.x=[1, 2]"]),
        (GOOD_FULL, []),
    ],
)
def test_dump_reparses_to_equal_recipe(path, overrides, tmp_path):
    r = load_recipe(path, overrides)
    text = dump_recipe(r)
    again = parse_recipe(text, "dumped.yaml")
    assert again == r
    # and through a file, as `streamrl check > resolved.yaml` would be used
    out = tmp_path / "resolved.yaml"
    out.write_text(text)
    assert load_recipe(out) == r
    # the dump is complete: every section and every key with its value
    data = yaml.safe_load(text)
    assert list(data) == list(Recipe.__struct_fields__)
    assert data["rollout"]["max_concurrency"] == r.rollout.max_concurrency
    assert data["pool"]["uri"] == r.pool.uri


def test_dump_of_default_lr_reparses_as_float():
    text = dump_recipe(parse_recipe(MINIMAL))
    assert parse_recipe(text).learner.lr == pytest.approx(1e-5)


# ---------------------------------------------------------------- (b) malformed recipe matrix

# file -> (line, key path or None, fragment of the explanation)
BAD = {
    "bad_unknown_top_key.yaml": (8, "trainer", "unknown key `trainer`"),
    "bad_unknown_nested_key.yaml": (8, "rollout.n_sample", "unknown key `n_sample`"),
    "bad_wrong_type.yaml": (9, "rollout.max_new_tokens", "Expected `int`, got `str`"),
    "bad_float_for_int.yaml": (5, "run.steps", "Expected `int`, got `float`"),
    "bad_out_of_range.yaml": (7, "rollout.n_samples", "Expected `int` >= 1"),
    "bad_prob_out_of_range.yaml": (9, "rollout.top_p", "<= 1.0"),
    "bad_flow_mapping_range.yaml": (6, "staleness.max_staleness", "Expected `int` >= 0"),
    "bad_enum.yaml": (10, "staleness.policy", "Invalid enum value 'discard'; choose one of 'drop', 'mask', 'keep'"),
    "bad_missing_model_path.yaml": (4, "model.path", "missing required key `path`"),
    "bad_missing_data.yaml": (2, "data", "missing required key `data`"),
    "bad_section_not_mapping.yaml": (6, "rollout", "Expected `object`, got `int`"),
    "bad_args_not_mapping.yaml": (8, "reward.args", "Expected `object`, got `array`"),
    "bad_fn_no_colon.yaml": (8, "reward.fn", "must be a dotted function path"),
    "bad_fn_module_missing.yaml": (7, "reward.fn", "cannot import module 'streamrl_no_such_module_for_tests'"),
    "bad_fn_attr_missing.yaml": (9, "filters[1].fn", "has no attribute 'no_such_function'"),
    "bad_generate_fn_attr_missing.yaml": (7, "data.generate.fn", "has no attribute 'generate'"),
    "bad_fn_not_callable.yaml": (7, "env.fn", "is a str, not a function"),
    "bad_filter_unknown_key.yaml": (10, "filters[1].weight", "unknown key `weight`"),
    "bad_yaml_syntax.yaml": (8, None, "not valid YAML"),
    "bad_yaml_unclosed_quote.yaml": (3, None, "not valid YAML"),
    "bad_top_level_list.yaml": (1, None, "a recipe is a mapping of sections"),
}

def _bad_params():
    for name, (line, key, fragment) in BAD.items():
        yield pytest.param(name, line, key, fragment, id=name.removesuffix(".yaml"))


def test_bad_matrix_covers_every_fixture():
    assert sorted(p.name for p in RECIPES.glob("bad_*.yaml")) == sorted(BAD)
    assert len(BAD) >= 12


@pytest.mark.parametrize("name, line, key, fragment", list(_bad_params()))
def test_bad_recipe_message_names_file_line_and_key(name, line, key, fragment):
    path = RECIPES / name
    msg = _error(path)
    prefix = f"{path}:{line}: "
    assert msg.startswith(prefix), f"expected {prefix!r}, got {msg!r}"
    if key is not None:
        assert msg.startswith(f"{prefix}{key}: "), msg
    assert fragment in msg
    assert "\n" not in msg.strip()  # one line, FILE:LINE: key.path: what is wrong


@pytest.mark.parametrize("name", ["bad_enum.yaml", "bad_fn_attr_missing.yaml"])
def test_overriding_the_bad_key_fixes_the_recipe(name):
    fix = {
        "bad_enum.yaml": "staleness.policy=keep",
        "bad_fn_attr_missing.yaml": "filters.1.fn=streamrl.plugins.filters:nonzero_std",
    }[name]
    r = load_recipe(RECIPES / name, [fix])
    assert isinstance(r, Recipe)


def test_relative_and_absolute_paths_are_reported_as_given(monkeypatch):
    monkeypatch.chdir(RECIPES)
    with pytest.raises(RecipeError, match=r"^bad_enum\.yaml:10: staleness\.policy: "):
        load_recipe("bad_enum.yaml")


def test_line_numbers_follow_the_key_not_the_section():
    text = MINIMAL + "rollout:\n  n_samples: 2\n  groups_per_step: 2\n\n  max_new_tokens: -3\n"
    with pytest.raises(RecipeError, match=r"^x\.yaml:9: rollout\.max_new_tokens: "):
        parse_recipe(text, "x.yaml")


# ---------------------------------------------------------------- (c) the `streamrl check` CLI


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamrl", "check", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_check_good_recipe_prints_resolved_yaml():
    p = _check(str(QUICKSTART), "rollout.n_samples=4", "learner.lr=0.5")
    assert p.returncode == 0, p.stderr
    printed = parse_recipe(p.stdout, "stdout")
    assert printed == load_recipe(QUICKSTART, ["rollout.n_samples=4", "learner.lr=0.5"])
    assert printed.rollout.n_samples == 4
    assert "max_concurrency: 64" in p.stdout  # defaults are printed too
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "name", ["bad_out_of_range.yaml", "bad_fn_module_missing.yaml", "bad_yaml_syntax.yaml", "bad_filter_unknown_key.yaml"]
)
def test_cli_check_bad_recipe_exits_2(name):
    line, key, fragment = BAD[name]
    path = RECIPES / name
    p = _check(str(path))
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    assert f"{path}:{line}" in p.stderr
    if key is not None:
        assert f"{key}: " in p.stderr
    assert fragment in p.stderr
    assert p.stdout == ""


def test_cli_check_bad_override_exits_2():
    p = _check(str(QUICKSTART), "rollout.n_samples=abc")
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "override 'rollout.n_samples=abc'" in p.stderr and "rollout.n_samples" in p.stderr
    assert "Traceback" not in p.stderr
    assert p.stdout == ""


@pytest.mark.parametrize("section, line, fragment", [
    ("placement:\n  engines:\n    resources: {trainer: -1}\n", 7, "Expected `float` > 0.0"),
    ("pool:\n  uri: s3://b/p\n  storage_options:\n    allow_http: true\n", 7, "quote it"),
])
def test_cli_check_a_bad_value_in_a_mapping_exits_2(tmp_path, section, line, fragment):
    """A bad value under a mapping key (msgspec's path ends in [...]) is located at its section;
    it once sent the locator into an endless loop, and `streamrl check` / `run` hung."""
    path = tmp_path / "r.yaml"
    path.write_text(MINIMAL + section)
    p = _check(str(path))
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert f"{path}:{line}:" in p.stderr and fragment in p.stderr, p.stderr


def test_cli_check_missing_file_exits_2(tmp_path):
    p = _check(str(tmp_path / "absent.yaml"))
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "absent.yaml" in p.stderr and "Traceback" not in p.stderr


def test_learner_section_maps_onto_the_rl_objective():
    from streamrl.connectors.megatron.learner import RLConfig

    r = load_recipe(QUICKSTART, ["learner.off_policy=decoupled", "learner.dual_clip=3", "learner.loss_agg=group",
                                 "rollout.temperature=0.7", "learner.decoupled_cap=5", "learner.mini_batches=4",
                                 "learner.epochs=2"])
    cfg = RLConfig.from_recipe(r.learner, r.rollout.temperature)
    assert (cfg.off_policy, cfg.dual_clip, cfg.loss_agg, cfg.temperature) == ("decoupled", 3.0, "group", 0.7)
    assert (cfg.decoupled_cap, cfg.mini_batches, cfg.epochs, cfg.correction) == (5.0, 4, 2, {"decoupled_cap": 5.0})


@pytest.mark.parametrize("overrides, chosen", [
    ([], "tis"),  # the quick-start streams with max_staleness 1
    (["staleness.max_staleness=0"], "none"),
    (["run.mode=lockstep"], "none"),
    (["run.mode=one_step_off"], "tis"),  # trains on data one version old
    (["learner.off_policy=none"], "none"),
    (["learner.off_policy=icepop", "run.mode=lockstep"], "icepop"),
])
def test_off_policy_auto_corrects_stale_modes(overrides, chosen):
    from streamrl.core.algorithms import RLConfig
    from streamrl.core.staleness import mode_bound

    r = load_recipe(QUICKSTART, overrides)
    assert r.learner.off_policy == ("auto" if not any("off_policy" in o for o in overrides) else chosen)
    cfg = RLConfig.from_recipe(r.learner, 1.0, mode_bound(r.run.mode, r.staleness.max_staleness))
    assert cfg.off_policy == chosen
    assert learner_summary(r).startswith(f"off-policy correction {chosen}")


@pytest.mark.parametrize("overrides, key, fragment", [
    (["learner.off_policy=mis", "learner.tis_cap=3"], "learner.tis_cap", "read only by learner.off_policy tis or tis_seq"),
    (["run.mode=lockstep", "learner.tis_cap=3"], "learner.tis_cap", "off_policy is 'none' (auto, for run.mode lockstep)"),
    (["learner.off_policy=tis", "learner.icepop_low=0.2"], "learner.icepop_low", "read only by learner.off_policy icepop"),
    (["learner.off_policy=mis", "learner.mis_low=3"], "learner.mis_low", "the band [mis_low 3.0, mis_high 2.0] is empty"),
    (["learner.off_policy=icepop", "learner.icepop_high=0.4"], "learner.icepop_high", "icepop_low must be below"),
    (["learner.off_policy=mis", "learner.seq_ratio=product"], "learner.seq_ratio", "no effect with learner.mis_level token"),
    (["learner.mini_batches=17"], "learner.mini_batches", "exceeds rollout.groups_per_step 16"),
    (["rollout.routing=on"], "rollout.routing", "is not a mixture-of-experts model"),
    (["learner.tis_cap=0.5"], "learner.tis_cap", ">= 1.0"),
    (["learner.decoupled_cap=1"], "learner.decoupled_cap", "> 1.0"),
    (["learner.off_policy=reweight"], "learner.off_policy", "choose one of 'auto', 'none', 'tis', 'tis_seq', 'mis'"),
    (["learner.epochs=0"], "learner.epochs", ">= 1"),
    (["learner.parallel.tp=3"], "learner.parallel.tp", "3 does not divide the model's num_attention_heads (4"),
    (["learner.parallel.tp=4"], "learner.parallel.tp", "4 does not divide the model's num_key_value_heads (2"),
    (["learner.parallel.pp=4"], "learner.parallel.pp", "4 does not divide the model's num_hidden_layers (2"),
    (["learner.parallel.dp=0"], "learner.parallel.dp", ">= 1"),
    (["learner.parallel.dp=some"], "learner.parallel.dp", "some"),
    (["learner.parallel.tp=2", "learner.num_gpus=4"], "learner.num_gpus", "tp 2 x pp 1 x dp 1 = 2 ranks"),
    (["learner.parallel.tp=2", "learner.num_gpus=3", "learner.parallel.dp=auto"], "learner.parallel.dp",
     "learner.num_gpus (3) to be a multiple of tp * pp = 2"),
])
def test_inconsistent_learner_settings_name_the_key(overrides, key, fragment):
    msg = _error(QUICKSTART, overrides)
    assert f": {key}: " in msg and fragment in msg, msg
    assert msg.startswith("override '"), msg  # located at the override that set it


def test_routing_on_loads_for_a_moe_model_in_either_spelling():
    moe = ["model.init.preset=tiny-moe", "model.path=runs/no-such-model"]
    assert routing.mode(load_recipe(QUICKSTART, ["rollout.routing=on", *moe]).rollout.routing) == "on"  # YAML: true
    assert routing.mode(load_recipe(QUICKSTART, ["rollout.routing='on'", *moe]).rollout.routing) == "on"
    assert routing.mode(load_recipe(QUICKSTART, ["rollout.routing=off"]).rollout.routing) == "off"


def test_parallel_layout_resolves_dp_auto_from_the_learner_gpus():
    r = load_recipe(QUICKSTART, ["learner.parallel.tp=2", "learner.parallel.dp=auto", "learner.num_gpus=4"])
    assert learner_layout(r) == (2, 1, 2)
    assert learner_summary(r).startswith("4 ranks (tp 2 x pp 1 x dp 2); ")
    assert learner_layout(load_recipe(QUICKSTART, ["learner.parallel.dp=auto"])) == (1, 1, 1)  # CPU: one replica


def test_parallel_layout_is_checked_against_the_model_on_disk(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"num_attention_heads": 6, "num_key_value_heads": 6, '
                                                '"intermediate_size": 96, "num_hidden_layers": 3}')
    p = tmp_path / "r.yaml"
    p.write_text(f"model:\n  path: {tmp_path / 'm'}\ndata:\n  path: d\nlearner:\n  parallel: {{tp: 4, pp: 3}}\n")
    assert _error(p).startswith(f"{p}:6: learner.parallel.tp: 4 does not divide the model's num_attention_heads (6")
    assert learner_layout(load_recipe(p, ["learner.parallel.tp=3"])) == (3, 3, 1)


def test_off_policy_keys_in_the_file_are_located_by_line(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(MINIMAL + "learner:\n  off_policy: tis\n  lr: 1e-5\n  mis_high: 3\n")
    assert _error(p).startswith(f"{p}:8: learner.mis_high: is read only by learner.off_policy mis")


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_loads(path, tmp_path, monkeypatch):
    if path.name == "starter.yaml":  # `streamrl init`'s recipe names my_rewards.py, written beside it
        from streamrl.tools.init import init_project

        init_project(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path))
        path = tmp_path / "recipe.yaml"
    r = load_recipe(path)
    assert r.run.steps >= 1 and r.model.path and r.data.path


def test_sft_lr_schedule_is_constant_unless_asked() -> None:
    sft = MINIMAL + "sft:\n  path: s.jsonl\n"
    assert parse_recipe(sft, "x.yaml").sft.lr_schedule == "constant"
    assert parse_recipe(sft + "  lr_schedule: cosine\n", "x.yaml").sft.lr_schedule == "cosine"
    with pytest.raises(RecipeError,
                       match=r"^x\.yaml:7: sft\.lr_schedule: Invalid enum value 'linear'; choose one of 'constant', 'cosine'"):
        parse_recipe(sft + "  lr_schedule: linear\n", "x.yaml")


def test_network_bind_node_refuses_an_explicit_host_too():
    assert parse_recipe(MINIMAL + "network: {bind: node}\n").network.bind == "node"
    assert parse_recipe(MINIMAL).network.bind == "loopback"  # nothing leaves the machine by default
    with pytest.raises(RecipeError, match=r"engines\.host: is '10\.0\.0\.5' and network\.bind is node"):
        parse_recipe(MINIMAL + "network: {bind: node}\nengines: {host: 10.0.0.5}\n")
    with pytest.raises(RecipeError, match=r"network\.bind: Invalid enum value 'all'"):
        parse_recipe(MINIMAL + "network: {bind: all}\n")


def test_engines_python_must_be_an_executable_for_sglang(tmp_path: Path) -> None:
    """engines.python (docs/gpu.md): the interpreter that starts SGLang; each error names key and value."""
    assert parse_recipe(MINIMAL).engines.python is None
    exe = tmp_path / "bin" / "python"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    sglang = MINIMAL + "engines:\n  backend: sglang\n  python: {}\n"
    assert parse_recipe(sglang.format(exe), "x.yaml").engines.python == str(exe)
    for value, problem in ((tmp_path / "nope", "does not exist on this machine"),
                           (tmp_path / "bin", "is a directory"), ("python3", "not an absolute path")):
        with pytest.raises(RecipeError, match=rf"^x\.yaml:7: engines\.python: is '{value}'.*{problem}"):
            parse_recipe(sglang.format(value), "x.yaml")
    exe.chmod(0o644)
    with pytest.raises(RecipeError, match=rf"engines\.python: is '{exe}', which is not executable"):
        parse_recipe(sglang.format(exe), "x.yaml")
    exe.chmod(0o755)
    with pytest.raises(RecipeError, match=r"engines\.python: .* engines\.backend is embedded"):
        parse_recipe(MINIMAL + f"engines:\n  python: {exe}\n", "x.yaml")


def test_learner_dtype_is_fp32_or_bf16():
    assert load_recipe(QUICKSTART).learner.dtype == "fp32"
    assert load_recipe(QUICKSTART, ["learner.dtype=bf16"]).learner.dtype == "bf16"
    with pytest.raises(RecipeError, match=r"learner\.dtype: Invalid enum value 'fp16'"):
        load_recipe(QUICKSTART, ["learner.dtype=fp16"])
