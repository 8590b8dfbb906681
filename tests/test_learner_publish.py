"""The learner driver publishes without a per-step copy of its weights: a push (weight group,
SGLang's bucketed layout) and an export gather the weights when they are asked for, so they
carry the newest step, in the learner's dtype; an export of a version the learner has left is
refused."""

from __future__ import annotations

from pathlib import Path

from learnerkit import model_dir, run_script  # noqa: F401 - model_dir is a fixture

PUBLISH = """
    import sys, json, threading, torch
    from safetensors.torch import load_file
    from streamrl.connectors.sglang import weight_sync as ws
    from streamrl.connectors.megatron.learner import Sample
    from streamrl.recipe import load_recipe
    from streamrl.runtime.learner import LearnerDriver
    model_dir, out, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
    r = load_recipe("recipes/quickstart.yaml", [f"model.path={model_dir}", f"learner.dtype={dtype}",
                                                "learner.lr=1e-2", "learner.off_policy=none"])
    d = LearnerDriver(r, model_dir, pool=False)
    res = {"snapshot_attrs": sorted(k for k in vars(d) if "snapshot" in k or "pinned" in k)}
    names, dtypes, shapes = d.weights_meta()
    res["meta_dtypes"] = sorted(set(dtypes))
    before = d.learner.hf_state_dict()

    host, port = d.open_weight_store("127.0.0.1", 2)
    joined = {}
    t = threading.Thread(target=lambda: joined.update(g=ws.join_group(host, port, 1, 2, "w", "gloo", 30)))
    t.start(); d.init_weight_group(2, "w", "gloo"); t.join()

    rows = [Sample(prompt=[5, 6, 7 + g], response=[20 + i + g, 30, 31 + i], advantage=(1.0 if i % 2 else -1.0),
                   rollout_logprobs=[-2.0] * 3, group=g) for g in range(2) for i in range(4)]
    d._train(0, rows)
    newest = d.learner.hf_state_dict()

    got = {}
    t = threading.Thread(target=lambda: got.update(ws.receive(joined["g"], names, dtypes, shapes, ws.BUCKET_FORMAT)))
    t.start(); d.push_weights(True); t.join()
    res["pushed_is_newest"] = all(torch.equal(got[k], newest[k]) for k in names)
    res["step_moved"] = any(not torch.equal(before[k], newest[k]) for k in names)

    path = d.export(f"{out}/v1", version=d.version)
    exported = load_file(f"{path}/model.safetensors")
    res["exported_is_newest"] = all(torch.equal(exported[k], newest[k]) for k in exported)
    res["exported_dtypes"] = sorted({str(t.dtype) for t in exported.values()})
    cfg = json.load(open(f"{path}/config.json"))
    res["config_dtype"] = cfg.get("dtype", cfg.get("torch_dtype"))
    cast = load_file(f"{d.export(f'{out}/v1-bf16', dtype='bfloat16')}/model.safetensors")  # bf16 engines
    res["cast_is_newest_in_bf16"] = all(cast[k].dtype == torch.bfloat16 and torch.equal(cast[k], newest[k].to(torch.bfloat16))
                                        for k in cast)
    try:
        d.export(f"{out}/v0", version=d.version - 1)
        res["old_version"] = "exported"
    except RuntimeError as e:
        res["old_version"] = str(e)
    print(json.dumps(res))
"""


def _publish(model_dir: Path, tmp_path: Path, dtype: str) -> dict:
    return run_script(PUBLISH, str(model_dir), str(tmp_path), dtype)


def test_bf16_learner_pushes_and_exports_its_newest_weights_in_bf16(model_dir: Path, tmp_path: Path) -> None:
    res = _publish(model_dir, tmp_path, "bf16")
    assert res["snapshot_attrs"] == []  # nothing keeps a copy of the model between publishes
    assert res["meta_dtypes"] == ["bfloat16"] and res["exported_dtypes"] == ["torch.bfloat16"]
    assert res["config_dtype"] == "bfloat16"
    assert res["step_moved"] and res["pushed_is_newest"] and res["exported_is_newest"]
    assert res["cast_is_newest_in_bf16"]
    assert "learner is at version 1" in res["old_version"]


def test_fp32_learner_publishes_fp32(model_dir: Path, tmp_path: Path) -> None:
    res = _publish(model_dir, tmp_path, "fp32")
    assert res["meta_dtypes"] == ["float32"] and res["exported_dtypes"] == ["torch.float32"]
    assert res["config_dtype"] == "float32"
    assert res["step_moved"] and res["pushed_is_newest"] and res["exported_is_newest"]
    assert res["cast_is_newest_in_bf16"]  # for bf16 engines: the export (and a push) cast
