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
import math
import os
import tempfile
from pathlib import Path

import fsspec
import jax
import numpy as np
import orbax.checkpoint as ocp

import olmo3
import train  # its checkpoints(); importing it also quiets Orbax's notes

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
# Our Config field -> its config.json key.
HF_CONFIG = {"d_model": "hidden_size", "n_layers": "num_hidden_layers",
             "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
             "head_dim": "head_dim", "mlp_hidden": "intermediate_size", "vocab_size": "vocab_size",
             "sliding_window": "sliding_window", "norm_eps": "rms_norm_eps",
             "seq_len": "max_position_embeddings"}  # seq_len kept, so an export writes it back


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
    # RoPE per layer type: the rope_parameters form, or the legacy rope_scaling key, which
    # transformers applies to the full-attention layers only (as AI2's released config has it)
    rope = hf.get("rope_parameters") or {}
    full = {**rope.get("full_attention", {}), **(hf.get("rope_scaling") or {})}
    sliding, theta = rope.get("sliding_attention", {}), hf.get("rope_theta") or 5e5
    need(sliding.get("rope_type", "default") == "default",
         f"RoPE scaling {sliding} on the sliding-window layers is not OLMo 3's")
    need(full.get("rope_theta", theta) == sliding.get("rope_theta", theta),
         f"RoPE thetas differ by layer type ({rope})")
    yarn = full.get("rope_type", "default") == "yarn"
    need(yarn or full.get("rope_type", "default") == "default", f"RoPE {full} is not yarn")
    factor = full.get("factor", 0.0) if yarn else 0.0
    need(not yarn or full.get("attention_factor", 0.1 * math.log(factor) + 1) == 0.1 * math.log(
        factor) + 1 and not {"mscale", "mscale_all_dim"} & full.keys() and full.get(
        "truncate", True), f"YaRN {full}: only OLMo 3's form (attention factor 0.1 ln f + 1)")
    heads = hf["num_attention_heads"]  # the defaults of keys a config.json may leave out:
    defaults = {"num_key_value_heads": heads, "head_dim": hf["hidden_size"] // heads,
                "sliding_window": 4096, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192}
    cfg = olmo3.Config(**{ours: hf.get(key) or defaults[key] for ours, key in HF_CONFIG.items()},
                       rope_theta=float(full.get("rope_theta", theta)), yarn_factor=float(factor),
                       yarn_beta_fast=float(full.get("beta_fast") or 32),
                       yarn_beta_slow=float(full.get("beta_slow") or 1),
                       yarn_original_context=int(full.get("original_max_position_embeddings",
                                                          8192)),
                       tokenizer="bytes" if hf["vocab_size"] == 258 else "dolma2")
    need(hf.get("layer_types", layer_types(cfg)) == layer_types(cfg),
         "layer_types differ from OLMo 3's 3 sliding : 1 full pattern")
    return cfg


def layer_types(cfg):
    return ["full_attention" if cfg.is_global(i) else "sliding_attention"
            for i in range(cfg.n_layers)]


def config_to_hf(cfg) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    yarn = {"rope_type": "yarn", "factor": cfg.yarn_factor, "beta_fast": cfg.yarn_beta_fast,
            "beta_slow": cfg.yarn_beta_slow, "original_max_position_embeddings":
            cfg.yarn_original_context, "attention_factor": 0.1 * math.log(cfg.yarn_factor or 1) + 1}
    specials = (256, 257) if cfg.tokenizer == "bytes" else (100257, 100277)
    eos, pad = [i if i < cfg.vocab_size else None for i in specials]
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "hidden_act": "silu",
            **{key: getattr(cfg, ours) for ours, key in HF_CONFIG.items()},
            "layer_types": layer_types(cfg), "attention_bias": False, "tie_word_embeddings": False,
            "rope_parameters": {"full_attention": rope | (yarn if cfg.yarn_factor else {}),
                                "sliding_attention": rope},
            "eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None, "dtype": "float32"}


# ----------------------------------------------------------------------------- reading HF

def open_hf_weights(hf_dir: Path):
    """name -> loader for every tensor of a HF checkpoint: safetensors or .bin, sharded or not."""
    single = next((f for f in ("model.safetensors", "pytorch_model.bin")
                   if (hf_dir / f).exists() or (hf_dir / f"{f}.index.json").exists()), None)
    if single is None:
        raise SystemExit(f"error: no model.safetensors or pytorch_model.bin (or index) in {hf_dir}")
    index = hf_dir / f"{single}.index.json"  # a sharded checkpoint lists its files there
    files = json.loads(index.read_text())["weight_map"].values() if index.exists() else [single]
    loaders = {}
    for f in sorted(set(files)):
        if not (hf_dir / f).exists():
            raise SystemExit(f"error: {hf_dir / f} is listed in {index.name} but missing; "
                             "download it again")
        if f.endswith(".bin"):  # needs torch; mmap leaves a tensor on disk until it is read
            import torch
            state = torch.load(hf_dir / f, map_location="cpu", weights_only=True, mmap=True)
            loaders |= {n: (lambda t=t: t.float().numpy()) for n, t in state.items()}
        else:
            from safetensors import safe_open
            handle = safe_open(hf_dir / f, framework="np")
            names = handle.keys()  # noqa: SIM118 (a safetensors file, not a dict)
            loaders |= {n: (lambda h=handle, n=n: h.get_tensor(n)) for n in names}
    return loaders


def from_hf(path, scratch: str | None = None):
    """A HF checkpoint directory -> (Config, params as fp32 numpy arrays)."""
    # With `scratch`, the arrays are memory-mapped files there: host memory holds about a tensor.
    hf_dir = Path(path)
    if not (hf_dir / "config.json").exists():
        raise SystemExit(f"error: {hf_dir}/config.json not found; pass a Hugging Face model folder")
    cfg = config_from_hf(json.loads((hf_dir / "config.json").read_text()))
    loaders, expected = open_hf_weights(hf_dir), {name for name, *_ in hf_tensors(cfg)}
    if missing := sorted(expected - loaders.keys()):
        raise SystemExit(f"error: {hf_dir}: tensor {missing[0]} is missing ({len(missing)} in all)")
    if extra := sorted(loaders.keys() - expected):
        raise SystemExit(f"error: {hf_dir}: unexpected tensor {extra[0]} ({len(extra)} extra); "
                         "not plain OLMo 3?")

    def allocate(path, spec):  # zeros, so the vocabulary padding rows stay zero
        if scratch is None:
            return np.zeros(spec.shape, np.float32)
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        return np.lib.format.open_memmap(f"{scratch}/{name}.npy", "w+", np.float32, spec.shape)
    params = jax.tree_util.tree_map_with_path(allocate, olmo3.param_specs(cfg),
                                              is_leaf=olmo3.is_spec)
    for name, key, sub, layer in hf_tensors(cfg):
        dest = params[key] if sub is None else params[key][sub][layer]
        tensor, view = loaders[name](), to_hf_layout(dest, sub or key, cfg)
        if tensor.shape != view.shape:
            raise SystemExit(f"error: {hf_dir}: {name} has shape {tuple(tensor.shape)}, "
                             f"expected {view.shape}")
        view[...] = tensor  # the view is transposed and cut to the vocab: it writes our layout
    return cfg, params


# ----------------------------------------------------------------------------- writing HF

def to_hf(read, cfg, out_dir, max_shard_size="5GB"):
    """A folder from_pretrained loads: safetensors shards, config.json, generation_config.json."""
    # The shards are split by size as save_pretrained does.
    # read(key, sub) returns one of our weight kinds, so a large model is read a kind at a time.
    from huggingface_hub import split_state_dict_into_shards_factory
    from safetensors.numpy import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: (key, sub, layer) for name, key, sub, layer in hf_tensors(cfg)}
    split = split_state_dict_into_shards_factory(  # kind by kind: a shard needs a kind or two
        tensors, get_storage_size=lambda t: 4 * math.prod(hf_shape(t[1] or t[0], cfg)),
        filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    kind = array = None  # the one weight kind in memory: the tensors come kind by kind
    for fname, names in split.filename_to_tensors.items():
        shard = {}
        for name in names:
            key, sub, layer = tensors[name]
            if kind != (key, sub):
                kind, array = (key, sub), np.asarray(read(key, sub))
            hf = to_hf_layout(array if layer is None else array[layer], sub or key, cfg)
            shard[name] = np.ascontiguousarray(hf)
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
    specs = olmo3.param_specs(cfg)
    shape = specs[key].shape if key in HF_TOP else specs["blocks"][key].shape[1:]
    return (cfg.vocab_size, cfg.d_model) if key in ("embed", "lm_head") else shape[::-1]


# ----------------------------------------------------------------------------- Orbax side

def save_checkpoint(params, cfg, out_dir):
    """An Orbax checkpoint (step 0: params + config) that `train.py --init-from` starts from."""
    # Streaming needs two changes to Orbax's defaults: no defensive copy of host arrays (ours
    # are memory-mapped and nobody changes them), no compression (zstd holds every chunk).
    ocp.type_handlers.register_type_handler(
        np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False), override=True)
    handlers = {"params": ocp.PyTreeCheckpointHandler(use_compression=False),
                "config": ocp.JsonCheckpointHandler()}
    with train.orbax_manager(os.fspath(out_dir), handlers) as manager:
        manager.save(0, args=ocp.args.Composite(params=ocp.args.PyTreeSave(params),
                                                config=ocp.args.JsonSave(dataclasses.asdict(cfg))))


def load_checkpoint(ckpt_dir):
    """A checkpoint of ours (converted, or a run's latest) -> (Config, read(key, sub=None))."""
    # read restores one weight kind as numpy, e.g. read("blocks", "q"): a weight at a time.
    manager = train.checkpoints(ckpt_dir)  # a converted one, or a run directory
    step = manager.latest_step()
    config = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))

    def read(key, sub=None):
        item = {key: np.zeros(0) if sub is None else {sub: np.zeros(0)}}
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
        out = manager.restore(step, args=ocp.args.Composite(params=ocp.args.PyTreeRestore(
            item=item, restore_args=restore_args, partial_restore=True)))["params"][key]
        return out if sub is None else out[sub]
    return olmo3.Config(**config["config"]), read


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
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir,
                                                                  dtype=getattr(torch, dtype))
        with torch.no_grad():
            theirs = model(torch.from_numpy(tokens)).logits.float().numpy()
        ours = jax.jit(olmo3.forward, static_argnums=2)(
            params, tokens, dataclasses.replace(cfg, compute_dtype=dtype, attention="reference"))
        r = results[dtype] = compare(theirs, ours, cfg.vocab_size)
        print(f"verify {dtype:8s}: KL(HF||ours) {r['kl']:.3e}  top-1 agreement "
              f"{100 * r['top1']:.2f}%  max |logit diff| {r['max_abs']:.3e}  ({batch} x "
              f"{seq_len} tokens)")
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
    out_fs, remote = fsspec.core.url_to_fs(args.out)[0], lambda path: "://" in path
    if out_fs.exists(args.out) and out_fs.ls(args.out):
        raise SystemExit(f"error: {args.out} exists and is not empty; choose a new output folder")
    beside = os.getcwd() if remote(args.out) else Path(args.out).absolute().parent
    os.makedirs(beside, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=beside) as scratch:
        if args.direction == "hf-to-jax":
            src = args.src
            if remote(src):  # safetensors and transformers read local files: fetch them once
                fsspec.core.url_to_fs(src)[0].get(f"{src.rstrip('/')}/", src := f"{scratch}/hf",
                                                   recursive=True)
            cfg, params = from_hf(src, scratch)
            save_checkpoint(params, cfg, args.out)
            if args.verify:
                verify(src, cfg, params, seq_len=args.verify_seq)
        else:
            cfg, read = load_checkpoint(args.src)
            out = f"{scratch}/hf" if remote(args.out) else args.out
            to_hf(read, cfg, out)
            if args.verify:
                params = {k: read(k) for k in HF_TOP} | {"blocks": {k: read("blocks", k)
                                                                    for k in HF_LAYER}}
                verify(out, cfg, params, seq_len=args.verify_seq)
            if remote(args.out):
                out_fs.put(f"{out}/", args.out, recursive=True)
    unpadded = olmo3.param_count(cfg) - 2 * (cfg.padded_vocab - cfg.vocab_size) * cfg.d_model
    print(f"wrote {args.out}: {cfg.n_layers} layers, d_model {cfg.d_model}, {unpadded:,} "
          f"parameters ({olmo3.param_count(cfg):,} with the vocabulary padded to "
          f"{cfg.padded_vocab:,}, as trained)")


if __name__ == "__main__":
    main()
