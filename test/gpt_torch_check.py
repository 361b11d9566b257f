"""The GPT example (examples/gpt.c) against PyTorch.

usage: gpt_torch_check.py [--label LABEL] CHECKPOINT CORPUS_DIR GPT_OUTPUT VAL_BATCHES BATCH CONTEXT [GRADS]
       gpt_torch_check.py --grads-only GRADS LABEL      (the gradients alone, e.g. of a --tp run; LABEL names it)

CHECKPOINT is the full checkpoint gpt.c saved (--save; LABEL, e.g. "tp 2",
names the run that saved it in the checks' names), GPT_OUTPUT what it
printed with --print-losses --val-batches VAL_BATCHES --batch BATCH
--logits CONTEXT, GRADS the file of --grads (its first step). A GPT module
of nanoGPT's layout, written here in torch (GPT-2: wte, wpe, pre-norm
blocks ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj, ln_f,
lm_head tied to wte), run in float64:

  - loads the checkpoint with load_state_dict(strict=True);
  - its validation loss (gpt_data's windows, as gpt.c builds them) equals
    gpt.c's within 1e-4;
  - its logits for the character after CONTEXT equal gpt.c's within 1e-4;
  - from the weights in GRADS, on the batch in GRADS: its loss equals the
    step's within 1e-5, and autograd's gradient of every parameter equals
    gpt.c's (float32) within a relative bound (GRAD_BOUND below).

Prints PASS:/FAIL: lines (exit status 3 when one failed); torch missing
prints SKIP: lines. Debian's python3-torch lives in Debian's
/usr/bin/python3, with Debian's numpy and without the safetensors package:
files are read with safetensors_common.read_numpy.
"""
import math
import sys

from safetensors_common import check, exit_status, read_numpy

CKPT_LABEL = ""
if len(sys.argv) > 2 and sys.argv[1] == "--label":
    CKPT_LABEL = f" ({sys.argv[2]})"
    del sys.argv[1:3]
GRADS_ONLY = len(sys.argv) == 4 and sys.argv[1] == "--grads-only"
NAMES = ([] if GRADS_ONLY else ["strict load", "validation loss", "logits"]) + \
    (["first step's loss", "gradients"] if len(sys.argv) > 7 or GRADS_ONLY else [])
try:
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import gpt_data
except ImportError as e:
    for n in NAMES:
        print(f"SKIP: gpt/torch: {n}: {e} (Debian's python3-torch: make deps)")
    sys.exit(0)

torch.set_num_threads(1)  # two cores, shared
torch.set_default_dtype(torch.float64)


class Block(nn.Module):
    """A pre-norm block as gpt_model.h's: x + attn(ln_1(x)), then r + mlp(ln_2(r))."""

    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1 = nn.LayerNorm(C, eps=1e-5)  # with bias, eps as gpt_model.h's layernorm
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(C, 3 * C)  # q, k, v side by side, head h at columns h*hd of each
        self.attn.c_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C, eps=1e-5)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(C, 4 * C)
        self.mlp.gelu = nn.GELU(approximate="tanh")
        self.mlp.c_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.H
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (z.view(B, T, self.H, hd).transpose(1, 2) for z in (q, k, v))  # [B, H, T, hd]
        s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))  # causal
        y = (F.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.attn.c_proj(y)
        return x + self.mlp.c_proj(self.mlp.gelu(self.mlp.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, V, T, C, L, H):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(V, C), wpe=nn.Embedding(T, C),
            h=nn.ModuleList([Block(C, H) for _ in range(L)]), ln_f=nn.LayerNorm(C, eps=1e-5)))
        self.lm_head = nn.Linear(C, V, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT ties them

    def forward(self, idx):
        t = idx.shape[1]
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t))
        for b in self.transformer.h:
            x = b(x)
        return self.lm_head(self.transformer.ln_f(x))


def load(path):
    """A GPT with path's weights (strict names), its metadata, and the
    file's other tensors (gradients, batch)."""
    tensors, meta = read_numpy(path)
    V, T, C, L, H = (int(meta[k]) for k in ("vocab_size", "block_size", "n_embd", "n_layer", "n_head"))
    model = GPT(V, T, C, L, H)
    sd = {k: torch.from_numpy(v.astype(np.float64)) for k, v in tensors.items() if not k.startswith(("optimizer.", "batch."))}
    # gpt.c stores the tied weight once, as transformer.wte.weight; torch's
    # state dict names it twice (lm_head.weight is the same tensor), so a
    # strict load needs the alias:
    if "transformer.wte.weight" in sd:
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
    model.load_state_dict(sd, strict=True)  # raises on a missing, unexpected or misshapen tensor
    return model, meta, tensors


def mean_loss(model, x, y):
    logits = model(torch.from_numpy(np.asarray(x, dtype=np.int64)))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(np.asarray(y, dtype=np.int64)).reshape(-1))


def check_checkpoint(ckpt, corpus, output, val_batches, batch, context):
    """The full checkpoint: strict load, validation loss and logits against gpt.c's output."""
    val_batches, batch = int(val_batches), int(batch)
    printed = {}
    for line in open(output, errors="replace"):
        w = line.split()
        if w and w[0] in ("validation", "logits") and (len(w) == 2 or w[0] == "logits"):
            printed[w[0]] = [float.fromhex(v) for v in w[1:]]
    try:
        model, meta, _ = load(ckpt)
        model.eval()
        check(True, f"gpt/torch: the full checkpoint{CKPT_LABEL} loads with strict names into a PyTorch GPT "
              "(lm_head.weight tied to transformer.wte.weight)")
    except (RuntimeError, KeyError, ValueError) as e:
        check(False, f"gpt/torch: the full checkpoint{CKPT_LABEL} loads with strict names into a PyTorch GPT",
              str(e)[:400])
        sys.exit(exit_status())

    with torch.no_grad():
        # (a) the validation loss: gpt.c's is the mean of val_batches batch means, all of the same size
        T = int(meta["block_size"])
        ids = gpt_data.encode(gpt_data.validation_text(corpus), meta["vocab_bytes"])
        x, y = gpt_data.validation_windows(ids, T, val_batches, batch)
        loss = mean_loss(model, x, y).item()
        c_loss = printed.get("validation", [math.nan])[0]
        check(abs(loss - c_loss) < 1e-4,
              f"gpt/torch{CKPT_LABEL}: validation loss equals gpt.c's within 1e-4 ({loss:.6f} against {c_loss:.6f})",
              f"torch {loss:.8f}, gpt.c {c_loss:.8f} ({len(x)} windows)")

        # (b) the next-character logits after the context
        z = model(torch.from_numpy(gpt_data.encode(context.encode(), meta["vocab_bytes"])[None]))[0, -1].numpy()
        c_z = np.array(printed.get("logits", []))
        err = float(np.abs(z - c_z).max()) if c_z.shape == z.shape else math.inf
        check(err < 1e-4,
              f"gpt/torch{CKPT_LABEL}: the logits after \"{context}\" equal gpt.c's within 1e-4 "
              f"(largest difference {err:.1e} of {len(z)})",
              f"largest difference {err:.3e} (gpt.c printed {len(c_z)} logits, torch has {len(z)})")


# (c) the first step's gradients: float64 autograd against gpt.c's float32 backward. The bound, per
# parameter: max |g_c - g_torch| <= GRAD_BOUND * max |g_torch|. Float32 rounds each operation to
# u = 2^-24 (6e-8); a gradient entry sums up to B*T = 128 token rows (dW, db) or 4C = 128 products,
# after some ten chained operations per layer (layernorm, linear, attention, GELU, softmax). Rounding
# errors of independent signs grow as a random walk, about sqrt(128) * 10 * u = 7e-6 of the largest
# entry (the worst case, every rounding the same way, is 128 * 10 * u = 8e-5). Measured on the tiny
# model of test_gpt.sh: 6e-7. GRAD_BOUND = 1e-5 sits above the random walk and 15 times the
# measurement, and below what a wrong detail gives: GELU's erf form instead of tanh 2.5e-5, a
# layernorm eps of 1e-6 instead of 1e-5 6e-3, an untied lm_head 1.3, a wrong scale or a missing
# term O(1).
GRAD_BOUND = 1e-5


def check_grads(grads, label):
    """From the weights in grads, on its batch: the loss and every gradient against autograd."""
    model, meta, tensors = load(grads)
    x, y = tensors["batch.x"], tensors["batch.y"]
    loss = mean_loss(model, x, y)
    loss.backward()
    c_loss = float.fromhex(meta["loss"])
    check(abs(loss.item() - c_loss) < 1e-5,
          f"gpt/torch{label}: the first training step's loss equals gpt.c's within 1e-5 "
          f"({loss.item():.6f} against {c_loss:.6f})",
          f"torch {loss.item():.8f}, gpt.c {c_loss:.8f}")
    worst, bad, n = (0.0, ""), [], 0
    for name, p in model.named_parameters():  # the tied weight once, under transformer.wte.weight
        g = p.grad.numpy()
        c_g = tensors.get(f"optimizer.{name}.grad")
        if c_g is None or c_g.shape != g.shape:
            bad.append(f"{name}: gpt.c's gradient is {None if c_g is None else c_g.shape}, not {g.shape}")
            continue
        rel = float(np.abs(c_g - g).max() / max(np.abs(g).max(), 1e-30))
        worst = max(worst, (rel, name))
        n += 1
        if not rel <= GRAD_BOUND:
            bad.append(f"{name}: {rel:.2e} of its largest entry")
    check(not bad and n > 0,
          f"gpt/torch{label}: the first step's gradients of all {n} parameters equal float64 autograd's "
          f"within {GRAD_BOUND:g} of each "
          f"one's largest entry (worst {worst[0]:.1e}, {worst[1]})", "; ".join(bad[:4]))


if GRADS_ONLY:
    check_grads(sys.argv[2], f" ({sys.argv[3]})")
else:
    check_checkpoint(*sys.argv[1:7])
    if len(sys.argv) > 7:
        check_grads(sys.argv[7], "")
sys.exit(exit_status())
