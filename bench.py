"""Benchmarks, outside the core and its count.

    python bench.py                     # our training step against transformers + torch AdamW
    python bench.py --baseline DIR      # our tiny step against another checkout's, side by side
    python bench.py --data              # tokenize MB/s and loader tokens/s
    python bench.py --packing GB        # stage 3's packing: MB/s over GB of synthetic documents
    python bench.py --eval              # downstream evaluation requests/s
    python bench.py --plot-schedule docs/olmo3-lr.png
    python bench.py --gpu               # one GPU: cuDNN attention against the reference, and
                                        # the step at the 7B's width (8 layers): tokens/s, MFU

Each contender runs in its own process (so peak memory is its own); contenders are alternated
rep by rep (so this machine's drift hits all alike), and medians are reported.
"""

import argparse
import dataclasses
import multiprocessing
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {  # name -> (olmo3.Config overrides of the tiny model, batch, sequence length)
    "tiny": ({}, 32, 256),
    "wide": (dict(d_model=1024, n_layers=8, n_heads=8, n_kv_heads=8, head_dim=128,
                  mlp_hidden=2816, sliding_window=256), 4, 1024),
}


def setup(name, dtype):
    """(Config, Recipe) of a benchmark configuration, in this checkout's code."""
    import olmo3
    import train

    overrides, batch, seq_len = CONFIGS[name]
    cfg = dataclasses.replace(olmo3.MODELS["tiny"], compute_dtype=dtype, **overrides)
    return cfg, dataclasses.replace(train.RECIPES["tiny"], global_batch=batch, seq_len=seq_len)


def jax_worker(conn, name, dtype, code=HERE):
    """Our step exactly as train.py runs it (AdamW, clipping, spike guard, z-loss) on one device,
    from the checkout in `code` (an older one keeps its own API: presets in olmo3.PRESETS)."""
    sys.path.insert(0, code)
    os.chdir(code)
    import jax
    import numpy as np

    import olmo3
    import train

    mesh = olmo3.make_mesh(fsdp=1)
    with jax.set_mesh(mesh):
        if hasattr(train, "RECIPES"):
            cfg, r = setup(name, dtype)
            target = train.abstract_state(cfg, r, mesh)
            state, step = train.init_state(cfg, r, target), train.compile_step(cfg, r, mesh, target)
        else:  # one Config of model and recipe, before the two were split
            overrides, batch, seq_len = CONFIGS[name]
            r = cfg = dataclasses.replace(olmo3.PRESETS["tiny"], compute_dtype=dtype,
                                          global_batch=batch, seq_len=seq_len, **overrides)
            state = train.init_state(cfg, mesh)
            step = train.compile_steps(cfg, mesh, train.abstract_state(cfg, mesh))
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (r.global_batch, r.seq_len),
                                                   dtype=np.int32)
        labels = np.concatenate([tokens[:, 1:], np.full_like(tokens[:, :1], -100)], 1)
        x, y = (jax.device_put(a, olmo3.batch_sharding(mesh)) for a in (tokens, labels))
        new = hasattr(train, "device_batch") or hasattr(olmo3, "device_batch")
        batch = (dict(inputs=x, labels=y),) if new else (x, y)
        # for a time, the compiled step also took each process's signal flag
        takes = len(getattr(step, "args_info", ((),))[0])  # a lambda adds the flags itself
        if hasattr(train, "signal_flags") and takes == len(batch) + 2:
            batch += (train.signal_flags(mesh),)
        state, metrics = step(state, *batch)
        jax.block_until_ready(metrics)
        conn.send("ready")
        while (k := conn.recv()) is not None:
            start = time.perf_counter()
            for _ in range(k):
                state, metrics = step(state, *batch)
            jax.block_until_ready(metrics)
            conn.send((time.perf_counter() - start) / k)
    conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def torch_worker(conn, name, dtype):
    """transformers' Olmo3ForCausalLM, the same config and padded vocab, torch.optim.AdamW with the
    same hyperparameters and clipping; bf16 compute through torch.autocast, fp32 master weights.
    Both attention implementations are tried and the faster one is used."""
    import torch
    import transformers

    import convert

    cfg, r = setup(name, dtype)
    torch.manual_seed(0)
    hf = {k: v for k, v in convert.config_to_hf(cfg).items()
          if k not in ("architectures", "model_type")}
    model = transformers.Olmo3ForCausalLM(
        transformers.Olmo3Config(**hf | {"vocab_size": cfg.padded_vocab}))
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, betas=(r.beta1, r.beta2), eps=r.adam_eps,
                            weight_decay=r.weight_decay)
    x = torch.randint(0, cfg.vocab_size, (r.global_batch, r.seq_len))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    timings = {}
    for implementation in ("eager", "sdpa"):
        model.config._attn_implementation = implementation
        step()
        start = time.perf_counter()
        step()
        timings[implementation] = time.perf_counter() - start
    model.config._attn_implementation = min(timings, key=timings.get)
    conn.send("ready")
    while (k := conn.recv()) is not None:
        start = time.perf_counter()
        for _ in range(k):
            step()
        conn.send((time.perf_counter() - start) / k)
    conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def start(worker, *args):
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=worker, args=(child, *args), daemon=True)
    process.start()
    while not parent.poll(1):
        if not process.is_alive():
            raise SystemExit(f"error: {worker.__name__} died while starting (traceback above)")
    parent.recv()
    return parent


def race(contenders, reps, steps):
    """{name: (median seconds per step, peak RSS)}, the contenders alternated rep by rep."""
    conns = {name: start(*worker) for name, worker in contenders.items()}
    times = {name: [] for name in conns}
    for _ in range(reps):
        for name, conn in conns.items():
            conn.send(steps)
            times[name].append(conn.recv())
    out = {}
    for name, conn in conns.items():
        conn.send(None)
        out[name] = (statistics.median(times[name]), conn.recv())
    return out


def compare(name, dtype, reps, steps):
    import olmo3

    cfg, r = setup(name, dtype)
    result = race({"ours": (jax_worker, name, dtype), "pytorch": (torch_worker, name, dtype)},
                  reps, steps)
    (ours, ours_mem), (theirs, theirs_mem) = result["ours"], result["pytorch"]
    tokens = r.global_batch * r.seq_len
    flops = olmo3.flops_per_token(cfg, r.seq_len) * tokens / ours
    print(f"{name:5s} {dtype:9s} | ours {tokens / ours:9,.0f} tok/s ({flops / 1e9:.1f} GFLOP/s) "
          f"| pytorch {tokens / theirs:9,.0f} tok/s | ratio {theirs / ours:.2f} | peak RSS ours "
          f"{ours_mem / 2**30:.2f} GiB, pytorch {theirs_mem / 2**30:.2f} GiB", flush=True)
    return theirs / ours


def baseline(directory, reps, steps):
    """The tiny fp32 step of this checkout against another's (e.g. the previous main)."""
    result = race({"this": (jax_worker, "tiny", "float32", HERE),
                   "baseline": (jax_worker, "tiny", "float32", os.path.abspath(directory))},
                  reps, steps)
    this, base = result["this"][0], result["baseline"][0]
    print(f"tiny fp32 step: this checkout {this * 1e3:.0f} ms, {directory} {base * 1e3:.0f} ms "
          f"(medians of {reps} x {steps} steps): this is {100 * (this / base - 1):+.1f}%")


def bench_data(tokenizer):
    """Tokenize throughput (this Python's standard library) and loader throughput up to a
    7b-shaped per-host batch (64 x 8192) over 384 MB of synthetic token files."""
    import shutil
    import tempfile

    import numpy as np

    import data

    tmp = tempfile.mkdtemp(prefix="olmo3-bench-")
    try:
        files = data.stdlib_files()
        size, start = sum(map(os.path.getsize, files)), time.perf_counter()
        data.tokenize(filter(None, map(data.read_text, files)), f"{tmp}/out", tokenizer)
        print(f"tokenize: {size / 1e6:.1f} MB of Python source, {tokenizer}, one core: "
              f"{size / 1e6 / (time.perf_counter() - start):.1f} MB/s")
        rng, paths = np.random.default_rng(0), [f"{tmp}/synthetic-{i}.npy" for i in range(3)]
        for path in paths:
            rng.integers(0, 100278, size=32 << 20, dtype=np.uint32).tofile(path)
        for seq_len, batch in ((2048, 16), (8192, 64)):
            loader = data.Loader(paths, seq_len, batch, 34521, vocab_size=100278)
            steps = rng.integers(0, 50 * loader.steps_per_epoch, size=20)  # over many epochs
            start = time.perf_counter()
            for step in steps:
                loader.batch(int(step))
            seconds = (time.perf_counter() - start) / len(steps)
            print(f"loader: {batch} x {seq_len}: {seconds * 1e3:.1f} ms/batch = "
                  f"{batch * seq_len / seconds / 1e6:.1f} M tokens/s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_packing(gigabytes, seq_len=65536, group_size=8):
    """Stage 3's packing (data.PackedLoader: find the documents, best-fit decreasing) over
    synthetic token files of `gigabytes` GB: documents with long-context-like lengths (a
    log-normal around 2,000 tokens, some over 65,536), in 16 files packed 8 at a time."""
    import shutil
    import tempfile

    import numpy as np

    import data

    if not gigabytes >= 0.05:  # fewer tokens than fill a batch of 64 x 65,536 (or NaN)
        raise SystemExit(f"error: --packing {gigabytes}: give 0.05 (GB) or more")
    tmp, rng = tempfile.mkdtemp(prefix="olmo3-bench-"), np.random.default_rng(0)
    try:
        paths = [f"{tmp}/longmino-{i}.npy" for i in range(16)]
        per_file = int(gigabytes * 1e9 / 4 / 16)  # tokens
        for path in paths:
            lengths = rng.lognormal(7.6, 1.5, per_file // 1000).astype(np.int64) + 1
            ends = np.cumsum(lengths)
            tokens = rng.integers(0, 100257, ends[-1], dtype=np.uint32)
            tokens[ends - 1] = 100257  # every document ends with EOS
            tokens[:per_file].tofile(path)
        size = sum(map(os.path.getsize, paths))
        start = time.perf_counter()
        loader = data.PackedLoader(paths, seq_len, 64, 4123, group_size=group_size, cache=tmp,
                                   permutation_seed=123)
        seconds = time.perf_counter() - start
        padding = 1 - loader.docs[2].sum() / (loader.num_instances * seq_len)
        print(f"packing: {size / 1e9:.2f} GB, {loader.docs.shape[1]:,} documents into "
              f"{loader.num_instances:,} instances of {seq_len} ({padding:.2%} padding) in "
              f"{seconds:.1f}s: {size / 1e6 / seconds:.0f} MB/s, {seconds / size * 1e9:.1f} s/GB")
        start = time.perf_counter()
        for step in range(20):
            loader.batch(step)
        print(f"packed loader: {(time.perf_counter() - start) / 20 * 1e3:.0f} ms for a global "
              f"batch of 64 x {seq_len}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_eval(task="arc_easy:rc_5shot", docs=250):
    """Downstream evaluation speed on the tiny preset (random weights; AI2's request files,
    tokenized by the bytes tokenizer), and the estimate for the 1b shape by FLOPs per token."""
    import jax

    import data
    import evaluation
    import olmo3
    import train

    cfg, r = olmo3.MODELS["tiny"], train.RECIPES["tiny"]
    params, mesh = olmo3.init(cfg, jax.random.key(0)), olmo3.make_mesh(fsdp=1)
    metric, requests, rows = evaluation.load_task(task, docs, data.get_tokenizer("bytes"), 256)
    with jax.set_mesh(mesh):
        evaluation.score(params, cfg, mesh, rows, cfg.vocab_size, r.global_batch, 256)  # compiles
        start = time.perf_counter()
        evaluation.score(params, cfg, mesh, rows, cfg.vocab_size, r.global_batch, 256)
        seconds = time.perf_counter() - start
    per_1000 = seconds / len(requests) * 1000
    one_b = olmo3.Config(d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16, mlp_hidden=8192)
    ratio = olmo3.flops_per_token(one_b, 256) / olmo3.flops_per_token(cfg, 256)
    print(f"eval {task}: {len(requests)} requests in {seconds:.1f}s: {per_1000:.1f}s per 1,000 "
          f"requests on the tiny shape; the 1b shape has {ratio:.0f}x the FLOPs per token: about "
          f"{per_1000 * ratio / 60:.0f} min per 1,000 on this CPU")


def plot_schedule(path):
    """The 7b preset's LR (schedule "olmo3") against AI2's two parts and MaxText's cosine."""
    import numpy as np
    from matplotlib.figure import Figure

    import train

    r = train.RECIPES["7b"]
    steps = np.arange(1, r.steps + 1, 997)
    ours = np.asarray(train.schedule(r)(steps))
    cosine = np.asarray(train.schedule(dataclasses.replace(r, schedule="cosine"))(steps))

    def ai2(k):  # OLMo-core's CosWithWarmup, then from 596,048 HalfCosWithWarmup (restated)
        if k <= 596_047:
            frac = min(max(k - 2000, 0) / (1_192_093 - 2000), 1)
            return min(k / 2000, 0.1 + 0.45 * (1 + np.cos(np.pi * frac)))
        if k < 597_046:
            return 0.55 * k / 597_046
        return 0.1 + 0.45 * (1 + np.cos(np.pi * (k - 597_046 + 1_071_885) / 2_143_770))

    ax = Figure(figsize=(8, 3.5)).subplots()
    ax.plot(steps, ours / r.lr, label="ours: schedule olmo3 (7b preset)", lw=2)
    ax.plot(steps[::40], [ai2(k) for k in steps[::40]], "k.", label="AI2's two parts (OLMo-core)")
    ax.plot(steps, cosine / r.lr, "--", label="cosine: MaxText's single cosine", lw=1)
    ax.axvline(596_047, color="gray", lw=0.8)
    ax.annotate("restart from step 596,047:\nHalfCosWithWarmup aimed at 7T tokens",
                (596_047, 0.75), (650_000, 0.8), fontsize=8)
    ax.set(xlabel="step", ylabel="LR / peak (3e-4)", title="OLMo 3 7B stage 1 learning rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.figure.savefig(path, dpi=110, bbox_inches="tight")
    print(f"wrote {path}")


def bench_attention():
    """olmo3.attention with cuDNN and the reference in bf16, against the reference in fp32: the
    largest error of the output and of each gradient (relative to the largest value), and the
    forward + backward time, with and without a sliding window."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import olmo3

    B, T, H, K, E = (1, 256, 4, 2, 64) if jax.default_backend() == "cpu" else (2, 4096, 32, 8, 128)
    print(f"attention on {jax.devices()[0].device_kind}, [B, T, H, K, E] = {[B, T, H, K, E]}")
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (B, T, n, E)) for key, n in zip(ks, (H, K, K)))
    cotangent = jax.random.normal(ks[3], (B, T, H, E))

    def run(name, window, dtype):  # -> (output, gradients, ms for forward + backward)
        cfg = dataclasses.replace(olmo3.MODELS["7b"], attention=name)
        attend = lambda q, k, v: olmo3.attention(q, k, v, window, cfg).astype(jnp.float32)
        grad = jax.jit(jax.grad(lambda *qkv: jnp.sum(attend(*qkv) * cotangent), (0, 1, 2)))
        qkv = [x.astype(dtype) for x in (q, k, v)]
        out, grads = jax.block_until_ready((jax.jit(attend)(*qkv), grad(*qkv)))
        start = time.perf_counter()
        for _ in range(5):
            jax.block_until_ready(grad(*qkv))
        return out, grads, (time.perf_counter() - start) / 5 * 1e3

    for window in (None, T // 4):
        truth, truth_grads, _ = run("reference", window, jnp.float32)
        for name in ("reference", "cudnn"):
            try:
                out, grads, ms = run(name, window, jnp.bfloat16)
            except SystemExit as e:
                print(f"window {window}, {name}: {e}")
                continue
            error = lambda a, b: float(np.abs(np.float32(a) - b).max() / np.abs(b).max())
            dq, dk, dv = (error(a, b) for a, b in zip(grads, truth_grads))
            print(f"window {window}, {name:9s} bf16: output {error(out, truth):.1e}, dq {dq:.1e}, "
                  f"dk {dk:.1e}, dv {dv:.1e}; forward + backward {ms:.2f} ms")


def bench_7b_step(layers=8, batch=8, micro=2, seq_len=8192):
    """train.py's step (AdamW, clipping, spike guard, z-loss, micro-batches) at the 7B's width
    with fewer layers, on one device: memory, step time, tokens/s and MFU. (On CPU: tiny's.)"""
    import jax
    import numpy as np

    import olmo3
    import train

    cfg = dataclasses.replace(olmo3.MODELS["7b"], n_layers=layers)
    if jax.default_backend() == "cpu":  # a smoke test
        cfg, seq_len = dataclasses.replace(olmo3.MODELS["tiny"], compute_dtype="bfloat16"), 256
    # cosine: the olmo3 schedule's step counts assume the 7B's batch
    r = dataclasses.replace(train.RECIPES["7b"], global_batch=batch, micro_batch=micro,
                            seq_len=seq_len, schedule="cosine")
    mesh = olmo3.make_mesh(fsdp=1, devices=jax.devices()[:1])
    gib = lambda n: f"{n / 2**30:.1f} GiB"
    print(f"{cfg.n_layers} layers, width {cfg.d_model} ({olmo3.param_count(cfg) / 1e9:.2f}B), "
          f"batch {batch} x {seq_len}, micro-batch {micro}, on {jax.devices()[0].device_kind}")
    with jax.set_mesh(mesh):
        target = train.abstract_state(cfg, r, mesh)
        step = train.compile_step(cfg, r, mesh, target)
        memory = step.memory_analysis()
        print(f"compiled: arguments {gib(memory.argument_size_in_bytes)}, temporaries "
              f"{gib(memory.temp_size_in_bytes)}", flush=True)
        state = train.init_state(cfg, r, target)
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq_len + 1))
        put = lambda x: jax.device_put(x.astype(np.int32), olmo3.batch_sharding(mesh))
        data = {"inputs": put(tokens[:, :-1]), "labels": put(tokens[:, 1:])}
        for _ in range(2):  # compiles nothing more: warms up
            state, metrics = step(state, data)
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for _ in range(5):
            state, metrics = step(state, data)
        jax.block_until_ready((state, metrics))
    seconds = (time.perf_counter() - start) / 5
    rate = batch * seq_len / seconds
    tflops = rate * olmo3.flops_per_token(cfg, seq_len) / 1e12
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)
    print(f"step {seconds:.3f} s, {rate:,.0f} tokens/s, {tflops:.0f} TFLOP/s: MFU "
          f"{tflops / train.PEAK_TFLOPS['h200']:.1%} of the H100's and H200's "
          f"{train.PEAK_TFLOPS['h200']} (dense bf16); peak memory {gib(peak)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="tiny,wide")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=5, help="alternating repetitions (medians)")
    ap.add_argument("--steps", type=int, default=3, help="training steps per repetition")
    ap.add_argument("--baseline", metavar="DIR", help="another checkout to race the tiny step")
    ap.add_argument("--data", action="store_true", help="tokenize and loader throughput")
    ap.add_argument("--tokenizer", default="dolma2", help="for --data")
    ap.add_argument("--packing", type=float, metavar="GB", help="stage 3's packing over GB")
    ap.add_argument("--eval", action="store_true", help="downstream evaluation requests/s")
    ap.add_argument("--plot-schedule", metavar="PNG", help="draw the 7b preset's LR schedule")
    ap.add_argument("--gpu", action="store_true", help="cuDNN attention; the 7B-width step")
    args = ap.parse_args(argv)
    sys.path.insert(0, HERE)
    if args.baseline:
        return baseline(args.baseline, args.reps, args.steps)
    if args.data:
        return bench_data(args.tokenizer)
    if args.packing is not None:
        return bench_packing(args.packing)
    if args.eval:
        return bench_eval()
    if args.plot_schedule:
        return plot_schedule(args.plot_schedule)
    if args.gpu:
        bench_attention()
        return bench_7b_step()
    print(f"training step, {os.cpu_count()} CPU cores; model FLOPs count sliding windows "
          "(olmo3.flops_per_token)", flush=True)
    ratios = [compare(name, dtype, args.reps, args.steps) for name in args.configs.split(",")
              for dtype in args.dtypes.split(",")]
    print(f"worst ratio ours/pytorch: {min(ratios):.2f}")


if __name__ == "__main__":
    main()
