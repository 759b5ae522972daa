"""Train OLMo 3: python train.py --preset tiny (CPU, minutes) or --preset 7b --data MIX (a pod).

Every field of olmo3.Config and train.Recipe is a flag (--lr 1e-3). Rerunning a command resumes
its run (on any mesh that splits it). Stopped early (a signal, --stop-at), it saves, exits 75."""
# Read it top-down: the recipe, `main` and `train` (setup, then the loop), then the helpers in the
# file's order, down to the optimizer. Below the "second read" banner are the progress line (Log)
# and what the 7B on a pod needs (AI2's stage-1 schedule, the spike guard, checkpoints, stopping,
# several hosts), then the command line. On a first read, take each call to a function below the
# banner as its name and the comment beside the call say.
# `r` is always the Recipe, `cfg` the model's olmo3.Config. The README has a JAX glossary.
# Steps (updates) count from 1, as OLMo-core's do (the loop in `train` says what counts them).
import argparse
import dataclasses
import datetime
import json
import logging
import os
import signal
import time

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

logging.getLogger("absl").setLevel(logging.ERROR)  # silences Orbax's notes on each save and restore


# Training settings: AI2's stage 1, with a plain cosine as the default schedule. RECIPES below
# changes a few fields for each preset (7b: AI2's two-part schedule, "olmo3", micro-batches, saves
# every 250 steps).
@dataclasses.dataclass(frozen=True)
class Recipe:
    seq_len: int = 8192
    global_batch: int = 512            # sequences per optimizer step
    micro_batch: int = 0               # sequences per forward/backward over all devices (0: all)
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
    packing: bool = False              # packs whole documents into rows (stage 3)
    doc_masking: bool = True           # packed documents attend only to themselves, as AI2 ran it
    source_group_size: int = 1         # files packed together (OLMo-core's source_group_size)
    source_permutation_seed: int = -1  # OLMo-core's file shuffle seed (-1 keeps the mix order)
    log_every: int = 10
    eval_every: int = 1000
    eval_limit: int = 500              # documents per perplexity set and per task (0 means all)
    save_every: int = 1000
    keep_checkpoints: int = 3          # the newest ones, plus every keep_every-th step for good
    keep_every: int = 5000


RECIPES = {
    "tiny": Recipe(seq_len=256, global_batch=16, steps=500, lr=3e-3, warmup_steps=50,
                   log_every=25, eval_every=100, save_every=100),
    # A micro-batch of 64 fits v5p-128 (39 GiB a device) and v5p-64 (80 of 95 GiB; the README's
    # v5p-64 row takes 32, for 42 GiB).
    # Saving every 250 steps means a save about every 70 minutes on v5p-128 at 40% MFU (Cloud TPU
    # advises about an hour).
    "7b": Recipe(schedule="olmo3", micro_batch=64, save_every=250),
    "7b-wide": Recipe(schedule="olmo3", micro_batch=64, save_every=250),
    # Stage 3 is the long-context extension that made AI2's released model. This is how it ran
    # (the cookbook config that OLMo-core's OLMo3-7B-long-context.py reproduces). It trains on
    # 50B tokens in batches of 64 x 65,536, with documents of the longmino mix packed in groups
    # of 8 files, and it starts from stage 2's weights and Adam state (--init-from). The README
    # explains why the data seed is 4123 and the weight decay 0.033.
    "7b-long": Recipe(seq_len=65536, global_batch=64, steps=11_921, lr=2.0712352850360292e-4,
                      warmup_steps=200, schedule="linear", min_lr_ratio=0.0, weight_decay=0.033,
                      data_seed=4123, packing=True, source_group_size=8,
                      source_permutation_seed=123, save_every=250),
}
# Stage 2 (OLMo-3-1025-7B-midtrain.py) starts from stage 1's weights *and* Adam state ("warm
# Adam", --init-from) with a fresh schedule that decays linearly to 0, and another data seed.
STAGE2 = dict(global_batch=256, lr=2.0712352850360292e-4, warmup_steps=0, schedule="linear",
              min_lr_ratio=0.0, steps=47_684, data_seed=1337)


# ----------------------------------------------------------------------------- the run

def main(argv=None):
    cfg, r, args = parse_args(argv)  # the preset's Config and Recipe, then STAGE2, then the flags
    start_jax(args)  # fake CPU devices if asked, then JAX's multi-host start-up
    if args.dry_run:
        # data.beside("prepare"): a lazy import of prepare.py (in data.py, for data's own command
        # line too), which says what is missing if the file is not there
        return data.beside("prepare").dry_run(cfg, r, args)
    if args.eval_only or args.generate is not None:
        return data.beside("evaluation").main(cfg, r, args)
    # From here on, Ctrl-C and SIGTERM save a checkpoint, then stop the run; and every host must
    # see the run directory process 0 writes (on one host, this only makes the directory)
    set_up_run(args.out)
    mesh = olmo3.make_mesh(**args.mesh)  # args.mesh: {"data": 1, "fsdp": -1, "tensor": 1}
    # manager: Orbax's CheckpointManager for the run's checkpoints/. It lists the saved steps, and
    # saves new ones in the background.
    with jax.set_mesh(mesh), checkpoints(f"{args.out}/checkpoints", r) as manager:
        return train(cfg, r, args, mesh, manager)


def train(cfg, r, args, mesh, manager):  # -> exit code; setup, then the loop: step, log, eval, save
    loader, heldout = load_data(cfg, r, args, mesh)  # every process reads the same token files
    # log(text) prints a line (process 0's); log(**record) adds a record for metrics.jsonl (the
    # files are written with each checkpoint)
    log = Log(cfg, r, args.out, mesh)
    evals = evaluator(cfg, r, args, mesh, heldout, log)  # evals(params, step), or None
    # target: the state's shapes and shardings, with nothing allocated (abstract_state; Orbax
    # calls such a tree the restore target)
    target = abstract_state(cfg, r, mesh)
    state, note = starting_state(cfg, r, args, manager, target, loader, log)
    done = int(state["step"])  # the steps done before this run: 0, or the checkpoint's step
    # after a resume, drops metrics.jsonl's records newer than the state (a kill can leave some)
    log.rewind(done)
    devices = f"{mesh.size} x {mesh.devices.flat[0].device_kind} {dict(mesh.shape)}"
    log(f"olmo3-jax | {olmo3.param_count(cfg):,} parameters | {devices} | {note} | compiling")
    step_fn = compile_step(cfg, r, mesh, target)
    # The loop, in short: nanoGPT's, with the metrics read a step late, and a stop that saves.
    #   for each step:
    #       state, metrics = step_fn(state, batch)  # returns at once, while the devices compute
    #       stop = None, or why to stop after this step (a signal, --stop-at)
    #       read the step before's metrics (before a save, this step's too): print, check skips
    #       every eval_every steps, evaluate; every save_every steps (and last, or on a stop), save
    #       on a stop: wait for the save, exit 75
    # Why a step late: reading a result (nanoGPT's loss.item(), here jax.device_get) makes the host
    # wait for the devices. When the loop reads step s - 1's metrics, step s is already queued on
    # the devices, so they keep computing while the host waits, prints and fetches the next batch;
    # reading step s's own would leave them idle until the host dispatched step s + 1. (Stopper
    # reads its flag a step late for the same reason.)
    # Steps count from 1, as OLMo-core's do. What counts them, at step 5 of a fresh run:
    #   step                 5  the loop's: the step's number, logged, saved, and the LR's index
    #   loader.batch(4)         what step 5 trains on (batches count from 0, so step s gets s - 1)
    #   state["step"]        4  the steps done: 4 before step 5, 5 after it (saved in checkpoints)
    #   opt_state.count      4  Adam's own count, for its bias correction (adamw): the same in a
    #                           fresh run, but --init-from (stages 2, 3) carries it over, while
    #                           state["step"] restarts from 0
    stopper = Stopper(args.stop_at, mesh)  # on a signal or --stop-at, every process stops
    for step, batch in enumerate(loader.iterate(done, r.steps), start=done + 1):
        # device_batch: this process's rows -> one array over all devices (one host: device_put)
        state, metrics = step_fn(state, device_batch(batch, loader, mesh))
        stop = stopper.poll(step)
        save_now = step % r.save_every == 0 or step == r.steps or stop
        # log.step reads the step before's metrics and prints them every log_every steps. Before a
        # save, which waits for this step anyway, it reads this step's too, so that the
        # metrics.jsonl saved with the checkpoint holds every step up to it. It ends the run with
        # an error after 10 skipped updates in a row: the spike guard cannot save such a run.
        log.step(step, metrics, wait=save_now)
        if evals and (step % r.eval_every == 0 or step == r.steps):
            evals(state["params"], step)  # the results are logged
        if save_now:
            log.flush()  # writes metrics.jsonl and log.txt
            # save copies the arrays to host memory before it returns (Orbax's D2H transfer
            # blocks), then writes them in the background: so the next step may reuse the state's
            # buffers (donation, compile_step)
            save(manager, step, state, cfg, r, loader.fingerprint)
        if stop and step < r.steps:  # (after the last step, the run ends anyway)
            manager.wait_until_finished()  # the save is committed
            log(f"stopped after step {step} ({stop}), checkpointed: rerun to resume")
            log.flush()
            return 75  # EX_TEMPFAIL: stopped before its last step, so rerun to resume
    manager.wait_until_finished()
    if args.samples and data.have("evaluation"):  # with evaluation.py only
        data.beside("evaluation").samples(state["params"], cfg, r, loader, args.samples, log)
    log(f"done: step {int(state['step'])} in {(time.time() - log.started) / 60:.1f} min")
    log.flush()
    return 0


# ----------------------------------------------------------------------------- data and evaluation

def load_data(cfg, r, args, mesh):  # -> (this process's train loader, its held-out mix or None)
    # (data.Loader and data.corpus are the reading map's stop 6)
    source, heldout = args.data, None
    if source is None and cfg.tokenizer != "bytes":
        raise SystemExit("error: --data is required with the dolma2 tokenizer: a mix file, token "
                         "files, or a `python data.py tokenize` folder (or stdlib, shakespeare)")
    if source in (None, "stdlib", "shakespeare"):
        source, heldout = data.corpus(source if source else "stdlib", cfg.tokenizer)
    elif os.path.isfile(os.path.join(source, "heldout.txt")):  # a tokenize folder brings its own
        heldout = os.path.join(source, "heldout.txt")
    # rows: the rows of each batch that this process's devices hold (on one host, all of them)
    options = dict(rows=local_rows(mesh, r), tokenizer=cfg.tokenizer, root=args.data_root,
                   vocab_size=cfg.vocab_size, permutation_seed=r.source_permutation_seed)
    # The plain Loader comes first even for packing: the hosts compare its fingerprint (the
    # token files) before process 0 spends minutes packing them.
    loader = data.Loader(source, r.seq_len, r.global_batch, r.data_seed, **options)
    # on several hosts, every one must read the same token files
    check_processes_agree(loader.fingerprint, "read other token files than process 0; check "
                          "--data, --data-root and the mix file on every host")
    if r.packing:  # process 0 packs the same files into the run directory once, then all read it
        options |= dict(group_size=r.source_group_size, cache=args.out, rank=jax.process_index())
        loader = data.PackedLoader(source, r.seq_len, r.global_batch, r.data_seed, **options)
    return loader, heldout


def evaluator(cfg, r, args, mesh, heldout, log):  # -> evals(params, step), or None
    # evaluation.py (beside the core) evaluates the sets and tasks given (--eval-data,
    # --eval-tasks), or else the corpus's held-out set. With the core alone (a copy of the three
    # files) the held-out set is skipped (and so are the samples and the loss plot), and
    # --eval-data or --eval-tasks is an error.
    # (data.have asks whether evaluation.py is here, without importing it; data.beside imports it,
    # or stops with a line saying that it is missing. Optional features ask; flags import.)
    if not (args.eval_data or args.eval_tasks or (heldout and data.have("evaluation"))):
        return None
    sets = args.eval_data if args.eval_data else heldout
    evaluation = data.beside("evaluation")
    return evaluation.evaluator(cfg, r, mesh, sets, args.eval_tasks, args.data_root, log)


# ----------------------------------------------------------------------------- the state
# fresh_state builds the state from params; abstract_state describes it; init_state creates it
# sharded; starting_state picks a resumed, fresh or --init-from one.

shardings_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)


HISTORY = 128  # the spike guard's window (OLMo-core's rolling_interval_length)


def fresh_state(r, params):  # the training state before step 1
    # opt_state is Adam's (count, mu, nu): count 0, and mu and nu zeros shaped like params.
    # history [2, 128]: the spike guard's last losses (row 0) and grad norms (row 1).
    return {"params": params, "opt_state": adam(r).init(params), "step": jnp.int32(0),
            "history": jnp.zeros((2, HISTORY))}


def abstract_state(cfg, r, mesh):  # fresh_state's tree, described, with nothing allocated
    # Each leaf is a jax.ShapeDtypeStruct (shape, dtype, sharding). jit and Orbax need every
    # leaf's shape and sharding before any array exists, so that the 7B's state is never whole on
    # one device: init_state creates each device's shards from these, restore reads a checkpoint
    # onto them, and compile_step compiles for them. (jax.eval_shape(fresh_state) would give the
    # shapes, but not these shardings.)
    params = olmo3.abstract_params(cfg, mesh)  # each weight cut as olmo3.AXIS_RULES says
    replicated = NamedSharding(mesh, P())  # every device holds all of it
    whole = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
    # Adam's mu and nu are described exactly as params, so each is cut like its param (ZeRO-3).
    # (adam(r).init returns this type; a test compares the two:
    # test_abstract_state_describes_fresh_state_with_adam_cut_like_params)
    opt = optax.ScaleByAdamState(count=whole((), jnp.int32), mu=params, nu=params)
    return {"params": params, "opt_state": opt, "step": whole((), jnp.int32),
            "history": whole((2, HISTORY), jnp.float32)}


# jit with out_shardings: each device computes and keeps only its own shards, so the 7B is never
# whole on one device
def init_state(cfg, r, target):
    make = lambda key: fresh_state(r, olmo3.init(cfg, key))
    return jax.jit(make, out_shardings=shardings_of(target))(jax.random.key(r.seed))


def starting_state(cfg, r, args, manager, target, loader, log):  # -> (state, note)
    # A new run is init_state(cfg, r, target), with the note "fresh start". If the run directory
    # has a checkpoint, the state is its newest readable one, read into target's shardings.
    # Otherwise it is a fresh state, into which --init-from (if given) copies its weights and Adam
    # state (stages 2 and 3: the last lines, below).
    if manager.latest_step() is not None:
        state = resume(manager, target, cfg, r, loader, log)
        return state, f"resumed from step {int(state['step'])}"
    refuse_fresh_start(args.out)  # stops if a run already trained in args.out
    state = init_state(cfg, r, target)
    if not args.init_from:
        return state, "fresh start"
    # (--init-from, stages 2 and 3: skip on a first read) restore reads what the checkpoint holds:
    # params alone from a converted one; params, opt_state, step and history from a run's. With
    # no recipe given, only the model's settings must match, not the data.
    restored = restore(latest_checkpoint(args.init_from), target, cfg)
    # "Warm Adam": of these, only params and opt_state are kept, so Adam's moments and its count
    # (opt_state.count) go on. step and history stay fresh (state["step"] is 0), so the schedule
    # and the spike guard start again.
    carried = [k for k in ("params", "opt_state") if k in restored]
    return state | {k: restored[k] for k in carried}, f"{' and '.join(carried)} of {args.init_from}"


# ----------------------------------------------------------------------------- the step

# Ahead of time, so that --dry-run compiles the same step with no data, and a step that does
# not fit fails at start-up.
def compile_step(cfg, r, mesh, target):
    micro = r.micro_batch if r.micro_batch else r.global_batch
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    if r.global_batch % micro or micro % dp:
        raise SystemExit(f"error: global batch {r.global_batch} / micro batch {micro} / {dp} "
                         "data-parallel devices do not divide; pick multiples of each other")
    tokens = jax.ShapeDtypeStruct((r.global_batch, r.seq_len), jnp.int32,
                                  sharding=olmo3.batch_sharding(mesh))
    # The batch is described as the loader gives it: inputs, labels and, when packed, segments
    batch = dict(inputs=tokens, labels=tokens) | (dict(segments=tokens) if r.packing else {})
    # - the lambda bakes cfg and r into the program, as static arguments would;
    # - donate_argnums=0: the new state reuses the old one's buffers, so memory holds one copy of
    #   it (the caller must not touch the old state again);
    # - out_shardings: the new state keeps the state's shardings (None: XLA places the metrics);
    # - lower(target, batch).compile() compiles for target's and batch's shardings: this is where
    #   stop 4's shardings enter jit (the activations' come from olmo3.constrain, met as it
    #   traces). The compiled step takes only arrays cut exactly so.
    step = jax.jit(lambda state, batch: train_step(state, batch, cfg, r, r.global_batch // micro),
                   donate_argnums=0, out_shardings=(shardings_of(target), None))
    return step.lower(target, batch).compile()


def train_step(state, batch, cfg, r, n_micro):  # one update over n_micro micro-batches
    # -> (the new state, metrics). batch holds inputs, labels and, when packed, segments, each
    # [global_batch, seq_len]
    params = state["params"]
    # Each micro-batch's loss sum is divided by the whole batch's target count, so the sum over
    # micro-batches is the batch's mean loss.
    n_tokens = jnp.maximum(jnp.sum(batch["labels"] >= 0), 1)

    def loss(params, micro):
        segments = micro.get("segments") if r.doc_masking else None  # keep documents apart
        logits = olmo3.forward(params, micro["inputs"], cfg, segments)
        ce_sum, z_sum, _ = olmo3.loss_terms(logits, micro["labels"], r.z_loss)
        # (what is differentiated: CE + z-loss; what is logged: CE alone)
        return (ce_sum + z_sum) / n_tokens, ce_sum / n_tokens
    # grad_fn(params, micro) -> ((the loss with z-loss, ce), grads): has_aux says loss returns
    # (what to differentiate, an extra), and value_and_grad passes the extra (ce) through
    grad_fn = jax.value_and_grad(loss, has_aux=True)

    if n_micro == 1:  # one micro-batch: the plain step, with no scan around it
        (_, ce), grads = grad_fn(params, batch)
    else:  # a scan over the micro-batches sums their gradients and losses
        def add_micro(carry, micro):  # carry = (summed gradients, summed loss)
            (_, ce), grads = grad_fn(params, micro)
            return (jax.tree.map(jnp.add, carry[0], grads), carry[1] + ce), None
        zeros = (jax.tree.map(jnp.zeros_like, params), 0.0)
        micros = jax.tree.map(lambda x: split_micro(x, n_micro), batch)
        (grads, ce), _ = jax.lax.scan(add_micro, zeros, micros)
    grad_norm = optax.tree.norm(grads)  # before clipping (the spike guard watches it too)
    # The LR is indexed by this step's number (state["step"] + 1), not by Adam's count, so a stage
    # restarts its schedule while Adam's count carries over (--init-from)
    lr = schedule(r)(state["step"] + 1)
    new = adamw(params, state["opt_state"], grads, grad_norm, lr, r)  # {params, opt_state}
    # The spike guard (OLMo-core's; nanoGPT has none) may skip the update: then params and
    # opt_state stay as they were, while step and history advance.
    # spikes [2]: did the loss, did the grad norm spike; history: the window with them added
    spikes, history = spike_guard(state["history"], state["step"], jnp.stack([ce, grad_norm]))
    # (r.spike_guard is a Python bool, a constant in the traced expression)
    skip = (~jnp.isfinite(ce + grad_norm)) | (spikes.any() & r.spike_guard)  # never apply a NaN
    # where skip is True, keep the old params and Adam state ({k: state[k] for k in new}: the
    # state's params and opt_state)
    new = jax.tree.map(lambda upd, old: jnp.where(skip, old, upd), new, {k: state[k] for k in new})
    # The logged loss is the cross-entropy alone: z-loss is trained on, not logged
    metrics = {"loss": ce, "grad_norm": grad_norm, "lr": lr, "skipped": skip, "spikes": spikes}
    return new | {"step": state["step"] + 1, "history": history}, metrics


def split_micro(x, n_micro: int):
    # [global, ...] -> [n_micro, global/n_micro, ...], row i to micro-batch i % n_micro: with 8
    # rows and n_micro 2, rows 0..7 -> [[0 2 4 6], [1 3 5 7]] (np.stack([x[a::n_micro] ...])).
    # Why strided: with 2 devices, device 0 holds global rows 0-3; rows 0 and 2 go to micro-batch
    # 0 and rows 1 and 3 to micro-batch 1, so no row moves (constrain pins that). A plain
    # reshape(n_micro, global/n_micro) would put all of micro-batch 0 on device 0.
    # [8] -> [4, 2] ([[0 1] [2 3] [4 5] [6 7]]) -> swapaxes -> [2, 4]: [[0 2 4 6] [1 3 5 7]]
    x = x.reshape(x.shape[0] // n_micro, n_micro, *x.shape[1:]).swapaxes(0, 1)
    return olmo3.constrain(x, None, "batch", "seq")


# ----------------------------------------------------------------------------- the optimizer

def schedule(r: Recipe):  # -> a function: step k (1-based) -> its LR
    # These are OLMo-core's formulas for its step k (ours too), with peak P, floor
    # F = min_lr_ratio * P, warmup W and t_max T (letters local to this comment, not olmo3's):
    #   CosWithWarmup:    P k / W for k < W, then F + (P - F) (1 + cos(pi (k - W) / (T - W))) / 2
    #   LinearWithWarmup: P k / W for k < W, then P - (P - F) (k - W) / (T - W)
    # Both stay at F from T on, and both give the peak P at k = W. The code below uses optax's;
    # test_schedule_matches_olmo_core_off_by_one checks them against these formulas. (The "olmo3"
    # schedule, olmo3_stage1, is in the second read.)
    peak, floor, warmup = r.lr, r.lr * r.min_lr_ratio, r.warmup_steps
    # optax's arguments, in order: init value, peak, warmup steps, decay steps (T), end value
    cosine = lambda t_max: optax.warmup_cosine_decay_schedule(0.0, peak, warmup, t_max, floor)
    # (the max()es keep a run no longer than its warmup valid)
    if r.schedule == "cosine":  # optax's decay_steps includes the warmup, so it is T
        return cosine(max(r.steps, warmup + 1))
    if r.schedule == "linear":  # join_schedules counts its second part's steps from W
        return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup),
                                     optax.linear_schedule(peak, floor, max(r.steps - warmup, 1))],
                                    [warmup])
    # "olmo3": AI2's stage 1 in two parts (the 7b presets; second read)
    return olmo3_stage1(peak, floor, warmup, r.global_batch * r.seq_len, cosine)


# AdamW, as torch's and OLMo-core's: p - lr * (adam(clip(g)) + wd * p), with no wd on the
# embedding. Why not optax.adamw: its LR schedule counts steps in opt_state from 0, so step 1 would
# get OLMo-core's LR for step 0, and --init-from would carry that count into the next stage. Here
# the LR is indexed by this run's step (train_step passes it), and opt_state holds Adam's alone.
def adamw(params, opt_state, grads, grad_norm, lr, r):  # -> the updated {params, opt_state}
    # clip to a global norm of grad_clip (optax's clip_by_global_norm; torch's clip_grad_norm_
    # divides by the norm + 1e-6 instead)
    clip = lambda g: jnp.where(grad_norm < r.grad_clip, g, g / grad_norm * r.grad_clip)
    # Adam's direction m^ / (sqrt(v^) + eps), with m and v bias-corrected by Adam's own count.
    # (optax's scale_by_adam returns it as is: no minus sign and no LR, so the code subtracts below)
    updates, opt_state = adam(r).update(jax.tree.map(clip, grads), opt_state)
    # + wd * p on every weight but the embedding (the norms and lm_head too, as OLMo-core)
    decayed = jax.tree.map(lambda u, p: u + r.weight_decay * p, updates, params)
    updates = decayed | {"embed": updates["embed"]}  # the embedding's update, undecayed
    new_params = jax.tree.map(lambda p, u: p - lr * u, params, updates)  # p - lr (adam + wd p)
    return {"params": new_params, "opt_state": opt_state}


def adam(r):  # optax's Adam (adamw clips before it and decays after it)
    return optax.scale_by_adam(r.beta1, r.beta2, r.adam_eps)


# =============================================================================
# Second read (the map's stop 8): the progress line, and what the 7B on a pod needs. By section:
#   the progress line: Log, which reads each step's metrics a step late, prints them, and writes
#     log.txt and metrics.jsonl;
#   the 7b's schedule: AI2's two-part stage 1 (the 7b presets only);
#   the spike guard: OLMo-core's check that skips an update whose loss or grad norm spikes;
#   checkpoints: saves that survive a kill at any moment and resume on another mesh (any run);
#   stopping: a SIGTERM that every process acts on at the same step (matters on a pod);
#   across hosts: JAX's start-up, each host feeding its own devices, and checks that the hosts
#     agree (pods only; on one host, each is simple);
#   then the command line.
# A preempted pod run, end to end, through these sections (say 4 hosts, resuming from step 500):
#   start: every host runs the same command. start_jax joins them into one JAX cluster, and
#     set_up_run checks that all see the run directory process 0 writes (run_mark);
#   data: each host's loader reads only the rows its devices hold (local_rows), and the hosts
#     check that they read the same token files (check_processes_agree);
#   resume: every host reads checkpoint 500 onto its own devices (resume, restore, read_item),
#     after restore checks the settings and the data; an all-gather confirms all could;
#   steps: device_batch makes each host's rows one global batch; Log prints process 0's lines;
#   preemption: host 3 gets a SIGTERM while step 612 runs. It shows in step 612's or 613's stop
#     flag, every host reads that flag a step later (both in Stopper.poll), and all save the same
#     step and exit 75 (train's loop);
#   rerun: the same command, on this slice or another whose mesh splits the model, resumes there.
# =============================================================================


# ----------------------------------------------------------------------------- the progress line

# (skim: for the MFU) Dense bf16 TFLOP/s per JAX device. TPU7x (Ironwood) has two devices per
# chip. The first entry whose name is in the device's kind counts, so "v5 lite" must come before
# "v5". (An fp32 run's MFU is still against these bf16 peaks.)
PEAK_TFLOPS = {"v5 lite": 197, "v5e": 197, "v5p": 459, "v5": 459, "v6 lite": 918, "v6e": 918,
               "7x": 2307 / 2, "v4": 275, "h100": 989, "h200": 989, "a100": 312}


class Log:  # process 0's console lines and metric records, in RUN_DIR/log.txt and metrics.jsonl
    # Both live in the run directory, because a spot slice's disks go when the slice is deleted.
    # What train's loop uses: log(text) or log(**record); log.step(step, metrics) for each step;
    # flush() before a save.

    def __init__(self, cfg, r, run_dir, mesh):
        self.cfg, self.r, self.run_dir, self.mesh = cfg, r, run_dir, mesh
        # last: (step, time) of the last progress line; pending: step -> its metrics, on the
        # devices until read; skipped: updates skipped in a row
        self.started, self.last, self.pending, self.skipped = time.time(), None, {}, 0
        kind = mesh.devices.flat[0].device_kind.lower()  # "cpu" matches no entry
        self.peak = next((v for name, v in PEAK_TFLOPS.items() if name in kind), None)
        self.files = {name: epath.Path(run_dir, name) for name in ("metrics.jsonl", "log.txt")}
        # a resume keeps the earlier lines (flush rewrites the files whole)
        self.lines = {name: path.read_text().splitlines(True) if path.exists() else []
                      for name, path in self.files.items()}

    def __call__(self, text=None, **record):  # log(text) prints; log(**record) is a metric record
        if jax.process_index() == 0 and text:
            print(text, flush=True)
            self.lines["log.txt"].append(text + "\n")
        if record and jax.process_index() == 0:  # process 0 writes them
            self.lines["metrics.jsonl"].append(json.dumps(record) + "\n")

    # step keeps this step's metrics and reads the step before's (with wait, this step's too)
    def step(self, step, metrics, wait=False):
        self.pending[step] = metrics
        for s in (step - 1, step) if wait else (step - 1,):
            self.read(s)

    # flush rewrites each file whole and atomically (an object store cannot append), and draws
    # loss.png if evaluation.py is here.
    def flush(self):
        if jax.process_index() == 0:
            for name, path in self.files.items():  # (run_mark made the run directory)
                path.with_suffix(".tmp").write_text("".join(self.lines[name]))
                path.with_suffix(".tmp").replace(path)
            if data.have("evaluation"):
                data.beside("evaluation").plot(self.run_dir, self.lines["metrics.jsonl"])

    # metrics.jsonl can run ahead of the checkpoint a run resumes from: flush writes
    # it before Orbax commits the checkpoint, so a kill between the two leaves records past it, and
    # so does the stop after 10 skipped steps. rewind drops them (it keeps steps 1 to the state's
    # step); the resumed run logs those steps again.
    def rewind(self, step):
        records = self.lines["metrics.jsonl"]
        self.lines["metrics.jsonl"] = [x for x in records if json.loads(x)["step"] <= step]

    def read(self, step):  # waits for a step's metrics; logs them every log_every steps
        if step not in self.pending:  # before this run's first step, or read by a save already
            return
        r = self.r
        # jax.device_get waits for the devices, as nanoGPT's loss.item() does
        m = {k: v.tolist() for k, v in jax.device_get(self.pending.pop(step)).items()}
        self.skipped = self.skipped + 1 if m["skipped"] else 0
        if m["skipped"]:  # skipped by the spike guard ([loss, grad norm] spiked) or as not finite
            self(f"step {step}: update skipped (loss {m['loss']:.4f}, grad norm "
                 f"{m['grad_norm']:.4f})", step=step, spikes=m["spikes"])
        if self.skipped == 10:  # the last checkpoint holds the last good weights
            self.flush()
            raise SystemExit(f"error: 10 updates in a row skipped, up to step {step}; lower --lr "
                             "or check the data")
        if step % r.log_every and step != r.steps:  # a line every log_every steps, and the last
            return
        now, tokens, rate = time.time(), r.global_batch * r.seq_len, None
        line = [f"step {step:>6}/{r.steps}", f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}",
                f"grad norm {m['grad_norm']:.3f}"]
        # (skim) the rate, MFU and ETA, from the second line on: the first has no line before it
        if self.last:
            rate = (step - self.last[0]) * tokens / (now - self.last[1])
            tflops = rate * olmo3.flops_per_token(self.cfg, r.seq_len) / self.mesh.size / 1e12
            mfu = f"{100 * tflops / self.peak:.1f}%" if self.peak else "n/a"
            eta = datetime.timedelta(seconds=round((r.steps - step) * tokens / rate))
            line += [f"{rate:,.0f} tok/s", f"MFU {mfu}", f"ETA {eta}"]
        self.last = (step, now)
        self(" | ".join(line), step=step, loss=m["loss"], lr=m["lr"], grad_norm=m["grad_norm"],
             tokens_per_s=rate, time=now - self.started)


# ----------------------------------------------------------------------------- the 7b's schedule

# the first step of stage 1's second part (AI2 restarted after step 596,047)
RESTART = 596_048


# -> (step k -> its LR), for P, F, W and the tokens a step; cosine(T) is CosWithWarmup
def olmo3_stage1(peak, floor, warmup, tokens, cosine):
    # AI2 ran stage 1 in two parts (OLMo-core's OLMo-3-1025-7B-pretrain-1.py and -2.py). Part 1 is
    # cosine(T1), aimed at 5T tokens (T1 steps); AI2 stopped it after step 596,047. Part 2, from
    # RESTART on, is HalfCosWithWarmup aimed at 7T tokens (T2): a warmup to (F + P) / 2 at step
    # W2, then the second half of a cosine from P to F, reaching F at T2. For the 7b preset
    # (4,194,304 tokens a step), T1 = 1,192,093, T2 = 1,668,931 and W2 = 597,046, so part 2 starts
    # inside its warmup, at 99.8% of (F + P) / 2, close to where part 1 had come down to. In
    # OLMo-core's formulas (schedule's), with part 2's warmup W2 and t_max T2,
    #   HalfCosWithWarmup: ((F + P) / 2) k / W2 for k < W2, then
    #                      F + (P - F) (1 + cos(pi (k - W2 + T2 - W2) / (2 (T2 - W2)))) / 2
    t1, t2 = -(-int(5e12) // tokens), -(-int(7e12) // tokens)  # T1 and T2, rounded up
    # -2.py's W2: original_max_steps // 2 + original_warmup_steps // 2, where
    # original_max_steps = 5e12 // tokens (T1 rounded down) and original_warmup_steps = W
    w2 = int(5e12) // tokens // 2 + warmup // 2
    # The 7b preset's LR at a few steps k: 1.5e-7 at 1; the peak 3.0e-4 at 2,000;
    # 1.654e-4 at 596,047 (part 1's last); 1.647e-4 at 596,048 (part 2's first, in its
    # warmup); 1.650e-4 = (F + P) / 2 at 597,046 (W2); 3.93e-5 at 1,413,814, the last.
    # Part 2 is HalfCosWithWarmup, as written above. The cosine's angle runs from pi / 2 at W2
    # ((F + P) / 2) to pi at T2 (F), and stays at pi from T2 on (the minimum).
    angle = lambda k: jnp.pi * (jnp.minimum(k, t2) - w2 + t2 - w2) / (2 * (t2 - w2))
    part2 = lambda k: jnp.where(k < w2, (peak + floor) / 2 * k / w2,
                                floor + (peak - floor) * (1 + jnp.cos(angle(k))) / 2)
    return lambda k: jnp.where(k < RESTART, cosine(t1)(k), part2(k))


# ----------------------------------------------------------------------------- the spike guard

def spike_guard(history, steps_done, values):  # -> (is each a spike, the history with them)
    # OLMo-core's SkipStepOptimizer on values [loss, grad norm]; a spike in either one skips the
    # update. In short: a value spikes if it is more than 6 std above the mean of the (up to) 128
    # values before it; checking starts at the 64th value.
    # - history [2, 128] is a ring of each one's last 128 values. steps_done is the state's step:
    #   slots i < min(steps_done, 128) hold values, and this step's go to slot steps_done % 128
    #   (at step 4, steps_done 3: slots 0-2 hold values, this one goes to slot 3; at step 200,
    #   all 128 hold values, and this one overwrites slot 199 % 128 = 71, the oldest).
    # - Checking starts at the 64th value, counting this one: from step 64 on (steps_done 63).
    # - A value spikes when it is more than 6 std above the mean of the filled slots (mean and std
    #   [2], one per row).
    n_filled = jnp.minimum(steps_done, HISTORY)  # how many values the history holds
    filled = jnp.arange(HISTORY) < steps_done  # [128]: which slots hold one (all, from step 129 on)
    mean = jnp.sum(jnp.where(filled, history, 0.0), -1) / jnp.maximum(n_filled, 1)
    square = jnp.where(filled, (history - mean[:, None]) ** 2, 0.0)
    std = jnp.sqrt(jnp.sum(square, -1) / jnp.maximum(n_filled - 1, 1))  # torch.std's n - 1
    checking = n_filled + 1 >= HISTORY // 2  # 64 values, counting this one (from step 64 on)
    # one-sided, as OLMo-core's test is written: only a rise counts; within is False for NaN, +inf
    within = values - mean <= 6 * std
    # A value that is not finite is kept out of the history (the mean takes its slot), or every
    # later step would spike until it left the window. (OLMo-core keeps it, but then its trainer
    # stops at the non-finite loss.)
    kept = jnp.where(jnp.isfinite(values), values, mean)
    return checking & ~within, history.at[:, steps_done % HISTORY].set(kept)


# ----------------------------------------------------------------------------- checkpoints
# Orbax saves asynchronously under a temporary name and commits a step atomically (a rename, or
# a commit file on gs://). Only committed steps are listed, so a kill -9 at any moment loses only
# the steps since the last commit. A step holds params, train_state and config. (Orbax's names
# used here, CheckpointManager, StandardSave and the rest: the README's pod glossary, note 2.)
# The section's map: save writes a step. A resume (resume) tries the steps newest first, each
# through read_retrying(restore): restore compares the settings, then read_item compares the
# layout and reads the arrays. A run directory with no checkpoint to resume passes
# refuse_fresh_start before a fresh start. --init-from reads latest_checkpoint with restore.

TRAIN_STATE = ("opt_state", "step", "history")  # a checkpoint's train_state (params are separate)


def checkpoints(directory, r=Recipe(), read_only=False):  # r says how many to keep
    path = directory if "://" in directory else os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=r.keep_checkpoints, keep_period=r.keep_every,
                                           create=not read_only, read_only=read_only)
    return ocp.CheckpointManager(path, options=options)


def latest_checkpoint(path):  # the newest step of a run directory or of a converted checkpoint
    for directory in (f"{path}/checkpoints", path):
        step = checkpoints(directory, read_only=True).latest_step()  # None if none or no folder
        if step is not None:
            return epath.Path(directory) / str(step)
    raise SystemExit(f"error: no checkpoint in {path}; pass a run directory or a converted one")


def save(manager, step, state, cfg, r=None, data_fingerprint=None):
    # A checkpoint holds the params, the rest of a training state if there is one, and the config.
    saves = {"params": ocp.args.StandardSave(state["params"])}
    if "opt_state" in state:
        saves["train_state"] = ocp.args.StandardSave({k: state[k] for k in TRAIN_STATE})
    config = {"model": dataclasses.asdict(cfg)}
    if r is not None:
        config |= {"recipe": dataclasses.asdict(r), "data": data_fingerprint}
    manager.save(step, args=ocp.args.Composite(**saves, config=ocp.args.JsonSave(config)))


def saved_config(step_dir):  # -> {"model": Config's fields, "recipe": ..., "data": ...}
    return ocp.JsonCheckpointHandler().restore(epath.Path(step_dir) / "config")


DATA_ORDER = ("seq_len", "global_batch", "data_seed", "packing", "source_group_size",
              "source_permutation_seed")  # a resumed run must keep these and its data


def restore(step_dir, target, cfg, r=None, loader=None):
    # Compares the saved settings with this run's, then reads the arrays (params, and the rest if
    # target has it) onto target's shardings, whatever mesh wrote them. A resume (r given) must
    # match the model (every Config field but NUMERICS), the data order (DATA_ORDER) and the data;
    # --init-from (r None) only the model, and may turn YaRN on (stage 3 from stage 2's weights).
    # (Fields are compared as saved, so another version's checkpoint is a one-line mismatch.)
    saved = saved_config(step_dir)
    given = dataclasses.asdict(cfg)  # the command line's model settings
    may_differ = lambda f: f in olmo3.NUMERICS or (r is None and f.startswith("yarn_"))
    # pairs: (a setting, its checkpoint value, its command-line value), which must be equal, for
    # every model setting either side has (saved["model"] | given: the keys of both, in order),
    # as ("yarn_factor", 0.0, 8.0)
    pairs = [(f, saved["model"].get(f), given.get(f)) for f in saved["model"] | given
             if not may_differ(f)]
    if r is not None:  # a resume
        pairs += [(f, saved.get("recipe", {}).get(f), getattr(r, f)) for f in DATA_ORDER]
        pairs += [("data", saved.get("data"), loader.fingerprint)]
    diff = [f"{k}={a!r} (command line: {b!r})" for k, a, b in pairs if a != b]
    if diff:
        raise SystemExit(f"error: checkpoint {step_dir} has {', '.join(diff)}; use a new --out, "
                         "or the settings and data it was made with")
    state = {"params": read_item(step_dir / "params", target["params"])}
    if "opt_state" in target and (step_dir / "train_state").exists():  # opt_state, step, history
        state |= read_item(step_dir / "train_state", {k: target[k] for k in TRAIN_STATE})
    return state


def read_item(path, tree):  # reads one item of a checkpoint step onto tree's shapes and shardings
    handler = ocp.StandardCheckpointHandler()
    # a tree's layout: each leaf's path and shape, as [("opt_state/mu/embed", (384, 256)), ...]
    layout = lambda tree: sorted((jax.tree_util.keystr(k, simple=True, separator="/"),
                                  tuple(x.shape)) for k, x in jax.tree.leaves_with_path(tree))
    if layout(handler.metadata(path)) != layout(tree):  # the code changed: fail with no retry
        raise SystemExit(f"error: checkpoint {path.parent} holds a {path.name} layout this code "
                         "does not make; resume with the version that wrote it, or a new --out")
    return handler.restore(path, args=ocp.args.StandardRestore(tree))


def resume(manager, target, cfg, r, loader, log):
    # The newest checkpoint every process can read (on one host with a good one: restore(newest)).
    # Each process reads it itself, retrying errors that can pass, and an all-gather decides for
    # all (Orbax's restore would wait at a barrier for one that failed). A step some process cannot
    # read is renamed <step>.unreadable, and the one before is tried. A mismatch (SystemExit) is
    # never retried or renamed; a failing device (JaxRuntimeError) is raised at once.
    for step in sorted(manager.all_steps(), reverse=True):
        step_dir = manager.directory / str(step)
        log(f"restoring step {step} of {manager.directory}")
        state = read_retrying(lambda: restore(step_dir, target, cfg, r, loader), step_dir)
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
        except jax.errors.JaxRuntimeError:  # a failing device, not the files
            raise
        # orbax and tensorstore raise many kinds, some plain Exception (a SystemExit is not an
        # Exception, so restore's one-line mismatch error passes through)
        except Exception as e:
            why = str(e).splitlines()[0][:200]
            print(f"process {jax.process_index()}: reading {step_dir} (try {attempt + 1}): {why}")
            time.sleep(2 ** attempt if attempt + 1 < tries else 0)  # 1, 2, 4 s; none after the last
    # every try failed: returns None


def refuse_fresh_start(out):
    # A directory where a run trained never starts over silently. With no committed checkpoint,
    # checkpoints/ can hold only "tmp" steps (saves cut short) and <step>.unreadable ones:
    #   any <step>.unreadable                -> refuse (a run trained here)
    #   metrics.jsonl and no "tmp" step      -> refuse (a run trained here)
    #   metrics.jsonl and a "tmp" step       -> start fresh (the first save was cut short)
    #   no metrics.jsonl                     -> start fresh (nothing ran here)
    names = [p.name for p in (epath.Path(out) / "checkpoints").glob("*")]
    unreadable = [n for n in names if n.endswith(".unreadable")]
    interrupted = any("tmp" in n for n in names)  # Orbax's name for a step not yet committed
    if unreadable or (epath.Path(out, "metrics.jsonl").exists() and not interrupted):
        found = f"checkpoints {', '.join(unreadable)}" if unreadable else "metrics.jsonl"
        raise SystemExit(f"error: {out} holds a run ({found}) but no checkpoint to resume; "
                         "restore its checkpoints, or use a new --out")


# ----------------------------------------------------------------------------- stopping

def set_up_run(out):  # main calls it after start_jax, before training
    # Ctrl-C and SIGTERM ask for a checkpoint and a stop (request_stop). This comes after
    # start_jax, because JAX's distributed start-up installs its own SIGTERM handler and this one
    # replaces it (Stopper.poll says why not JAX's own preemption sync point).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, request_stop)
    # Every host must see the run directory that process 0 writes (run_mark)
    check_processes_agree(run_mark(out), f"do not see the run directory {out} that process 0 "
                          "writes; give every host the same: a bucket, or a shared disk")


SIGNALS = []  # the signals this process received (the first asked it to stop)


def request_stop(signum, frame):  # checkpoint within two steps, exit (a second Ctrl-C: exit now)
    if SIGNALS and signum == signal.SIGINT:
        raise SystemExit("interrupted; rerun the same command to resume from the last checkpoint")
    SIGNALS.append(signal.Signals(signum).name)
    print(f"{SIGNALS[0]}: checkpointing within two steps, then stopping (Ctrl-C again: now)")


class Stopper:  # stopper.poll(step): why the run stops after step (None: it goes on)
    # The rule: a signal that comes while step s runs stops every process after step s + 1 or
    # s + 2, the same step on all. Why: each process may get a signal at its own moment, so poll
    # does an all-reduce each step, "has any process got a signal?", and every process acts on
    # the answer a step later, as the loop reads metrics a step late: by then the next step is
    # already queued, so the devices do not idle while the host waits for it. A SIGTERM
    # while iteration 8 waits in log.step for step 7's metrics (poll(8) has already asked):
    #   iteration   the answer it reads      the answer it asks for    decision
    #   8           step 7's: no             step 8's: no (asked before the signal)   go on
    #   9           step 8's: no             step 9's: yes             go on
    #   10          step 9's: yes            step 10's: yes            save step 10, exit 75
    # So a signal stops the run within two steps.

    def __init__(self, stop_at, mesh):
        self.stop_at, self.mesh, self.asked = stop_at, mesh, False  # asked: see poll

    def poll(self, step):
        # The all-reduce: per_device has one entry per device, its process's bool(SIGNALS), cut
        # over every device (P(MESH_AXES) = P(("data", "fsdp", "tensor")) cuts its one dimension
        # over all three mesh axes), and jnp.any over it gives every process the same answer. (On
        # one host it is bool(SIGNALS). JAX's preemption sync point, which Orbax offers, misses a
        # SIGTERM that comes before the first step.)
        sharding = NamedSharding(self.mesh, P(olmo3.MESH_AXES))
        per_device = jax.make_array_from_callback((self.mesh.size,), sharding,
                                                  lambda _: np.array([bool(SIGNALS)]))
        # answer: what the last poll asked for, the step before's; self.asked: what
        # this poll asks for, this step's, which the next poll reads
        answer, self.asked = self.asked, jnp.any(per_device)
        if step == self.stop_at:
            return "--stop-at"
        if answer:  # a device array: this `if` is where the host waits for it
            return f"{SIGNALS[0]} received" if SIGNALS else "another process was asked to stop"


# ----------------------------------------------------------------------------- across hosts
# On one machine with one process, these are simple: start_jax finds no cluster, local_rows is
# every row, and device_batch cuts the batch over this machine's devices.

def start_jax(args):
    # Fake CPU devices, then the multi-host start-up, which cannot be forgotten. JAX finds its
    # peers itself on a TPU slice, under SLURM, Open MPI or Kubernetes; elsewhere, --coordinator.
    if args.devices:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # so CPU processes can talk
    # Compiled programs are cached (JAX_COMPILATION_CACHE_DIR, or else in the run directory), so
    # a restart does not compile the 7B step again
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", f"{args.out}/compile-cache")
    try:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    except (ValueError, RuntimeError) as e:
        # What initialize raised, and what happens:
        #   ValueError: no cluster found here                    -> one process: go on
        #   RuntimeError: JAX already runs (the tests call main) -> one process: go on
        #   JaxRuntimeError (a RuntimeError): peers found, but
        #     not reached                                        -> raise
        #   either, with --coordinator (a cluster was asked for) -> raise
        if isinstance(e, jax.errors.JaxRuntimeError) or args.coordinator:
            raise
    if jax.process_count() > 1 and not jax.distributed.is_initialized():
        raise SystemExit("error: several hosts, but JAX found no cluster; give --coordinator")


def local_rows(mesh, r):  # the rows of every global batch that this process's devices hold
    # Every process runs this same program but feeds only its own devices. The batch sharding says
    # which rows each device holds (asked for a width of 1: only the row slices are read, so any
    # width does). On 2 processes of 2 devices with fsdp=4, process 1 holds rows 8-15 of 16.
    # (OLMo-core's rank i of W takes rows i::W instead; the batch, and so the loss, is the same.)
    # held: each of this process's devices -> the (rows, columns) slices of the batch it holds,
    # as (slice(8, 12), slice(None)) for rows 8-11, every column
    held = olmo3.batch_sharding(mesh).addressable_devices_indices_map((r.global_batch, 1))
    return np.unique(np.concatenate([np.arange(r.global_batch)[rows] for rows, _ in held.values()]))


def device_batch(batch, loader, mesh):  # this process's rows -> arrays of the whole batch
    # One jax.Array spans every device of every process. Each process gives its own rows, x
    # [len(loader.rows), seq_len], and the whole batch's shape; JAX hands each of its devices the
    # rows that device holds, in order (with loader.rows 8-15, rows 12-15 are x[4:8]), and no data
    # moves between hosts. On one host, it is jax.device_put(x, sharding).
    shape = lambda x: (loader.global_batch, x.shape[1])  # the whole batch's
    return {name: jax.make_array_from_process_local_data(olmo3.batch_sharding(mesh), x, shape(x))
            for name, x in batch.items()}


# A fresh number (the time in ns) that only process 0 writes, in this run: a host that reads the
# same number sees the directory process 0 writes; one with another disk reads none, or an old one.
def run_mark(out):  # what process 0 writes into the run directory, as this process reads it
    mark = epath.Path(out) / "run-mark.txt"
    if jax.process_index() == 0:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(str(time.time_ns()))
    multihost_utils.sync_global_devices("run mark written")
    return int(mark.read_text()) if mark.exists() else -1


def check_processes_agree(value, problem):  # on several hosts, checks every one has the same value
    every = multihost_utils.process_allgather(np.int64(value))
    differ = np.flatnonzero(every != every[0]).tolist()  # from process 0's
    if differ:
        raise SystemExit(f"error: process(es) {differ} {problem}")


# ----------------------------------------------------------------------------- command line

# the flags whose values are a few names
CHOICES = olmo3.CHOICES | {"schedule": ("cosine", "linear", "olmo3")}


def parse_args(argv=None):  # -> (olmo3.Config, Recipe, args), the preset's with the flags applied
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
    # every field's flag defaults to None, so the fields given are those that are not None
    given = lambda cls: {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                         if getattr(args, f.name) is not None}
    # The layers: the preset's recipe, then STAGE2's fields with --stage2, then every flag given
    r = dataclasses.replace(RECIPES[args.preset], **(STAGE2 if args.stage2 else {}))
    cfg = dataclasses.replace(olmo3.MODELS[args.preset], **given(olmo3.Config))
    return cfg, dataclasses.replace(r, **given(Recipe)), args


def boolean(text):  # "true" or "false" (argparse reports anything else)
    return bool(("false", "true").index(text.lower()))


# An axis left out of --mesh is 1: tensor=2 on 8 devices uses 2 (fsdp=-1,tensor=2 uses all 8).
# (olmo3.make_mesh's own default is fsdp=-1.)
def parse_mesh(text):  # "data=2,fsdp=-1" -> {"data": 2, "fsdp": -1, "tensor": 1}
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    for name, _, value in (part.partition("=") for part in text.split(",")):
        if name not in olmo3.MESH_AXES or not value.lstrip("-").isdigit():
            raise SystemExit(f"error: --mesh {text!r}: expected data=N,fsdp=N,tensor=N (-1: rest)")
        sizes[name] = int(value)
    return sizes


if __name__ == "__main__":
    raise SystemExit(main())
