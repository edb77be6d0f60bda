"""A small GPT-style model (token + position embedding, pre-LayerNorm blocks of
multi-head causal self-attention and an MLP, dropout) used by the demo, the
benchmarks and the tests."""
import math

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        # (b, heads, t, d/heads): non-contiguous views, saved by the matmuls below.
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(torch.nn.functional.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab=512, dim=128, heads=4, layers=4, context=64, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def loss_fn(model, idx):
    logits = model(idx[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       idx[:, 1:].reshape(-1))
