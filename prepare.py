"""Preparing a run, beside the core: token files, TinyShakespeare, a plan for a pod."""
# It serves three commands that share no code but all come before training: python data.py
# tokenize (your documents; data.tokenize itself is core, as the tiny run tokenizes its corpus),
# --data shakespeare (a download) and train.py --dry-run (a plan). None is needed to train, so
# they sit here, outside the core's 1,000-line budget (docs/reference.md, "The line budget").
import argparse
import gzip
import json
import os
import time
import urllib.request

import data

SHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                   "tinyshakespeare/input.txt")


# `python data.py tokenize ...` lands here, so its --help opens with data.py's docstring
def main(argv=None):
    ap = argparse.ArgumentParser(description=data.__doc__)
    ap.add_argument("command", choices=["tokenize"])
    ap.add_argument("inputs", nargs="+", help=".txt; JSON lines: .jsonl(.gz), .json.gz")
    ap.add_argument("--out", required=True, help="folder: train.txt (and heldout.txt), the tokens")
    ap.add_argument("--heldout", type=float, default=0.0, help="fraction held out, by content")
    ap.add_argument("--tokenizer", default="dolma2", choices=["dolma2", "bytes"])
    args = ap.parse_args(argv)
    # tokenize rewrites these two in --out first: an input of that name there would be lost
    outputs = [os.path.abspath(os.path.join(args.out, n)) for n in ("train.txt", "heldout.txt")]
    for path in args.inputs:
        if not os.path.isfile(path):
            raise SystemExit(f"error: input {path} does not exist; check the path")
        if os.path.abspath(path) in outputs:
            raise SystemExit(f"error: input {path} is an output of tokenize; choose another --out")
    texts = (text for path in args.inputs for text in documents(path) if text)  # skip empty ones
    gz = any(path.endswith(".gz") for path in args.inputs)
    total = None if gz else sum(map(os.path.getsize, args.inputs))  # for the ETA
    data.tokenize(texts, args.out, args.tokenizer, args.heldout, total)


def documents(path):
    """The text of each document of a file: a .txt is one, else one JSON per line."""
    if path.endswith(".txt"):
        yield data.read_text(path)
        return
    if not path.endswith((".jsonl", ".jsonl.gz", ".json.gz")):
        raise SystemExit(f"error: input {path} is not .txt, .jsonl, .jsonl.gz or .json.gz")
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                yield json.loads(line)["text"] if line.strip() else ""  # main skips an empty one
            except (ValueError, KeyError, TypeError):
                raise SystemExit(f"error: {path} line {n} is not a JSON object with a 'text' "
                                 "field; fix or remove that line") from None


def shakespeare():
    """([TinyShakespeare's file], its passages), downloaded once into OLMO3_CACHE."""
    # data.corpus keys its cache on the file list and tokenizes the passages: each passage (the
    # text between blank lines, one speech) is one document. Offline, put the file at the path
    # that the error names.
    path = os.path.join(data.cache_dir(), "tinyshakespeare.txt")
    if not os.path.exists(path):
        try:
            text = urllib.request.urlopen(SHAKESPEARE_URL, timeout=60).read()  # closed when read
        except OSError as e:
            raise SystemExit(f"error: could not download TinyShakespeare ({type(e).__name__}); "
                             f"connect, or put the file at {path}") from None
        os.makedirs(data.cache_dir(), exist_ok=True)
        with open(path, "wb") as f:
            f.write(text)
    return [path], (p for p in data.read_text(path).split("\n\n") if p.strip())


def dry_run(cfg, r, args):
    import jax  # imported here, not above, since tokenizing text needs no JAX

    import olmo3
    import train
    devices = None
    if args.topology:  # the TPU compiler (libtpu) plans a slice it does not have. JAX's
        # experimental topologies API describes the slice's devices without owning them.
        from jax.experimental import topologies
        devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    mesh = olmo3.make_mesh(**args.mesh, devices=devices)
    # The timer covers describing the state and compiling the step. compile() runs the real
    # compiler for these devices (libtpu for a topology), and nothing executes. It runs under
    # the mesh, as training does, because olmo3.constrain reads the mesh while tracing.
    t, target = time.time(), train.abstract_state(cfg, r, mesh)
    with jax.set_mesh(mesh):
        m = train.compile_step(cfg, r, mesh, target).memory_analysis()
    micro = r.micro_batch if r.micro_batch else r.global_batch
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    print(f"dry run: {mesh.size} x {mesh.devices.flat[0].device_kind} {dict(mesh.shape)} | "
          f"compiled in {time.time() - t:.0f}s | {olmo3.param_count(cfg):,} parameters | batch "
          f"{r.global_batch} x {r.seq_len} in micro-batches of {micro} "
          f"({micro // (mesh.shape['data'] * mesh.shape['fsdp'])} per device) | remat {cfg.remat}")
    for path, x in jax.tree_util.tree_leaves_with_path(target["params"]):  # one line per weight
        print(f"{jax.tree_util.keystr(path):22} {str(x.shape):22} one device holds "
              f"{str(x.sharding.shard_shape(x.shape)):22} {x.sharding.spec}")
    # (Without --topology these are XLA:CPU's figures for fake devices, a plan, not a TPU's.)
    # XLA's accounting per device adds the arguments (the state's shard and the batch's rows),
    # the outputs less those written into donated arguments (the new state reuses the old
    # one's memory, which the arguments already count), and the temporaries.
    outputs = m.output_size_in_bytes - m.alias_size_in_bytes
    total = m.argument_size_in_bytes + outputs + m.temp_size_in_bytes
    print(f"per device: arguments {gib(m.argument_size_in_bytes)}, temporaries "
          f"{gib(m.temp_size_in_bytes)}, outputs {gib(outputs)}, total {gib(total)} | training "
          f"FLOPs/token {olmo3.flops_per_token(cfg, r.seq_len) / 1e9:.4g}G")
    return 0
