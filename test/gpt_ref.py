"""The GPT example's checkpoint against an independent forward pass.

usage: gpt_ref.py CHECKPOINT CORPUS_DIR VAL_LOSS_HEX VAL_BATCHES BATCH [LABEL]

Loads the full checkpoint examples/gpt.c saved (safetensors, read with
numpy), checks that its tensors are exactly nanoGPT's GPT state dict with
strict names and shapes (less lm_head.weight, which nanoGPT ties to
transformer.wte.weight), rebuilds the validation text and windows as gpt.c
does, runs nanoGPT's forward (GPT-2 layout, tanh GELU) in float64 numpy
and checks the mean validation loss against gpt.c's within 1e-4.
Prints PASS:/FAIL: lines (LABEL, e.g. "tp 2", names the run that saved
it); numpy or safetensors missing is a SKIP.
"""
import sys

try:
    import numpy as np
    from safetensors import safe_open

    import gpt_data
except ImportError as e:  # pragma: no cover
    print(f"SKIP: gpt/numpy forward of the checkpoint: {e}")
    sys.exit(0)

path, corpus, val_hex, val_batches, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
LABEL = f" ({sys.argv[6]})" if len(sys.argv) > 6 else ""
NAME = (f"gpt/the checkpoint{LABEL} loads with nanoGPT's strict names into a numpy GPT whose validation loss equals "
        "gpt.c's within 1e-4")

with safe_open(path, "np") as f:
    meta = f.metadata()
    sd = {k: f.get_tensor(k).astype(np.float64) for k in f.keys()}
L, H, C, T, V = (int(meta[k]) for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"))

# strict names and shapes, as nanoGPT's GPT(GPTConfig(bias=True)).state_dict()
want = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C),
        "transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,)}
for i in range(L):
    p = f"transformer.h.{i}."
    want.update({p + "ln_1.weight": (C,), p + "ln_1.bias": (C,), p + "ln_2.weight": (C,), p + "ln_2.bias": (C,),
                 p + "attn.c_attn.weight": (3 * C, C), p + "attn.c_attn.bias": (3 * C,),
                 p + "attn.c_proj.weight": (C, C), p + "attn.c_proj.bias": (C,),
                 p + "mlp.c_fc.weight": (4 * C, C), p + "mlp.c_fc.bias": (4 * C,),
                 p + "mlp.c_proj.weight": (C, 4 * C), p + "mlp.c_proj.bias": (C,)})
got = {k: tuple(v.shape) for k, v in sd.items()}
if got != want:
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    print(f"FAIL: {NAME}: missing {missing[:4]}, unexpected {extra[:4]}, wrong shapes {wrong[:4]}")
    sys.exit(0)

# the validation text and windows, as gpt.c builds them
ids = gpt_data.encode(gpt_data.validation_text(corpus), meta["vocab_bytes"])

# nanoGPT's forward in float64
def layernorm(x, w, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + 1e-5) * w + b

def forward(idx):
    B, t = idx.shape
    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:t]
    hd, mask = C // H, np.tril(np.ones((t, t), dtype=bool))
    for i in range(L):
        p = f"transformer.h.{i}."
        h = layernorm(x, sd[p + "ln_1.weight"], sd[p + "ln_1.bias"])
        qkv = h @ sd[p + "attn.c_attn.weight"].T + sd[p + "attn.c_attn.bias"]
        q, k, v = (qkv[..., j * C:(j + 1) * C].reshape(B, t, H, hd).transpose(0, 2, 1, 3) for j in range(3))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
        s = np.where(mask, s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        y = (s / s.sum(-1, keepdims=True)) @ v
        y = y.transpose(0, 2, 1, 3).reshape(B, t, C)
        x = x + y @ sd[p + "attn.c_proj.weight"].T + sd[p + "attn.c_proj.bias"]
        h = layernorm(x, sd[p + "ln_2.weight"], sd[p + "ln_2.bias"])
        h = h @ sd[p + "mlp.c_fc.weight"].T + sd[p + "mlp.c_fc.bias"]
        h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
        x = x + h @ sd[p + "mlp.c_proj.weight"].T + sd[p + "mlp.c_proj.bias"]
    x = layernorm(x, sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"])
    return x @ sd["transformer.wte.weight"].T  # lm_head, tied

x, y = gpt_data.validation_windows(ids, T, val_batches, batch)
z = forward(x)
z = z - z.max(-1, keepdims=True)
logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
loss = -np.take_along_axis(logp, y[..., None], -1).mean()
c_loss = float.fromhex(val_hex)
if abs(loss - c_loss) < 1e-4:
    print(f"PASS: {NAME} ({loss:.6f} against {c_loss:.6f})")
else:
    print(f"FAIL: {NAME}: numpy {loss:.6f}, gpt.c {c_loss:.6f}")
