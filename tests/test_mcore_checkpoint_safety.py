"""A tampered run directory cannot run code when a learner checkpoint loads
(connectors/megatron/checkpoint.py, connectors/megatron/sharded.py): pickles placed in the DCP
`.metadata`, megatron's `common.pt` or an RNG file, with the manifest re-signed, are refused by
name; a model extra state that would be stored as a pickle is refused at save time."""

from __future__ import annotations

from pathlib import Path

from learnerkit import model_dir, run_script  # noqa: F401 - model_dir is a fixture

TAMPER = """
    import io, json, os, pickle, shutil, sys, torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from streamrl.connectors.megatron.learner import MegatronLearner, init_single_process
    from streamrl.connectors.megatron import checkpoint as mc
    model_dir, root, marker = sys.argv[1:4]
    init_single_process()
    learner = MegatronLearner(model_dir, lr=1e-2)
    learner.sft_step([([5, 6, 7], [8, 9, 2])])
    clean = mc.save_checkpoint(learner, root)
    out = {}

    # TransformerEngine's FP8 `_extra_state` would be stored as a pickle: refused when saving
    sd = learner.model.sharded_state_dict
    learner.model.sharded_state_dict = lambda *a, **k: {**sd(*a, **k), "te._extra_state": ShardedObject(
        "te._extra_state", io.BytesIO(b"fp8"), (1,), (0,), replica_id=0)}
    learner.version += 1
    try:
        mc.save_checkpoint(learner, root)
        out["extra_state"] = ""
    except NotImplementedError as e:
        out["extra_state"] = str(e)
    out["versions"] = [v for v, _ in mc.list_checkpoints(root)]
    learner.model.sharded_state_dict = sd

    class Evil:  # what a tampered run directory could hold
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    def with_bytes_entry(p):  # genuine DCP metadata plus an object entry, which DCP unpickles
        m = pickle.loads(p.read_bytes())
        m.state_dict_metadata["te._extra_state"] = BytesStorageMetadata()
        p.write_bytes(pickle.dumps(m))

    tamper = {"sharded/.metadata": lambda p: p.write_bytes(pickle.dumps(Evil())),
              "sharded/.metadata bytes": with_bytes_entry,
              "sharded/common.pt": lambda p: torch.save({"scheduler": Evil()}, p),
              "rng/rank_00000.pt": lambda p: torch.save({"python": Evil()}, p)}
    for what, hurt in tamper.items():
        d = clean.with_name("step_00000009")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(clean, d)
        hurt(d / what.split()[0])
        (d / "meta.json").write_text(json.dumps({**json.loads((d / "meta.json").read_text()), "version": 9}))
        mc._write_manifest(d, 9, mc._files(d))  # re-signed too: the manifest is no defence here
        try:
            mc.load_checkpoint(learner, d)
            out[what] = ""
        except mc.CheckpointError as e:
            out[what] = str(e)
    out["ran"] = os.path.exists(marker)
    print(json.dumps(out))
"""


def test_loading_a_checkpoint_never_unpickles(model_dir: Path, tmp_path: Path) -> None:
    res = run_script(TAMPER, str(model_dir), str(tmp_path / "ckpt"), str(tmp_path / "pwned"))
    assert "te._extra_state" in res["extra_state"] and res["versions"] == [1], res  # refused before writing
    assert "system is not allowed in checkpoint metadata" in res["sharded/.metadata"], res
    assert "sharded/.metadata cannot be read: holds pickled objects" in res["sharded/.metadata bytes"], res
    assert "sharded/common.pt cannot be read" in res["sharded/common.pt"], res
    assert "rng/rank_00000.pt cannot be read" in res["rng/rank_00000.pt"], res
    assert res["ran"] is False and not (tmp_path / "pwned").exists()
