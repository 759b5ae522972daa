"""Hugging Face `Olmo3ForCausalLM` checkpoints <-> olmo3-jax Orbax checkpoints, both ways:

    python convert.py hf-to-jax HF_DIR OUT_DIR [--verify]   # --verify: logits against transformers
    python convert.py jax-to-hf CKPT_DIR OUT_DIR [--verify] # a converted or a run's checkpoint"""
# Read hf_tensors and hf_view, then from_hf and to_hf; config_from_hf (with rope_from_hf and
# global_every_from) and config_to_hf map config.json (skim them), and verify is --verify. The HF
# name of each weight is in olmo3.param_specs. Torch Linear weights are [out, in] and ours are
# [in, out], so every matrix but the embedding is transposed. The whole model is held in host
# memory as fp32 numpy arrays, so a 7B (29 GB) converts on a machine with about 64 GB.
import argparse
import dataclasses
import json
import math
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

import olmo3
import train  # for its checkpoint helpers, and importing it also quiets Orbax's notes


def hf_tensors(cfg):  # (HF name, our weight kind, layer or None) of every tensor, kind by kind
    specs = olmo3.param_specs(cfg)
    for kind in ("embed", "final_norm", "lm_head"):
        yield f"{specs[kind].hf}.weight", kind, None
    for kind, spec in specs["blocks"].items():
        for i in range(cfg.n_layers):
            yield f"model.layers.{i}.{spec.hf}.weight", kind, i


def hf_view(params, kind, layer, cfg):  # our array for `kind` (and layer) as HF's, a view
    # A numpy view, not a copy (`.T` and `[:n]` are views): writing into it writes into our
    # array (from_hf does), and to_hf reads through it. For layer 3's q, the view is
    # params["blocks"]["q"][3].T, so `view[...] = t` sets params["blocks"]["q"][3] to t.T.
    # HF's nn.Linear weights are [out, in] and ours [in, out], so they are transposed;
    # nn.Embedding is [V, D], as ours is.
    array = params[kind] if layer is None else params["blocks"][kind][layer]  # None: not a block's
    hf = array if array.ndim == 1 or kind == "embed" else array.T
    # both are [V, D] here (lm_head's .T above); the padding rows past vocab_size are not HF's
    return hf[:cfg.vocab_size] if kind in ("embed", "lm_head") else hf


def from_hf(path):
    # A HF checkpoint folder (safetensors, sharded or not) -> (Config, params as fp32 numpy).
    # framework="np" reads bf16 tensors as numpy's bfloat16, which exists because importing jax
    # registered ml_dtypes' types with numpy (safetensors alone raises a TypeError for them)
    from safetensors import safe_open
    if not os.path.isfile(f"{path}/config.json"):
        raise SystemExit(f"error: {path}/config.json not found; pass a Hugging Face model folder")
    with open(f"{path}/config.json") as f:
        cfg = config_from_hf(json.load(f))
    shards = [safe_open(f"{path}/{name}", framework="np") for name in sorted(os.listdir(path))
              if name.endswith(".safetensors")]
    files = {name: shard for shard in shards for name in list(shard.keys())}  # name -> its file
    names = {name for name, _, _ in hf_tensors(cfg)}  # the tensors OLMo 3 has
    for what, odd in (("is missing", names - set(files)), ("is not OLMo 3's", set(files) - names)):
        if odd:
            raise SystemExit(f"error: {path}: tensor {min(odd)} {what} ({len(odd)} in all)")
    # Start from zeros: the embedding's padding rows stay zero (no token id reads them).
    params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), olmo3.param_specs(cfg),
                          is_leaf=olmo3.is_spec)
    # Each HF tensor is written into a view of our array: hf_view indexes, transposes and cuts
    # the vocabulary, all numpy views, not copies, so `view[...] = tensor` lands in params itself.
    for name, kind, layer in hf_tensors(cfg):
        tensor, view = files[name].get_tensor(name), hf_view(params, kind, layer, cfg)
        if tensor.shape != view.shape:
            raise SystemExit(f"error: {name} has shape {tensor.shape}, expected {view.shape}")
        view[...] = tensor
    # The lm_head's 74 padding columns, absent from HF files, get the mean of its real columns.
    # Then the padded softmax adds at most ln(1 + 74 / 100,278) = 0.00074 nats to HF's loss.
    # Why: a padding column's logit is the mean real logit, and exp(mean) <= mean(exp) (Jensen),
    # so each padding column adds at most 1 / 100,278 of the real columns' sum of exps. Zero
    # columns would be worse: 74 logits of 0 add ln(75) nats when the logsumexp is near 0, where
    # z-loss pushes it. (OLMo-core's load_hf_model draws them around the mean instead, with
    # transformers' mean_resizing.)
    # lm_head is [D, V]; its .T is a [V, D] view, so this writes the padding columns in place
    params["lm_head"].T[cfg.vocab_size:] = params["lm_head"].T[:cfg.vocab_size].mean(0)
    return cfg, params


def to_hf(params, cfg, out):
    # A folder from_pretrained loads: safetensors and their index, config.json and more.
    # It writes one safetensors file per weight kind (at most 5.8 GB for the 7B) and
    # generation_config.json.
    from safetensors.numpy import save_file
    weight_map, size = {}, 0
    for kind in [*params["blocks"], "embed", "final_norm", "lm_head"]:
        shard = {name: np.ascontiguousarray(hf_view(params, kind, layer, cfg))
                 for name, k, layer in hf_tensors(cfg) if k == kind}
        save_file(shard, f"{out}/model-{kind}.safetensors", metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, f"model-{kind}.safetensors")
        size += sum(a.nbytes for a in shard.values())
    hf = config_to_hf(cfg)
    files = {"model.safetensors.index.json": {"metadata": {"total_size": size},
                                              "weight_map": weight_map}, "config.json": hf,
             "generation_config.json": {k: hf[k] for k in ("eos_token_id", "pad_token_id")}}
    for name, content in files.items():
        with open(f"{out}/{name}", "w") as f:
            json.dump(content, f, indent=1)


# Our Config field -> its config.json key.
HF_CONFIG = {"d_model": "hidden_size", "n_layers": "num_hidden_layers",
             "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
             "head_dim": "head_dim", "mlp_hidden": "intermediate_size", "vocab_size": "vocab_size",
             "sliding_window": "sliding_window", "norm_eps": "rms_norm_eps"}


def need(ok, what):  # config_from_hf's and rope_from_hf's checks of a config.json
    if not ok:
        raise SystemExit(f"error: config.json: {what}; only OLMo 3 checkpoints convert")


def config_from_hf(hf: dict) -> olmo3.Config:
    need(hf.get("model_type") == "olmo3", f"model_type is {hf.get('model_type')!r}, not 'olmo3'")
    # a null means the default: dropped here, so that the defaults (below, and rope_from_hf's) apply
    hf = {key: value for key, value in hf.items() if value is not None}
    rope_fields = rope_from_hf(hf)  # Config's rope_theta and yarn_ fields (skim it: YaRN's part)
    # transformers' Olmo3Config defaults, for a key that config.json leaves out (OLMo 3's files
    # give every one; rms_norm_eps is 1e-6 in them, though transformers' default is 1e-5)
    defaults = {"num_key_value_heads": hf["num_attention_heads"], "sliding_window": 4096,
                "head_dim": hf["hidden_size"] // hf["num_attention_heads"], "rms_norm_eps": 1e-5}
    # The layer kinds: config.json's, or else transformers' default (every 4th layer full)
    kinds = hf.get("layer_types", ["full_attention" if i % 4 == 3 else "sliding_attention"
                                   for i in range(hf["num_hidden_layers"])])
    cfg = olmo3.Config(**{name: hf.get(key, defaults.get(key)) for name, key in HF_CONFIG.items()},
                       **rope_fields, global_every=global_every_from(kinds),
                       tokenizer="bytes" if hf["vocab_size"] == 258 else "dolma2")  # by size
    # (258 is the bytes tokenizer's vocabulary: 256 bytes, EOS and pad)
    need(kinds == layer_types(cfg), "layer_types: not every k-th layer and the last full attention")
    return cfg


def rope_from_hf(hf):  # config.json's RoPE, either form -> Config's rope_theta and yarn_ fields
    # (Only a YaRN model needs this: skip it on a first read.) config.json gives RoPE in one of
    # two forms, here with AI2's stage-3 values (... is YaRN's other keys):
    #   legacy:  rope_theta: 500000, rope_scaling: {rope_type: yarn, factor: 8, ...}
    #   newer:   rope_parameters: {full_attention: {rope_type: yarn, factor: 8, ...},
    #                              sliding_attention: {rope_type: default, rope_theta: 500000}}
    # A legacy file is first rewritten in the newer form (its rope_scaling is the full layers').
    # Then full, the full-attention layers' RoPE, is rope_theta (500,000 if absent) with the
    # full_attention keys over it: {rope_theta: 500000, rope_type: yarn, factor: 8, ...} for
    # either form above, and the fields are {rope_theta: 500000.0, yarn_factor: 8.0, ...}.
    # Without YaRN (stages 1 and 2), factor is 0.
    rope = hf.get("rope_parameters", {"full_attention": hf.get("rope_scaling", {})})
    # (YaRN's original context defaults to max_position_embeddings, 2,048 if absent, as in
    # transformers' standardize_rope_params and Olmo3Config)
    full = {"rope_theta": hf.get("rope_theta", 5e5), "original_max_position_embeddings":
            hf.get("max_position_embeddings", 2048)} | rope.get("full_attention", {})
    plain = {"rope_type": "default", "rope_theta": full["rope_theta"]}  # what sliding must be
    sliding = plain | rope.get("sliding_attention", {})
    factor = full.get("factor", 0.0) if full.get("rope_type") == "yarn" else 0.0
    # the sliding layers must have plain RoPE with the full layers' theta, as OLMo 3's do
    need(sliding == plain, f"sliding layers' RoPE {sliding}, not the full layers' theta unscaled")
    # olmo3.rope_tables computes YaRN's attention factor itself, as OLMo 3 does, so a config
    # that sets another would not match our RoPE
    expected = 0.1 * math.log(max(factor, 1)) + 1
    need(full.get("attention_factor", expected) == expected, f"YaRN {full}: only OLMo 3's form")
    return {"rope_theta": float(full["rope_theta"]), "yarn_factor": float(factor),
            "yarn_beta_fast": float(full.get("beta_fast", 32)),
            "yarn_beta_slow": float(full.get("beta_slow", 1)),
            "yarn_original_context": full["original_max_position_embeddings"]}


def global_every_from(kinds):  # config.json's layer kinds -> our global_every
    # Ours are full at every global_every-th layer and at the last. So global_every is the first
    # full layer's number, from 1 (config_from_hf then checks every other layer). The one case
    # that number does not settle: only the last layer is full. Any global_every >= n_layers
    # gives that, and max(4, n_layers) picks OLMo 3's 4 for a model of up to 4 layers (so a
    # small model trained with the default converts back to the same Config, which restore
    # compares), else n_layers. For example:
    #   32 layers, full at 3, 7, ..., 31    first full: 3    global_every 4 (the 7B)
    #   4 layers, full at 1 and 3           first full: 1    global_every 2
    #   2 layers, full at 1 (the last)      the last only    global_every 4 (2 gives it too)
    #   6 layers, full at 3 only            first full: 3    global_every 4, but layer 5 is not
    #                                                        full: config_from_hf refuses it
    # the first full layer, from 0 (len(kinds) where there is none: the check then refuses any
    # layers there are, as ours always make the last one full)
    first = next((i for i, kind in enumerate(kinds) if kind == "full_attention"), len(kinds))
    return first + 1 if first < len(kinds) - 1 else max(4, len(kinds))


def layer_types(cfg):
    return ["full_attention" if cfg.is_full(i) else "sliding_attention"
            for i in range(cfg.n_layers)]


def config_to_hf(cfg) -> dict:
    # The sliding layers get plain RoPE. The full-attention layers get plain RoPE too, or, with
    # YaRN, YaRN's keys over it, so that they keep the same theta (a YaRN dict without rope_theta
    # would take Olmo3Config.default_theta, 500,000 in transformers 5.24).
    full = plain = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.yarn_factor:  # YaRN's keys, for the full-attention layers only
        full = plain | {"rope_type": "yarn", "factor": cfg.yarn_factor, "beta_fast":
                        cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
                        "original_max_position_embeddings": cfg.yarn_original_context,
                        "attention_factor": 0.1 * math.log(cfg.yarn_factor) + 1}
    specials = (256, 257) if cfg.tokenizer == "bytes" else (100257, 100277)
    eos, pad = [i if i < cfg.vocab_size else None for i in specials]  # None in small test models
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "hidden_act": "silu",
            **{key: getattr(cfg, name) for name, key in HF_CONFIG.items()},
            # yarn_original_context (8,192, OLMo 3's trained context), or YaRN's factor times it
            "max_position_embeddings": int(cfg.yarn_original_context * max(cfg.yarn_factor, 1)),
            "layer_types": layer_types(cfg), "attention_bias": False,
            "tie_word_embeddings": False, "eos_token_id": eos, "pad_token_id": pad,
            "rope_parameters": {"full_attention": full, "sliding_attention": plain}}


def verify(hf_dir, cfg, params, seq_len=256, batch=2):
    """Hugging Face (torch) and ours on the same random tokens, in fp32 and bf16."""
    # It reports KL(HF || ours) per position, top-1 agreement and max |logit difference|, over
    # the real vocabulary. torch and transformers are imported here: only --verify needs them.
    import torch
    from transformers import AutoModelForCausalLM
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq_len))
    results = {}
    for dtype in ("float32", "bfloat16"):
        # requires_grad_(False): a forward pass that keeps nothing for a backward one
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).requires_grad_(False)
        theirs = model(torch.from_numpy(tokens)).logits.double().numpy()
        ours = jax.jit(olmo3.forward, static_argnums=2)(
            params, tokens, dataclasses.replace(cfg, compute_dtype=dtype, attention="reference"))
        ours = np.asarray(ours, np.float64)[..., :cfg.vocab_size]
        log_p, log_q = (x - np.logaddexp.reduce(x, -1, keepdims=True) for x in (theirs, ours))
        res = results[dtype] = {"kl": np.mean(np.sum(np.exp(log_p) * (log_p - log_q), -1)),
                                "top1": np.mean(theirs.argmax(-1) == ours.argmax(-1)),
                                "max_abs": np.max(np.abs(theirs - ours))}
        print(f"verify {dtype:8s}: KL(HF||ours) {res['kl']:.3e} top-1 agreement "
              f"{100 * res['top1']:.2f}% max |logit diff| {res['max_abs']:.3e} ({batch}x{seq_len})")
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("direction", choices=["hf-to-jax", "jax-to-hf"])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--verify", action="store_true", help="compare logits with transformers")
    args = ap.parse_args(argv)
    if os.path.exists(args.out) and os.listdir(args.out):
        raise SystemExit(f"error: {args.out} exists and is not empty; choose a new output folder")
    os.makedirs(args.out, exist_ok=True)
    if args.direction == "hf-to-jax":
        cfg, params = from_hf(args.src)
        with train.checkpoints(args.out) as manager:  # step 0 of a new checkpoint directory
            train.save(manager, 0, {"params": params}, cfg)
    else:  # a converted checkpoint, or a run's latest
        step_dir = train.latest_checkpoint(args.src)
        cfg = olmo3.Config(**train.saved_settings(step_dir)["model"])
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                                olmo3.param_specs(cfg), is_leaf=olmo3.is_spec)
        # PyTreeCheckpointHandler can read into host memory as numpy, so a 7B need not fit a
        # device to convert (train.restore reads onto devices with StandardCheckpointHandler).
        params = ocp.PyTreeCheckpointHandler().restore(
            step_dir / "params", args=ocp.args.PyTreeRestore(restore_args=as_numpy))
        to_hf(params, cfg, args.out)
    if args.verify:
        # compares our logits with the HF model's: the folder written, or the one read
        verify(args.out if args.direction == "jax-to-hf" else args.src, cfg, params)
    print(f"wrote {args.out}: {olmo3.param_count(cfg):,} parameters (the vocabulary padded)")


if __name__ == "__main__":
    main()
