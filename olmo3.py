"""OLMo 3 in plain JAX: the config, the model as pure functions, and how it is sharded."""
# OLMo 3 in one paragraph. It is a decoder-only transformer that puts the norm on each
# sub-block's *output* (h = x + norm(attn(x)); out = h + norm(mlp(h))) and applies RMSNorm to
# the whole q and k projections before RoPE. It uses rotate-half RoPE with theta 500k, SwiGLU,
# no biases and an untied lm_head. It has three sliding-window layers for every full-attention
# one, and the last layer is always full.
#
# Read it in the file's order:
#   1. Config, param_specs and init;
#   2. forward: embed -> decoder -> block and its helpers (attention among them) -> unembed;
#      then loss_terms;
#   3. flops_per_token (skip it);
#   4. the sharding (part two of its comment says what each device holds);
#   5. attention's kernels (a later read).
# The model is a pytree (nested dict) of arrays. One Spec per weight drives `init` and
# `abstract_params` (shapes and shardings), and its Hugging Face name drives convert.py.
import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)  # frozen: hashable, so jit can take it as a static argument
class Config:
    # The model (OLMo 3 7B by default). The training recipe is train.Recipe.
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32               # < n_heads means grouped-query attention
    head_dim: int = 128
    mlp_hidden: int = 11008
    vocab_size: int = 100_278          # the tokenizer's ids (weights are padded to `padded_vocab`)
    tokenizer: str = "dolma2"          # "dolma2" (cl100k + OLMo specials) or "bytes"
    sliding_window: int = 4096         # the keys a sliding layer sees, including the current token
    global_every: int = 4              # layers 3, 7, 11, ... (from 0) and the last are global:
    #                                    full attention, no window (is_full; window None)
    rope_theta: float = 500_000.0
    yarn_factor: float = 0.0           # YaRN RoPE scaling on full-attention layers (0 means none)
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_original_context: int = 8192
    norm_eps: float = 1e-6
    # How it runs (NUMERICS). The command line sets these, and a checkpoint need not match them.
    compute_dtype: str = "bfloat16"    # params and optimizer state stay fp32
    remat: str = "dots"                # what the backward pass keeps of each layer, recomputing
    #                                    the rest (decoder): "dots" keeps the matmul outputs
    #                                    (jax's dots_saveable); "full" keeps only the layer's
    #                                    input (nothing_saveable: full remat, as MaxText's "full")
    attention: str = "auto"            # "auto", "reference", "cudnn" or "splash"

    @property
    def padded_vocab(self) -> int:
        # a multiple of 128, as OLMo-core does (-(-a // b) is a / b rounded up)
        return -(-self.vocab_size // 128) * 128

    # (The last-layer rule matters only when global_every does not divide n_layers: otherwise the
    # last layer is already a full one.)
    def is_full(self, layer: int) -> bool:
        return layer % self.global_every == self.global_every - 1 or layer == self.n_layers - 1


NUMERICS = ("compute_dtype", "remat", "attention")  # fields a checkpoint need not match
# the fields whose values are a few names (train.py's command line offers only these)
CHOICES = {"attention": ("auto", "reference", "cudnn", "splash"), "remat": ("dots", "full"),
           "compute_dtype": ("float32", "bfloat16"), "tokenizer": ("dolma2", "bytes")}
MODELS = {
    # A laptop CPU trains it in minutes. Its vocabulary is bytes, and window 64 < seq 256 makes
    # both layer kinds matter.
    "tiny": Config(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=64, mlp_hidden=768,
                   vocab_size=258, tokenizer="bytes", sliding_window=64, compute_dtype="float32"),
    "7b": Config(),
    # MaxText's head reshape, 16 heads x 256, keeps the parameter count, the FLOPs and H x E =
    # 4096 (QK-norm still normalises over 4096); the 7b's weights do not carry over (16 heads of
    # 256 attend differently).
    "7b-wide": Config(n_heads=16, n_kv_heads=16, head_dim=256),
    # AI2's released model after stage 3. It uses YaRN x8 on the full-attention layers. That
    # stage trains 65,536-token rows, which fit v5p-128 only with remat: 64 of 95 GiB a device
    # (docs/pods.md).
    "7b-long": Config(yarn_factor=8.0, remat="full"),
}


# ----------------------------------------------------------------------------- parameters

# A weight's spec: its shape, its axes (one logical axis name per dimension), and hf, its Hugging
# Face tensor (convert.py): model.layers.{i}.<hf>.weight in a layer
Spec = collections.namedtuple("Spec", "shape axes hf")


# The logical axes name what a dimension is, whatever the weight: "d_model" is D in every matrix
# (the embedding's too), "heads" the query heads x head_dim, "mlp" the hidden width. A norm's weight
# follows the activation it scales. attn_norm, mlp_norm and final_norm scale D, and their D is
# labelled "norm", so it is never split (a norm weight is tiny, and the activations' D is whole on
# every device). q_norm and k_norm scale q and k, so they are labelled, and split, as q's and k's
# heads ("heads", "kv_heads"). AXIS_RULES (stop 4) maps these names to how each weight is cut over
# the devices.
def param_specs(cfg: Config) -> dict:
    D, L, F, V = cfg.d_model, cfg.n_layers, cfg.mlp_hidden, cfg.padded_vocab
    Q, KV = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

    def w(hf, *dims):  # dims are (size, logical axis) pairs
        return Spec(tuple(size for size, _ in dims), tuple(axis for _, axis in dims), hf)
    layers = (L, "layers")  # stacked, so each kind of weight is one array whatever the depth
    return {
        "embed": w("model.embed_tokens", (V, "vocab"), (D, "d_model")),
        "blocks": {
            "q": w("self_attn.q_proj", layers, (D, "d_model"), (Q, "heads")),
            "k": w("self_attn.k_proj", layers, (D, "d_model"), (KV, "kv_heads")),
            "v": w("self_attn.v_proj", layers, (D, "d_model"), (KV, "kv_heads")),
            "o": w("self_attn.o_proj", layers, (Q, "heads"), (D, "d_model")),
            "q_norm": w("self_attn.q_norm", layers, (Q, "heads")),
            "k_norm": w("self_attn.k_norm", layers, (KV, "kv_heads")),
            "attn_norm": w("post_attention_layernorm", layers, (D, "norm")),
            "gate": w("mlp.gate_proj", layers, (D, "d_model"), (F, "mlp")),
            "up": w("mlp.up_proj", layers, (D, "d_model"), (F, "mlp")),
            "down": w("mlp.down_proj", layers, (F, "mlp"), (D, "d_model")),
            "mlp_norm": w("post_feedforward_layernorm", layers, (D, "norm")),
        },
        "final_norm": w("model.norm", (D, "norm")),
        "lm_head": w("lm_head", (D, "d_model"), (V, "vocab")),
    }


is_spec = lambda x: isinstance(x, Spec)  # lets jax.tree treat a Spec as a leaf, not a tuple


def param_count(cfg: Config) -> int:  # every weight, vocab padding included, as OLMo-core counts
    return sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec))


def init(cfg: Config, key) -> dict:
    # Makes fp32 parameters. train.init_state runs this under jit, which creates them sharded.
    # As in OLMo-core's init, every matrix is N(0, 0.02) cut at 3 std with no depth scaling, and
    # the norms' weights are 1. A weight is a norm's when its Hugging Face name says "norm".
    # leaves: the Specs in order; treedef: the dict's structure, for unflatten to rebuild
    leaves, treedef = jax.tree.flatten(param_specs(cfg), is_leaf=is_spec)
    arrays = [jnp.ones(s.shape, jnp.float32) if "norm" in s.hf else
              0.02 * jax.random.truncated_normal(k, -3.0, 3.0, s.shape, jnp.float32)
              for s, k in zip(leaves, jax.random.split(key, len(leaves)))]
    return jax.tree.unflatten(treedef, arrays)


# ----------------------------------------------------------------------------- the model
# A name's suffix gives its shape, so x_BTD is an array [B, T, D]. There are B sequences of T tokens
# (S counts the keys' tokens), D = d_model, H query heads and K key/value heads of E = head_dim
# each, and F = mlp_hidden. A name without a suffix (q, k, h, attn, mlp) is [B, T, ...].

def forward(params, tokens, cfg: Config, segments=None):
    # tokens [B, T] int -> logits [B, T, padded_vocab] in fp32.
    # segments [B, T] int marks packed documents (stage 3). A token sees only its own segment.
    return unembed(params, decoder(params, embed(params, tokens, cfg), cfg, segments), cfg)


def embed(params, tokens, cfg: Config):  # [B, T] -> [B, T, D] (OLMo 3 does not scale it)
    x = jnp.take(params["embed"], tokens, axis=0).astype(cfg.compute_dtype)
    # a sharding hint (constrain, stop 4): x's rows go to the data-parallel devices, and its D
    # stays whole; with no mesh set (one device, a test) it does nothing
    return constrain(x, "batch", "seq", None)


# Every layer is a jax.checkpoint, so the backward pass keeps only what this policy says, and
# recomputes the rest (without it, autodiff keeps every intermediate of every layer, the
# elementwise ones too). --remat picks the policy (Config.remat says what each keeps).
REMAT = {"dots": jax.checkpoint_policies.dots_saveable,
         "full": jax.checkpoint_policies.nothing_saveable}


def decoder(params, x, cfg: Config, segments=None):  # [B, T, D] -> [B, T, D], through the layers
    # The math is nanoGPT's `for l in range(32): x = block(...)`, but a scan compiles one unit once
    # instead of 32 layers (as MaxText does). Every scan step runs the same program, and a layer's
    # window is baked into its program (the attention kernels build their masks from a Python int,
    # as the reference's `if window` does), so the unit is a group of 4 layers (3 sliding, 1 full),
    # not one layer. In plain Python, for the 7B's 32 layers in 8 groups of 4 (tiny's 4 layers are 1
    # group), with windows [4096, 4096, 4096, None]:
    #   for g in range(8):        # lax.scan: the compiler traces one group, once
    #       for j in range(4):    # a Python loop, unrolled inside the traced group
    #           x = block(weights of layer 4 g + j, x, windows[j], its RoPE tables, ...)
    # When global_every does not divide n_layers, the window pattern does not repeat from
    # group to group, so all the layers are one group.
    group_size = cfg.global_every if cfg.n_layers % cfg.global_every == 0 else cfg.n_layers
    # each weight [32, ...] -> [8 groups (scanned), 4 layers (group's Python loop), ...]; in
    # tiny, q [4, 256, 256] -> [1, 4, 256, 256], so group gets p_group["q"] [4, 256, 256] and
    # layer j gets p["q"] [256, 256]
    groups = jax.tree.map(lambda w: w.reshape(-1, group_size, *w.shape[1:]), params["blocks"])
    # windows[j]: the window of layer j of every group (layer j has the same kind in every
    # group, as group_size is global_every or all the layers). tiny's: [64, 64, 64, None].
    windows = [None if cfg.is_full(j) else cfg.sliding_window for j in range(group_size)]
    # the RoPE tables, (cos_TE, sin_TE), of the sliding and of the full layers: YaRN applies to
    # the full layers only (without it, the two are the same).
    # Positions are absolute within the row (arange(T)), even for packed documents, as
    # OLMo-core's were when OLMo 3 ran (docs/reference.md, Fidelity).
    rope_sliding, rope_full = [rope_tables(jnp.arange(x.shape[1]), cfg, f) for f in (False, True)]
    # block under jax.checkpoint (REMAT says why). Its arguments 2 and 4, window and cfg, stay
    # static: Python values for attention's `if`s.
    layer = jax.checkpoint(block, static_argnums=(2, 4), policy=REMAT[cfg.remat])

    def group(x, p_group):  # one group's weights, each [group_size, ...]
        for j, window in enumerate(windows):  # unrolled: each window is a Python value
            p = jax.tree.map(lambda w: w[j], p_group)  # the group's layer j's weights
            # block, checkpointed (a window of None is a full layer's)
            x = layer(p, x, window, rope_full if window is None else rope_sliding, cfg, segments)
        return x, None
    # group g gets each leaf of `groups` sliced at g; scan returns (x after the last group, None)
    return jax.lax.scan(group, x, groups)[0]


# window is None for a full-attention layer, or W, the width of a sliding one. decoder passes it
# and cfg as Python values, so they are static. rope is rope_tables' (cos_TE, sin_TE).
def block(p, x_BTD, window, rope, cfg: Config, segments=None):
    B, T, _ = x_BTD.shape
    H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    # Cast every weight to the compute dtype, the norms' too: OLMo-core's bf16 FSDP and HF's bf16
    # model round a norm's weight so, and rounding it the same way keeps our numbers on theirs.
    # (rms_norm still does its arithmetic in fp32.)
    p = jax.tree.map(lambda w: w.astype(cfg.compute_dtype), p)
    # QK-norm normalises the whole projection [B, T, H*E], before splitting heads and before RoPE
    # (OLMo-core's qk_norm with use_head_qk_norm=False).
    q = rms_norm(dense(x_BTD, p["q"]), p["q_norm"], cfg.norm_eps)
    k = rms_norm(dense(x_BTD, p["k"]), p["k_norm"], cfg.norm_eps)
    q_BTHE = apply_rope(q.reshape(B, T, H, E), *rope)
    k_BTKE = apply_rope(k.reshape(B, T, K, E), *rope)
    v_BTKE = dense(x_BTD, p["v"]).reshape(B, T, K, E)
    # attention (below) picks a kernel; all compute the same thing
    attn = attention(q_BTHE, k_BTKE, v_BTKE, window, cfg, segments).reshape(B, T, H * E)
    # The norms sit on each sub-block's output, not its input (OLMo-core's ReorderedNormBlock).
    h = x_BTD + rms_norm(dense(attn, p["o"]), p["attn_norm"], cfg.norm_eps)
    h = constrain(h, "batch", "seq", None)  # as in embed (stop 4); no-op without a mesh
    mlp = dense(jax.nn.silu(dense(h, p["gate"])) * dense(h, p["up"]), p["down"])  # SwiGLU
    return constrain(h + rms_norm(mlp, p["mlp_norm"], cfg.norm_eps), "batch", "seq", None)


def dense(x, w):  # x [..., in] @ w [in, out] in x's dtype, accumulating in fp32
    # One 2-D matmul: XLA:CPU runs it 2.3x faster, forward and backward, than the 3-D form
    # ([B, T, D] @ [D, F]) (tiny's, JAX 0.10.2, 2 EPYC cores)
    y = jnp.dot(x.reshape(-1, x.shape[-1]), w, preferred_element_type=jnp.float32)
    return y.astype(x.dtype).reshape(*x.shape[:-1], w.shape[-1])


# The statistics and the multiply by the weight run in fp32, as OLMo-core's and HF's do. The
# weight arrives already rounded to the compute dtype (block and unembed cast it; block says why).
def rms_norm(x, weight, eps):  # -> x's dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * x32).astype(x.dtype)


def rope_tables(positions, cfg: Config, full: bool):
    # Returns cos and sin [T, head_dim] at `positions`, in the rotate-half layout. YaRN, when
    # set, applies to full-attention layers only, as in transformers' Olmo3 and OLMo-core.
    E, theta, scale = cfg.head_dim, cfg.rope_theta, 1.0
    inv_freq = 1.0 / (theta ** (jnp.arange(0, E, 2, dtype=jnp.float32) / E))
    if full and cfg.yarn_factor:  # (YaRN: stage 3's long context; optional on a first read)
        # YaRN follows transformers' _compute_yarn_parameters. Frequencies that turn fewer than
        # beta_slow times over the original context are divided by the factor. Those that turn more
        # than beta_fast times are kept, and a linear ramp blends the ones between. cos and sin are
        # multiplied by 0.1 ln(factor) + 1. dim(turns) is the rotary dimension whose frequency turns
        # that many times over the original context (tau = 2 pi). The ramp runs from dimension `low`
        # (fast, kept) to `high` (slow).
        dim = lambda turns: E / 2 * math.log(cfg.yarn_original_context / (turns * math.tau), theta)
        low = max(math.floor(dim(cfg.yarn_beta_fast)), 0)
        high = min(math.ceil(dim(cfg.yarn_beta_slow)), E - 1)
        # to_scale [E / 2]: 1 where a frequency is divided by the factor, 0 where it is kept
        # (arange(E / 2) counts the rotary dimensions 0, 1, ..., E / 2 - 1, as floats)
        to_scale = jnp.clip((jnp.arange(E / 2) - low) / max(high - low, 1e-3), 0, 1)
        inv_freq = inv_freq / cfg.yarn_factor * to_scale + inv_freq * (1 - to_scale)
        scale = 0.1 * math.log(cfg.yarn_factor) + 1
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)  # twice: rotate-half pairs i, i + E/2
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x_BTHE, cos_TE, sin_TE):  # rotates in fp32, returns the result in x's dtype
    # Rotate-half: dimension i pairs with i + E/2, and the pair turns by the angle
    # position * inv_freq[i]. rope_tables repeats the angles twice along E for that reason.
    x32 = x_BTHE.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos_TE[:, None, :] + rotated * sin_TE[:, None, :]).astype(x_BTHE.dtype)


def attention(q, k, v, window: int | None, cfg: Config, segments=None):
    # q [B, T, H, E], k and v [B, T, K, E] -> causal softmax(q k^T / sqrt(E)) v [B, T, H, E]. With
    # segments [B, T], a query sees only keys of its own segment (OLMo-core's doc_lens). A TPU runs
    # the splash kernel, an NVIDIA GPU in bf16 cuDNN's; both compute what the reference below
    # computes, and the reference itself runs everywhere else (a CPU, a GPU in fp32). The kernels,
    # and why, are at the end of the file. (An AMD GPU's ROCm has no cuDNN: there, pass --attention
    # reference. Not tried here.)
    name, backend = cfg.attention, jax.default_backend()
    if name == "splash" or (name == "auto" and backend == "tpu"):
        return attention_splash(q, k, v, window, segments)
    # "auto" takes cuDNN on a GPU in bf16 (of the two compute dtypes, the one cuDNN takes)
    if name == "cudnn" or (name == "auto" and backend == "gpu" and q.dtype == jnp.bfloat16):
        return attention_cudnn(q, k, v, window, segments)
    # --- The reference. Heads go first so that both products are plain batched matmuls.
    # Query head h reads kv head h // (H / K). Key j is visible to query i iff j <= i and, in a
    # sliding layer, i - j < window (and, with segments, both are in the same one).
    _, T, H, E = q.shape  # q is [B, T, H, E]; k and v are [B, T, K, E]
    q_BHTE, k_BKSE, v_BKSE = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    # each kv head repeated H // K times, for the query heads that read it
    k_BHSE, v_BHSE = (jnp.repeat(x, H // k_BKSE.shape[1], axis=1) for x in (k_BKSE, v_BKSE))
    scores_BHTS = jnp.einsum("bhte,bhse->bhts", q_BHTE, k_BHSE,
                             preferred_element_type=jnp.float32) * E ** -0.5
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)  # [T, S] (S = T: self-attention)
    if segments is not None:  # now [B, 1, T, S], per sequence and the same for every head
        visible = visible & (segments[:, None, :, None] == segments[:, None, None, :])
    probs_BHTS = jax.nn.softmax(jnp.where(visible, scores_BHTS, -jnp.inf), axis=-1)
    out_BHTE = jnp.einsum("bhts,bhse->bhte", probs_BHTS.astype(v.dtype), v_BHSE,
                          preferred_element_type=jnp.float32).astype(q.dtype)
    return out_BHTE.transpose(0, 2, 1, 3)


def unembed(params, h, cfg: Config):  # the final norm, then lm_head: fp32 logits [B, T, V_padded]
    # (The norm's weight is cast as in block.) lm_head is an einsum, not dense: dense casts its
    # result back to h's dtype, and the logits stay fp32.
    h = rms_norm(h, params["final_norm"].astype(h.dtype), cfg.norm_eps)
    logits = jnp.einsum("btd,dv->btv", h, params["lm_head"].astype(h.dtype),
                        preferred_element_type=jnp.float32)
    return constrain(logits, "batch", "seq", "vocab")


def loss_terms(logits, labels, z_loss: float, axis=None):
    # (cross-entropy, z-loss, count), summed over the labels that are not -100 (axis=-1: rows).
    # axis=None sums over everything (training). axis=-1 gives one sum per row, as
    # evaluation.logprobs uses it. It returns sums, not means, so micro-batches and
    # data-parallel shards combine exactly. The z-loss is PaLM's, added as OLMo-core adds it,
    # and keeps the softmax normaliser near 1.
    valid = labels >= 0
    lse = jax.nn.logsumexp(logits, axis=-1)
    # -100 is no index, so it is read as 0 here; those positions are masked out below anyway
    target = jnp.take_along_axis(logits, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    ce = jnp.sum(jnp.where(valid, lse - target, 0.0), axis)
    z = z_loss * jnp.sum(jnp.where(valid, lse * lse, 0.0), axis)
    return ce, z, jnp.sum(valid, axis)


def flops_per_token(cfg: Config, seq_len: int, windows: bool = True) -> float:
    # Training costs 3 x the forward pass. The forward pass costs 2 FLOPs per matmul weight (not
    # the embedding, which is a gather) and 4 per head dim, per query head, for each key a query
    # sees.
    # seen: the keys a query sees on average, per layer. Query i (i = 1..S) sees i keys in a
    # full causal layer, (S + 1) / 2 on average, and min(i, W) in a window W, which sum to
    # SW - W(W - 1) / 2, so W - (W^2 - W) / 2S on average. windows=False counts every layer
    # as full causal, as MaxText does.
    S, W = seq_len, cfg.sliding_window
    seen = [(S + 1) / 2 if cfg.is_full(i) or not windows or W >= S else W - (W * W - W) / (2 * S)
            for i in range(cfg.n_layers)]
    # Only matmul weights count. Filtering by HF name drops the norms and the embedding (a gather).
    leaves = jax.tree.leaves(param_specs(cfg), is_leaf=is_spec)
    weights = sum(math.prod(s.shape) for s in leaves if "norm" not in s.hf and "embed" not in s.hf)
    return 3 * (2 * weights + 4 * cfg.head_dim * cfg.n_heads * sum(seen))


# ----------------------------------------------------------------------------- sharding

MESH_AXES = ("data", "fsdp", "tensor")
# AXIS_RULES, below, is the one table from logical axes to mesh axes. Every sharding the code sets
# (the weights', the batch's, the constrained activations') comes from it, and XLA chooses the rest.
# A batch's rows (sequences) are split over both data-parallel axes. Weights are split ZeRO-3
# style over fsdp and Megatron style over tensor. Axes not named here ("layers", "norm", "seq")
# are not split. A tuple splits one dimension over several mesh axes, so "batch" is split over
# data x fsdp devices.
AXIS_RULES = {"batch": ("data", "fsdp"), "d_model": "fsdp", "heads": "tensor", "kv_heads": "tensor",
              "mlp": "tensor", "vocab": "tensor"}

# Sharding, in three parts. First, the mesh: it arranges the devices in a grid with named axes, as 8
# devices in fsdp=4,tensor=2 form a 1 x 4 x 2 grid (data, fsdp, tensor). By AXIS_RULES (above), data
# and fsdp cut a batch's rows; fsdp also cuts each weight matrix along its d_model (D) dimension, as
# ZeRO-3 does; tensor cuts a weight's heads, MLP or vocab dimension, as Megatron does. A mesh axis
# cuts at most one dimension of an array. The key fact: fsdp cuts a weight's D, but an
# activation's rows, never its D (part two shows it). The code sets three kinds of sharding, and
# XLA chooses the rest: the weights' (abstract_params, below), the batch's (batch_sharding) and
# a few activations' (constrain, which reads the mesh that `jax.set_mesh` set: train.main does).
# train.compile_step hands the first two to jit.
#
# Second, what a device holds. The example: the 7B with `--mesh fsdp=4,tensor=2` on those 8
# devices (data is 1; device d sits at fsdp index i = d // 2 and tensor index j = d % 2, as
# make_mesh reshapes jax.devices() in order), and a batch of 16 x 8192 (a made-up run, small
# enough to hold all its activations at once):
#   array         shape                what cuts each dimension              one device holds
#   embed         [100352, 4096]       tensor (vocab), fsdp (d_model)        [50176, 1024]
#   q weight      [32, 4096, 4096]     -, fsdp (d_model), tensor (heads)     [32, 1024, 2048]
#   o weight      [32, 4096, 4096]     -, tensor (heads), fsdp (d_model)     [32, 2048, 1024]
#   batch         [16, 8192]           data x fsdp (rows), -                 [4, 8192]
#   x_BTD         [16, 8192, 4096]     data x fsdp, -, -                     [4, 8192, 4096]
#   q = x @ Wq    [16, 8192, 4096]     data x fsdp, -, tensor                [4, 8192, 2048]
#   logits        [16, 8192, 100352]   data x fsdp, -, tensor (vocab)        [4, 8192, 50176]
# - Weights. The device holds q[:, 1024*i : 1024*(i+1), 2048*j : 2048*(j+1)] of the weight,
#   and an eighth of its Adam moments. Before each matmul, XLA gathers a layer's weight over fsdp
#   (part three), so the device multiplies its x [4, 8192, 4096] by q's [4096, 2048], one layer
#   at a time, inside the layer scan. (tiny's q, in the README's dry run: [4, 256, 256] -> (4, 64,
#   128).)
# - Rows. It holds rows 4*i to 4*i + 3 of the batch, and every activation keeps those rows, so no
#   row moves between devices. Its tensor partner (same i) holds the same rows. (A large batch
#   runs as micro-batches: train.split_micro takes each from every device's rows.)
# - Activations keep D whole. What each mesh axis cuts:
#     axis     in a weight                                    in an activation
#     fsdp     D (stored in shards, gathered whole for use)   the batch's rows
#     tensor   heads, MLP or vocab                            heads, MLP or vocab
#   So D is never cut in an activation: fsdp cuts its rows instead, and tensor partners hold the
#   same rows. The matmuls that make q and the logits need no communication beyond the weights'
#   gather: each device computes its own heads' or vocab's columns for its rows. What follows
#   them does: QK-norm's statistics and the loss's logsumexp sum across tensor partners (part
#   three). constrain pins the cuts of x_BTD and the logits; XLA chooses q's, normally the table's.
#
# Third, what XLA communicates (docs/reference.md's "Seeing the communication" counts it). It
# inserts the communication itself, and typically chooses:
#   all-gather over fsdp: each layer's weights, before its matmuls (q's becomes [4096, 2048]);
#   all-reduce over tensor, forward: after o and down, whose input dimension tensor cuts, so
#     each partner holds a partial sum over its half of the heads or of the MLP, and the two
#     are added;
#   all-reduce over tensor, backward: the gradient of the x that enters q, k, v, gate and up, for
#     the same reason (each partner's half of those weights gives a partial sum);
#   all-reduce over tensor, small: QK-norm's statistics (a mean over all the heads, which tensor
#     cuts) and the loss's logsumexp (over the vocabulary, which tensor cuts);
#   reduce-scatter over fsdp: in the backward pass, each gradient back to its fsdp shard;
#   all-reduce over data, when data > 1: the gradients of its N copies of the weights.
# The embedding's lookup needs communication too: all-gathers give each device every row of the
# table, for part of its columns (docs/pods.md, "The embedding's communication", has tiny's dump).


# Maps logical axis names to a PartitionSpec with one entry per dimension. None, or a name not in
# AXIS_RULES such as "seq", is not split (.get gives None). ("batch", "seq") -> P(("data", "fsdp"),
# None).
logical_to_spec = lambda axes: P(*(AXIS_RULES.get(name) for name in axes))

# [batch, seq] with rows over data parallelism
batch_sharding = lambda mesh: NamedSharding(mesh, logical_to_spec(("batch", "seq")))


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None) -> Mesh:
    # A (data, fsdp, tensor) mesh; one size may be -1: all the remaining devices.
    # Without a -1, the mesh takes the first data x fsdp x tensor devices, which may be fewer
    # than there are (to resume on fewer). With a -1 it takes all of them. On 8 devices:
    # (1, -1, 1) is 1 x 8 x 1; (1, 2, 2) takes the first 4; (1, -1, 3) and (1, 4, 4) are errors.
    devices, sizes = np.array(jax.devices() if devices is None else devices), (data, fsdp, tensor)
    given = f"mesh data={data},fsdp={fsdp},tensor={tensor}"  # for the errors
    if sizes.count(-1) > 1 or any(s < 1 and s != -1 for s in sizes):
        raise SystemExit(f"error: {given}: give each axis a size > 0, or -1 (one axis at most)")
    fixed = math.prod(s for s in sizes if s > 0)  # the devices the sizes given take
    n = len(devices) if -1 in sizes else fixed  # numpy's reshape works out the -1
    # (Pods only; on one host it is empty.) A process that holds none of the mesh's devices
    # would have no rows to read.
    left_out = {d.process_index for d in devices} - {d.process_index for d in devices[:n]}
    # The sizes given must fit the devices; with a -1, which takes all the rest, they must divide
    # their number; and they must take some devices of every process
    if fixed > len(devices) or (-1 in sizes and len(devices) % fixed) or left_out:
        raise SystemExit(f"error: {given} takes {fixed} of {len(devices)} devices; it must take "
                         "no more, divide them with a -1, and take some of every process's")
    # The Mesh constructor's axes are Auto: XLA picks every sharding the code does not set
    return Mesh(devices[:n].reshape(sizes), MESH_AXES)


def abstract_params(cfg: Config, mesh: Mesh) -> dict:  # describes the params, allocates none
    # Each weight becomes a jax.ShapeDtypeStruct, which describes an array (shape, dtype fp32,
    # and its sharding from AXIS_RULES). jit compiles for such descriptions, and
    # train.init_state creates the arrays with these shardings. A weight that the mesh cannot
    # split is an error here.
    def place(path, spec):
        sharding = NamedSharding(mesh, logical_to_spec(spec.axes))
        try:  # shard_shape raises if the mesh does not divide a dimension it splits
            sharding.shard_shape(spec.shape)
        except ValueError:
            raise SystemExit(f"error: weight {jax.tree_util.keystr(path)} {spec.shape} does not "
                             f"split over mesh {dict(mesh.shape)}; choose another --mesh") from None
        return jax.ShapeDtypeStruct(spec.shape, jnp.float32, sharding=sharding)
    return jax.tree_util.tree_map_with_path(place, param_specs(cfg), is_leaf=is_spec)


def constrain(x, *axes):  # pin an activation's sharding (by logical axes) under a mesh
    # Pins x's rows to the data-parallel devices, where XLA, left alone, may gather a whole batch
    # onto every device. The mesh is the one `with jax.set_mesh(mesh)` set (train.main does, and
    # so do evaluation.main, prepare.dry_run and some tests): get_abstract_mesh() returns it while
    # tracing, and with_sharding_constraint uses it. With none set (other tests, convert
    # --verify), it does nothing. A name not in AXIS_RULES ("seq") is not split: it only names
    # the dimension.
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes))


# On a pod (the second read: the README's stop 8), each process feeds only its own devices:
# local_rows names the rows of each batch that they hold (the process's loader reads those alone),
# and device_batch makes the whole batch's arrays from them. On one host, these are every row and
# jax.device_put.
def local_rows(mesh: Mesh, global_batch: int):  # -> the rows this process's devices hold
    # With 2 processes of 2 devices each and fsdp=4, process 1 holds rows 8-15 of 16. held maps
    # each of this process's devices to its (rows, columns) slices of the batch: {device 2:
    # (slice(8, 12), slice(None)), device 3: (slice(12, 16), slice(None))}. The sharding is for
    # [batch, seq] arrays, so the shape needs two dimensions; any width gives the same rows (seq
    # is not cut), so it is 1. On one host, every row is held: 0 to 15.
    held = batch_sharding(mesh).addressable_devices_indices_map((global_batch, 1))
    # np.unique lists each row once, in order: a tensor axis's devices hold the same rows
    return np.unique(np.concatenate([np.arange(global_batch)[rows] for rows, _ in held.values()]))


def device_batch(batch, mesh: Mesh):  # this process's rows -> arrays of the whole batch
    # One jax.Array spans every device of every process. Each process gives its own rows, x
    # [len(loader.rows), seq_len], and no data moves between hosts. JAX infers the whole batch's
    # shape from the sharding: [global_batch, seq_len].
    return {name: jax.make_array_from_process_local_data(batch_sharding(mesh), x)
            for name, x in batch.items()}


# ----------------------------------------------------------------------------- attention kernels

# attention's kernel, which computes the same as the reference:
#   "splash", or "auto" on a TPU: Pallas' splash kernel;
#   "cudnn", or "auto" on an NVIDIA GPU in bf16 (cuDNN takes no fp32): cuDNN's;
#   otherwise, as on a CPU (where it is the fastest) or for tiny's fp32: the reference.
# cuDNN is asked for by name, because JAX's default is the XLA path, whose [B, H, T, T] fp32
# scores are 8 GiB a sequence and layer at 8192: too much when the default policy
# (dots_saveable, --remat dots) keeps the matmul outputs, these among them, for every layer.


def attention_cudnn(q, k, v, window, segments):  # cuDNN's flash attention, for NVIDIA GPUs
    if segments is not None:
        raise SystemExit("error: cuDNN's attention in JAX cannot keep packed documents apart; use "
                         "--attention reference or --doc-masking false, or a TPU (splash)")
    left = None if window is None else (window - 1, 0)  # OLMo's window W has W - 1 keys to the left
    try:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=left,
                                            implementation="cudnn")
    except (ValueError, NotImplementedError, RuntimeError) as e:  # checked as it is traced
        raise SystemExit(f"error: cuDNN's attention cannot run this ({e}); use --attention "
                         "reference (it holds [B, H, T, T] scores: try --remat full)") from None


def attention_splash(q, k, v, window: int | None, segments=None):
    # TPU: the Pallas splash kernel, per device under shard_map (interpreted on other backends).
    from jax.experimental.pallas.ops.tpu import splash_attention as splash
    # The kernel's blocks are multiples of 128 tokens, so the sequence is padded to one. Padded
    # keys come after every real query, so the causal mask hides them. Padded queries are cut
    # off. The batch is padded to split over the data-parallel devices, because shard_map needs
    # it to divide. --generate's one prompt on 4 devices is one such case.
    mesh = jax.sharding.get_abstract_mesh()
    B, T, _, E = q.shape
    dp = 1 if mesh.empty else mesh.shape["data"] * mesh.shape["fsdp"]  # data-parallel devices
    pads = ((0, -B % dp), (0, -T % 128))  # for B and T; heads and E are not padded
    q, k, v = (jnp.pad(x, (*pads, (0, 0), (0, 0))) for x in (q, k, v))
    # padded positions get segment id -1, so they see only each other
    segments = None if segments is None else jnp.pad(segments, pads, constant_values=-1)
    padded = q.shape[1]
    mask = (splash.CausalMask((padded, padded)) if window is None else
            splash.LocalMask((padded, padded), (window - 1, 0), offset=0))
    # Every block size (queries, keys, forward and backward, 8 of them) is 512 tokens where the
    # length allows. Each device runs the kernel on all its heads over the whole sequence. Skip
    # the kernel's details on a first read. It computes the reference's attention, tiled for
    # the TPU.
    sizes = splash.BlockSizes(*[math.gcd(padded, 512)] * 8)  # the same size, 8 times

    # k and v keep their K heads. For query head h, the kernel reads kv head h // (H / K).
    def local(q, k, v, segments):  # one device's shard [b, T, h, E] -> the kernel's [h, T, E]
        # head_shards and q_seq_shards are 1, so nothing is split inside the kernel (shard_map
        # has split already). The kernel does not scale the scores, so q is scaled first. vmap
        # maps the kernel over the rows. ids is None with no packing, an empty pytree, which vmap
        # passes through.
        heads = splash.MultiHeadMask([mask] * q.shape[2])
        kernel = splash.make_splash_mha(heads, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                        interpret=jax.default_backend() != "tpu")
        heads_first = lambda x: x.transpose(0, 2, 1, 3)
        ids = None if segments is None else splash.SegmentIds(segments, segments)  # q, kv
        out = jax.vmap(kernel)(heads_first(q * E ** -0.5), heads_first(k), heads_first(v), ids)
        return heads_first(out)
    if mesh.empty:
        return local(q, k, v, segments)[:B, :T]
    # shard_map runs `local` on each device's own block (its rows and heads, as the specs cut
    # them) of the mesh set by jax.set_mesh, and reassembles the outputs by out_specs.
    # check_vma=False skips JAX's check of which mesh axes the outputs vary over, because the
    # kernel's outputs carry no record of it.
    # k and v are cut by "heads" too, because "kv_heads" maps to the same mesh axis (tensor).
    pspec = logical_to_spec(("batch", None, "heads", None))
    # in_specs cut q, k and v by `pspec`, and segments [B, T] by rows. With no packing, segments
    # is None, an empty pytree, which its spec cuts into nothing. The shapes, with B' and T'
    # padded and dp, tp the data-parallel and tensor sizes:
    #   q [B', T', H, E] -shard_map-> [B'/dp, T', H/tp, E] -heads_first-> [b, h, T', E]
    #   -vmap over b-> the kernel on [h, T', E] -> back, and reassembled by out_specs
    return jax.shard_map(local, in_specs=(pspec,) * 3 + (logical_to_spec(("batch", None)),),
                         out_specs=pspec, check_vma=False)(q, k, v, segments)[:B, :T]
