"""OLMo 3 in plain JAX: the config, the model as pure functions, and how it is sharded."""
# OLMo 3 in one paragraph: a decoder-only transformer with the norm on each sub-block's *output*
# (h = x + norm(attn(x)); out = h + norm(mlp(h))), RMSNorm on the whole q and k projections
# before RoPE, rotate-half RoPE with theta 500k, SwiGLU, no biases, an untied lm_head, and three
# sliding-window layers for every full-attention one (the last layer is always full).
#
# Read in this order: Config, param_specs, forward (embed -> decoder -> block -> unembed),
# loss_terms; then make_mesh, whose comment says what each device holds. The model is a pytree
# (nested dict) of arrays; one Spec per weight drives `init`, `shardings` and convert.py.
import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config:
    # --- model (a checkpoint only loads into the same values of these) ---
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32               # < n_heads means grouped-query attention
    head_dim: int = 128
    mlp_hidden: int = 11008
    vocab_size: int = 100_278          # the tokenizer's ids; weights are padded to `padded_vocab`
    sliding_window: int = 4096         # keys a sliding layer sees, the current token included
    global_every: int = 4              # layers 3, 7, 11, ... (and the last) attend to everything
    rope_theta: float = 500_000.0
    yarn_factor: float = 0.0           # YaRN RoPE scaling on full-attention layers (0: none)
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_original_context: int = 8192
    norm_eps: float = 1e-6
    tokenizer: str = "dolma2"          # "dolma2" (cl100k + OLMo specials) or "bytes"
    # --- numerics and memory ---
    compute_dtype: str = "bfloat16"    # params and optimizer state stay fp32
    remat: bool = False                # recompute each layer in the backward pass
    attention: str = "auto"            # "auto", "reference", "blockwise", "cudnn", "splash"
    # --- the training recipe (train.py) ---
    seq_len: int = 8192
    global_batch: int = 512            # sequences per optimizer step
    micro_batch: int = 0               # sequences per forward/backward; 0 = the whole batch
    steps: int = 1_413_814             # ~5.93T tokens at 512 x 8192
    lr: float = 3e-4
    warmup_steps: int = 2000
    schedule: str = "cosine"           # "cosine" (to min_lr_ratio * lr), "linear" or "olmo3"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    z_loss: float = 1e-5
    spike_guard: bool = True           # skip updates whose loss or grad norm spikes (OLMo-core)
    seed: int = 0                      # model init
    data_seed: int = 34521             # data order (AI2's stage-1 seed)
    repetition_filter: bool = False    # mask instances with long periodic runs (off in AI2's 7B)
    log_every: int = 10
    eval_every: int = 1000
    eval_limit: int = 500              # documents per perplexity set and per task; 0: all
    save_every: int = 1000
    keep_checkpoints: int = 3

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // 128) * 128  # a multiple of 128, like OLMo-core

    def is_global(self, layer: int) -> bool:
        return layer % self.global_every == self.global_every - 1 or layer == self.n_layers - 1


_FIELDS = [field.name for field in dataclasses.fields(Config)]
MODEL_FIELDS = tuple(_FIELDS[:_FIELDS.index("compute_dtype")])  # Config's "model" section


PRESETS = {
    # Laptop CPU, minutes. Byte-level vocab; window 64 < seq 256 so both layer kinds matter.
    "tiny": Config(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=64,
                   mlp_hidden=768, vocab_size=258, sliding_window=64,
                   tokenizer="bytes", compute_dtype="float32", seq_len=256, global_batch=16,
                   steps=500, lr=3e-3, warmup_steps=50, log_every=25, eval_every=100,
                   save_every=100),
    # One accelerator: OLMo's 1B shape with the 7B recipe.
    "1b": Config(d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16, head_dim=128,
                 mlp_hidden=8192, seq_len=4096, global_batch=64, micro_batch=8, lr=4e-4),
    "7b": Config(schedule="olmo3"),  # AI2's two-part stage-1 LR (train.schedule)
    # MaxText's head reshape: 16 heads x 256, same parameters and FLOPs (QK-norm stays 4096).
    "7b-wide": Config(n_heads=16, n_kv_heads=16, head_dim=256, schedule="olmo3"),
    # AI2's released model, stage 3's shape: YaRN x8 on the full layers, 65,536 tokens of context
    "7b-long": Config(yarn_factor=8.0, seq_len=65536, global_batch=64, lr=2.0712e-4,
                      warmup_steps=200, schedule="linear", min_lr_ratio=0.0, steps=11_921),
}
# Stage 2 ("mid-training"): start from stage 1's weights *and* Adam moments, linear decay to 0.
STAGE2 = dict(global_batch=256, lr=2.0712e-4, warmup_steps=0, schedule="linear",
              min_lr_ratio=0.0, steps=47_684, data_seed=1337)


# ----------------------------------------------------------------------------- parameters

class Spec(NamedTuple):
    shape: tuple
    axes: tuple     # one logical axis name per dimension
    init: str       # "normal" (truncated, std 0.02, cut at 3 std) or "ones"


def param_specs(cfg: Config) -> dict:
    D, L, F, V = cfg.d_model, cfg.n_layers, cfg.mlp_hidden, cfg.padded_vocab
    Q, KV = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

    def w(*dims, init="normal"):  # dims: (size, logical axis) pairs
        return Spec(tuple(size for size, _ in dims), tuple(axis for _, axis in dims), init)
    layers = (L, "layers")  # stacked: one array per kind of weight, whatever the depth
    return {
        "embed": w((V, "vocab"), (D, "embed")),
        "blocks": {
            "q": w(layers, (D, "embed"), (Q, "heads")),
            "k": w(layers, (D, "embed"), (KV, "kv_heads")),
            "v": w(layers, (D, "embed"), (KV, "kv_heads")),
            "o": w(layers, (Q, "heads"), (D, "embed")),
            "q_norm": w(layers, (Q, "heads"), init="ones"),
            "k_norm": w(layers, (KV, "kv_heads"), init="ones"),
            "attn_norm": w(layers, (D, "norm"), init="ones"),
            "gate": w(layers, (D, "embed"), (F, "mlp")),
            "up": w(layers, (D, "embed"), (F, "mlp")),
            "down": w(layers, (F, "mlp"), (D, "embed")),
            "mlp_norm": w(layers, (D, "norm"), init="ones"),
        },
        "final_norm": w((D, "norm"), init="ones"),
        "lm_head": w((D, "embed"), (V, "vocab")),
    }


def is_spec(x) -> bool:
    return isinstance(x, Spec)


def param_count(cfg: Config) -> int:
    """Every weight, the vocabulary padding included (as OLMo-core counts)."""
    return sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec))


def flops_per_token(cfg: Config, seq_len: int, windows: bool = True) -> float:
    """Training FLOPs per token (3 x forward)."""
    # windows=True counts the keys a sliding-window query really sees; windows=False counts every
    # layer as full causal, MaxText's convention.
    D, F, Dh, H, K = cfg.d_model, cfg.mlp_hidden, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    S, W = seq_len, cfg.sliding_window
    matmuls = 2 * (D * (H + 2 * K) * Dh + H * Dh * D + 3 * D * F)
    keys_full = (S + 1) / 2
    keys_window = keys_full if W >= S else W - (W * W - W) / (2 * S)  # about W - W^2/(2S)
    keys = [keys_full if cfg.is_global(i) or not windows else keys_window
            for i in range(cfg.n_layers)]
    attn = sum(4 * Dh * H * c for c in keys)
    return 3 * (cfg.n_layers * matmuls + attn + 2 * D * cfg.padded_vocab)


def init(cfg: Config, key) -> dict:
    """fp32 parameters (train.init_state calls this under jit, creating them sharded)."""
    leaves, treedef = jax.tree.flatten(param_specs(cfg), is_leaf=is_spec)
    arrays = [jnp.ones(s.shape, jnp.float32) if s.init == "ones" else
              0.02 * jax.random.truncated_normal(k, -3.0, 3.0, s.shape, jnp.float32)
              for s, k in zip(leaves, jax.random.split(key, len(leaves)))]
    return jax.tree.unflatten(treedef, arrays)


# ----------------------------------------------------------------------------- sharding

MESH_AXES = ("data", "fsdp", "tensor")
# The one table from logical axes to mesh axes: every sharding in the project comes from it.
AXIS_RULES = {
    "batch": ("data", "fsdp"),  # sequences are split over both data-parallel axes
    "embed": "fsdp",            # weights: ZeRO-3 style over fsdp ...
    "heads": "tensor",          # ... and Megatron style over tensor
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "layers": None,
    "norm": None,
    "seq": None,
}


def logical_to_spec(axes) -> P:
    """Logical axis names (None: replicated) -> a PartitionSpec."""
    # JAX's NamedSharding itself rejects a spec that uses a mesh axis twice.
    return P(*(AXIS_RULES[name] if name else None for name in axes))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches [batch, seq]: rows over the data-parallel axes."""
    return NamedSharding(mesh, logical_to_spec(("batch", "seq")))


# Sharding in one paragraph. The mesh arranges the devices in a grid with named axes; 8 devices
# as fsdp=4,tensor=2 form a 4 x 2 grid. AXIS_RULES cuts each weight along those axes: the q
# weight [layers, embed 4096, heads 4096] is cut 4 ways along embed (fsdp) and 2 ways along heads
# (tensor), so one device holds [32, 1024, 2048], an eighth of it, and an eighth of its Adam
# moments. A batch [512, 8192] is cut 4 ways along its rows (fsdp): each device holds 128
# sequences, the same ones as its tensor partner. XLA inserts the communication: before a layer's
# matmuls it all-gathers the fsdp shards of the weights (a device then sees q as [4096, 2048]),
# after `o` and `down` it all-reduces over `tensor` (each partner summed half of the heads or
# of the MLP), and in the backward pass it reduce-scatters each gradient back to its fsdp shard.
# data=N keeps N whole copies of the weights and all-reduces their gradients.
def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh; one size may be -1: all the remaining devices."""
    # Sizes that multiply to fewer devices than there are use the first ones (e.g. to resume on
    # fewer).
    devices, sizes = np.array(jax.devices() if devices is None else devices), (data, fsdp, tensor)
    n = len(devices) if -1 in sizes else math.prod(sizes)  # numpy's reshape works out the -1
    valid = sizes.count(-1) <= 1 and all(s > 0 or s == -1 for s in sizes)
    if not valid or n > len(devices) or n % math.prod(s for s in sizes if s > 0):
        raise SystemExit(f"error: mesh data={data},fsdp={fsdp},tensor={tensor} does not fit "
                         f"{len(devices)} devices; their product must divide it (one may be -1)")
    return Mesh(devices[:n].reshape(sizes), MESH_AXES)


def shardings(cfg: Config, mesh: Mesh) -> dict:
    """NamedSharding for every weight; a dimension the mesh cannot split is a one-line error."""
    def place(path, spec):
        pspec = logical_to_spec(spec.axes)
        for dim, rule in zip(spec.shape, pspec):
            axes = (rule,) if isinstance(rule, str) else rule or ()
            if dim % (n := math.prod(mesh.shape[a] for a in axes)):
                raise SystemExit(f"error: weight {jax.tree_util.keystr(path)} {spec.shape}: "
                                 f"dimension {dim} does not split over mesh axes {rule} of size "
                                 f"{n}; choose another --mesh")
        return NamedSharding(mesh, pspec)
    return jax.tree_util.tree_map_with_path(place, param_specs(cfg), is_leaf=is_spec)


def constrain(x, *axes):
    """Pin an activation's sharding (by logical axes) when running under a mesh."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes))


# ----------------------------------------------------------------------------- the model

def forward(params, tokens, cfg: Config):
    """tokens [B, T] int -> logits [B, T, padded_vocab] in fp32."""
    return unembed(params, decoder(params, embed(params, tokens, cfg), cfg)[0])


def embed(params, tokens, cfg: Config):
    """tokens [B, T] -> embeddings [B, T, D] in the compute dtype (OLMo 3 does not scale them)."""
    x = jnp.take(params["embed"], tokens, axis=0).astype(cfg.compute_dtype)
    return constrain(x, "batch", "seq", None)


def decoder(params, x, cfg: Config, cache=None, start=0):
    """Embeddings [B, T, D] at positions start.. -> (final normed hidden states, KV cache)."""
    # The layers are unrolled, so each knows its window statically (a scan was 1.5-2x slower on
    # CPU); per-layer weights are stacked [n_layers, ...] and sliced here. With a cache (see
    # init_cache), each layer also stores its keys and values and, one token at a time, reads
    # them back.
    positions = start + jnp.arange(x.shape[1])
    ropes = {full: rope_tables(positions, cfg, full) for full in (False, True)}
    layer = jax.checkpoint(block, static_argnums=(2, 4)) if cfg.remat else block
    caches = []
    for i in range(cfg.n_layers):
        p = jax.tree.map(lambda w: w[i], params["blocks"])
        window = None if cfg.is_global(i) else cfg.sliding_window
        x, layer_cache = layer(p, x, window, ropes[cfg.is_global(i)], cfg, cache and cache[i],
                               start)
        caches.append(layer_cache)
    return rms_norm(x, params["final_norm"], cfg.norm_eps), cache and caches


def block(p, x, window, rope, cfg: Config, cache=None, start=0):
    """One OLMo 3 layer -> (output, its KV cache); window: None (full attention) or W, static."""
    # The norms sit on each sub-block's output, not its input.
    p = jax.tree.map(lambda w: w.astype(cfg.compute_dtype), p)  # rms_norm upcasts its weight
    attended, cache = attention_block(p, x, window, rope, cfg, cache, start)
    h = constrain(x + rms_norm(attended, p["attn_norm"], cfg.norm_eps), "batch", "seq", None)
    mlp = dense(jax.nn.silu(dense(h, p["gate"])) * dense(h, p["up"]), p["down"])  # SwiGLU
    out = h + rms_norm(mlp, p["mlp_norm"], cfg.norm_eps)
    return constrain(out, "batch", "seq", None), cache


def attention_block(p, x_BTD, window, rope, cfg: Config, cache=None, start=0):
    B, T, _ = x_BTD.shape
    H, K, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    # QK-norm over the whole projection, before splitting heads and before RoPE
    q_BTQ = rms_norm(dense(x_BTD, p["q"]), p["q_norm"], cfg.norm_eps)
    k_BTK = rms_norm(dense(x_BTD, p["k"]), p["k_norm"], cfg.norm_eps)
    q_BTHD = apply_rope(q_BTQ.reshape(B, T, H, Dh), *rope)
    k_BTKD = apply_rope(k_BTK.reshape(B, T, K, Dh), *rope)
    v_BTKD = dense(x_BTD, p["v"]).reshape(B, T, K, Dh)
    if cache is not None:
        cache = cache_write(cache, k_BTKD, v_BTKD, start)
    if cache is None or T > 1:  # training, or a prompt (from position 0)
        out_BTHD = attention(q_BTHD, k_BTKD, v_BTKD, window, cfg)
    else:  # one new token over the cached keys it can see
        positions = (start + jnp.arange(1), cache["pos"])
        out_BTHD = attention_reference(q_BTHD, cache["k"], cache["v"], window, positions)
    return dense(out_BTHD.reshape(B, T, H * Dh), p["o"]), cache


def unembed(params, h):
    """Hidden states -> fp32 logits over the padded vocabulary (matmul in h's dtype)."""
    logits = jnp.einsum("btd,dv->btv", h, params["lm_head"].astype(h.dtype),
                        preferred_element_type=jnp.float32)
    return constrain(logits, "batch", "seq", "vocab")


def dense(x, w):
    """x [..., in] @ w [in, out] in x's dtype, accumulating in fp32."""
    # One 2-D matmul: XLA:CPU runs the batched 3-D form about a quarter slower.
    y = jnp.dot(x.reshape(-1, x.shape[-1]), w, preferred_element_type=jnp.float32)
    return y.astype(x.dtype).reshape(*x.shape[:-1], w.shape[-1])


def rms_norm(x, weight, eps):
    """Statistics and the weight multiply in fp32 (as OLMo-core and HF do), cast back after."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * x32).astype(x.dtype)


def rope_tables(positions, cfg: Config, full: bool):
    """cos and sin [T, head_dim] at `positions`, in the rotate-half layout; YaRN, when set,
    on full-attention layers only (as transformers' Olmo3 and OLMo-core apply it)."""
    Dh, theta, scale = cfg.head_dim, cfg.rope_theta, 1.0
    inv_freq = 1.0 / (theta ** (jnp.arange(0, Dh, 2, dtype=jnp.float32) / Dh))
    if full and cfg.yarn_factor:
        # YaRN (transformers' _compute_yarn_parameters): frequencies that turn fewer than
        # beta_slow times over the original context are divided by the factor, more than
        # beta_fast kept, with a linear ramp between; cos and sin grow by 0.1 ln(factor) + 1.
        dim = lambda turns: Dh * math.log(cfg.yarn_original_context / (turns * 2 * math.pi)) / (
            2 * math.log(theta))
        low = max(math.floor(dim(cfg.yarn_beta_fast)), 0)
        high = min(math.ceil(dim(cfg.yarn_beta_slow)), Dh - 1)
        ramp = jnp.arange(Dh // 2, dtype=jnp.float32)
        ramp = jnp.clip((ramp - low) / max(high - low, 1e-3), 0, 1)
        inv_freq = inv_freq / cfg.yarn_factor * ramp + inv_freq * (1 - ramp)
        scale = 0.1 * math.log(cfg.yarn_factor) + 1
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x_BTHD, cos_TD, sin_TD):
    """Rotation in fp32, result in x's dtype."""
    x32 = x_BTHD.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos_TD[:, None, :] + rotated * sin_TD[:, None, :]).astype(x_BTHD.dtype)


def loss_terms(logits, labels, z_loss: float, axis=None):
    """(cross-entropy, z-loss, count), summed over the labels that are not -100 (axis=-1: rows)."""
    # Sums, not means, so micro-batches and data-parallel shards combine exactly.
    valid = labels >= 0
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    ce = jnp.sum(jnp.where(valid, lse - target, 0.0), axis)
    z = z_loss * jnp.sum(jnp.where(valid, lse * lse, 0.0), axis)
    return ce, z, jnp.sum(valid, axis)


# ----------------------------------------------------------------------------- attention

def visible(q_pos, k_pos, window: int | None):
    """Key j is visible to query i iff j <= i and, in a sliding layer, i - j < window."""
    return (k_pos <= q_pos) & ((q_pos - k_pos < window) if window else True)


def attention(q, k, v, window: int | None, cfg: Config):
    """q [B, T, H, Dh], k and v [B, T, K, Dh] -> [B, T, H, Dh], by cfg.attention's kernel."""
    # "auto" takes the maintained kernel of the backend (cuDNN on NVIDIA GPUs with bf16, splash
    # on TPU), else the reference for short sequences and blockwise for long ones.
    name = cfg.attention
    if name == "auto":
        backend = jax.default_backend()
        name = ("splash" if backend == "tpu" else
                "cudnn" if backend == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) else
                "reference" if q.shape[1] <= 2048 else "blockwise")
    if name not in ATTENTION:
        raise SystemExit(f"error: attention {name!r} unknown; use auto, {', '.join(ATTENTION)}")
    return ATTENTION[name](q, k, v, window)


def attention_reference(q, k, v, window: int | None, positions=None):
    """Softmax attention over the whole [T, S] score matrix: the definition."""
    # The fastest on CPU for short sequences. Heads go first so that both products are plain
    # batched matmuls; query head h reads kv head h // (H / K). `positions`: (the queries' [T],
    # the keys' [S]), 0.. by default; a KV cache passes its slots'.
    B, T, H, Dh = q.shape
    q_pos, k_pos = (jnp.arange(T), jnp.arange(T)) if positions is None else positions
    q_BHTD, k_BKTD, v_BKTD = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    k_BHTD, v_BHTD = (jnp.repeat(x, H // x.shape[1], axis=1) for x in (k_BKTD, v_BKTD))
    scores_BHTS = jnp.einsum("bhtd,bhsd->bhts", q_BHTD, k_BHTD,
                             preferred_element_type=jnp.float32) * Dh ** -0.5
    mask_TS = visible(q_pos[:, None], k_pos[None, :], window)
    probs_BHTS = jax.nn.softmax(jnp.where(mask_TS, scores_BHTS, -jnp.inf), axis=-1)
    out_BHTD = jnp.einsum("bhts,bhsd->bhtd", probs_BHTS.astype(v.dtype), v_BHTD,
                          preferred_element_type=jnp.float32).astype(q.dtype)
    return out_BHTD.transpose(0, 2, 1, 3)


def attention_blockwise(q, k, v, window: int | None, block: int = 512):
    """Memory-efficient attention in pure JAX: O(T x visible keys) work and memory."""
    # Queries go in n blocks of c; each query block runs an online softmax over only the key
    # blocks it can see (causal: blocks 0..i; a window: the 1 + ceil((W-1)/c) blocks it reaches),
    # and is rematerialised in the backward pass, like flash attention. G = H / K query heads
    # share each kv head.
    B, T, H, Dh = q.shape
    K, G = k.shape[2], H // k.shape[2]
    c = math.gcd(T, block)
    n = T // c
    reach = n if window is None else min(n, 1 + -(-(window - 1) // c))
    q_nBKGcD = q.reshape(B, n, c, K, G, Dh).transpose(1, 0, 3, 4, 2, 5)
    k_nBKcD, v_nBKcD = (x.reshape(B, n, c, K, Dh).transpose(1, 0, 3, 2, 4) for x in (k, v))
    offsets = jnp.arange(c)

    def query_block(i, q_BKGcD):
        def visit(carry, t):
            j = i - reach + 1 + t  # the key block; < 0 means before the sequence start

            def attend(carry):
                m, denom, acc = carry  # running max, softmax denominator and output
                s = jnp.einsum("bkgqd,bksd->bkgqs", q_BKGcD, k_nBKcD[j],
                               preferred_element_type=jnp.float32) * Dh ** -0.5
                mask = visible(i * c + offsets[:, None], j * c + offsets[None, :], window)
                s = jnp.where(mask, s, -1e30)  # finite: a row that sees nothing yet stays NaN-free
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                scale = jnp.exp(m - m_new)
                pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), v_nBKcD[j],
                                preferred_element_type=jnp.float32)
                return m_new, denom * scale + p.sum(-1), acc * scale[..., None] + pv
            return jax.lax.cond(j >= 0, attend, lambda carry: carry, carry), None
        rows = q_BKGcD.shape[:-1]
        init = (jnp.full(rows, -1e30), jnp.zeros(rows), jnp.zeros(q_BKGcD.shape, jnp.float32))
        (_, denom, acc), _ = jax.lax.scan(visit, init, jnp.arange(reach))
        return (acc / denom[..., None]).astype(q.dtype)
    out_nBKGcD = jax.lax.map(lambda args: jax.checkpoint(query_block)(*args),
                             (jnp.arange(n), q_nBKGcD))
    return out_nBKGcD.transpose(1, 0, 4, 2, 3, 5).reshape(B, T, H, Dh)


def attention_cudnn(q, k, v, window: int | None):
    """NVIDIA: cuDNN's fused flash attention with a causal local window (bf16/fp16 only)."""
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn",
        local_window_size=None if window is None else (window - 1, 0))


def attention_splash(q, k, v, window: int | None, interpret: bool = False):
    """TPU: the Pallas splash-attention kernel (interpret=True runs it on CPU)."""
    # Causal or local mask, run per device under shard_map: batch over data/fsdp, heads over
    # tensor.
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
        splash_attention_mask as masks,
    )
    T, Dh = q.shape[1], q.shape[3]
    mask = (masks.CausalMask((T, T)) if window is None else
            masks.LocalMask((T, T), (window - 1, 0), 0))
    sizes = splash.BlockSizes(*[math.gcd(T, 512)] * 8)

    def local(q, k, v):  # one device's shard [b, T, h, Dh] -> the kernel's [h, T, Dh], vmapped
        kernel = splash.make_splash_mha(masks.MultiHeadMask([mask] * q.shape[2]), block_sizes=sizes,
                                        head_shards=1, q_seq_shards=1, interpret=interpret)
        heads_first = lambda x: x.transpose(0, 2, 1, 3)
        out = jax.vmap(kernel)(heads_first(q * Dh ** -0.5), heads_first(k), heads_first(v))
        return heads_first(out)
    if jax.sharding.get_abstract_mesh().empty:
        return local(q, k, v)
    spec = logical_to_spec(("batch", None, "heads", None))
    return jax.shard_map(local, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)(q, k, v)


def init_cache(cfg: Config, batch: int, length: int):
    """An empty KV cache for `length` positions: per layer keys and values [B, C, K, Dh] and
    each slot's position; C is `length`, or a sliding layer's window."""
    def layer(i):
        C = length if cfg.is_global(i) else min(length, cfg.sliding_window)
        kv = jnp.zeros((batch, C, cfg.n_kv_heads, cfg.head_dim), cfg.compute_dtype)
        return {"k": kv, "v": kv, "pos": jnp.full((C,), 2**31 - 1)}  # empty: after every query
    return [layer(i) for i in range(cfg.n_layers)]


def cache_write(cache, k_BTKD, v_BTKD, start):
    """Keys and values of positions start.. into slots position % C: a window is a ring."""
    C, T = cache["pos"].shape[0], k_BTKD.shape[1]
    keep = min(T, C)  # of a long prompt, a sliding layer keeps its last window
    positions = start + jnp.arange(T - keep, T)
    slots = positions % C
    return {"k": cache["k"].at[:, slots].set(k_BTKD[:, T - keep:].astype(cache["k"].dtype)),
            "v": cache["v"].at[:, slots].set(v_BTKD[:, T - keep:].astype(cache["v"].dtype)),
            "pos": cache["pos"].at[slots].set(positions)}


ATTENTION = {"reference": attention_reference, "blockwise": attention_blockwise,
             "cudnn": attention_cudnn, "splash": attention_splash}
