"""Train OLMo 3: python train.py --preset tiny (CPU, minutes) or --preset 7b --data MIX (a pod).
Rerunning a command resumes its run; one stopped early (a signal, --stop-at) saves, exits 75."""
# Read it from the top down: the recipe, `main`, `train` (setup, then the loop), then the helpers
# down to the optimizer. That is the first read. A banner below it starts the "second read": the
# 7B's schedule, the progress line, and what a pod needs. In every function, `r` is the Recipe
# and `cfg` is the olmo3.Config. Steps count from 1, as in OLMo-core: step s trains on batch s - 1.
import argparse
import contextlib
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


# The training settings. The defaults are AI2's stage 1; RECIPES changes a few fields per preset.
# The tiny one takes a plain cosine, which fits a run of any length.
@dataclasses.dataclass(frozen=True)
class Recipe:
    seq_len: int = 8192
    global_batch: int = 512            # sequences per optimizer step
    micro_batch: int = 0               # sequences per forward/backward over all devices (0: all)
    steps: int = 1_413_814             # one epoch of the mix, ~5.93T tokens
    lr: float = 3e-4
    warmup_steps: int = 2000
    schedule: str = "olmo3"            # "olmo3", "cosine" (to min_lr_ratio * lr) or "linear"
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
                   schedule="cosine", log_every=25, eval_every=100, save_every=100),
    # A micro-batch of 64 fits v5p-128 (39 GiB per device); 250 steps take about 70 minutes there
    "7b": Recipe(micro_batch=64, save_every=250),
    "7b-wide": Recipe(micro_batch=64, save_every=250),
    # Stage 3, long context (OLMo-core's OLMo3-7B-long-context.py): 50B tokens, packed, from
    # stage 2's weights and Adam state (--init-from). docs/reference.md says why 4123 and 0.033.
    "7b-long": Recipe(seq_len=65536, global_batch=64, steps=11_921, lr=2.0712352850360292e-4,
                      warmup_steps=200, schedule="linear", min_lr_ratio=0.0, weight_decay=0.033,
                      data_seed=4123, packing=True, source_group_size=8,
                      source_permutation_seed=123, save_every=250),
}
# Stage 2 (OLMo-3-1025-7B-midtrain.py) starts from stage 1's weights and Adam state (--init-from)
# with a fresh linear schedule to 0. It is a set of changes (--stage2) for 7b and 7b-wide alike.
STAGE2 = dict(global_batch=256, lr=2.0712352850360292e-4, warmup_steps=0, schedule="linear",
              min_lr_ratio=0.0, steps=47_684, data_seed=1337)


# ----------------------------------------------------------------------------- the run

def main(argv=None):
    cfg, r, args = parse_args(argv)  # the preset's Config and Recipe, with the flags applied
    start_jax(args)  # uses fake CPU devices if asked, then joins the hosts of a pod
    if args.dry_run:
        # data.beside imports a file that sits beside the core, or says clearly that it is missing
        return data.beside("prepare").dry_run(cfg, r, args)
    if args.eval_only or args.generate is not None:
        return data.beside("evaluation").main(cfg, r, args)
    # From here on, Ctrl-C and SIGTERM make the run save a checkpoint and stop (request_stop).
    # This must come after start_jax: jax.distributed.initialize installs a SIGTERM handler.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, request_stop)
    check_run_directory(args.out)  # makes the directory; a pod's hosts must all see it
    mesh = olmo3.make_mesh(**args.mesh)  # args.mesh is a dict: {"data": 1, "tensor": 1, "fsdp": -1}
    # The manager is Orbax's CheckpointManager. It lists the saved steps and saves in the
    # background; leaving the `with` waits for its last save, and closes it.
    with jax.set_mesh(mesh), checkpoints(f"{args.out}/checkpoints", r) as manager:
        return train(cfg, r, args, mesh, manager)


# In a plain run on one machine (no pod, no Ctrl-C or SIGTERM, no crash), the names that train
# and its set-up take from elsewhere do only this. These do real work:
#   Log                         log(text) prints a line; log(text, **record) also keeps the
#                               record for metrics.jsonl; log.flush() writes both files
#   olmo3.device_batch(b, mesh) puts the batch's rows on the devices
#   loader.iterate(a, b)        loader.batch(i), nanoGPT's get_batch, for each i from a to b - 1
#   resume                      reads the newest checkpoint (only where the run has one)
#   restore, latest_checkpoint  (--init-from) read the newest step of a checkpoint, after checking
#                               its settings (starting_state says which)
#   save_step                   waits for the last save, writes metrics.jsonl and log.txt, then
#                               manager.save(step, state)
# The rest, there for a pod or for a run that ended early (a stop, a kill or an error), do nothing
# that matters here:
#   signal_flags(mesh)          one False per device (True after a Ctrl-C or a SIGTERM)
#   late_metrics.signalled      False
#   stop_reason                 None (with --stop-at, "--stop-at" at that step)
#   olmo3.local_rows            (in load_data) every row of the batch (a pod's process holds
#                               only some)
#   check_processes_agree       checks nothing
#   refuse_fresh_start          does nothing
#   catch_up                    does nothing on a run's first start. On a resume, it cuts
#                               metrics.jsonl back to the step resumed from, and runs that step's
#                               evaluation if the early end lost it.
def train(cfg, r, args, mesh, manager):  # -> exit code; setup, then the loop: step, log, save, eval
    # args holds the flags that are not Config or Recipe fields, such as args.out, args.data
    log = Log(cfg, r, args.out, mesh)
    # target: the state's arrays described (shape, dtype, sharding), with nothing allocated
    target = abstract_state(cfg, r, mesh)
    log(f"{olmo3.param_count(cfg):,} parameters | {log.kind} {dict(mesh.shape)} | compiling")
    # nanoGPT's torch.compile, ahead of time: a step that does not fit fails here, before any data
    compiled = compile_step(cfg, r, mesh, target)

    # One step, plus "signalled": has any process received a Ctrl-C or a SIGTERM? On one host,
    # that is bool(SIGNALS). It is a device array so that on a pod the jnp.any is an all-reduce
    # over the hosts, read with the metrics, and all stop together.
    # (It runs beside the compiled step, so that train_step holds the update alone.)
    def step_fn(state, batch):
        state, metrics = compiled(state, olmo3.device_batch(batch, mesh))
        return state, metrics | {"signalled": jnp.any(signal_flags(mesh))}

    loader, heldout = load_data(cfg, r, args, mesh)  # nanoGPT's get_batch, and its val split
    evals = make_evals(cfg, r, args, mesh, heldout, log)  # evals(params, step), or None
    # nanoGPT's init_from: a fresh start, a resume, or --init-from (nanoGPT's "gpt2")
    state, note = starting_state(cfg, r, args, manager, target, loader.fingerprint, log)
    done = int(state["step"])  # the steps done before this run: 0, or the checkpoint's step
    log(note)  # "fresh start", "resumed from step 100", or what --init-from carried over
    # every `every` steps, and at the last (so the last step saves, and evaluates)
    due = lambda step, every: step % every == 0 or step == r.steps
    # after a run that ended early: cuts metrics.jsonl back to step done, so that no step has two
    # records there (kill-safe, rule 2)
    catch_up(log, evals, state["params"], done, due(done, r.eval_every))
    # On one device, nanoGPT would write the loop like this:
    #   for step in range(done + 1, r.steps + 1):
    #       state, metrics = step_fn(state, loader.batch(step - 1))  # (1)
    #       log.metrics(step, jax.device_get(metrics))  # (2) waits for this step
    #       if due(step, r.save_every) or step == args.stop_at: manager.save(step, state)  # (3)
    #       if step == args.stop_at: return 75  # (4) (or a Ctrl-C, a SIGTERM); rerun to resume
    #       if due(step, r.eval_every): evals(state["params"], step)  # (5)
    # The loop below reads each step's metrics a step later, so that the devices never wait for
    # the host (LateMetrics), and it learns of a Ctrl-C or a SIGTERM from those metrics.
    late_metrics = LateMetrics(log)
    for step, batch in enumerate(loader.iterate(done, r.steps), start=done + 1):
        state, metrics = step_fn(state, batch)  # (1) returns at once; the devices run the step
        # (2) reads and logs the step before's metrics (a step that saved read its own at once),
        # and keeps this step's on the devices
        late_metrics.add(step, metrics)
        # (3) save, also where (2) read a signal in the step before's metrics
        if due(step, r.save_every) or step == args.stop_at or late_metrics.signalled:
            # this step's record goes to disk just before its checkpoint, so that a kill after the
            # commit cannot lose it (kill-safe, rule 1); this read may find a signal too
            late_metrics.read_pending()
            save_step(manager, log, step, state, cfg, r, loader.fingerprint)
        # (4) stop, if --stop-at says so or a read in (2) or (3) found a signal: either way, (3)
        # saved this step
        stop = stop_reason(step, args.stop_at, late_metrics.signalled)
        if stop and step < r.steps:  # (at the last step, it ends as any run: evaluates, exits 0)
            manager.wait_until_finished()  # until this step's save is committed
            log(f"stopped after step {step} ({stop}), checkpointed: rerun to resume")
            log.flush()
            return 75  # EX_TEMPFAIL: the run stopped before its last step, so rerun to resume
        # (5) after the save, which commits in the background meanwhile
        if evals and due(step, r.eval_every):
            evals(state["params"], step)
    # (the last step is always due, so (3) read its metrics: none are left unread)
    if args.samples and data.have("evaluation"):  # only with evaluation.py
        data.beside("evaluation").samples(state["params"], cfg, r, loader, args.samples, log)
    log(f"done: step {int(state['step'])} in {(time.time() - log.started) / 60:.1f} min")
    log.flush()  # (the last save commits meanwhile; main's `with` waits for it)
    return 0


class LateMetrics:  # late_metrics.add(step, metrics) after each step
    # Keeps each step's metrics on the devices until the next step has been dispatched, then
    # reads them. step_fn returns at once, so while the host waits for step 149's metrics,
    # step 150 keeps the devices busy:
    #   host:     dispatch 150 | read 149's metrics | dispatch 151 | read 150's metrics ...
    #   devices:  ... 149 ...  | 150 ............................ | 151 ..................
    # (nanoGPT's loss.item() after each step would leave the devices idle.) A step that saves
    # reads its own metrics at once (read_pending), so that its checkpoint's metrics.jsonl holds
    # its record. Ten skipped updates in a row end the run with an error.

    def __init__(self, log):
        # pending: the last step's (step, metrics), still on the devices, or None
        self.log, self.pending, self.skipped, self.signalled = log, None, 0, False

    def add(self, step, metrics):  # reads the last step's metrics, and keeps this step's
        self.read_pending()
        self.pending = (step, metrics)

    def read_pending(self):  # reads the kept step's metrics, if any, and logs them
        if self.pending is not None:
            # waits for the devices, like loss.item(); nothing is pending after
            (step, m), self.pending = jax.device_get(self.pending), None
            self.skipped = self.skipped + 1 if m["skipped"] else 0
            self.signalled = self.signalled | bool(m["signalled"])
            self.log.metrics(step, m)  # a line every log_every steps, and one for each skip
            if self.skipped == 10:  # stuck (the newest checkpoint holds good weights)
                self.log.flush()
                raise SystemExit("error: 10 updates in a row skipped; lower --lr or check the data")


# ----------------------------------------------------------------------------- data and evaluation

def load_data(cfg, r, args, mesh):  # -> (this process's train loader, its held-out mix or None)
    source, heldout = args.data, None
    if source is None and cfg.tokenizer != "bytes":
        raise SystemExit("error: --data is required with the dolma2 tokenizer: a mix file, token "
                         "files, or a `python data.py tokenize` folder (or stdlib, shakespeare)")
    if source in (None, "stdlib", "shakespeare"):
        source, heldout = data.corpus(source if source else "stdlib", cfg.tokenizer)
    elif os.path.isfile(os.path.join(source, "heldout.txt")):  # a tokenize folder brings its own
        heldout = os.path.join(source, "heldout.txt")
    # rows: the rows of each batch that this process's devices hold (on one host, all of them)
    rows = olmo3.local_rows(mesh, r.global_batch)
    options = dict(rows=rows, tokenizer=cfg.tokenizer, root=args.data_root,
                   vocab_size=cfg.vocab_size, permutation_seed=r.source_permutation_seed)
    # A packed run, too, builds this plain Loader first: its fingerprint lets the hosts compare
    # their token files before process 0 spends minutes packing them.
    loader = data.Loader(source, r.seq_len, r.global_batch, r.data_seed, **options)
    # On a pod, every host must read the same token files (on one host, this checks nothing)
    check_processes_agree(loader.fingerprint, "have other token files than process 0; check --data")
    # Stage 3 packs documents into rows: process 0 packs the files once, into the run directory,
    # and every process reads the result
    if r.packing:
        options |= dict(group_size=r.source_group_size, cache=args.out, rank=jax.process_index())
        loader = data.PackedLoader(source, r.seq_len, r.global_batch, r.data_seed, **options)
    return loader, heldout


def make_evals(cfg, r, args, mesh, heldout, log):  # -> evals(params, step), or None
    # evaluation.py measures perplexity on --eval-data's sets (else the corpus's held-out set)
    # and scores --eval-tasks. Without evaluation.py, the held-out set is skipped.
    if args.eval_data or args.eval_tasks or (heldout and data.have("evaluation")):
        sets = args.eval_data if args.eval_data else heldout
        return data.beside("evaluation").evaluator(cfg, r, mesh, sets, args, log)
    # else None: nothing to evaluate (no flag, and no held-out set or no evaluation.py)


# ----------------------------------------------------------------------------- the state
# The state is one pytree, a dict of four entries; tiny's, with the arrays' shapes (its 258 byte
# ids padded to 384 rows, olmo3.Config.padded_vocab):
#   params      {"embed": [384, 256], "blocks": {"q": [4, 256, 256], ...}, "lm_head": [256, 384]...}
#   opt_state   Adam's (count [], mu, nu), where mu and nu are shaped as params
#   step        [], the steps done
#   history     [2, 128], the spike guard's last 128 losses and grad norms
# One description of it, target, drives the rest. abstract_state makes it: every array's shape,
# dtype and sharding, with nothing allocated. init_state creates a fresh state that matches it,
# restore reads a checkpoint onto it, and compile_step compiles the step for it.

shardings_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)

# optax's Adam, whose state is opt_state (adamw adds the weight decay, and says why)
adam = lambda r: optax.scale_by_adam(r.beta1, r.beta2, r.adam_eps)
HISTORY = 128  # the spike guard's window (OLMo-core's rolling_interval_length)


def fresh_state(r, params):  # the training state before step 1
    return {"params": params, "opt_state": adam(r).init(params), "step": jnp.int32(0),
            "history": jnp.zeros((2, HISTORY))}


def abstract_state(cfg, r, mesh):  # fresh_state's tree, described, with nothing allocated
    # Each leaf is a jax.ShapeDtypeStruct: a shape, a dtype and a sharding. Because the
    # shardings are known before anything exists, the 7B's state is never whole on one device.
    # (jax.eval_shape(fresh_state) would give the shapes but no shardings.)
    params = olmo3.abstract_params(cfg, mesh)  # each weight cut as olmo3.AXIS_RULES says
    # whole: an array that every device holds all of (P() cuts no dimension)
    whole = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))
    # Adam's mu and nu are cut like params (ZeRO-3); adam(r).init returns this same type
    opt = optax.ScaleByAdamState(count=whole((), jnp.int32), mu=params, nu=params)
    return {"params": params, "opt_state": opt, "step": whole((), jnp.int32),
            "history": whole((2, HISTORY), jnp.float32)}


# jit with out_shardings: each device computes only its own shards of the new state, so no
# device ever holds the whole 7B. The random draws are made shard by shard too, and give the same
# numbers on any mesh (jax_threefry_partitionable, JAX's default).
def init_state(cfg, r, target):
    make = lambda key: fresh_state(r, olmo3.init(cfg, key))
    return jax.jit(make, out_shardings=shardings_of(target))(jax.random.key(r.seed))


def starting_state(cfg, r, args, manager, target, data_fingerprint, log):  # -> (state, note)
    # There are three ways to start:
    #   resume       The run directory has a checkpoint: read the whole state from the newest.
    #   fresh        init_state's new weights, and Adam's moments at zero.
    #   --init-from  Fresh, then another checkpoint's params, and its Adam state too if it has
    #                one (stages 2 and 3). Step and history, and so the LR schedule, start at 0.
    # What the checkpoint's settings must match (restore checks; NUMERICS are free to differ):
    #   resume       the model's, DATA_ORDER's and the data's (the token files' fingerprint)
    #   --init-from  the model's but YaRN's (stage 3 turns YaRN on over stage 2's weights)
    if manager.latest_step() is not None:
        return resume(cfg, r, manager, target, data_fingerprint, log)  # (state, "resumed ...")
    refuse_fresh_start(args.out)  # where a run's checkpoints were lost (kill-safe)
    state = init_state(cfg, r, target)
    if not args.init_from:
        return state, "fresh start"
    # restore reads what the checkpoint has: params alone from a converted model, the whole
    # state from a run. Not resuming, it checks only the model's settings.
    restored = restore(latest_checkpoint(args.init_from), target, cfg, resuming=False)
    # "Warm Adam": params and opt_state (Adam's moments and its count) carry over, nothing else
    carried = {k: restored[k] for k in ("params", "opt_state") if k in restored}
    return state | carried, f"{' and '.join(carried)} of {args.init_from}"


# ----------------------------------------------------------------------------- the step

# Ahead of time: --dry-run compiles the same step, and a step that does not fit fails at start-up.
def compile_step(cfg, r, mesh, target):
    micro = r.micro_batch if r.micro_batch else r.global_batch
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    # the batch splits into whole micro-batches, and each of them evenly over the data-parallel
    # devices
    if r.global_batch % micro or micro % dp:
        raise SystemExit(f"error: global batch {r.global_batch} / micro batch {micro} / {dp} "
                         "data-parallel devices do not divide; pick multiples of each other")
    # each array of the batch, described: [global_batch, seq_len] int32, its rows cut over the
    # data-parallel devices
    array = jax.ShapeDtypeStruct((r.global_batch, r.seq_len), jnp.int32,
                                 sharding=olmo3.batch_sharding(mesh))
    batch = dict(inputs=array, labels=array) | (dict(segments=array) if r.packing else {})

    n_micro = r.global_batch // micro
    # jax.jit's arguments:
    #   static_argnames   cfg, r and n_micro are Python values, fixed when the step is traced
    #                     (frozen dataclasses are hashable, as jit needs)
    #   donate_argnames   the new state reuses the old one's buffers, so memory holds one copy
    #   out_shardings     the new state keeps target's shardings (None: XLA picks the metrics')
    # lower() traces the step for ShapeDtypeStructs, which carry their shardings (so jit needs no
    # in_shardings), and compile() compiles it before any data exists. The compiled step takes
    # only arrays: compiled(state, batch) -> (state, metrics).
    jitted = jax.jit(train_step, static_argnames=("cfg", "r", "n_micro"), donate_argnames="state",
                     out_shardings=(shardings_of(target), None))
    return jitted.lower(target, batch, cfg=cfg, r=r, n_micro=n_micro).compile()


def train_step(state, batch, cfg, r, n_micro):  # one update over n_micro micro-batches
    # -> (the new state, metrics). The batch holds inputs and labels (and segments when
    # packed), each [batch, seq_len].
    # It is written as for one device: batch and params are global arrays cut over the mesh,
    # and XLA inserts the communication (olmo3.py's sharding comment, part three).
    params = state["params"]
    # The counters at step s:
    #   the batch       s - 1 (the loader counts batches from 0)
    #   the LR          schedule(r)(s): s is OLMo-core's k
    #   state["step"]   the steps done: s - 1 before this step, s after it (a checkpoint's step)
    #   Adam's count    the updates made, over every stage (warm Adam carries it on); only its
    #                   bias correction reads it (adamw says why it is not the LR's step)
    step = state["step"] + 1  # s, this step
    # -- The loss and its gradients, over the micro-batches (nanoGPT's forward and backward)
    # Each micro-batch's loss sum is divided by the whole batch's target count, so the sum over
    # micro-batches is the batch's mean loss.
    n_tokens = jnp.maximum(jnp.sum(batch["labels"] >= 0), 1)

    def loss(params, micro):
        segments = micro.get("segments") if r.doc_masking else None  # keeps documents apart
        logits = olmo3.forward(params, micro["inputs"], cfg, segments)
        ce_sum, z_sum, _ = olmo3.loss_terms(logits, micro["labels"], r.z_loss)
        # CE + z-loss is differentiated; CE alone is logged
        return (ce_sum + z_sum) / n_tokens, ce_sum / n_tokens
    # grad_fn(params, micro) -> ((loss, ce), grads). has_aux means ce is passed through as is.
    grad_fn = jax.value_and_grad(loss, has_aux=True)

    if n_micro == 1:  # one micro-batch: the plain step, with no scan around it
        (_, ce), grads = grad_fn(params, batch)
    else:  # a scan over the micro-batches sums their gradients and losses
        def add_micro(sums, micro):  # sums = (the gradients so far, the loss so far)
            grads_so_far, ce_so_far = sums
            (_, ce), grads = grad_fn(params, micro)
            return (jax.tree.map(jnp.add, grads_so_far, grads), ce_so_far + ce), None
        zeros = (jax.tree.map(jnp.zeros_like, params), 0.0)
        micros = jax.tree.map(lambda x: split_micro(x, n_micro), batch)
        (grads, ce), _ = jax.lax.scan(add_micro, zeros, micros)
    # -- Clipping (nanoGPT's clip_grad_norm_)
    grad_norm = optax.tree.norm(grads)  # before clipping (the spike guard watches it too)
    # optax's clip_by_global_norm, written out because the spike guard needs the same norm
    clip = lambda g: jnp.where(grad_norm < r.grad_clip, g, g / grad_norm * r.grad_clip)
    # -- AdamW, at this step's LR (nanoGPT's optimizer.step())
    lr = schedule(r)(step)
    # updated: {params, opt_state} after the update
    updated = adamw(params, state["opt_state"], jax.tree.map(clip, grads), lr, r)
    # -- The spike guard (OLMo-core's), which may skip the update
    # spikes [2]: did the loss, did the grad norm spike? It watches CE, as OLMo-core does.
    spikes, history = spike_guard(state["history"], step, jnp.stack([ce, grad_norm]))
    # A NaN or inf in either value is always skipped, even with --spike-guard false
    # (r.spike_guard is a Python bool, fixed when the step is traced: False makes the `&` False)
    skip = (~jnp.isfinite(ce + grad_norm)) | (spikes.any() & r.spike_guard)
    # A skip keeps the old params and Adam state (its count too); step and history advance
    old = {"params": params, "opt_state": state["opt_state"]}  # before this step
    new = jax.tree.map(lambda upd, before: jnp.where(skip, before, upd), updated, old)
    # -- The metrics, which the loop reads a step late
    metrics = {"loss": ce, "grad_norm": grad_norm, "lr": lr, "skipped": skip, "spikes": spikes}
    return new | {"step": step, "history": history}, metrics


def split_micro(x, n_micro: int):
    # [global, ...] -> [n_micro, global/n_micro, ...], without moving a row between devices.
    # A plain reshape would put all of micro-batch 0 on the first devices, so the micro-batches
    # are strided: 8 rows in 2 micro-batches become [[0 2 4 6], [1 3 5 7]], and a device that
    # holds rows 0-3 gives rows 0 and 2 to micro-batch 0, rows 1 and 3 to micro-batch 1.
    x = x.reshape(x.shape[0] // n_micro, n_micro, *x.shape[1:]).swapaxes(0, 1)
    return olmo3.constrain(x, None, "batch", "seq")


# ----------------------------------------------------------------------------- the spike guard

def spike_guard(history, step, values):  # (1-based) -> (is each a spike, the history with them)
    # As plain Python, for each of the two values (before: its values at the steps before this):
    #   window = before[-128:]
    #   spike = step >= 64 and not value - mean(window) <= 6 * std(window)  # NaN spikes too
    #   before.append(value if isfinite(value) else mean(window))
    # OLMo-core's SkipStepOptimizer, for values = [loss, grad norm]. history [2, 128] is a ring
    # buffer: step k's values go to slot (k - 1) % 128, so at step 4 slots 0-2 hold steps 1-3.
    # [128]: which slots hold a value (all of them from step 129 on)
    filled = jnp.arange(HISTORY) < step - 1
    n_filled = jnp.sum(filled)  # how many values the history holds
    mean = jnp.sum(jnp.where(filled, history, 0.0), -1) / jnp.maximum(n_filled, 1)
    square = jnp.where(filled, (history - mean[:, None]) ** 2, 0.0)
    std = jnp.sqrt(jnp.sum(square, -1) / jnp.maximum(n_filled - 1, 1))  # torch.std's n - 1
    # OLMo-core checks once its list holds 64 values (half a window), this step's included: at
    # step 64, this step's value against the mean and std of the 63 before it.
    # Only a rise counts; NaN spikes too (the comparison is False, so `~` makes it True).
    spikes = (step >= HISTORY // 2) & ~(values - mean <= 6 * std)
    # a value that is not finite is kept out of the history, or every later step would spike
    kept = jnp.where(jnp.isfinite(values), values, mean)
    return spikes, history.at[:, (step - 1) % HISTORY].set(kept)


# ----------------------------------------------------------------------------- the optimizer

def schedule(r: Recipe):  # -> a function: step k (1-based) -> its LR
    # OLMo-core's schedules, for its step k, with peak P, floor F, warmup W and t_max T:
    #   CosWithWarmup:    P k / W for k < W, then F + (P - F) (1 + cos(pi (k - W) / (T - W))) / 2
    #   LinearWithWarmup: P k / W for k < W, then P - (P - F) (k - W) / (T - W)
    # For example, the tiny preset's cosine (P 3e-3, W 50, T 500) gives 6e-5 at step 1, the peak
    # 3e-3 at step 50, 1.65e-3 at step 275 (halfway down), and F = 3e-4 at step 500, the last.
    # optax's schedules count from 0. They are given OLMo-core's 1-based k, so that step 1's LR
    # is P / W, as in OLMo-core.
    peak, floor, warmup = r.lr, r.lr * r.min_lr_ratio, r.warmup_steps
    # "olmo3" is AI2's stage 1, in two parts (for the 7b presets; olmo3_stage1, second read)
    if r.schedule == "olmo3":
        return olmo3_stage1(peak, floor, warmup, r.global_batch * r.seq_len)
    # "linear" is LinearWithWarmup above: join_schedules runs the first part up to W, then hands
    # the second k - W. Stage 2's (P 2.07e-4, W 0, T 47,684) reaches P / 2 at step 23,842.
    if r.schedule == "linear":
        decay = optax.linear_schedule(peak, floor, max(r.steps - warmup, 1))
        return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])
    # "cosine" is CosWithWarmup above. optax's arguments, in order: the LR at 0, the peak, the
    # warmup's steps, the decay's steps (T, the warmup included), and the floor. (The max() keeps
    # a run no longer than its warmup valid: optax needs decay_steps > warmup.)
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(r.steps, warmup + 1), floor)


# AdamW, as in torch and OLMo-core: p - lr * (adam(clip(g)) + wd * p), with no weight decay on
# the embedding. Why not optax.adamw: it reads its LR at a count kept in its optimizer state,
# which warm Adam carries from stage 1 (about 1.4M) into stage 2, past the end of stage 2's
# 47,684-step schedule: an LR of 0 throughout. Here Adam's count feeds only its bias correction,
# and the LR follows the run's own step (train_step).
def adamw(params, opt_state, grads, lr, r):  # grads, clipped -> the updated {params, opt_state}
    # Adam's direction, m^ / (sqrt(v^) + eps), bias-corrected with Adam's count
    updates, opt_state = adam(r).update(grads, opt_state)
    # + wd * p on every weight but the embedding (as in OLMo-core)
    decayed = jax.tree.map(lambda u, p: u + r.weight_decay * p, updates, params)
    updates = decayed | {"embed": updates["embed"]}  # the embedding's update, undecayed
    new_params = jax.tree.map(lambda p, u: p - lr * u, params, updates)  # p - lr (adam + wd p)
    return {"params": new_params, "opt_state": opt_state}


# =============================================================================
# The second read, in this order: the 7B's schedule, the progress line (Log), then what the 7B
# needs on a pod (checkpoints and their kill-safe part, stopping, several hosts), then the command
# line. JAX's terms for several hosts (process_allgather, ...) are in the README's JAX glossary.
# =============================================================================


# ----------------------------------------------------------------------------- the 7B's schedule

# Returns a function: step k -> its LR, for peak P, floor F, warmup W and the tokens in a step.
def olmo3_stage1(peak, floor, warmup, tokens_per_step):
    # AI2 ran stage 1 in two parts (OLMo-core's OLMo-3-1025-7B-pretrain-1.py and -2.py; see
    # "Stage 1's learning rate" in docs/reference.md). Part 1, up to step 596,047, is schedule's
    # CosWithWarmup aimed at T1 steps, 5T tokens. Part 2 starts at step 596,048, where AI2
    # restarted. It is OLMo-core's HalfCosWithWarmup, aimed at 7T tokens: a warmup to (F + P) / 2
    # at step W2, then the second half of a cosine from P to F, which reaches F at T2:
    #   ((F + P) / 2) k / W2 for k < W2,
    #   then F + (P - F) (1 + cos(pi (k - W2 + T2 - W2) / (2 (T2 - W2)))) / 2
    # For the 7b, T1 = 1,192,093, T2 = 1,668,931 and W2 = 597,046. The LR (P 3e-4, F 3e-5) is:
    #   step 1            1.5e-7     part 1's warmup, P k / W
    #   step 2,000        3.0e-4     the peak, P
    #   step 596,047      1.654e-4   part 1's last step, on its cosine
    #   step 596,048      1.647e-4   part 2's first, just inside its warmup
    #   step 597,046      1.650e-4   W2: part 2's warmup ends at (F + P) / 2, then it decays
    #   step 1,413,814    3.93e-5    the last step, 0.131 P
    # 5T and 7T tokens' steps, rounded up
    T1, T2 = -(-int(5e12) // tokens_per_step), -(-int(7e12) // tokens_per_step)
    # -2.py's W2 is original_max_steps // 2 + original_warmup_steps // 2, where original_max_steps
    # is 5T tokens' steps rounded down (an integer division, unlike T1)
    W2 = int(5e12) // tokens_per_step // 2 + warmup // 2
    part1 = optax.warmup_cosine_decay_schedule(0.0, peak, warmup, T1, floor)  # as schedule's
    # the formula's angle: from pi / 2 at W2 to pi at T2, where it stays
    angle = lambda k: jnp.pi * (jnp.minimum(k, T2) - W2 + T2 - W2) / (2 * (T2 - W2))
    part2 = lambda k: jnp.where(k < W2, (peak + floor) / 2 * k / W2,
                                floor + (peak - floor) * (1 + jnp.cos(angle(k))) / 2)
    # AI2's restart, a fact of its run (at 512 x 8,192 tokens a step), in this run's steps:
    # another --global-batch or --seq-len restarts after the same tokens, not the same steps
    restart_step = 596_048 * 512 * 8192 // tokens_per_step
    return lambda k: jnp.where(k < restart_step, part1(k), part2(k))


# ----------------------------------------------------------------------------- the progress line

# For the MFU: dense bf16 TFLOP/s per JAX device (Ironwood, TPU7x, has two devices per chip). The
# first name found in the device's kind wins, so "v5 lite" must come before "v5".
PEAK_TFLOPS = {"v5 lite": 197, "v5e": 197, "v5p": 459, "v5": 459, "v6 lite": 918, "v6e": 918,
               "7x": 2307 / 2, "v4": 275, "h100": 989, "h200": 989, "a100": 312}


class Log:  # process 0's console lines and metric records, in RUN_DIR/log.txt and metrics.jsonl
    # It prints the progress line (log.metrics) and other lines (log(text)). It keeps both files
    # in the run directory, not on a host's disk, which a spot slice loses with the slice.

    def __init__(self, cfg, r, run_dir, mesh):
        self.cfg, self.r, self.run_dir, self.mesh = cfg, r, run_dir, mesh
        # last is the (step, time) of the last progress line
        self.started, self.last = time.time(), None
        self.kind = mesh.devices.flat[0].device_kind  # "TPU v5p", "NVIDIA H100 80GB HBM3", "cpu"
        self.peak = next((v for name, v in PEAK_TFLOPS.items() if name in self.kind.lower()), None)
        self.files = {name: epath.Path(run_dir, name) for name in ("metrics.jsonl", "log.txt")}
        # a resumed run keeps the lines written before
        self.lines = {name: path.read_text().splitlines(True) if path.exists() else []
                      for name, path in self.files.items()}

    # log(text) prints a line, and keeps it for log.txt. log(text, **record) also keeps the record,
    # the line's numbers, for metrics.jsonl. (Only process 0 prints and keeps.)
    def __call__(self, text, **record):
        if jax.process_index() == 0:
            self.lines["log.txt"].append(text + "\n")
            if record:
                self.lines["metrics.jsonl"].append(json.dumps(record) + "\n")
            try:
                print(text, flush=True)
            # The console is gone (a Ctrl-C stops `| tee` too), but the run must still save and
            # stop: stdout goes to /dev/null from here (log.txt keeps every line)
            except OSError:
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)

    # Rewrites each file whole and atomically (an object store cannot append), draws loss.png.
    # save_step calls it just before each save, so that a kill after the save commits cannot lose
    # the records up to it (kill-safe, rule 1).
    def flush(self):
        if jax.process_index() == 0:
            for name, path in self.files.items():  # (check_run_directory made the directory)
                path.with_suffix(".tmp").write_text("".join(self.lines[name]))
                path.with_suffix(".tmp").replace(path)
            if data.have("evaluation"):
                data.beside("evaluation").plot(self.run_dir, self.lines["metrics.jsonl"])

    # a step's metrics, read to the host: a line for a skipped update, one every log_every steps
    def metrics(self, step, m):
        m = {k: v.tolist() for k, v in m.items()}  # numpy -> Python numbers, for JSON
        if m["skipped"]:  # by the spike guard (spikes says which of [loss, grad norm]), or a NaN
            self(f"step {step}: update skipped (loss {m['loss']:.4f}, grad norm "
                 f"{m['grad_norm']:.4f})", step=step, spikes=m["spikes"])
        # the progress line comes every log_every steps, and at the last step
        if step % self.r.log_every and step != self.r.steps:
            return
        now, tokens, rate = time.time(), self.r.global_batch * self.r.seq_len, None
        line = [f"step {step:>6}/{self.r.steps}", f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}",
                f"grad norm {m['grad_norm']:.3f}"]
        # the rate, MFU and ETA need the time since the last line, so the first line has none
        if self.last:
            rate = (step - self.last[0]) * tokens / (now - self.last[1])
            tflops = rate * olmo3.flops_per_token(self.cfg, self.r.seq_len) / self.mesh.size / 1e12
            mfu = f"{100 * tflops / self.peak:.1f}%" if self.peak else "n/a"
            eta = datetime.timedelta(seconds=round((self.r.steps - step) * tokens / rate))
            line += [f"{rate:,.0f} tok/s", f"MFU {mfu}", f"ETA {eta}"]
        self.last = (step, now)
        # (time: the seconds since train began, so from 0 again after a resume)
        self(" | ".join(line), step=step, loss=m["loss"], lr=m["lr"], grad_norm=m["grad_norm"],
             tokens_per_s=rate, time=now - self.started)


# ----------------------------------------------------------------------------- checkpoints
# The plain save and load, first (evaluation.py and convert.py call all of them but restore):
#   checkpoints        Orbax's CheckpointManager for a run's checkpoints/ folder
#   save               manager.save(step, Composite(params=..., train_state=..., config=...))
#   restore            reads a step's items onto target's shapes and shardings, after checking
#                      that its model (and for a resume, its data order and data) are this run's
#   saved_settings     a step's settings (its config item)
#   read_item          reads one item, params or train_state
#   latest_checkpoint  the newest step of a run directory, or of a converted checkpoint
# The "kill-safe" section below makes them safe through a kill at any moment, and on a pod.

# a checkpoint's train_state item: every entry of the state but params (opt_state, step, history)
train_state_of = lambda state: {k: v for k, v in state.items() if k != "params"}
DATA_ORDER = ("seq_len", "global_batch", "data_seed", "packing", "source_group_size",
              "source_permutation_seed")  # Recipe's fields a resumed run must keep (restore)


# r says which steps to keep (a read-only manager, as latest_checkpoint's, deletes none anyway)
def checkpoints(directory, r=Recipe(), read_only=False):
    path = directory if "://" in directory else os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=r.keep_checkpoints, keep_period=r.keep_every,
                                           create=not read_only, read_only=read_only)
    return ocp.CheckpointManager(path, options=options)


# manager.save(step, state), with the run's settings. It returns once Orbax has copied the state
# to host memory, and writes the files in the background. (convert.py saves params alone.)
def save(manager, step, state, cfg, r=None, data_fingerprint=None):
    saves = {"params": ocp.args.StandardSave(state["params"])}
    if "opt_state" in state:
        saves["train_state"] = ocp.args.StandardSave(train_state_of(state))
    config = ocp.args.JsonSave(run_settings(cfg, r, data_fingerprint))
    manager.save(step, args=ocp.args.Composite(**saves, config=config))


# the settings a step keeps, as JSON: {"model": Config's fields, "recipe": Recipe's, "data": the
# token files' fingerprint}
def run_settings(cfg, r=None, data_fingerprint=None):
    return {"model": dataclasses.asdict(cfg), "data": data_fingerprint,
            "recipe": dataclasses.asdict(r) if r is not None else {}}


# What must match the checkpoint: the model's settings, always; the data order and the data too
# when resuming (--init-from does not resume). evaluation.py and convert.py do not call it: they
# read a checkpoint with its own settings.
def restore(step_dir, target, cfg, resuming=False, r=None, data_fingerprint=None):
    # Reads the arrays onto target's shardings, whatever mesh wrote them. Given --d-model 2048 for
    # a 7B checkpoint, theirs["d_model"] = 4096, and ours 2048
    theirs = compared_settings(saved_settings(step_dir), resuming)
    ours = compared_settings(run_settings(cfg, r, data_fingerprint), resuming)
    # every setting whose values differ, as 'd_model=4096 (command line: 2048)' (the keys of
    # theirs | ours are every key of either, in a fixed order)
    diff = [f"{f}={theirs.get(f)!r} (command line: {ours.get(f)!r})" for f in theirs | ours
            if theirs.get(f) != ours.get(f)]
    if diff:
        raise SystemExit(f"error: checkpoint {step_dir} has {', '.join(diff)}; use a new --out, "
                         "or the settings and data it was made with")
    state = {"params": read_item(step_dir / "params", target["params"])}
    # train_state too, where the target asks for it and the checkpoint has it (a converted one
    # holds params alone)
    if "opt_state" in target and (step_dir / "train_state").exists():
        state |= read_item(step_dir / "train_state", train_state_of(target))
    return state


# a step's run_settings, read back
saved_settings = lambda step: ocp.JsonCheckpointHandler().restore(epath.Path(step) / "config")


def compared_settings(settings, resuming):  # run_settings' -> the fields that must match (a dict)
    # the model's fields but NUMERICS (and YaRN's for --init-from: stage 3 turns YaRN on over
    # stage 2's weights), and for a resume DATA_ORDER's fields and the data's fingerprint
    exempt = lambda f: f in olmo3.NUMERICS or (not resuming and f.startswith("yarn_"))
    fields = {f: v for f, v in settings["model"].items() if not exempt(f)}
    if resuming:  # (a checkpoint of another version may lack the recipe: its fields are None)
        recipe = settings.get("recipe", {})
        fields |= {f: recipe.get(f) for f in DATA_ORDER} | {"data": settings.get("data")}
    return fields


def read_item(path, tree):  # reads one item of a checkpoint step onto tree's shapes and shardings
    # each leaf's path and shape, such as [("opt_state/mu/embed", (384, 256)), ...]
    layout = lambda tree: sorted((jax.tree_util.keystr(k, simple=True, separator="/"),
                                  tuple(x.shape)) for k, x in jax.tree.leaves_with_path(tree))
    # another layout means the code changed since the save: fail, and never retry
    if layout(ocp.StandardCheckpointHandler().metadata(path)) != layout(tree):
        raise SystemExit(f"error: checkpoint {path.parent} holds a {path.name} layout this code "
                         "does not make; resume with the version that wrote it, or a new --out")
    return ocp.StandardCheckpointHandler().restore(path, args=ocp.args.StandardRestore(tree))


def latest_checkpoint(path):  # the newest step of a run directory or of a converted checkpoint
    for directory in (f"{path}/checkpoints", path):
        step = checkpoints(directory, read_only=True).latest_step()  # None if there is none
        if step is not None:
            return epath.Path(directory) / str(step)
    raise SystemExit(f"error: no checkpoint in {path}; pass a run directory or a converted one")


# ----------------------------------------------------------------------------- kill-safe
# Orbax saves a step in the background under a temporary name, then commits it atomically, so a
# kill loses only the steps since the last commit. Beside checkpoints/, metrics.jsonl must keep in
# step with them, and committed.txt remembers that a run committed one. Three rules:
#   1. metrics.jsonl holds every record up to each checkpoint: save_step writes it just before
#      the save (written after, a kill between the commit and the write would lose those records
#      for good, since a rerun resumes past their steps).
#   2. No step has two records: catch_up cuts the file back to the step each start resumes from.
#   3. A run whose checkpoints are gone is not silently started over: refuse_fresh_start refuses
#      where committed.txt exists.
# A save at step 200 (save_every 100), and what a kill at each moment leaves:
#   moment                                    on disk                     a rerun
#   1. wait for save 100 to commit            records 1-100, ckpt 100     resumes from 100
#   2. write metrics.jsonl, committed.txt     records 1-200, ckpt 100     resumes from 100, cuts
#      (100, the newest committed)                                        records 101-200
#   3. save 200; Orbax commits it later       ckpt 200 once committed     resumes from 200 once
#                                                                         committed, else as 2
#   4. evaluate step 200                      the same                    as after 3
# An evaluation's record reaches metrics.jsonl with the next flush: the next save's (moment 2), or
# the run's last. So where metrics.jsonl lacks the evaluation of the step a rerun resumes from
# (after a kill at 1, 3 or 4, or between saves), the rerun runs it first (catch_up).
# committed.txt names the newest committed step, which the run learns only by waiting for it: so
# save 100 writes none, save 200 writes 100, save 300 writes 200. A run that loses checkpoint 100
# before save 200 starts over: at most save_every steps lost. On a pod, resume has every process
# read the same step. The tests `pytest -k "kill or resume or fresh or commit"` kill real runs at
# each moment, and check that the rerun matches an unbroken run.


def save_step(manager, log, step, state, cfg, r, data_fingerprint):  # the loop's save
    manager.wait_until_finished()  # moment 1: the previous save
    log.flush()  # moment 2: writes metrics.jsonl (rule 1) and log.txt
    # after the wait, latest_step() is the newest committed checkpoint (rule 3; process 0 writes)
    if manager.latest_step() is not None and jax.process_index() == 0:
        (manager.directory.parent / "committed.txt").write_text(f"{manager.latest_step()}\n")
    save(manager, step, state, cfg, r, data_fingerprint)  # moment 3


def refuse_fresh_start(out):
    # where there is no checkpoint: metrics.jsonl alone is a run killed before its first commit,
    # and starts afresh; committed.txt, or steps that resume renamed unreadable, are refused
    unreadable = [p.name for p in (epath.Path(out) / "checkpoints").glob("*.unreadable")]
    if unreadable or (epath.Path(out) / "committed.txt").exists():
        found = f"checkpoints {', '.join(unreadable)}" if unreadable else "committed.txt"
        raise SystemExit(f"error: {out} holds a run ({found}) but no checkpoint to resume; "
                         "restore its checkpoints, or use a new --out")


def catch_up(log, evals, params, done, eval_due):  # metrics.jsonl and evaluations, up to step done
    # Mends what a run that ended early (a stop, a kill or an error) left: drops the records past
    # step done (rule 2; all of them on a fresh start), and runs step done's evaluation if one
    # is due and metrics.jsonl lacks it (a stop skips it; a kill before the next flush loses its
    # record).
    records = [rec for rec in map(json.loads, log.lines["metrics.jsonl"]) if rec["step"] <= done]
    log.lines["metrics.jsonl"] = [json.dumps(rec) + "\n" for rec in records]
    # an evaluation's record has keys that start with "eval/" (evaluation.evaluator's)
    evaluated = any(k.startswith("eval/") for rec in records if rec["step"] == done for k in rec)
    if evals and done and eval_due and not evaluated:
        evals(params, done)


def resume(cfg, r, manager, target, data_fingerprint, log):
    # Reads the newest checkpoint that every process can read. Each process reads it itself,
    # with retries, then an all-gather of the outcomes decides for all of them (Orbax's own
    # restore would hang at a barrier if one process failed). A step that some process cannot
    # read is renamed <step>.<time>.unreadable, and the step before it is tried.
    for step in sorted(manager.all_steps(), reverse=True):
        step_dir = manager.directory / str(step)
        log(f"restoring step {step} of {manager.directory}")
        state = read_retrying(restore, step_dir, target, cfg, resuming=True, r=r,
                              data_fingerprint=data_fingerprint)
        read = multihost_utils.process_allgather(np.int32(state is not None))
        if read.all():
            return state, f"resumed from step {step}"
        failed = np.flatnonzero(read == 0).tolist()
        if jax.process_index() == 0:  # a new name each time: the step saved again may fail again
            step_dir.rename(manager.directory / f"{step}.{time.time_ns()}.unreadable")
        log(f"checkpoint {step} is unreadable on process(es) {failed}: renamed {step}.*.unreadable")
        multihost_utils.sync_global_devices("unreadable checkpoint renamed")
        manager.reload()
    raise SystemExit(f"error: no checkpoint in {manager.directory} can be read (see above); fix "
                     "the cause and rename the .unreadable steps back, or use a new --out")


def read_retrying(read, step_dir, *args, tries=4, **kwargs):  # read(step_dir, ...), or None
    for attempt in range(tries):
        try:
            return read(step_dir, *args, **kwargs)
        # a failing device, not the files (an Exception too, so it is let through first)
        except jax.errors.JaxRuntimeError:
            raise
        # Orbax and tensorstore raise many kinds (restore's SystemExit is not an Exception)
        except Exception as e:
            why = type(e).__name__ + ": " + str(e).split("\n")[0][:200]  # the message may be empty
            print(f"process {jax.process_index()}: reading {step_dir} (try {attempt + 1}): {why}")
            time.sleep(2 ** attempt if attempt + 1 < tries else 0)  # 1, 2, 4 s; none after the last
    # every try failed, so it returns None


# ----------------------------------------------------------------------------- stopping
# A pod's processes must all stop after the same step, but a signal reaches each process at its
# own moment. So with each step, train's step_fn makes signal_flags, one entry per device, its
# process's bool(SIGNALS), and reduces them with jnp.any (on a pod, an all-reduce across the
# hosts) into metrics["signalled"]. Every process reads it a step later with the rest of the
# metrics, so every process stops after the same step, at no extra wait. On one host, a signal
# simply stops the run within two steps. A SIGTERM during step 150, just after its flags:
#   step 151  Its flag says yes. The host reads step 150's metrics: no signal.
#   step 152  The host reads step 151's metrics: a signal. Every process saves step 152 and
#             exits with code 75, and a rerun resumes at step 153.
# (JAX's own preemption sync point is not used: it misses a SIGTERM before step 1.)
# A new reason to stop that only one process knows (its own clock, say) makes that process's
# signal_flags True, with its reason kept beside SIGNALS, not in it (an entry in SIGNALS would
# make the next Ctrl-C exit at once: request_stop), and stop_reason reports it.

SIGNALS = []  # the signals this process received (the first asked it to stop)


def stop_reason(step, stop_at, signalled):  # -> why the run stops after this step, or None
    # signalled: a signal reached this process or another one (--stop-at, every process knows)
    if signalled:
        return f"{SIGNALS[0]} received" if SIGNALS else "another process was asked to stop"
    return "--stop-at" if step == stop_at else None


def request_stop(signum, frame):  # checkpoint within two steps, exit (a second Ctrl-C: exit now)
    if SIGNALS and signum == signal.SIGINT:
        raise SystemExit("interrupted; rerun the same command to resume from the last checkpoint")
    SIGNALS.append(signal.Signals(signum).name)
    # os.write to stderr, not print: a print that interrupts another print may raise, and a
    # Ctrl-C may have closed stdout (`| tee`). If stderr is closed too, the run stops all the same.
    with contextlib.suppress(OSError):
        os.write(2, f"{SIGNALS[0]}: checkpointing within two steps (Ctrl-C again: now)\n".encode())


def signal_flags(mesh):  # -> [devices] bool: has each device's process received a signal?
    # this process's entries, one for each of its devices (the whole shape is given: JAX could
    # not infer it where processes hold different numbers of devices)
    local = np.full(len(mesh.local_devices), bool(SIGNALS))
    # [devices]: its one dimension cut over all three mesh axes together, one entry per device
    sharding = NamedSharding(mesh, P(olmo3.MESH_AXES))
    return jax.make_array_from_process_local_data(sharding, local, (mesh.size,))


# ----------------------------------------------------------------------------- across hosts
# What each function does on a pod, and what it does on one host:
#   start_jax              joins every host's process into one JAX run      one process
#   check_run_directory    checks that every host sees the run directory    makes the directory
#                          that process 0 writes (else the first save
#                          hangs, an hour in)
#   check_processes_agree  checks that every host holds the same value      checks nothing
#                          (the token files' fingerprint)

def start_jax(args):
    # JAX finds its peers itself on a TPU slice, and under SLURM, Open MPI or Kubernetes.
    # Elsewhere, give --coordinator.
    if args.devices:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
    # lets CPU processes talk to each other (TPUs and GPUs have their own collectives)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # a compilation cache, so that a restart does not compile the 7B's step again
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", f"{args.out}/compile-cache")
    # What jax.distributed.initialize raises, and what the run does:
    #   JaxRuntimeError   a cluster found, not reached   fails (first: it is a RuntimeError too)
    #   ValueError        no cluster                     goes on as one process *
    #   RuntimeError      JAX ran already (the tests)    goes on as one process *
    #   IndexError        --coordinator without a port   an error (--coordinator asked for one)
    # * unless --coordinator, --num-processes or --process-id asked for a cluster: then an error
    try:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    except jax.errors.JaxRuntimeError:
        raise
    except (ValueError, RuntimeError, IndexError) as e:
        if args.coordinator or args.num_processes or args.process_id is not None:
            raise SystemExit(f"error: no cluster ({e}); give --coordinator HOST:PORT") from None
    if jax.process_count() > 1 and not jax.distributed.is_initialized():
        raise SystemExit("error: several hosts, but JAX found no cluster; give --coordinator")


def check_run_directory(out):  # every host must see the run directory that process 0 writes
    # Process 0 writes a fresh number (the time) into it. A host that has another disk there
    # reads no number (-1), or an old one.
    mark = epath.Path(out) / "run-mark.txt"
    # (every process checks: where all see a file there, all stop, and none waits at the barrier
    # below for a process 0 that stopped; where hosts see different disks, some may still wait
    # there until JAX times them out)
    if mark.parent.is_file():
        raise SystemExit(f"error: --out {out} is a file; give a directory for the run")
    if jax.process_index() == 0:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(str(time.time_ns()))
    multihost_utils.sync_global_devices("run mark written")
    check_processes_agree(int(mark.read_text()) if mark.exists() else -1, f"do not see the run "
                          f"directory {out} that process 0 writes; give every host the same one")


def check_processes_agree(value, problem):  # on several hosts, checks every one has the same value
    every = multihost_utils.process_allgather(np.int64(value))
    differ = np.flatnonzero(every != every[0]).tolist()  # the processes that differ from 0
    if differ:
        raise SystemExit(f"error: process(es) {differ} {problem}")


# ----------------------------------------------------------------------------- command line

# the flags whose values are a few names
CHOICES = olmo3.CHOICES | {"schedule": ("cosine", "linear", "olmo3")}


def parse_args(argv=None):  # -> (olmo3.Config, Recipe, args), the preset's with the flags applied
    ap = argparse.ArgumentParser(description=__doc__)
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
    # (argparse runs type on a string default too, so args.mesh is always parse_mesh's dict)
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
    # --eval-tasks' names, a list (a "\r" from a CRLF file is kept: an unknown task's error)
    args.eval_tasks = [n.strip(" \t") for n in args.eval_tasks.split(",") if n.strip(" \t")]
    # every field's flag defaults to None, so the fields given are those that are not None
    given = lambda cls: {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                         if getattr(args, f.name) is not None}
    # The layers: the preset's recipe, then STAGE2's fields with --stage2, then every flag given
    # (a flag wins over STAGE2: in `a | b`, b's values win)
    changes = (STAGE2 if args.stage2 else {}) | given(Recipe)
    r = dataclasses.replace(RECIPES[args.preset], **changes)
    cfg = dataclasses.replace(olmo3.MODELS[args.preset], **given(olmo3.Config))
    # Every int flag is a count, a seed, a step or a process's number: one below its least value
    # (1, or the one in `least`) would divide by zero, or be ignored silently. The int flags:
    # Config's and Recipe's int fields (d_model, steps, ...), and --stop-at, --samples,
    # --max-new-tokens, --devices, --num-processes and --process-id.
    least = {"micro_batch": 0, "warmup_steps": 0, "eval_limit": 0, "samples": 0, "seed": 0,
             "data_seed": 0, "process_id": 0, "source_permutation_seed": -1}  # -1: the mix's order
    for f, value in vars(args).items():
        if type(value) is int and value < least.get(f, 1):
            raise SystemExit(f"error: --{f.replace('_', '-')} must be {least.get(f, 1)} or more")
    if cfg.n_heads % cfg.n_kv_heads:  # (also where n_kv_heads > n_heads)
        raise SystemExit("error: --n-kv-heads must divide --n-heads")
    return cfg, r, args


def boolean(text):  # "true" or "false" (argparse reports anything else)
    return bool(("false", "true").index(text.lower()))


# A left-out data or tensor is 1, and a left-out fsdp takes the devices the others leave (-1),
# unless another axis already does: tensor=2 on 8 devices is fsdp=4,tensor=2, and data=-1 is
# data=8 with fsdp=1. Naming every axis's size uses only those devices (to resume on fewer).
def parse_mesh(text):  # "data=2,fsdp=-1" -> {"data": 2, "tensor": 1, "fsdp": -1}
    sizes = {"data": 1, "tensor": 1}
    for name, _, value in (part.partition("=") for part in text.split(",")):
        if name not in olmo3.MESH_AXES or not value.lstrip("-").isdigit():
            raise SystemExit(f"error: --mesh {text!r}: expected data=N,fsdp=N,tensor=N (-1: rest)")
        sizes[name] = int(value)
    # where fsdp was not given: the devices left (-1), or 1 if another axis already takes them
    sizes.setdefault("fsdp", 1 if -1 in sizes.values() else -1)
    return sizes


if __name__ == "__main__":
    raise SystemExit(main())
