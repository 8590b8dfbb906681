"""Learner checkpoints (connectors/megatron/checkpoint.py): a resumed run repeats the original
bit for bit; a save SIGKILLed at any moment leaves a complete checkpoint behind; a damaged
file is refused by name; the HF export loads in transformers with the learner's logits
(tests/test_mcore_checkpoint_layouts.py: other parallel layouts; _safety.py: tampering).

Learner code runs in subprocesses: megatron / torch.distributed state is per process."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from learnerkit import REPO, model_dir, run_script  # noqa: F401 - model_dir is a fixture

# ---------------------------------------------------------------- (1) resume is exact

TRAIN = """
    import sys, json, random
    import numpy as np, torch
    from safetensors.torch import save_file
    from streamrl.connectors.megatron.learner import MegatronLearner, init_single_process
    from streamrl.connectors.megatron import checkpoint as mc
    model_dir, root, mode, out = sys.argv[1:5]
    init_single_process()
    learner = MegatronLearner(model_dir, lr=3e-3, warmup_steps=5, weight_decay=0.01, micro_batch_size=8)

    def batch():  # every draw goes through the global RNGs a checkpoint must restore
        rows = []
        for _ in range(16):
            a, b, c = random.randint(0, 99), int(np.random.randint(0, 99)), int(torch.randint(0, 99, ()))
            rows.append(([5 + a % 50, 60 + b % 50, 120 + c % 50], [200 + (a + b + c) % 100, 2]))
        return rows

    if mode == "first":
        random.seed(1); np.random.seed(2); torch.manual_seed(3)
        before = [learner.sft_step(batch()) for _ in range(2)]
        mc.save_checkpoint(learner, root, extra={"rows_seen": 32})
        extra = None
    else:  # other RNG streams and the base weights: only the checkpoint can make this match
        random.seed(7); np.random.seed(7); torch.manual_seed(7)
        extra = mc.load_checkpoint(learner, root)
    start = learner.version
    after = [learner.sft_step(batch()) for _ in range(2)]
    save_file({k: v.contiguous() for k, v in learner.model.state_dict().items() if isinstance(v, torch.Tensor)},
              out)
    exp_avg = sum(float(s["exp_avg_sq"].sum()) for s in learner.opt.param_states().values())
    print(json.dumps({"start": start, "version": learner.version, "extra": extra, "after": after,
                      "exp_avg_sq": exp_avg, "last_epoch": learner.opt.last_epoch}))
"""


@pytest.fixture(scope="module")
def first_run(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    d = tmp_path_factory.mktemp("first")
    res = run_script(TRAIN, str(model_dir), str(d / "ckpt"), "first", str(d / "final.safetensors"))
    return d / "ckpt", d / "final.safetensors", res


@pytest.mark.slow
def test_resume_from_a_checkpoint_repeats_the_run_exactly(model_dir: Path, first_run: tuple[Path, Path, dict],
                                                          tmp_path: Path) -> None:
    from safetensors.torch import load_file

    root, final, first = first_run
    assert (root / "latest").read_text().strip() == "step_00000002"
    resumed = run_script(TRAIN, str(model_dir), str(root), "resume", str(tmp_path / "final.safetensors"))
    assert resumed["start"] == first["start"] == 2 and resumed["version"] == first["version"] == 4
    assert resumed["extra"] == {"rows_seen": 32}
    assert resumed["last_epoch"] == first["last_epoch"]
    for a, b in zip(first["after"], resumed["after"]):
        assert a["lr"] == b["lr"], (a, b)  # scheduler (warm-up) restored
        assert abs(a["loss"] - b["loss"]) <= 1e-7 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-7, (a, b)
    assert abs(first["exp_avg_sq"] - resumed["exp_avg_sq"]) <= 1e-7 * max(1.0, abs(first["exp_avg_sq"]))
    wa, wb = load_file(str(final)), load_file(str(tmp_path / "final.safetensors"))
    assert wa.keys() == wb.keys()
    diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert diff <= 1e-7, diff


# ---------------------------------------------------------------- (2) SIGKILL mid-save

# A stand-in learner (plain torch module, saved unsharded by rank 0 of a one-process group)
# through the same save/load code. A fork
# server imports torch once (and runs no torch op, so forking is safe); per attempt it forks a
# worker that loads the latest checkpoint and checks that everything it restored (weights,
# Adam moments, scheduler, torch RNG, version) has the fingerprint recorded at save time, then
# takes a step and saves, and is SIGKILLed at a named stage of the save (a hook in the module)
# or, with fsyncs slowed down, after a random delay.
CRASH = """
    import sys, os, json, signal, hashlib, time, traceback
    import numpy, safetensors.torch, torch
    import megatron.core.dist_checkpointing, torch.distributed as dist
    from streamrl.connectors.megatron import checkpoint as mc
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # its lazy imports take ~1 s: once, here

    class Adam:  # torch AdamW with warm-up behind the learner optimizer's checkpoint interface (mcore_optimizer)
        def __init__(self, params):
            self.params = list(params)
            self.inner = torch.optim.AdamW(self.params, lr=1e-3)
            self.param_groups, self.last_epoch = self.inner.param_groups, 0
            self.load_scheduler_state({"last_epoch": 0})

        def step(self):
            self.inner.step(); self.inner.zero_grad(set_to_none=True)
            self.load_scheduler_state({"last_epoch": self.last_epoch + 1})

        def step_count(self):
            steps = {float(s["step"]) for s in self.inner.state.values()}
            return steps.pop() if steps else None

        def state_keys(self):
            return ["exp_avg", "exp_avg_sq"]

        def param_states(self):
            return {p: {k: self.inner.state[p][k] for k in self.state_keys()} for p in self.inner.state}

        def load_param_states(self, states, step):
            self.inner.state.clear()
            for p, s in states.items():
                self.inner.state[p] = {"step": torch.tensor(step), **{k: v.clone() for k, v in s.items()}}

        def scheduler_state(self):
            return {"last_epoch": self.last_epoch}

        def load_scheduler_state(self, state):
            self.last_epoch = state["last_epoch"]
            self.param_groups[0]["lr"] = 1e-3 * min(1.0, (self.last_epoch + 1) / 5)

    class Learner:
        def __init__(self):
            torch.manual_seed(0)
            self.model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256))
            self.opt = Adam(self.model.parameters())
            self.version = 0

        def step(self):
            self.model(torch.randn(8, 256)).pow(2).mean().backward()
            self.opt.step(); self.version += 1

    def fingerprint(l):
        h = hashlib.sha256()
        for t in l.model.state_dict().values():
            h.update(t.numpy().tobytes())
        for s in l.opt.inner.state_dict()["state"].values():
            for k in sorted(s):
                h.update(s[k].numpy().tobytes())
        h.update(torch.get_rng_state().numpy().tobytes())
        h.update(json.dumps([l.opt.last_epoch, l.opt.param_groups[0]["lr"], l.version]).encode())
        return h.hexdigest()

    def attempt(root, stage, out):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # checkpoints are collective
        learner = Learner()
        loaded = None
        if os.path.exists(os.path.join(root, "latest")):
            extra = mc.load_checkpoint(learner, root)
            loaded = {"version": learner.version, "saved_version": extra["version"],
                      "fingerprint_ok": extra["fingerprint"] == fingerprint(learner)}
        print(json.dumps({"loaded": loaded}), file=out)
        learner.step()
        if stage == "random":
            fsync = os.fsync
            os.fsync = lambda fd: (time.sleep(0.03), fsync(fd))[1]
        elif stage != "none":
            mc._crash_point = lambda s: os.kill(os.getpid(), signal.SIGKILL) if s == stage else None
        print(json.dumps({"saving": learner.version}), file=out)
        mc.save_checkpoint(learner, root, extra={"version": learner.version, "fingerprint": fingerprint(learner)},
                           keep_last=2)
        print(json.dumps({"saved": learner.version}), file=out)

    for cmd in sys.stdin:
        root, stage, delay = json.loads(cmd)
        r, w = os.pipe()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 0
            try:
                with os.fdopen(w, "w", buffering=1) as out:
                    attempt(root, stage, out)
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)
        os.close(w)
        lines = []
        with os.fdopen(r) as f:
            for line in f:
                lines.append(json.loads(line))
                if delay is not None and "saving" in lines[-1]:
                    time.sleep(delay)
                    os.kill(pid, signal.SIGKILL)  # a no-op on a worker that already finished
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        print(json.dumps({"lines": lines, "killed": killed, "exit": os.waitstatus_to_exitcode(status)}), flush=True)
"""


@pytest.mark.slow
def test_a_save_killed_at_any_moment_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    from streamrl.connectors.megatron.checkpoint import latest_checkpoint, list_checkpoints, verify_checkpoint

    root = tmp_path / "ckpt"
    rng = random.Random(0)
    # stage -> does the kill leave the new checkpoint as latest?
    stages = [("none", True), ("files", False), ("synced", False), ("renamed", False),
              ("latest_tmp", False),  # re-saves step 2, which "renamed" left (not latest) on disk
              ("latest", True), ("retention", True), *[("random", None)] * 6, ("none", True)]
    server = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CRASH)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert server.stdin is not None and server.stdout is not None
    expected: set[int] = set()  # versions the next load may find
    leftovers_seen, random_kills_mid_save = 0, 0
    try:
        for stage, new_is_latest in stages:
            delay = rng.uniform(0.0, 0.4) if stage == "random" else None
            server.stdin.write(json.dumps([str(root), stage, delay]) + "\n")
            server.stdin.flush()
            reply = server.stdout.readline()
            assert reply, server.communicate(timeout=30)[1][-3000:]
            res = json.loads(reply)
            lines = res["lines"]
            loaded = lines[0]["loaded"]
            if not expected:
                assert loaded is None
            else:  # a complete checkpoint, the one `latest` named: version, weights, optimizer, RNG agree
                assert loaded is not None and loaded["version"] in expected, (stage, loaded, expected)
                assert loaded["saved_version"] == loaded["version"] and loaded["fingerprint_ok"], (stage, loaded)
            prev, new = (loaded or {"version": 0})["version"], lines[1]["saving"]
            saved = any("saved" in x for x in lines)
            if stage == "random":
                assert saved != res["killed"], res
                random_kills_mid_save += res["killed"]
                expected = {new} if saved else {prev, new}
            else:
                assert res["killed"] == (stage != "none") and saved == (stage == "none"), (stage, res)
                expected = {new} if new_is_latest else {prev}
            # on disk, whatever the moment of the kill: `latest` names a checkpoint that verifies
            latest = latest_checkpoint(root)
            assert latest is not None and verify_checkpoint(latest)["version"] in expected, (stage, latest)
            leftovers_seen += sum(p.name.startswith((".tmp-", ".trash-")) for p in root.iterdir())
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=30)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    assert random_kills_mid_save >= 2, random_kills_mid_save
    # the kills did leave temp dirs behind, and the final clean save removed them all
    assert leftovers_seen > 0
    assert not [p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    assert len(list_checkpoints(root)) <= 2  # keep_last=2
    for _, p in list_checkpoints(root):
        verify_checkpoint(p)


# ---------------------------------------------------------------- (3) damage is refused by name


def _flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _damage_manifest_hash(path: Path) -> None:
    m = json.loads(path.read_text())
    f = m["files"]["sharded/common.pt"]
    f["sha256"] = ("0" if f["sha256"][0] != "0" else "1") + f["sha256"][1:]
    path.write_text(json.dumps(m))


SHARD = "sharded/__0_0.distcp"  # rank 0's shard: parameters and Adam moments
DAMAGE = {
    "truncate the shard": (SHARD, lambda p: p.write_bytes(p.read_bytes()[:1000])),
    "flip a byte of the shard": (SHARD, lambda p: _flip_byte(p, 0.9)),
    "flip a byte of the DCP metadata": ("sharded/.metadata", _flip_byte),
    "flip a byte of common.pt": ("sharded/common.pt", _flip_byte),
    "delete the RNG file": ("rng/rank_00000.pt", lambda p: p.unlink()),
    "edit a checksum in manifest.json": ("manifest.json", _damage_manifest_hash),
    "truncate manifest.json": ("manifest.json", lambda p: p.write_text(p.read_text()[:50])),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_naming_the_file(first_run: tuple[Path, Path, dict], tmp_path: Path,
                                                         damage: str) -> None:
    from streamrl.connectors.megatron.checkpoint import CheckpointError, load_checkpoint, verify_checkpoint

    root = tmp_path / "ckpt"
    shutil.copytree(first_run[0], root)
    step = root / "step_00000002"
    verify_checkpoint(step)  # intact copy verifies
    name, hurt = DAMAGE[damage]
    hurt(step / name)

    class Untouchable:  # the learner must not be touched when verification fails
        def __getattr__(self, attr: str) -> None:
            raise AssertionError(f"learner.{attr} touched while loading a damaged checkpoint")

    with pytest.raises(CheckpointError, match=rf"file {name} is|{name} is damaged") as e:
        load_checkpoint(Untouchable(), root)
    assert str(step) in str(e.value)


@pytest.mark.slow
def test_a_damaged_latest_pointer_is_refused(first_run: tuple[Path, Path, dict], tmp_path: Path) -> None:
    from streamrl.connectors.megatron.checkpoint import CheckpointError, load_checkpoint

    root = tmp_path / "ckpt"
    shutil.copytree(first_run[0], root)
    (root / "latest").write_text("step_000\x00\x00")
    with pytest.raises(CheckpointError, match="latest is damaged"):
        load_checkpoint(object(), root)
    with pytest.raises(CheckpointError, match="no checkpoint for step 9"):
        load_checkpoint(object(), root, step=9)


# ---------------------------------------------------------------- (4) HF export

EXPORT = """
    import sys, json, torch
    from streamrl.connectors.megatron.learner import MegatronLearner, init_single_process
    from streamrl.connectors.megatron.batch import TokenBatch
    from streamrl.connectors.megatron.hf_export import export_hf
    model_dir, out, logits_file = sys.argv[1:4]
    init_single_process()
    learner = MegatronLearner(model_dir, lr=1e-2)
    for _ in range(2):  # move the weights away from the base model's
        learner.sft_step([([5, 6, 7], [8, 9, 2]), ([11, 12, 13], [14, 15, 2])])
    export_hf(learner.hf_weights(), model_dir, out)
    export_hf(learner.hf_weights(), model_dir, out)  # again: replaces the directory atomically
    b = TokenBatch([([1, 2, 3, 4], [5, 6, 7, 8]), ([40, 41, 42, 43], [44, 45, 46, 47])])
    learner.model.eval()
    with torch.no_grad():
        logits = learner.model(b.ids, b.positions, b.attn_mask)
    torch.save({"ids": b.ids, "logits": logits.float()}, logits_file)
    print(json.dumps({"version": learner.version}))
"""


@pytest.mark.slow
def test_export_hf_loads_in_transformers_with_the_learner_logits(model_dir: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "export" / "hf"
    res = run_script(EXPORT, str(model_dir), str(out), str(tmp_path / "logits.pt"))
    assert res["version"] == 2
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf"]  # no temp dirs left
    ref = torch.load(tmp_path / "logits.pt")
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(input_ids=ref["ids"]).logits
        base_logits = base(input_ids=ref["ids"]).logits
    assert float((got - ref["logits"]).abs().max()) < 1e-5
    assert float((base_logits - ref["logits"]).abs().max()) > 1e-3  # the export is the trained weights
    assert hf.config.tie_word_embeddings and hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.encode("1+2=") == AutoTokenizer.from_pretrained(str(model_dir)).encode("1+2=")
    assert tok.chat_template
