"""olmo3-jax tests. CPU only, tiny configs, 8 fake devices where sharding matters.

Run: pytest -q test_olmo3.py   (the README's command sets TIKTOKEN_CACHE_DIR for offline machines)
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax loads
_SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared", "data")
if os.path.isdir(os.path.join(_SHARED, "tiktoken")):
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(_SHARED, "tiktoken"))

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import convert
import olmo3

TINY = olmo3.PRESETS["tiny"]


# ----------------------------------------------------------------------------- model and converter

def small_config(**overrides):
    """A tiny OLMo 3 with a window (16) far below the test sequence, so both layer kinds matter."""
    base = dict(n_layers=4, sliding_window=16, vocab_size=300, tokenizer="dolma2", compute_dtype="float32")
    return dataclasses.replace(TINY, **(base | overrides))


def make_hf_checkpoint(cfg, path, std=0.05, seed=0):
    """A randomly initialised transformers Olmo3ForCausalLM saved to `path` (no download).
    Norm weights are randomised too, so a mixed-up norm cannot pass unnoticed."""
    import torch
    import transformers
    hf_cfg = {k: v for k, v in convert.config_to_hf(cfg).items() if k not in ("architectures", "model_type", "dtype")}
    torch.manual_seed(seed)
    model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(**hf_cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else std * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("n_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_logits_match_hugging_face(tmp_path, n_kv_heads):
    cfg = small_config(n_kv_heads=n_kv_heads)
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "hf")
    loaded_cfg, params = convert.from_hf(hf_dir)
    assert all(getattr(loaded_cfg, f) == getattr(cfg, f) for f in olmo3.MODEL_FIELDS)
    results = convert.verify(hf_dir, loaded_cfg, params, seq_len=64)
    assert results["float32"]["max_abs"] <= 1e-5, results  # seen: ~2e-6
    assert results["float32"]["top1"] == 1.0
    assert results["bfloat16"]["kl"] < 2e-3 and results["bfloat16"]["top1"] > 0.95, results


def test_round_trip_is_bit_identical(tmp_path):
    from safetensors.numpy import load_file
    cfg = small_config(n_kv_heads=2)
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "hf")
    convert.main(["hf-to-jax", str(hf_dir), str(tmp_path / "jax")])
    convert.main(["jax-to-hf", str(tmp_path / "jax"), str(tmp_path / "back")])

    def tensors(d):
        return {k: v for f in sorted(Path(d).glob("*.safetensors")) for k, v in load_file(f).items()}
    original, back = tensors(hf_dir), tensors(tmp_path / "back")
    assert original.keys() == back.keys()
    for name in original:
        assert original[name].dtype == back[name].dtype and np.array_equal(original[name], back[name]), name
    import transformers  # and transformers loads what we wrote
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert model.config.layer_types == convert.config_to_hf(cfg)["layer_types"]


def test_converter_rejects_bad_checkpoints(tmp_path):
    cfg = small_config()
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(SystemExit, match="model_type is 'llama'"):
        convert.from_hf(hf_dir)
    (hf_dir / "config.json").write_text(json.dumps(config | {"intermediate_size": 512}))
    with pytest.raises(SystemExit, match=r"mlp.gate_proj.weight has shape \(768, 256\), expected \(512, 256\)"):
        convert.from_hf(hf_dir)
    del config["layer_types"]  # so the layer count alone changes
    (hf_dir / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3}))
    with pytest.raises(SystemExit, match="unexpected tensor model.layers.3"):
        convert.from_hf(hf_dir)
    (hf_dir / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 5}))
    with pytest.raises(SystemExit, match="tensor model.layers.4.* is missing"):
        convert.from_hf(hf_dir)


def test_causality_through_gradients():
    """d(loss at position t) / d(input embedding at s) is exactly zero for every s > t."""
    cfg = small_config()
    params = olmo3.init(cfg, jax.random.key(0))
    x = olmo3.embed(params, jax.random.randint(jax.random.key(1), (1, 40), 0, cfg.vocab_size), cfg)
    t = 23

    def loss_at_t(x):
        return jax.nn.logsumexp(olmo3.unembed(params, olmo3.decoder(params, x, cfg))[0, t])
    grads = np.abs(np.asarray(jax.grad(loss_at_t)(x)[0])).sum(-1)
    assert np.all(grads[t + 1:] == 0.0) and np.all(grads[:t + 1] > 0)


def test_sliding_window_forgets_tokens_more_than_w_back():
    cfg = small_config()
    params = olmo3.init(cfg, jax.random.key(0))
    layer = jax.tree.map(lambda w: w[0], params["blocks"])
    x = jax.random.normal(jax.random.key(1), (1, 48, cfg.d_model))
    rope = olmo3.rope_tables(48, cfg.head_dim, cfg.rope_theta)
    t, W = 40, cfg.sliding_window

    def influence(window):
        out_t = lambda x: olmo3.block(layer, x, window, rope, cfg)[0, t].sum()
        return np.abs(np.asarray(jax.grad(out_t)(x)[0])).sum(-1)
    local, full = influence(W), influence(None)
    assert np.all(local[:t - W + 1] == 0) and np.all(local[t - W + 1:t + 1] > 0)  # window includes t
    assert np.all(full[:t + 1] > 0)


def test_loss_ignores_labels_and_adds_z_loss():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7)) * 3
    labels = jnp.array([[1, 2, 3, -100, 0], [6, -100, 5, 4, -100]])
    ce, z, n = olmo3.loss_terms(logits, labels, 1e-2)
    lg, lb = np.asarray(logits, np.float64), np.asarray(labels)
    lse = np.log(np.exp(lg).sum(-1))
    keep = lb >= 0
    want_ce = (lse - np.take_along_axis(lg, np.where(keep, lb, 0)[..., None], -1)[..., 0])[keep].sum()
    assert int(n) == keep.sum()
    np.testing.assert_allclose([float(ce), float(z)], [want_ce, 1e-2 * (lse[keep] ** 2).sum()], rtol=1e-5)


def test_7b_parameter_count():
    assert olmo3.param_count(olmo3.PRESETS["7b"]) == 7_298_617_344
    assert olmo3.param_count(olmo3.PRESETS["7b-wide"]) == 7_298_617_344


@pytest.mark.parametrize("preset", ["7b", "7b-wide"])
def test_7b_forward_compiles_sharded(preset):
    """The real 7B shapes, lowered with abstract arrays (nothing allocated) on 8 fake devices."""
    cfg = olmo3.PRESETS[preset]
    mesh = olmo3.make_mesh(data=1, fsdp=4, tensor=2)
    abstract = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=sharding),
                            olmo3.param_specs(cfg), olmo3.shardings(cfg, mesh), is_leaf=olmo3.is_spec)
    tokens = jax.ShapeDtypeStruct((8, cfg.seq_len), jnp.int32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))
    with jax.set_mesh(mesh):
        compiled = jax.jit(olmo3.forward, static_argnums=2).lower(abstract, tokens, cfg).compile()
    assert compiled.memory_analysis().argument_size_in_bytes < olmo3.param_count(cfg) * 4 / 8 * 1.01


def test_mesh_errors_are_one_line():
    with pytest.raises(SystemExit, match="does not fit 8 devices"):
        olmo3.make_mesh(data=3, fsdp=-1)
    with pytest.raises(SystemExit, match="dimension 258 does not split"):
        olmo3.shardings(dataclasses.replace(TINY, d_model=258), olmo3.make_mesh(fsdp=8))


# ----------------------------------------------------------------------------- training

import train  # noqa: E402

SMALL_RUN = ["--preset", "tiny", "--d-model", "64", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "2",
             "--head-dim", "32", "--mlp-hidden", "256", "--sliding-window", "16", "--seq-len", "32",
             "--global-batch", "8", "--warmup-steps", "2", "--log-every", "1", "--eval-batches", "2",
             "--samples", "0"]


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    """Two small train token files and one held-out file (raw uint32, OLMo's format), byte vocab."""
    d = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    text = (b"the quick brown fox jumps over the lazy dog; " * 40 + bytes(rng.integers(97, 123, 2000, dtype=np.uint8)))
    for name, n in (("a", 6000), ("b", 5000), ("heldout", 3000)):
        tokens = np.frombuffer((text * 4)[:n], np.uint8).astype(np.uint32)
        tokens[::97] = 256  # EOS now and then
        tokens.tofile(d / f"{name}.npy")
    return {"train": str(d / "[ab].npy"), "eval": str(d / "heldout.npy")}


def run_train(out, token_files, *extra):
    train.main(SMALL_RUN + ["--data", token_files["train"], "--eval-data", token_files["eval"],
                            "--out", str(out), *extra])
    return [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]


def train_losses(records):
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def olmo_core_lr(initial_lr, step, max_steps, warmup, alpha_f, kind):
    """OLMo-core's CosWithWarmup / LinearWithWarmup.get_lr (src/olmo_core/optim/scheduler.py)."""
    eta_min = initial_lr * alpha_f
    if step < warmup:
        return initial_lr * min(step, warmup) / warmup
    if step >= max_steps:
        return eta_min
    step, max_steps = step - warmup, max_steps - warmup
    if kind == "cosine":
        return eta_min + (initial_lr - eta_min) * (1 + np.cos(np.pi * step / max_steps)) / 2
    return initial_lr - (initial_lr - eta_min) * (step / max_steps)


@pytest.mark.parametrize("kind,warmup,alpha_f", [("cosine", 10, 0.1), ("linear", 0, 0.0), ("linear", 5, 0.1)])
def test_schedule_matches_olmo_core_off_by_one(kind, warmup, alpha_f):
    cfg = dataclasses.replace(TINY, lr=3e-4, steps=50, warmup_steps=warmup, schedule=kind, min_lr_ratio=alpha_f)
    lr = train.schedule(cfg)
    for k in range(1, 56):  # the k-th update is optax count k - 1 and OLMo-core's current = k
        want = olmo_core_lr(3e-4, k, 50, warmup, alpha_f, kind)
        assert float(lr(k - 1)) == pytest.approx(want, rel=1e-5, abs=1e-12), k  # fp32
    assert float(lr(0)) > 0 or warmup == 0  # OLMo-core's first update already has a warmup LR


def test_stage2_preset_is_warm_adam_linear_to_zero():
    cfg, args = train.parse_args(["--preset", "7b", "--stage2"])
    assert (cfg.lr, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio, cfg.global_batch) == (2.0712e-4, 0, "linear", 0.0, 256)
    assert float(train.schedule(cfg)(0)) == pytest.approx(2.0712e-4 * (1 - 1 / cfg.steps))
    assert float(train.schedule(cfg)(cfg.steps - 1)) == 0.0


def test_spike_guard_follows_olmo_core():
    history = {"loss": jnp.zeros(128), "grad_norm": jnp.zeros(128), "count": jnp.int32(0)}
    rng = np.random.default_rng(0)
    skips = []
    for i in range(100):
        loss, gn = 3 + 0.01 * rng.standard_normal(), 1 + 0.01 * rng.standard_normal()
        if i in (40, 80):
            loss += 1.0  # a loss spike: ignored before 64 steps of history, skipped after
        if i == 90:
            gn += 1.0    # a grad-norm spike alone also skips (OLMo-core needs both within 6 sigma)
        skip, history = train.spike_guard(history, jnp.float32(loss), jnp.float32(gn))
        skips.append(bool(skip))
    assert [i for i, s in enumerate(skips) if s] == [80, 90]
    assert int(history["count"]) == 100


def test_exact_resume_and_run_outputs(tmp_path, token_files):
    straight = train_losses(run_train(tmp_path / "a", token_files, "--steps", "12", "--save-every", "100"))
    run_train(tmp_path / "b", token_files, "--steps", "12", "--stop-at", "6")
    resumed = run_train(tmp_path / "b", token_files, "--steps", "12")
    assert sorted(straight) == list(range(1, 13))
    assert train_losses(resumed) == straight  # bit-identical at every step, before and after the resume
    assert straight[12] < straight[1]
    evals = [r for r in resumed if "eval_loss" in r]
    assert evals and all(k in resumed[-1] for k in ("step", "eval_loss")) and (tmp_path / "b" / "loss.png").exists()
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(resumed[0])


def test_resume_refuses_other_config(tmp_path, token_files):
    run_train(tmp_path / "r", token_files, "--steps", "2")
    with pytest.raises(SystemExit, match=r"checkpoint in .* has d_model=64 \(command line: 128\)"):
        run_train(tmp_path / "r", token_files, "--steps", "4", "--d-model", "128")


def test_gradient_accumulation_matches_full_batch(tmp_path, token_files):
    full = train_losses(run_train(tmp_path / "full", token_files, "--steps", "3", "--mesh", "fsdp=2"))
    micro = train_losses(run_train(tmp_path / "micro", token_files, "--steps", "3", "--mesh", "fsdp=2",
                                   "--micro-batch", "2"))
    np.testing.assert_allclose([micro[s] for s in full], list(full.values()), rtol=1e-5)


def test_nan_stops_and_keeps_last_good_checkpoint(tmp_path, token_files):
    with pytest.raises(SystemExit, match=r"loss is nan at step 2; stopped. The last good checkpoint \(step 1\)"):
        run_train(tmp_path / "n", token_files, "--steps", "20", "--save-every", "1", "--lr", "1e12")
    assert sorted(p.name for p in (tmp_path / "n" / "checkpoints").iterdir()) == ["1"]


def test_7b_on_this_machine_fails_early():
    with pytest.raises(SystemExit, match=r"7.3B-parameter model needs \d+ GiB per device"):
        train.main(["--preset", "7b", "--data", "x.npy", "--mesh", "fsdp=8"])


def test_two_processes_match_one(tmp_path, token_files):
    """Multi-host: two processes on loopback (CPU collectives), one device each, each loading only
    its half of every batch, against one process with two devices: the same losses."""
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "train.py", *SMALL_RUN, "--data", token_files["train"], "--eval-data",
            token_files["eval"], "--steps", "4", "--samples", "1"]
    env = lambda n: {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run(args + ["--out", str(tmp_path / "one")], env=env(2), cwd=here, check=True, capture_output=True)
    procs = [subprocess.Popen(args + ["--out", str(tmp_path / "two"), "--coordinator", f"localhost:{port}",
                                      "--num-processes", "2", "--process-id", str(i)],
                              env=env(1), cwd=here, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(2)]
    outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    one = train_losses(json.loads(line) for line in open(tmp_path / "one" / "metrics.jsonl"))
    two = train_losses(json.loads(line) for line in open(tmp_path / "two" / "metrics.jsonl"))
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    np.testing.assert_allclose([two[s] for s in one], list(one.values()), rtol=1e-6)
