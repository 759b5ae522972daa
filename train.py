"""Train OLMo 3: python train.py --preset tiny (CPU, minutes) or --preset 7b --data MIX (a pod).

Every field of olmo3.Config and train.Recipe is a flag (--lr 1e-3). Rerunning a command resumes
its run, on any mesh. A run stopped before its last step checkpoints and exits with code 75."""
# Read `train` first: setup, then the loop. The recipe, the step and the checkpoints come
# before it; reporting and the command line after.
#
# Step numbers, defined once. `step` is the number of updates done so far: the state's counter.
# The batch it trains on next is loader.batch(step), and that update is number step + 1, which is
# OLMo-core's 1-based `global_step` and the number logged, checkpointed and compared with
# recipe.steps. The batch for a step is a pure function of the step, so a resume needs no loader
# state and replays exactly.
import argparse
import dataclasses
import datetime
import functools
import importlib.util
import io
import json
import logging
import math
import os
import signal
import time
from dataclasses import asdict

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

import data
import olmo3

logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes, on every save and restore
EXIT_STOPPED = 75  # checkpointed before the last step: rerun to resume (EX_TEMPFAIL)
HISTORY = 128  # the spike guard's window (OLMo-core's rolling_interval_length)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How OLMo 3 7B was trained: stage 1 (OLMo-core's OLMo-3-1025-7B-pretrain-1.py)."""
    seq_len: int = 8192
    global_batch: int = 512            # sequences per optimizer step
    micro_batch: int = 0               # sequences per forward/backward; 0 = the whole batch
    steps: int = 1_413_814             # one epoch of the mix, ~5.93T tokens
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
    log_every: int = 10
    eval_every: int = 1000
    eval_limit: int = 500              # documents per perplexity set and per task; 0: all
    save_every: int = 1000
    keep_checkpoints: int = 3


RECIPES = {
    "tiny": Recipe(seq_len=256, global_batch=16, steps=500, lr=3e-3, warmup_steps=50,
                   log_every=25, eval_every=100, save_every=100),
    "1b": Recipe(seq_len=4096, global_batch=64, micro_batch=8, lr=4e-4),
    # A micro-batch of 64 fits v5p-128 (39 GiB a device) and v5p-64 (80 of 95 GiB; README);
    # a save every 250 steps is about an hour on v5p-128, as Cloud TPU advises
    "7b": Recipe(schedule="olmo3", micro_batch=64, save_every=250),
    "7b-wide": Recipe(schedule="olmo3", micro_batch=64, save_every=250),
    # Stage 3's shape, to evaluate and generate with AI2's released model (training it needs
    # OLMo-core's document packing with intra-document masking, which is not here).
    "7b-long": Recipe(seq_len=65536, global_batch=64, lr=2.0712e-4, warmup_steps=200,
                      schedule="linear", min_lr_ratio=0.0, steps=11_921),
}
# Stage 2 (OLMo-3-1025-7B-midtrain.py) starts from stage 1's weights *and* Adam moments ("warm
# Adam", --init-from) with a fresh schedule, decaying linearly to 0, and another data seed.
STAGE2 = dict(global_batch=256, lr=2.0712e-4, warmup_steps=0, schedule="linear",
              min_lr_ratio=0.0, steps=47_684, data_seed=1337)
DATA_ORDER = ("seq_len", "global_batch", "data_seed")  # a resumed run must keep them
CHOICES = {"schedule": ("cosine", "linear", "olmo3"), "attention": olmo3.ATTENTION,
           "compute_dtype": ("float32", "bfloat16"), "tokenizer": ("dolma2", "bytes")}


# ----------------------------------------------------------------------------- the recipe

def schedule(r: Recipe):
    """count (updates done) -> the LR of the next update, OLMo-core's update number count + 1."""
    peak, floor, warmup = r.lr, r.lr * r.min_lr_ratio, r.warmup_steps
    cosine = functools.partial(optax.warmup_cosine_decay_schedule, 0.0, peak, warmup,
                               end_value=floor)  # OLMo-core's CosWithWarmup
    lr = cosine(max(r.steps, warmup + 1))
    if r.schedule == "linear":  # OLMo-core's LinearWithWarmup
        lr = optax.join_schedules([optax.linear_schedule(0.0, peak, warmup),
                                   optax.linear_schedule(peak, floor, max(r.steps - warmup, 1))],
                                  [warmup])
    if r.schedule == "olmo3":
        # Stage 1 as AI2 ran it (OLMo-3-1025-7B-pretrain-1.py, then -2.py from the checkpoint of
        # step 596,047): CosWithWarmup aimed at 5T tokens, then HalfCosWithWarmup aimed at 7T, a
        # "warmup" to half the peak, then the second half of a cosine. t_max is the token budget
        # over the tokens per step, rounded up; the second warmup is -2.py's arithmetic.
        tokens = r.global_batch * r.seq_len
        t_max1, t_max2 = -(-int(5e12) // tokens), -(-int(7e12) // tokens)
        warmup2 = int(5e12) // tokens // 2 + warmup // 2
        half = optax.cosine_decay_schedule(peak, 2 * (t_max2 - warmup2), floor / peak)
        part2 = optax.join_schedules([optax.linear_schedule(0.0, (peak + floor) / 2, warmup2),
                                      lambda k: half(k + t_max2 - warmup2)], [warmup2])
        lr = optax.join_schedules([cosine(t_max1), lambda k: part2(k + 596_048)], [596_048])
    return lambda count: lr(count + 1)


def optimizer(r: Recipe):
    # Clip, Adam, and decoupled weight decay on all but the embedding: OLMo-core decays the norms
    # and lm_head too. The LR is applied in train_step, from the state's own step counter.
    decayed = lambda params: {k: jax.tree.map(lambda _: k != "embed", v) for k, v in params.items()}
    return optax.chain(optax.clip_by_global_norm(r.grad_clip),
                       optax.scale_by_adam(r.beta1, r.beta2, r.adam_eps),
                       optax.add_decayed_weights(r.weight_decay, mask=decayed))


def spike_guard(history, step, values):
    """OLMo-core's SkipStepOptimizer: values [loss, grad norm] -> (is each a spike, history)."""
    # A spike: more than 6 std above the mean of the previous (up to) 128 values, once 64 exist.
    # history [2, 128] holds the last 128 losses and grad norms, a ring indexed by the step.
    n, valid = jnp.minimum(step, HISTORY), jnp.arange(HISTORY) < step
    mean = jnp.sum(jnp.where(valid, history, 0.0), -1, keepdims=True) / jnp.maximum(n, 1)
    var = jnp.sum(jnp.where(valid, (history - mean) ** 2, 0.0), -1) / jnp.maximum(n - 1, 1)
    spikes = (n + 1 >= HISTORY // 2) & (values - mean[:, 0] > 6 * jnp.sqrt(var))
    return spikes, history.at[:, step % HISTORY].set(values)


# ----------------------------------------------------------------------------- state and step

def abstract_state(cfg, r, mesh):
    """Shapes, dtypes and shardings of the whole training state, with nothing allocated."""
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=sh),
                          olmo3.param_specs(cfg), olmo3.shardings(cfg, mesh), is_leaf=olmo3.is_spec)
    replicated = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P()))
    opt_state = optax.tree_map_params(  # Adam's moments are sharded like the params they follow
        optimizer(r), lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=p.sharding),
        jax.eval_shape(optimizer(r).init, params), params, transform_non_params=replicated)
    return {"params": params, "opt_state": opt_state,
            "step": replicated(jax.ShapeDtypeStruct((), jnp.int32)),
            "history": replicated(jax.ShapeDtypeStruct((2, HISTORY), jnp.float32))}


def shardings_of(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def init_state(cfg, r, target):  # every array created directly with target's sharding
    def make(key):
        params = olmo3.init(cfg, key)
        return {"params": params, "opt_state": optimizer(r).init(params), "step": jnp.int32(0),
                "history": jnp.zeros((2, HISTORY))}
    return jax.jit(make, out_shardings=shardings_of(target))(jax.random.key(r.seed))


def train_step(state, inputs, labels, cfg, r, accum):
    """One update on a global batch [global_batch, seq_len], in `accum` micro-batches."""
    params = state["params"]
    n_tokens = jnp.maximum(jnp.sum(labels >= 0), 1)  # the loss is a mean over the whole batch

    def loss(params, x, y):
        ce, z, _ = olmo3.loss_terms(olmo3.forward(params, x, cfg), y, r.z_loss)
        return (ce + z) / n_tokens, ce / n_tokens
    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def add_micro(carry, xy):
        (_, ce), grads = grad_fn(params, *xy)
        return (jax.tree.map(jnp.add, carry[0], grads), carry[1] + ce), None
    if accum == 1:
        (_, ce), grads = grad_fn(params, inputs, labels)
    else:
        zeros = (jax.tree.map(jnp.zeros_like, params), 0.0)
        micro = (split_micro(inputs, accum), split_micro(labels, accum))
        (grads, ce), _ = jax.lax.scan(add_micro, zeros, micro)
    grad_norm = optax.tree.norm(grads)
    spikes, history = spike_guard(state["history"], state["step"], jnp.stack([ce, grad_norm]))
    skip = spikes.any() & r.spike_guard
    updates, opt_state = optimizer(r).update(grads, state["opt_state"], params)
    lr = schedule(r)(state["step"])
    new_params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
    new = {"params": new_params, "opt_state": opt_state}  # a skipped update keeps the old ones
    new = jax.tree.map(lambda a, b: jnp.where(skip, b, a), new, {k: state[k] for k in new})
    metrics = {"loss": ce, "grad_norm": grad_norm, "lr": lr, "skipped": skip, "spikes": spikes}
    return new | {"step": state["step"] + 1, "history": history}, metrics


def split_micro(x, accum: int):
    # [global, ...] -> [accum, global/accum, ...], row r in micro-batch r % accum, so that every
    # micro-batch is spread over all the data-parallel devices
    x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
    return olmo3.constrain(x, None, "batch", "seq")


def compile_step(cfg, r, mesh, target):  # ahead of time: --dry-run compiles the same step
    micro = r.micro_batch if r.micro_batch else r.global_batch
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    if r.global_batch % micro or micro % dp:
        raise SystemExit(f"error: global batch {r.global_batch} / micro batch {micro} / {dp} "
                         "data-parallel devices do not divide; pick multiples of each other")
    tokens = jax.ShapeDtypeStruct((r.global_batch, r.seq_len), jnp.int32,
                                  sharding=olmo3.batch_sharding(mesh))
    step = jax.jit(lambda s, x, y: train_step(s, x, y, cfg, r, r.global_batch // micro),
                   donate_argnums=0, out_shardings=(shardings_of(target), None))
    return step.lower(target, tokens, tokens).compile()


# ----------------------------------------------------------------------------- checkpoints
# Orbax saves asynchronously under a temporary name and commits a step atomically (a rename, or
# a commit file on gs://); only committed steps are listed, so a kill -9 at any moment loses only
# the steps since the last commit. A step holds params, train_state and config.

def checkpoints(directory, keep=None):
    path = directory if "://" in directory else os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=keep is not None)
    return ocp.CheckpointManager(path, options=options)


def latest_checkpoint(path):  # of a run directory, or of a converted checkpoint
    for directory in (f"{path}/checkpoints", path):
        step = checkpoints(directory).latest_step() if epath.Path(directory).exists() else None
        if step is not None:
            return epath.Path(directory) / str(step)
    raise SystemExit(f"error: no checkpoint in {path}; pass a run directory or a converted one")


def save(manager, step, state, cfg, r):
    manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(state["params"]),
        train_state=ocp.args.StandardSave({k: state[k] for k in ("opt_state", "step", "history")}),
        config=ocp.args.JsonSave({"model": asdict(cfg), "recipe": asdict(r)})))


def saved_config(step_dir):
    saved = ocp.JsonCheckpointHandler().restore(epath.Path(step_dir) / "config")
    return olmo3.Config(**saved["model"]), saved.get("recipe")


def restore(step_dir, target, cfg, r=None):
    # The state in a checkpoint step (the params, and the rest if target has it) on target's
    # shardings, whatever mesh wrote it; the model (and with a recipe, the data order) must match.
    saved, recipe = saved_config(step_dir)
    pairs = [(f, getattr(saved, f), v) for f, v in vars(cfg).items() if f not in olmo3.NUMERICS]
    pairs += [(f, recipe[f], getattr(r, f)) for f in DATA_ORDER if r]
    diff = [f"{k}={a!r} (command line: {b!r})" for k, a, b in pairs if a != b]
    if diff:
        raise SystemExit(f"error: checkpoint {step_dir} has {', '.join(diff)}; use a new --out, "
                         "or the settings it was made with")
    handler = ocp.StandardCheckpointHandler()
    state = {"params": handler.restore(step_dir / "params",
                                       args=ocp.args.StandardRestore(target["params"]))}
    if "opt_state" in target and (step_dir / "train_state").exists():
        rest = {k: target[k] for k in ("opt_state", "step", "history")}
        state |= handler.restore(step_dir / "train_state", args=ocp.args.StandardRestore(rest))
    return state


def resume(manager, target, cfg, r, log):
    # The state in the newest checkpoint that every process can read. Each process reads it
    # itself (Orbax's own restore would wait at a barrier for one that failed), retrying
    # transient errors; an all-gather then decides for all. A step some process cannot read is
    # renamed <step>.unreadable and the one before is tried.
    for step in sorted(manager.all_steps(), reverse=True):
        step_dir = manager.directory / str(step)
        state = read_retrying(lambda: restore(step_dir, target, cfg, r), step_dir)
        read = multihost_utils.process_allgather(np.int32(state is not None))
        if read.all():
            return state
        failed = np.flatnonzero(read == 0).tolist()
        log(f"checkpoint {step} is unreadable on process(es) {failed}: renamed {step}.unreadable")
        if jax.process_index() == 0:
            step_dir.rename(manager.directory / f"{step}.unreadable")
        multihost_utils.sync_global_devices("unreadable checkpoint renamed")
        manager.reload()
    raise SystemExit(f"error: no checkpoint in {manager.directory} can be read (see above); "
                     "restore one from a copy, or move them away to start again")


def read_retrying(read, step_dir, tries=4):  # None if reading keeps failing
    for attempt in range(tries):
        try:
            return read()
        except (SystemExit, jax.errors.JaxRuntimeError):
            raise  # settings that do not match, or a failing device: not the files
        except Exception as e:  # orbax and tensorstore raise many kinds, some plain Exception
            wait, why = 2 ** attempt if attempt + 1 < tries else 0, str(e).splitlines()[0][:200]
            print(f"process {jax.process_index()}: reading {step_dir}: {why}; retry in {wait}s")
            time.sleep(wait)


# ----------------------------------------------------------------------------- the run

def train(cfg, r, args, mesh, manager):
    """Setup, then the loop: step, log, evaluate, save. Returns the exit code."""
    loader, heldout = load_data(cfg, r, args)
    evals = None  # evaluations are beside the core (evaluation.py); it trains without them
    if args.eval_data or args.eval_tasks or heldout and importlib.util.find_spec("evaluation"):
        import evaluation
        sets = args.eval_data if args.eval_data else heldout
        evals = evaluation.evaluator(cfg, r, mesh, sets, args.eval_tasks, args.data_root)
    log = Log(cfg, r, args.out, mesh)
    target = abstract_state(cfg, r, mesh)
    state, note = init_state(cfg, r, target), "fresh start"
    if manager.latest_step() is not None:
        state = resume(manager, target, cfg, r, log)
        note = f"resumed from step {int(state['step'])}"
    elif args.init_from:  # "warm Adam": params and Adam moments carry over, the schedule restarts
        restored = restore(latest_checkpoint(args.init_from), target, cfg)
        state |= {k: restored[k] for k in ("params", "opt_state") if k in restored}
        note = f"{' and '.join(k for k in restored if k in state)} of {args.init_from}"
    step_fn = compile_step(cfg, r, mesh, target)
    start = int(state["step"])
    devices = f"{mesh.size} x {mesh.devices.flat[0].device_kind} {dict(mesh.shape)}"
    log(f"olmo3-jax | {olmo3.param_count(cfg):,} parameters | {devices} | {note}")
    pending = None  # a step's metrics are read once the next step has been dispatched
    for step, inputs, labels in loader.iterate(start, r.steps):
        batch_arrays = [jax.make_array_from_process_local_data(olmo3.batch_sharding(mesh), x)
                        for x in (inputs, labels)]  # this process's rows -> global arrays
        state, metrics = step_fn(state, *batch_arrays)
        if pending:
            log.step(*pending)
        pending, done = (step + 1, metrics), step + 1
        if evals and (done % r.eval_every == 0 or done == r.steps):
            log.evaluation(done, evals(state["params"]))
        stop = stop_reason(done, args, manager)
        if done % r.save_every == 0 or done == r.steps or stop:
            log.step(*pending)  # never checkpoint a state whose loss was not checked
            pending = None
            save(manager, done, state, cfg, r)
            log.flush()
        if stop:
            manager.wait_until_finished()
            log(f"stopped after step {done} ({stop}), checkpointed: rerun to resume")
            return EXIT_STOPPED
    manager.wait_until_finished()
    if args.samples and importlib.util.find_spec("evaluation"):
        import evaluation
        evaluation.samples(state["params"], cfg, r, loader, args.samples, log)
    log(f"done: step {int(state['step'])} in {(time.time() - log.started) / 60:.1f} min, "
        f"{args.out}/loss.png")
    return 0


def load_data(cfg, r, args):  # -> (this process's train loader, its held-out mix or None)
    source, heldout = args.data, None
    if source is None and cfg.tokenizer != "bytes":
        raise SystemExit("error: --data is required with the dolma2 tokenizer: a mix file, token "
                         "files, or a `python data.py tokenize` folder (or shakespeare)")
    if source in (None, "stdlib", "shakespeare"):
        source, heldout = data.corpus(source if source else "stdlib", cfg.tokenizer)
    elif os.path.isfile(os.path.join(source, "heldout.txt")):  # a tokenize folder brings its own
        heldout = os.path.join(source, "heldout.txt")
    loader = data.Loader(source, r.seq_len, r.global_batch, r.data_seed, jax.process_index(),
                         jax.process_count(), cfg.vocab_size, cfg.tokenizer, args.data_root)
    return loader, heldout


STOP = []  # the signal that asked the run to stop, once one came


def request_stop(signum, frame):  # checkpoint after this step and exit; Ctrl-C again: now
    if STOP and signum == signal.SIGINT:
        raise SystemExit("interrupted; rerun the same command to resume from the last checkpoint")
    STOP.append(signal.Signals(signum).name)
    print(f"{STOP[0]}: checkpointing after this step, then stopping (Ctrl-C again: stop now)")


def stop_reason(step, args, manager):
    # Why the run stops after this step (None: it goes on), the same on every process: a single
    # process catches SIGTERM itself; on several, JAX's preemption notifier does, and its sync
    # point (through Orbax) makes every process stop at the same step.
    if step == args.stop_at:
        return "--stop-at"
    if STOP:
        return f"{STOP[0]} received"
    if jax.process_count() > 1 and manager.reached_preemption(step):
        return "preempted"


# ----------------------------------------------------------------------------- reporting

PEAK_TFLOPS = {"v5 lite": 197, "v5e": 197, "v5p": 459, "v5": 459, "v6 lite": 918, "v6e": 918,
               "7x": 2307 / 2, "v4": 275, "h100": 989, "h200": 989, "a100": 312}
# dense bf16 TFLOP/s per JAX device; TPU7x (Ironwood) has two devices per chip


class Log:  # console lines and RUN_DIR/metrics.jsonl, process 0's

    def __init__(self, cfg, r, run_dir, mesh):
        self.cfg, self.r, self.run_dir, self.mesh = cfg, r, run_dir, mesh
        self.file, self.started, self.last = epath.Path(run_dir, "metrics.jsonl"), time.time(), None
        self.lines = self.file.read_text().splitlines(True) if self.file.exists() else []

    def __call__(self, text=None, **record):
        if jax.process_index() == 0 and text:
            print(text, flush=True)
        if record:
            self.lines.append(json.dumps(record) + "\n")

    def flush(self):  # with each checkpoint: metrics.jsonl, whole and atomically (an object
        if jax.process_index() == 0:  # store cannot append), and loss.png
            self.file.parent.mkdir(parents=True, exist_ok=True)
            self.file.with_suffix(".tmp").write_text("".join(self.lines))
            self.file.with_suffix(".tmp").replace(self.file)
            plot(self.run_dir, self.lines)

    def step(self, step, metrics):  # NaN stops the run; a line every log_every steps
        r, m = self.r, {k: v.tolist() for k, v in jax.device_get(metrics).items()}
        if not math.isfinite(m["loss"]):
            self.flush()
            raise SystemExit(f"error: loss is {m['loss']} at step {step}; lower --lr or check the "
                             "data, then rerun to resume from the last checkpoint")
        if m["skipped"]:  # the spike guard's: [loss, grad norm] spiked
            self(f"step {step}: update skipped", step=step, spikes=m["spikes"])
        if step % r.log_every and step != r.steps:
            return
        now, tokens, rate = time.time(), r.global_batch * r.seq_len, None
        line = [f"step {step:>6}/{r.steps}", f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}",
                f"grad norm {m['grad_norm']:.3f}"]
        if self.last:  # the first line's time includes compiling: rates start after it
            rate = (step - self.last[0]) * tokens / (now - self.last[1])
            tflops = rate * olmo3.flops_per_token(self.cfg, r.seq_len) / self.mesh.size / 1e12
            kind = self.mesh.devices.flat[0].device_kind.lower()  # "cpu" matches no entry
            peak = next((v for name, v in PEAK_TFLOPS.items() if name in kind), None)
            mfu = f"{100 * tflops / peak:.1f}%" if peak else "n/a"
            eta = datetime.timedelta(seconds=round((r.steps - step) * tokens / rate))
            line += [f"{rate:,.0f} tok/s", f"MFU {mfu}", f"ETA {eta}"]
        self.last = (step, now)
        self(" | ".join(line), step=step, loss=m["loss"], lr=m["lr"], grad_norm=m["grad_norm"],
             tokens_per_s=rate, time=now - self.started)

    def evaluation(self, step, results):  # AI2's names: eval/lm/<set>/CE loss, eval/downstream/
        names = {f"eval/{'lm' if 'PPL' in ms else 'downstream'}/{k}/{m}": v
                 for k, ms in results.items() for m, v in ms.items() if m != "docs"}
        shown = " | ".join(f"{k.split('/', 2)[2]} {v:.4f}" for k, v in names.items())
        self(f"step {step:>6}/{self.r.steps} | eval | {shown}", step=step, **names)


def plot(run_dir, lines):  # loss.png: the training loss and the evaluations', by step
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, nothing to close
    records = list(map(json.loads, lines))
    keys = sorted({k for r in records for k in r if k.startswith("eval/") and "PPL" not in k})
    ax = Figure(figsize=(8, 4)).subplots()
    for key in ["loss", *keys]:  # (None, None) closes each line with a gap: none can be empty
        points = sorted({r["step"]: r[key] for r in records if key in r}.items())
        ax.plot(*zip(*points, [None, None]), "-" if key == "loss" else "o-", lw=1, label=key)
    ax.set(xlabel="step", ylabel="CE loss (nats/token), accuracy", title=run_dir)
    ax.legend(fontsize=7)
    ax.figure.savefig(png := io.BytesIO(), format="png", dpi=120, bbox_inches="tight")
    (epath.Path(run_dir) / "loss.png").write_bytes(png.getvalue())


# ----------------------------------------------------------------------------- command line

def parse_args(argv=None):  # -> (olmo3.Config, Recipe, args): the preset's, flags applied
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--preset", default="tiny", choices=list(RECIPES))
    add("--stage2", action="store_true", help="OLMo 3 stage 2 (use with --init-from stage 1)")
    add("--out", help="run directory (default runs/PRESET); resumes if it holds a checkpoint")
    add("--data", help="stdlib, shakespeare, a mix file, a token-file glob or a tokenize folder")
    add("--data-root", help="where mix file paths start (default: the mix file's folder)")
    add("--eval-data", help="held-out sets: a mix file, NAME=SOURCE,... or one source")
    add("--eval-tasks", default="", help="OLMES tasks: hellaswag:rc_0shot,arc_easy:rc_5shot")
    add("--eval-only", action="store_true", help="evaluate --init-from's weights, write eval.json")
    add("--generate", metavar="TEXT", help="continue TEXT with --init-from's weights")
    add("--max-new-tokens", type=int, default=256)
    add("--temperature", type=float, default=0.0, help="for --generate (0: greedy)")
    add("--init-from", help="start from a checkpoint's weights (and Adam moments if it has them)")
    add("--mesh", default="fsdp=-1", type=parse_mesh, help="data=N,fsdp=N,tensor=N (-1: the rest)")
    add("--samples", type=int, default=3, help="prompts to continue at the end")
    add("--stop-at", type=int, help="checkpoint and exit after this step, as if preempted")
    add("--dry-run", action="store_true", help="compile the step, print memory per device, exit")
    add("--devices", type=int, help="use N fake CPU devices (e.g. with --dry-run: plan a pod)")
    add("--topology", help="--dry-run for a TPU slice (v5p:4x4x4 = 64 chips); needs libtpu")
    add("--coordinator", help="HOST:PORT of process 0, where JAX cannot find the cluster itself")
    add("--num-processes", type=int)
    add("--process-id", type=int)
    for f in dataclasses.fields(olmo3.Config) + dataclasses.fields(Recipe):  # every field
        kind = type(f.default)
        add("--" + f.name.replace("_", "-"), dest=f.name, type=boolean if kind is bool else kind,
            choices=CHOICES.get(f.name), metavar=kind.__name__.upper())
    args = ap.parse_args(argv)
    args.out = args.out if args.out else f"runs/{args.preset}"
    given = lambda cls: {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                         if getattr(args, f.name) is not None}
    r = dataclasses.replace(RECIPES[args.preset], **STAGE2 if args.stage2 else {})
    cfg = dataclasses.replace(olmo3.MODELS[args.preset], **given(olmo3.Config))
    return cfg, dataclasses.replace(r, **given(Recipe)), args


def boolean(text):  # "true" or "false"; argparse reports anything else
    return bool(("false", "true").index(text.lower()))


def parse_mesh(text):  # "data=2,fsdp=-1" -> {"data": 2, "fsdp": -1, "tensor": 1}
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    for name, _, value in (part.partition("=") for part in text.split(",")):
        if name not in olmo3.MESH_AXES or not value.lstrip("-").isdigit():
            raise SystemExit(f"error: --mesh {text!r}: expected data=N,fsdp=N,tensor=N (-1: rest)")
        sizes[name] = int(value)
    return sizes


def start_jax(args):
    # Fake CPU devices; then multi-host start-up, which cannot be forgotten: JAX finds its peers
    # itself on a TPU slice, under SLURM, Open MPI or Kubernetes (--coordinator elsewhere).
    if args.devices:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # so CPU processes talk
    jax.config.update("jax_compilation_cache_dir", f"{args.out}/compile-cache")  # for restarts
    try:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    except (ValueError, RuntimeError) as e:  # no cluster here, or JAX runs already (tests)
        if isinstance(e, jax.errors.JaxRuntimeError) or args.coordinator:
            raise  # a failure to connect to the other processes
    if jax.process_count() > 1 and not jax.distributed.is_initialized():
        raise SystemExit("error: several hosts, but JAX found no cluster; give --coordinator")


def main(argv=None):
    cfg, r, args = parse_args(argv)
    start_jax(args)
    if args.dry_run:
        import prepare  # beside the core
        return prepare.dry_run(cfg, r, args)
    if args.eval_only or args.generate is not None:
        import evaluation  # beside the core
        return evaluation.main(cfg, r, args)
    for sig in (signal.SIGTERM, signal.SIGINT) if jax.process_count() == 1 else ():
        signal.signal(sig, request_stop)  # several processes leave SIGTERM to JAX's notifier
    mesh = olmo3.make_mesh(**args.mesh)
    with jax.set_mesh(mesh), checkpoints(f"{args.out}/checkpoints", r.keep_checkpoints) as ckpt:
        return train(cfg, r, args, mesh, ckpt)


if __name__ == "__main__":
    raise SystemExit(main())
