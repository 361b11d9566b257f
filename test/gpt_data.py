"""examples/gpt.c's text as its Python checks need it (gpt_ref.py,
gpt_torch_check.py): the validation text and the validation windows,
rebuilt from the corpus folder exactly as gpt.c builds them, and the ids of
a text under a checkpoint's vocabulary. Needs numpy."""
import os

import numpy as np


def validation_text(corpus):
    """Every tenth fortune of the sorted text files (the .dat indexes, .u8
    links, dot files and non-files skipped; a file without a final newline
    gets one), each with its "%" line: gpt.c's corpus_load."""
    val, fortune = bytearray(), 0
    for name in sorted(os.listdir(corpus)):
        full = os.path.join(corpus, name)
        if name.startswith(".") or name.endswith(".dat") or name.endswith(".u8") or os.path.islink(full) or not os.path.isfile(full):
            continue
        text = open(full, "rb").read()
        if text and not text.endswith(b"\n"):
            text += b"\n"
        lines, cur = text.splitlines(keepends=True), []
        for i, line in enumerate(lines):
            cur.append(line)
            if line == b"%\n" or i == len(lines) - 1:
                if fortune % 10 == 9:
                    val += b"".join(cur)
                fortune, cur = fortune + 1, []
    return bytes(val)


def encode(text, vocab_bytes):
    """Ids of the bytes of text under the vocabulary (the checkpoint's
    vocab_bytes metadata, hex); a byte outside it raises ValueError."""
    chars = bytes.fromhex(vocab_bytes)
    return np.array([chars.index(b) for b in text], dtype=np.int64)


def validation_windows(ids, T, val_batches, batch):
    """gpt.c's fill_val: val_batches x batch windows of T characters evenly
    spread over the validation ids, as inputs x and next characters y,
    [val_batches * batch, T] each."""
    nw, span = val_batches * batch, len(ids) - T - 1
    starts = [int(float(w) * float(span) / float(nw - 1)) if nw > 1 else 0 for w in range(nw)]
    x = np.stack([ids[a:a + T] for a in starts])
    y = np.stack([ids[a + 1:a + T + 1] for a in starts])
    return x, y
