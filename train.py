"""Train OLMo 3: the recipe, the device mesh, the loop, checkpoints with exact resume.

    python train.py --preset tiny                       # CPU, minutes, the stdlib corpus
    python train.py --preset 7b --data mix.txt --mesh fsdp=-1 --out runs/7b
    python train.py --preset 7b --stage2 --init-from runs/7b --data dolmino.txt --out runs/7b-s2

Any Config field can be set from the command line (--lr 1e-3, --global-batch 64, --remat true).
A run directory holds checkpoints/, metrics.jsonl and loss.png; running the same command again
resumes from the last complete checkpoint. The batch for a step is a pure function of the step,
so resuming needs no data-loader state and replays exactly, on any mesh (the same command with
another --mesh resizes a run). A failed step is retried in-process from the last checkpoint, on the
devices still working (--max-retries; --inject-faults to try it). Plan a pod without one:
    python train.py --preset 7b --dry-run --devices 64 --mesh fsdp=-1 --remat true --micro-batch 64
"""
import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils, topologies
from jax.sharding import NamedSharding, PartitionSpec as P

import data
import olmo3

logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's informational warnings, on every restore
# Must match for a run directory to resume: the model, and everything that decides the data order.
RESUME_FIELDS = olmo3.MODEL_FIELDS + ("seq_len", "global_batch", "data_seed", "repetition_filter")
HISTORY = 128  # the spike guard's window (OLMo-core's rolling_interval_length)


# ----------------------------------------------------------------------------- the recipe

def schedule(cfg):
    """LR for the update whose optax count is `count` (0 for the first update). OLMo-core calls
    the first update step 1, so this is OLMo-core's CosWithWarmup / LinearWithWarmup at count + 1."""
    peak, warmup, total, floor = cfg.lr, cfg.warmup_steps, cfg.steps, cfg.lr * cfg.min_lr_ratio

    def lr(count):
        step = jnp.asarray(count, jnp.float32) + 1
        warm = peak * jnp.minimum(step, warmup) / max(warmup, 1)
        frac = jnp.clip((step - warmup) / max(total - warmup, 1), 0.0, 1.0)
        decay = (floor + (peak - floor) * (1 + jnp.cos(jnp.pi * frac)) / 2 if cfg.schedule == "cosine"
                 else peak - (peak - floor) * frac)
        return jnp.where(step < warmup, warm, decay)
    return lr


def optimizer(cfg):
    """Clip, Adam, decoupled weight decay (not on the embedding). The LR is applied in the step,
    from our own step counter, so a stage-2 run keeps Adam's moments but restarts the schedule."""
    no_decay = lambda params: {k: jax.tree.map(lambda _: k != "embed", v) for k, v in params.items()}
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.scale_by_adam(cfg.beta1, cfg.beta2, cfg.adam_eps),
                       optax.add_decayed_weights(cfg.weight_decay, mask=no_decay))


def spike_guard(history, step, loss, grad_norm):
    """OLMo-core's SkipStepOptimizer: skip when the loss or the grad norm is more than 6 standard
    deviations above its mean over the previous (up to) 128 steps; active from the 64th step.
    history: the last 128 losses and grad norms, a ring indexed by the step."""
    n = jnp.minimum(step, HISTORY)
    valid = jnp.arange(HISTORY) < n

    def too_high(values, x):
        mean = jnp.sum(jnp.where(valid, values, 0.0)) / jnp.maximum(n, 1)
        std = jnp.sqrt(jnp.sum(jnp.where(valid, (values - mean) ** 2, 0.0)) / jnp.maximum(n - 1, 1))
        return x - mean > 6 * std
    skip = (n + 1 >= HISTORY // 2) & (too_high(history["loss"], loss) | too_high(history["grad_norm"], grad_norm))
    new = {"loss": history["loss"].at[step % HISTORY].set(loss),
           "grad_norm": history["grad_norm"].at[step % HISTORY].set(grad_norm)}
    return skip, new


# ----------------------------------------------------------------------------- state and step

def accumulation(cfg, batch_shards: int) -> int:
    micro = cfg.micro_batch or cfg.global_batch
    if cfg.global_batch % micro or micro % batch_shards:
        raise SystemExit(f"error: global batch {cfg.global_batch} / micro batch {micro} / {batch_shards} "
                         f"data-parallel devices do not divide; pick sizes that are multiples of each other")
    return cfg.global_batch // micro


def abstract_state(cfg, mesh):
    """Shapes, dtypes and shardings of the whole training state, with nothing allocated."""
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=sh),
                          olmo3.param_specs(cfg), olmo3.shardings(cfg, mesh), is_leaf=olmo3.is_spec)
    replicated = NamedSharding(mesh, P())
    opt_shapes = jax.eval_shape(optimizer(cfg).init, params)
    opt_state = optax.tree_map_params(  # Adam's moments are sharded like the params they follow
        optimizer(cfg), lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=p.sharding),
        opt_shapes, params, transform_non_params=lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated))
    scalar = lambda dtype, shape=(): jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
    history = {"loss": scalar(jnp.float32, (HISTORY,)), "grad_norm": scalar(jnp.float32, (HISTORY,))}
    return {"params": params, "opt_state": opt_state, "step": scalar(jnp.int32), "history": history}


def shardings_of(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def init_state(cfg, mesh):
    """A fresh training state, every array created directly with its sharding."""
    target = abstract_state(cfg, mesh)

    def make(key):
        params = olmo3.init(cfg, key)
        history = {"loss": jnp.zeros(HISTORY), "grad_norm": jnp.zeros(HISTORY)}
        return {"params": params, "opt_state": optimizer(cfg).init(params), "step": jnp.int32(0), "history": history}
    return jax.jit(make, out_shardings=shardings_of(target))(jax.random.key(cfg.seed))


def split_micro(x, accum: int):
    """[global, ...] -> [accum, global/accum, ...] such that every micro-batch is spread over all
    data-parallel devices (row r goes to micro-batch r % accum)."""
    x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
    return olmo3.constrain(x, None, "batch", None)


def train_step(state, inputs, labels, cfg, accum):
    params = state["params"]
    n_tokens = jnp.maximum(jnp.sum(labels >= 0), 1)  # the loss is a mean over the whole global batch

    def loss(params, x, y):
        ce, z, _ = olmo3.loss_terms(olmo3.forward(params, x, cfg), y, cfg.z_loss)
        return (ce + z) / n_tokens, ce / n_tokens
    grad_fn = jax.value_and_grad(loss, has_aux=True)
    if accum == 1:
        (_, ce), grads = grad_fn(params, inputs, labels)
    else:
        def add_micro(carry, xy):
            (_, ce_i), g_i = grad_fn(params, *xy)
            return (jax.tree.map(jnp.add, carry[0], g_i), carry[1] + ce_i), None
        (grads, ce), _ = jax.lax.scan(add_micro, (jax.tree.map(jnp.zeros_like, params), 0.0),
                                      (split_micro(inputs, accum), split_micro(labels, accum)))
    grad_norm = optax.tree.norm(grads)
    skip, history = spike_guard(state["history"], state["step"], ce, grad_norm)
    skip = skip & cfg.spike_guard
    updates, opt_state = optimizer(cfg).update(grads, state["opt_state"], params)
    lr = schedule(cfg)(state["step"])
    new_params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(skip, b, a), new, old)
    new_state = {"params": keep(new_params, params), "opt_state": keep(opt_state, state["opt_state"]),
                 "step": state["step"] + 1, "history": history}
    return new_state, {"loss": ce, "grad_norm": grad_norm, "lr": lr, "skipped": skip}


def eval_step(params, inputs, labels, cfg, accum):
    """Summed cross-entropy and token count (no z-loss), micro-batched like training."""
    def one(carry, xy):
        ce, _, n = olmo3.loss_terms(olmo3.forward(params, *xy[:1], cfg), xy[1], 0.0)
        return (carry[0] + ce, carry[1] + n), None
    (ce, n), _ = jax.lax.scan(one, (0.0, 0), (split_micro(inputs, accum), split_micro(labels, accum)))
    return ce, n


def compile_steps(cfg, mesh, target):
    """The training step compiled ahead of time for the abstract state `target` (so a --dry-run
    compiles exactly what training runs), and the held-out evaluation, jitted."""
    accum = accumulation(cfg, mesh.shape["data"] * mesh.shape["fsdp"])
    batch = NamedSharding(mesh, P(("data", "fsdp"), None))
    tokens = jax.ShapeDtypeStruct((cfg.global_batch, cfg.seq_len), jnp.int32, sharding=batch)
    step = jax.jit(lambda s, x, y: train_step(s, x, y, cfg, accum), donate_argnums=0,
                   out_shardings=(shardings_of(target), None)).lower(target, tokens, tokens).compile()
    evaluate = jax.jit(lambda p, x, y: eval_step(p, x, y, cfg, accum))
    return step, evaluate, batch


# ----------------------------------------------------------------------------- checkpoints

def checkpoint_manager(run_dir: Path, cfg):
    import orbax.checkpoint as ocp
    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints, enable_async_checkpointing=True)
    return ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options)


def save(manager, state, cfg):
    import orbax.checkpoint as ocp
    step = int(state["step"])
    manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(state["params"]),
        train_state=ocp.args.StandardSave({k: state[k] for k in ("opt_state", "step", "history")}),
        config=ocp.args.JsonSave(dataclasses.asdict(cfg))))


def find_checkpoint(path: Path):
    """A converted checkpoint, a run directory or its checkpoints/ folder -> its CheckpointManager."""
    import orbax.checkpoint as ocp
    for d in (path / "checkpoints", path):
        if d.is_dir():
            manager = ocp.CheckpointManager(d.absolute(), options=ocp.CheckpointManagerOptions(create=False))
            if manager.latest_step() is not None:
                return manager
    raise SystemExit(f"error: no complete checkpoint in {path}; pass a run directory or a converted checkpoint")


class Unreadable(SystemExit):
    """A checkpoint that exists but cannot be read: files missing or truncated, or another format."""


def restore(path: Path, target, cfg, with_optimizer: bool, fields=olmo3.MODEL_FIELDS, step=None):
    """Restore params (and the optimizer state, step and spike history) of the latest (or the
    given) step from `path` directly onto the shardings in `target`, whatever mesh wrote it."""
    import orbax.checkpoint as ocp
    manager = find_checkpoint(path)
    step, directory = manager.latest_step() if step is None else step, manager.directory
    try:
        saved = olmo3.Config(**manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"])
        check_compatible(saved, cfg, path, fields)
        items = {"params": ocp.args.StandardRestore(target["params"])}
        has_optimizer = "train_state" in (manager.item_metadata(step) or {})
        if with_optimizer and has_optimizer:
            items["train_state"] = ocp.args.StandardRestore({k: target[k] for k in ("opt_state", "step", "history")})
        restored = manager.restore(step, args=ocp.args.Composite(**items))
    except jax.errors.JaxRuntimeError:
        raise  # a failing device, not a bad file
    except Exception as e:  # orbax and tensorstore raise many kinds, some plain Exception
        raise Unreadable(f"error: checkpoint {directory}/{step} could not be read ({str(e).splitlines()[0][:200]}); "
                         f"it may be incomplete or from another config")
    return restored, step, has_optimizer


def resume(manager, run_dir: Path, target, cfg, log):
    """The state in the newest readable checkpoint of this run. Unreadable newer ones are reported
    and renamed <step>.unreadable; with none readable, stop rather than start again from scratch."""
    bad = []
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            restored, _, _ = restore(run_dir, target, cfg, True, RESUME_FIELDS, step)
        except Unreadable as e:
            log(f"{e}; trying the one before")
            bad.append(step)
            continue
        for b in bad if jax.process_index() == 0 else ():
            (manager.directory / str(b)).rename(manager.directory / f"{b}.unreadable")
        multihost_utils.sync_global_devices("unreadable checkpoints renamed")
        manager.reload()
        return {"params": restored["params"], **restored["train_state"]}
    raise SystemExit(f"error: no checkpoint in {manager.directory} can be read (steps {sorted(bad)}, see above); "
                     f"restore one from a copy, or move them away to start this run from scratch")


def check_compatible(saved, cfg, where, fields):
    diff = [f"{f}={getattr(saved, f)!r} (command line: {getattr(cfg, f)!r})"
            for f in fields if getattr(saved, f) != getattr(cfg, f)]
    if diff:
        raise SystemExit(f"error: checkpoint in {where} has {', '.join(diff)}; use a new --out, or the settings it was made with")


# ----------------------------------------------------------------------------- logging

PEAK_TFLOPS = [  # dense bf16 TFLOP/s per JAX device (Ironwood has two devices per chip)
    ("v5 lite", 197), ("v5e", 197), ("v5p", 459), ("v5", 459), ("v6 lite", 918), ("v6e", 918), ("7x", 2307 / 2),
    ("ironwood", 2307 / 2), ("v4", 275), ("h100", 989), ("h200", 989), ("a100", 312)]


def peak_tflops(device):
    kind = device.device_kind.lower()
    return next((tflops for name, tflops in PEAK_TFLOPS if name in kind), None) if device.platform != "cpu" else None


def fmt_time(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class Log:
    """Console lines and metrics.jsonl (written only by process 0)."""
    def __init__(self, run_dir: Path, lead: bool):
        self.lead = lead
        self.file = open(run_dir / "metrics.jsonl", "a") if lead else None

    def __call__(self, text=None, **record):
        if self.lead and text:
            print(text, flush=True)
        if self.lead and record:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()


def plot(run_dir: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = sorted({r["step"]: r["loss"] for r in records if "loss" in r}.items())
    held = sorted({r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}.items())
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if held:
        ax.plot(*zip(*held), "o-", label="held-out")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=f"{run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(run_dir / "loss.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


# ----------------------------------------------------------------------------- sampling

def sample(params, cfg, prompts, tokenizer, n_new=64, temperature=0.0, seed=0):
    """Continue each prompt by n_new tokens (greedy at temperature 0). Recomputes the whole window
    per token: slow for long outputs, but it is the training forward pass, nothing new."""
    S = cfg.seq_len
    tokens = np.full((len(prompts), S), tokenizer.eos_id, np.int32)
    lengths = [len(p) for p in prompts]
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    next_logits = jax.jit(lambda p, t, pos: olmo3.forward(p, t, cfg)[jnp.arange(t.shape[0]), pos, :cfg.vocab_size])
    key = jax.random.key(seed)
    for _ in range(n_new):
        pos = np.minimum(np.array(lengths) - 1, S - 1)
        logits = next_logits(params, tokens, pos)
        key, sub = jax.random.split(key)
        nxt = np.asarray(jnp.argmax(logits, -1) if temperature == 0 else
                         jax.random.categorical(sub, logits / temperature))
        for i in range(len(prompts)):
            if lengths[i] < S:
                tokens[i, lengths[i]] = nxt[i]
                lengths[i] += 1
    return [tokenizer.decode(tokens[i, len(p):lengths[i]].tolist()) for i, p in enumerate(prompts)]


# ----------------------------------------------------------------------------- command line

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(olmo3.PRESETS))
    ap.add_argument("--stage2", action="store_true", help="OLMo 3 stage 2: linear decay to 0, no warmup")
    ap.add_argument("--out", help="run directory (default runs/PRESET); resumes if it holds a checkpoint")
    ap.add_argument("--data", help="stdlib, shakespeare, a mix file, a token-file glob or a tokenize output dir")
    ap.add_argument("--eval-data", help="held-out source (named corpora bring their own split)")
    ap.add_argument("--init-from", help="start from a converted or training checkpoint (with its Adam moments when present)")
    ap.add_argument("--mesh", default="fsdp=-1", help="data=N,fsdp=N,tensor=N (one may be -1: the rest)")
    ap.add_argument("--samples", type=int, default=3, help="prompts to continue at the end")
    ap.add_argument("--stop-at", type=int, help="checkpoint and exit after this step, as if preempted")
    ap.add_argument("--max-retries", type=int, default=3, help="failed steps to recover from in-process")
    ap.add_argument("--inject-faults", help="fail these steps, for tests and demos: 5,12:2 (at 12, keep 2 devices)")
    ap.add_argument("--dry-run", action="store_true", help="compile the training step, print memory per device, exit")
    ap.add_argument("--devices", type=int, help="use N fake CPU devices (with --dry-run: plan a pod on a laptop)")
    ap.add_argument("--topology", help="--dry-run for a TPU slice (v5p:4x4x4 = 64 chips), by the TPU compiler (libtpu)")
    ap.add_argument("--coordinator", help="host:port of process 0, for multi-host runs without auto-detection")
    ap.add_argument("--num-processes", type=int)
    ap.add_argument("--process-id", type=int)
    ap.add_argument("--distributed", action="store_true", help="jax.distributed.initialize() (TPU pods, SLURM)")
    for field in dataclasses.fields(olmo3.Config):
        ap.add_argument("--" + field.name.replace("_", "-"), dest="cfg_" + field.name, metavar=field.type.upper()
                        if isinstance(field.type, str) else field.type.__name__.upper())
    args = ap.parse_args(argv)
    cfg = olmo3.PRESETS[args.preset]
    if args.stage2:
        cfg = dataclasses.replace(cfg, **olmo3.STAGE2)
    overrides = {}
    for field in dataclasses.fields(olmo3.Config):
        value = getattr(args, "cfg_" + field.name)
        if value is not None:
            kind = type(getattr(cfg, field.name))
            try:
                overrides[field.name] = ({"true": True, "false": False, "1": True, "0": False}[value.lower()]
                                         if kind is bool else kind(value))
            except (ValueError, KeyError):
                raise SystemExit(f"error: --{field.name.replace('_', '-')} {value!r} is not a {kind.__name__}")
    return dataclasses.replace(cfg, **overrides), args


def parse_mesh(text):
    """"data=2,fsdp=-1" -> {"data": 2, "fsdp": -1, "tensor": 1}; axes not named have size 1."""
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name not in olmo3.MESH_AXES or not value.lstrip("-").isdigit():
            raise SystemExit(f"error: --mesh {text!r}: expected data=N,fsdp=N,tensor=N (N a number or -1)")
        sizes[name] = int(value)
    return sizes


def data_sources(cfg, args):
    """(train source, held-out source or None) as token file lists."""
    name = args.data or ("stdlib" if cfg.tokenizer == "bytes" else None)
    if name is None:
        raise SystemExit(f"error: --data is required for tokenizer {cfg.tokenizer!r}: a mix file, token files, "
                         f"or a folder from `python data.py tokenize` (or --data shakespeare)")
    if name in ("stdlib", "shakespeare"):
        train_files, heldout = data.corpus(name, cfg.tokenizer)
    else:
        split = Path(name) / "heldout.txt"  # written beside train.txt by `data.py tokenize --heldout`
        train_files = data.resolve_source(name, cfg.tokenizer)
        heldout = data.resolve_source(split, cfg.tokenizer) if split.exists() else None
    if args.eval_data:
        heldout = data.resolve_source(args.eval_data, cfg.tokenizer)
    return train_files, heldout


def check_fits(cfg, mesh):
    """Fail in a second, not after minutes of swapping, when the weights, Adam moments and
    gradients (16 bytes per parameter, activations not counted) cannot fit the devices."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    per_device = stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / mesh.size
    need = 16 * olmo3.param_count(cfg) / mesh.size
    if need > per_device:
        raise SystemExit(f"error: this {olmo3.param_count(cfg) / 1e9:.1f}B-parameter model needs {need / 2**30:.0f} GiB per device for weights, "
                         f"Adam moments and gradients, but {device.platform} devices here have {per_device / 2**30:.0f} GiB; "
                         f"use more devices (see --dry-run) or a smaller preset")


def evaluate(params, loader, evaluate_fn, batch_sharding, cfg):
    """Held-out cross-entropy over the first eval_batches batches, read back once at the end."""
    sums = [evaluate_fn(params, *(global_array(x, batch_sharding) for x in loader.batch(i)))
            for i in range(min(cfg.eval_batches, loader.steps_per_epoch))]
    ce, n = (float(sum(values)) for values in zip(*sums))
    return ce / max(n, 1)


def global_array(local, sharding):
    """This process's rows of the global batch -> one global array over every device."""
    return jax.make_array_from_process_local_data(sharding, local)


ACCELERATORS = (("TPU v5p", 95), ("Ironwood", 96), ("H100", 80), ("H200", 141))  # GiB per JAX device
# (Ironwood: 192 GiB per chip, which JAX sees as two devices)


def dry_run(cfg, mesh):
    """Compile the real training step for `mesh` on abstract arrays (nothing is allocated) and print
    what one device needs. The memory is this backend's buffer assignment (CPU when planning on fake
    devices); TPU and GPU compilers fuse and schedule differently, so read it as an estimate."""
    t, target = time.time(), abstract_state(cfg, mesh)
    with jax.set_mesh(mesh):
        step, _, _ = compile_steps(cfg, mesh, target)
    m = step.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    micro, gib = cfg.micro_batch or cfg.global_batch, lambda b: f"{b / 2**30:.2f} GiB"
    flops = [olmo3.flops_per_token(cfg, cfg.seq_len, windows) / 1e9 for windows in (True, False)]
    print(f"dry run: {mesh.size} x {mesh.devices.flat[0].device_kind} {dict(mesh.shape)} | batch {cfg.global_batch} x "
          f"{cfg.seq_len} in {cfg.global_batch // micro} micro-batches of {micro * mesh.shape['tensor'] // mesh.size} "
          f"per device | remat {cfg.remat} | compiled in {time.time() - t:.0f}s\n{olmo3.param_count(cfg):,} parameters"
          f" | training FLOPs/token {flops[0]:.4g}G with sliding windows, {flops[1]:.4g}G counting all layers full\n"
          f"per device: arguments {gib(m.argument_size_in_bytes)}, temporaries {gib(m.temp_size_in_bytes)}, outputs "
          f"{gib(m.output_size_in_bytes - m.alias_size_in_bytes)} (beyond the donated state), total {gib(total)}\n"
          + " | ".join(f"{name} {cap} GiB: {'fits' if total <= cap * 2**30 else 'does NOT fit'}" for name, cap in ACCELERATORS))
    return m


class StepFailed(Exception):
    """A training step failed; `devices`: how many remain usable, when known (an injected loss)."""
    def __init__(self, step, cause, devices=None):
        super().__init__(f"step {step} failed ({cause})")
        self.step, self.devices = step, devices


def parse_faults(text):
    """--inject-faults "5,12:2,20" -> [(5, None), (12, 2), (20, None)]: fail at step 5; at step 12,
    leaving 2 usable devices; at step 20. Each fires once (a step listed twice fails twice)."""
    try:
        return sorted(((int(k), int(n) if n else None) for k, _, n in (f.partition(":") for f in text.split(","))),
                      key=lambda f: f[0]) if text else []
    except ValueError:
        raise SystemExit(f"error: --inject-faults {text!r}: expected STEP or STEP:DEVICES, comma-separated (5,12:2,20)")


def usable_devices(devices):
    """The devices that still run a trivial computation."""
    usable = []
    for device in devices:
        with contextlib.suppress(jax.errors.JaxRuntimeError):
            usable.append(jax.device_put(1, device).block_until_ready().device)
    return usable


def recovery_mesh(sizes, devices):
    """The requested mesh on the devices left or, when it no longer fits them, fsdp over all of them."""
    try:
        return olmo3.make_mesh(**sizes, devices=devices)
    except SystemExit:
        return olmo3.make_mesh(data=1, fsdp=-1, tensor=sizes["tensor"], devices=devices)


def main(argv=None):
    cfg, args = parse_args(argv)
    if args.devices:  # fake CPU devices; only takes effect before JAX first lists its devices
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
    if args.coordinator or args.distributed:
        if jax.config.jax_platforms in (None, "", "cpu"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    sizes = parse_mesh(args.mesh)
    if args.dry_run:  # on this machine's devices, fake CPU ones (--devices) or a TPU topology's (needs libtpu)
        devices = args.topology and topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
        return dry_run(cfg, olmo3.make_mesh(**sizes, devices=devices or None))
    run_dir, devices = Path(args.out or f"runs/{args.preset}"), jax.devices()
    mesh, faults, failed, recovery = olmo3.make_mesh(**sizes), parse_faults(args.inject_faults), [], None
    while True:  # the elastic retry: a failed step restarts training from the last checkpoint
        try:
            return run(cfg, args, run_dir, mesh, faults, recovery)
        except StepFailed as e:
            rerun = f"rerun the same command to resume from the last checkpoint in {run_dir}/checkpoints"
            if jax.process_count() > 1:  # other hosts cannot be rebuilt from here
                raise SystemExit(f"error: {e} on a multi-host run; {rerun} (with a new --mesh if hosts are gone)")
            again = failed[-1:] == [e.step]
            if again or len(failed) == args.max_retries:
                why = "again at the same step" if again else f"failure {len(failed) + 1}, --max-retries {args.max_retries}"
                raise SystemExit(f"error: {e}, {why}; stopped: {rerun}")
            failed.append(e.step)
            devices = devices[:e.devices] if e.devices else usable_devices(devices)  # lost ones stay lost
            mesh, recovery = recovery_mesh(sizes, devices), (e.step, time.time())
            print(f"{e}; recovering on {mesh.size} devices (retry {len(failed)} of {args.max_retries})", flush=True)
        jax.clear_caches()  # the programs compiled for the old mesh; the old state was freed with `e`


def run(cfg, args, run_dir, mesh, faults, recovery=None):
    """Train on `mesh` from the last checkpoint (or the start) to the end. A failing step raises
    StepFailed. recovery: (failed step, when) if this run recovers from a failure."""
    check_fits(cfg, mesh)
    tokenizer = data.get_tokenizer(cfg.tokenizer)
    train_files, heldout = data_sources(cfg, args)
    rank, world = jax.process_index(), jax.process_count()
    loader = data.Loader(train_files, cfg.seq_len, cfg.global_batch, cfg.data_seed, rank, world,
                         cfg.repetition_filter, cfg.vocab_size)
    eval_loader = heldout and data.Loader(heldout, cfg.seq_len, cfg.global_batch, cfg.data_seed, rank, world,
                                          False, cfg.vocab_size)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = abstract_state(cfg, mesh)
    manager = checkpoint_manager(run_dir, cfg)
    log = Log(run_dir, lead=rank == 0)
    with jax.set_mesh(mesh):
        if manager.latest_step() is not None:
            state = resume(manager, run_dir, target, cfg, log)
            note = f"resumed from step {int(state['step'])}"
        else:
            state = init_state(cfg, mesh)
            note = "fresh start"
            if args.init_from:
                restored, from_step, has_opt = restore(Path(args.init_from), target, cfg, with_optimizer=True)
                state["params"] = restored["params"]
                if has_opt:  # "warm Adam": the moments carry over, the schedule starts again
                    state["opt_state"] = restored["train_state"]["opt_state"]
                note = f"weights{' and Adam moments' if has_opt else ''} from {args.init_from} (step {from_step})"
        step_fn, evaluate_fn, batch_sharding = compile_steps(cfg, mesh, target)
        start = int(state["step"])
        if recovery:
            lost, took = recovery[0] - 1 - start, time.time() - recovery[1]
            note = f"recovered in {took:.1f}s (restore and compile), {lost} steps to redo from step {start}"
            log(step=start, recovered_from=recovery[0], steps_lost=lost, recovery_s=took, devices=mesh.size)
        flops = olmo3.flops_per_token(cfg, cfg.seq_len)
        peak = peak_tflops(mesh.devices.flat[0])
        tokens_per_step = cfg.global_batch * cfg.seq_len
        log(f"olmo3-jax | preset {args.preset} | {olmo3.param_count(cfg) / 1e6:,.1f}M params | "
            f"{mesh.size} x {mesh.devices.flat[0].device_kind} {dict(mesh.shape)} | {note}\n"
            f"data: {loader.num_instances:,} sequences of {cfg.seq_len} ({loader.steps_per_epoch} steps/epoch), held-out: "
            f"{f'{eval_loader.num_instances:,} sequences' if eval_loader else 'none (--eval-data)'}, "
            f"{tokens_per_step:,} tokens/step | steps {start} -> {cfg.steps} | run dir {run_dir}")

        skipped, t_log, step_log, t_start = 0, None, start, time.time()

        def report(step, metrics):
            nonlocal skipped, t_log, step_log
            m = {k: v.item() for k, v in jax.device_get(metrics).items()}
            if not math.isfinite(m["loss"]):
                manager.wait_until_finished()
                last = manager.latest_step()
                kept = (f"The last good checkpoint (step {last}) is in {run_dir}/checkpoints" if last is not None
                        else "No checkpoint was written yet")
                raise SystemExit(f"error: loss is {m['loss']} at step {step}; stopped. {kept}: lower --lr or "
                                 f"check the data, then rerun the same command to resume")
            skipped += m["skipped"]
            if step % cfg.log_every and step != cfg.steps:
                return
            now = time.time()  # the first step includes compilation: the rate is measured from there
            rate = (step - step_log) * tokens_per_step / (now - t_log) if t_log else None
            t_log, step_log = now, step
            tflops = rate * flops / mesh.size / 1e12 if rate else None
            eta = (cfg.steps - step) * tokens_per_step / rate if rate else None
            log(f"step {step:>6}/{cfg.steps} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | grad norm {m['grad_norm']:.3f}"
                f" | {f'{rate:,.0f}' if rate else '-'} tok/s | {f'{tflops:.2f}' if tflops else '-'} TFLOP/s/device"
                f" | MFU {f'{100 * tflops / peak:.1f}%' if tflops and peak else 'n/a'}"
                f" | skipped {skipped} | ETA {fmt_time(eta) if eta else '-'}",
                step=step, loss=m["loss"], lr=m["lr"], grad_norm=m["grad_norm"], tokens_per_s=rate,
                skipped=skipped, time=now - t_start)

        def run_eval(step):
            loss = evaluate(state["params"], eval_loader, evaluate_fn, batch_sharding, cfg)
            log(f"step {step:>6}/{cfg.steps} | held-out loss {loss:.4f} | perplexity {math.exp(min(loss, 50)):.2f}",
                step=step, eval_loss=loss, eval_ppl=math.exp(min(loss, 50)))
            return loss

        pending, eval_loss, batches = None, None, loader.iterate(start, cfg.steps)
        try:
            for step, inputs, labels in batches:
                if faults and faults[0][0] == step + 1:
                    raise StepFailed(step + 1, "fault injected by --inject-faults", faults.pop(0)[1])
                state, metrics = step_fn(state, global_array(inputs, batch_sharding), global_array(labels, batch_sharding))
                if pending:
                    report(*pending)  # the previous step's numbers: reading them does not stall this step
                pending, done = (step + 1, metrics), step + 1
                stop = done == args.stop_at
                if done % cfg.save_every == 0 or done == cfg.steps or stop:
                    report(*pending)  # never checkpoint a state whose loss was not checked
                    pending = None
                    save(manager, state, cfg)
                if eval_loader and (done % cfg.eval_every == 0 or done == cfg.steps):
                    eval_loss = run_eval(done)
                if stop:
                    manager.wait_until_finished()
                    return log(f"stopped after step {done} (--stop-at); the same command without it resumes")
            if pending:
                report(*pending)
        except jax.errors.JaxRuntimeError as e:
            raise StepFailed(step + 1, str(e).splitlines()[0][:200]) from e
        finally:
            batches.close()  # stops the loader's thread
            manager.close()  # after the save in flight, if any, has completed
        if eval_loader and eval_loss is None:
            eval_loss = run_eval(int(state["step"]))
        if args.samples:  # every process takes part (the weights may span hosts); process 0 prints
            # the same prompts on every process: whole rows of the first batch, not this rank's slice
            first = data.Loader(heldout or train_files, cfg.seq_len, cfg.global_batch, cfg.data_seed).batch(0)[0]
            prompt_len = min(32, cfg.seq_len // 4)
            prompts = [row[:prompt_len].tolist() for row in first[:args.samples]]
            n_new = min(128, cfg.seq_len - prompt_len)
            for temperature in (0.0, 0.8):
                for prompt, text in zip(prompts, sample(state["params"], cfg, prompts, tokenizer, n_new, temperature)):
                    log(f"--- sample (temperature {temperature}) ---\n{tokenizer.decode(prompt)}>>>{text}")
        if rank == 0:
            plot(run_dir)
        log(f"done: step {int(state['step'])} in {fmt_time(time.time() - t_start)}"
            + (f" | held-out loss {eval_loss:.4f}" if eval_loss is not None else "") + f" | plot {run_dir / 'loss.png'}")


if __name__ == "__main__":
    main()
