"""Hugging Face `Olmo3ForCausalLM` checkpoints <-> olmo3-jax Orbax checkpoints.

    python convert.py hf-to-jax HF_DIR OUT_DIR [--verify]   # safetensors (or .bin) -> Orbax
    python convert.py jax-to-hf CKPT_DIR OUT_DIR [--verify] # Orbax -> safetensors + config.json

--verify compares the logits of both implementations (KL, top-1 agreement, max difference).
"""
# The converter streams: a tensor is read, transposed into place and dropped, and the stacked
# per-layer arrays live in memory-mapped scratch files, so a 7B checkpoint (29 GB in fp32)
# converts on a 24 GiB machine.
import argparse
import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np

import olmo3

logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes on its type handlers

# Our weight -> Hugging Face tensor. Torch Linear weights are [out, in], ours are [in, out], so
# every matrix except the embedding is transposed. Per-layer names get "model.layers.{i}.".
HF_TOP = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
          "lm_head": "lm_head.weight"}
HF_LAYER = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
            "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
            "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
            "attn_norm": "post_attention_layernorm.weight", "gate": "mlp.gate_proj.weight",
            "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
            "mlp_norm": "post_feedforward_layernorm.weight"}


def hf_tensors(cfg):
    """(hf name, our key, our block key or None, layer or None) for every tensor, kind by kind."""
    for key, name in HF_TOP.items():
        yield name, key, None, None
    for key, name in HF_LAYER.items():
        for i in range(cfg.n_layers):
            yield f"model.layers.{i}.{name}", "blocks", key, i


def to_hf_layout(ours: np.ndarray, key: str, cfg) -> np.ndarray:
    """One of our (per-layer) arrays as the HF tensor: transposed, vocab padding cut off."""
    hf = ours if ours.ndim == 1 or key == "embed" else ours.T
    return hf[:cfg.vocab_size] if key in ("embed", "lm_head") else hf


# ----------------------------------------------------------------------------- configs

def config_from_hf(hf: dict) -> olmo3.Config:
    def need(ok, what):
        if not ok:
            raise SystemExit(f"error: config.json: {what}; only OLMo 3 (Olmo3ForCausalLM) "
                             "checkpoints convert")
    need(hf.get("model_type") == "olmo3", f"model_type is {hf.get('model_type')!r}, not 'olmo3'")
    need(not hf.get("attention_bias") and not hf.get("tie_word_embeddings"),
         "biases or tied embeddings")
    need(hf.get("hidden_act", "silu") == "silu", f"activation {hf.get('hidden_act')!r} is not silu")
    rope = hf.get("rope_parameters") or {}
    thetas = ({p.get("rope_theta", hf.get("rope_theta")) for p in rope.values()}
              or {hf.get("rope_theta")})
    need(len(thetas) == 1 and all(p.get("rope_type", "default") == "default" for p in rope.values()),
         f"RoPE {rope} is not one plain theta (YaRN / long-context checkpoints are not supported)")
    heads = hf["num_attention_heads"]
    cfg = olmo3.Config(
        d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        mlp_hidden=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        sliding_window=hf.get("sliding_window") or 4096, rope_theta=float(thetas.pop() or 5e5),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tokenizer="bytes" if hf["vocab_size"] == 258 else "dolma2",
        seq_len=hf.get("max_position_embeddings") or 8192)  # kept, so an export writes it back
    need(hf.get("layer_types", layer_types(cfg)) == layer_types(cfg),
         "layer_types differ from OLMo 3's 3 sliding : 1 full pattern")
    return cfg


def layer_types(cfg):
    return ["full_attention" if cfg.is_global(i) else "sliding_attention"
            for i in range(cfg.n_layers)]


def config_to_hf(cfg) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    specials = (256, 257) if cfg.tokenizer == "bytes" else (100257, 100277)
    eos, pad = [i if i < cfg.vocab_size else None for i in specials]
    return {
        "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.mlp_hidden, "vocab_size": cfg.vocab_size, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "sliding_window": cfg.sliding_window,
        "layer_types": layer_types(cfg),
        "rope_parameters": {"full_attention": rope, "sliding_attention": dict(rope)},
        "max_position_embeddings": cfg.seq_len, "attention_bias": False,
        "tie_word_embeddings": False,
        "eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None, "dtype": "float32",
    }


# ----------------------------------------------------------------------------- reading HF

def open_hf_weights(hf_dir: Path):
    """name -> loader for every tensor of a HF checkpoint: safetensors or .bin, sharded or not."""
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (hf_dir / index).exists():
            files = sorted(set(json.loads((hf_dir / index).read_text())["weight_map"].values()))
        elif (hf_dir / single).exists():
            files = [single]
        else:
            continue
        loaders = {}
        for f in files:
            if not (hf_dir / f).exists():
                raise SystemExit(f"error: {hf_dir / f} is listed in {index} but missing; "
                                 "download it again")
            if f.endswith(".safetensors"):
                from safetensors import safe_open
                handle = safe_open(hf_dir / f, framework="np")
                loaders |= {n: (lambda h=handle, n=n: h.get_tensor(n)) for n in handle.keys()}
            else:
                import torch  # .bin needs torch; mmap keeps them on disk until a tensor is read
                state = torch.load(hf_dir / f, map_location="cpu", weights_only=True, mmap=True)
                loaders |= {n: (lambda t=t: t.float().numpy()) for n, t in state.items()}
        return loaders
    raise SystemExit(f"error: no model.safetensors or pytorch_model.bin (or index) in {hf_dir}")


def from_hf(path, scratch: str | None = None):
    """A HF checkpoint directory -> (Config, params as fp32 numpy arrays)."""
    # With `scratch`, the arrays are memory-mapped files there: host memory holds about a tensor.
    hf_dir = Path(path)
    if not (hf_dir / "config.json").exists():
        raise SystemExit(f"error: {hf_dir}/config.json not found; pass a Hugging Face model folder")
    cfg = config_from_hf(json.loads((hf_dir / "config.json").read_text()))
    loaders = open_hf_weights(hf_dir)
    expected = {name for name, *_ in hf_tensors(cfg)}
    if missing := sorted(expected - loaders.keys()):
        raise SystemExit(f"error: {hf_dir}: tensor {missing[0]} is missing ({len(missing)} "
                         "missing in all)")
    if extra := sorted(loaders.keys() - expected):
        raise SystemExit(f"error: {hf_dir}: unexpected tensor {extra[0]} ({len(extra)} extra); "
                         "not plain OLMo 3?")

    def allocate(path, spec):  # zeros, so the vocabulary padding rows stay zero
        if scratch is None:
            return np.zeros(spec.shape, np.float32)
        file = os.path.join(scratch, jax.tree_util.keystr(path, simple=True, separator=".") + ".npy")
        return np.lib.format.open_memmap(file, "w+", np.float32, spec.shape)
    params = jax.tree_util.tree_map_with_path(allocate, olmo3.param_specs(cfg),
                                              is_leaf=olmo3.is_spec)

    for name, key, sub, layer in hf_tensors(cfg):
        dest = params[key] if sub is None else params[key][sub][layer]
        tensor, view = loaders[name](), to_hf_layout(dest, key if sub is None else sub, cfg)
        if tensor.shape != view.shape:
            raise SystemExit(f"error: {hf_dir}: {name} has shape {tuple(tensor.shape)}, "
                             f"expected {view.shape}")
        view[...] = tensor  # the view is transposed and cut to the vocab: it writes our layout
    return cfg, params


# ----------------------------------------------------------------------------- writing HF

def to_hf(read, cfg, out_dir, max_shard_size="5GB"):
    """A folder that transformers' from_pretrained loads: safetensors shards (split by size as
    save_pretrained does), config.json and generation_config.json."""
    # read(key, sub) returns one of our weight kinds, so a large model is read a kind at a time.
    from huggingface_hub import split_state_dict_into_shards_factory
    from safetensors.numpy import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # kind by kind, so that a shard needs only one or two of our arrays in memory
    tensors = {name: (key, sub, layer) for name, key, sub, layer in hf_tensors(cfg)}
    split = split_state_dict_into_shards_factory(
        tensors, get_storage_size=lambda t: 4 * math.prod(hf_shape(t[1] or t[0], cfg)),
        filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    cache = {}
    for fname, names in split.filename_to_tensors.items():
        kinds = {tensors[n][:2] for n in names}
        cache = {k: v for k, v in cache.items() if k in kinds}  # earlier kinds are done
        shard = {}
        for name in names:
            key, sub, layer = tensors[name]
            if (key, sub) not in cache:
                cache[key, sub] = np.asarray(read(key, sub))
            array = cache[key, sub] if layer is None else cache[key, sub][layer]
            shard[name] = np.ascontiguousarray(to_hf_layout(array, key if sub is None else sub, cfg))
        save_file(shard, out / fname, metadata={"format": "pt"})
    if split.is_sharded:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": split.metadata, "weight_map": split.tensor_to_filename}, indent=1))
    hf = config_to_hf(cfg)
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    generation = {"_from_model_config": True, "eos_token_id": hf["eos_token_id"],
                  "pad_token_id": hf["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1))


def hf_shape(key, cfg):
    """The shape of one HF tensor of our weight kind `key` (a layer's, for block weights)."""
    spec = olmo3.param_specs(cfg)[key] if key in HF_TOP else olmo3.param_specs(cfg)["blocks"][key]
    shape = spec.shape[1:] if key in HF_LAYER else spec.shape
    return (cfg.vocab_size, cfg.d_model) if key in ("embed", "lm_head") else shape[::-1]


# ----------------------------------------------------------------------------- Orbax side

def save_checkpoint(params, cfg, out_dir):
    """An Orbax checkpoint (step 0: params + config) that `train.py --init-from` starts from."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint import type_handlers
    # Streaming needs two changes to Orbax's defaults: no defensive copy of host arrays (ours are
    # memory-mapped and nobody changes them), no compression (zstd holds every compressed chunk).
    type_handlers.register_type_handler(
        np.ndarray, type_handlers.NumpyHandler(deepcopy_host_arrays=False), override=True)
    handlers = {"params": ocp.PyTreeCheckpointHandler(use_compression=False),
                "config": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(Path(out_dir).absolute(), item_handlers=handlers) as manager:
        manager.save(0, args=ocp.args.Composite(params=ocp.args.PyTreeSave(params),
                                                config=ocp.args.JsonSave(dataclasses.asdict(cfg))))


def load_checkpoint(ckpt_dir):
    """A checkpoint of ours (converted, or a run's latest) -> (Config, read(key, sub=None))."""
    # read restores one weight kind as numpy, e.g. read("blocks", "q"): a weight at a time.
    import orbax.checkpoint as ocp
    import train
    manager = train.checkpoints(ckpt_dir)  # a converted one, or a run directory
    step = manager.latest_step()
    config = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    cfg = olmo3.Config(**config)

    def read(key, sub=None):
        item = {key: np.zeros(0) if sub is None else {sub: np.zeros(0)}}
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
        out = manager.restore(step, args=ocp.args.Composite(params=ocp.args.PyTreeRestore(
            item=item, restore_args=restore_args, partial_restore=True)))["params"][key]
        return out if sub is None else out[sub]
    return cfg, read


# ----------------------------------------------------------------------------- verification

def compare(hf_logits, our_logits, vocab_size):
    """KL(HF || ours) per position (mean), top-1 agreement and max |difference|, real vocab."""
    a = np.asarray(hf_logits, np.float64)[..., :vocab_size]
    b = np.asarray(our_logits, np.float64)[..., :vocab_size]
    log_p = a - np.logaddexp.reduce(a, axis=-1, keepdims=True)
    log_q = b - np.logaddexp.reduce(b, axis=-1, keepdims=True)
    kl = float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)))
    return {"kl": kl, "top1": float(np.mean(a.argmax(-1) == b.argmax(-1))),
            "max_abs": float(np.max(np.abs(a - b)))}


def verify(hf_dir, cfg, params, seq_len=256, batch=2, seed=0):
    """HF (torch) and ours on the same random tokens, fp32 and bf16 -> the metrics, printed."""
    import torch
    import transformers
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq_len))
    results = {}
    for dtype in ("float32", "bfloat16"):
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype))
        with torch.no_grad():
            theirs = model(torch.from_numpy(tokens)).logits.float().numpy()
        del model
        ours = jax.jit(olmo3.forward, static_argnums=2)(
            params, tokens, dataclasses.replace(cfg, compute_dtype=dtype, attention="reference"))
        results[dtype] = compare(theirs, ours, cfg.vocab_size)
        r = results[dtype]
        print(f"verify {dtype:8s}: KL(HF||ours) {r['kl']:.3e}  top-1 agreement "
              f"{100 * r['top1']:.2f}%  max |logit diff| {r['max_abs']:.3e}  ({batch} x {seq_len} "
              "tokens)")
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("direction", choices=["hf-to-jax", "jax-to-hf"])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--verify", action="store_true", help="compare logits with transformers")
    ap.add_argument("--verify-seq", type=int, default=256)
    args = ap.parse_args(argv)
    if Path(args.out).exists() and any(Path(args.out).iterdir()):
        raise SystemExit(f"error: {args.out} exists and is not empty; choose a new output folder")
    if args.direction == "hf-to-jax":
        Path(args.out).absolute().parent.mkdir(parents=True, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix=".convert-", dir=Path(args.out).absolute().parent)
        try:
            cfg, params = from_hf(args.src, scratch)
            save_checkpoint(params, cfg, args.out)
            if args.verify:
                verify(args.src, cfg, params, seq_len=args.verify_seq)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    else:
        cfg, read = load_checkpoint(args.src)
        to_hf(read, cfg, args.out)
        if args.verify:
            params = {k: read(k) for k in HF_TOP} | {"blocks": {k: read("blocks", k) for k in HF_LAYER}}
            verify(args.out, cfg, params, seq_len=args.verify_seq)
    unpadded = olmo3.param_count(cfg) - 2 * (cfg.padded_vocab - cfg.vocab_size) * cfg.d_model
    print(f"wrote {args.out}: {cfg.n_layers} layers, d_model {cfg.d_model}, {unpadded:,} "
          f"parameters ({olmo3.param_count(cfg):,} with the vocabulary padded to "
          f"{cfg.padded_vocab:,}, as trained)")


if __name__ == "__main__":
    main()
