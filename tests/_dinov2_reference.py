"""An independent, functional DINOv2 forward written from the official hub model's definition.

It reads the *official* key layout directly (no dinopipe code), so tests can check that a converted
checkpoint computes what the released model computes.
"""

import math

import torch
import torch.nn.functional as F


def official_keys(dim, depth, patch=14, grid=4, registers=0, swiglu=False, hidden=None, seed=0):
    """A state dict with the official DINOv2 hub key names and shapes, random values."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.05):
        return torch.randn(*shape, generator=g) * scale

    sd = {
        "cls_token": r(1, 1, dim, scale=0.5),
        "pos_embed": r(1, 1 + grid * grid, dim, scale=0.5),
        "mask_token": r(1, dim),
        "patch_embed.proj.weight": r(dim, 3, patch, patch),
        "patch_embed.proj.bias": r(dim),
        "norm.weight": 1 + r(dim),
        "norm.bias": r(dim),
    }
    if registers:
        sd["register_tokens"] = r(1, registers, dim, scale=0.5)
    hidden = hidden or 4 * dim
    for i in range(depth):
        b = f"blocks.{i}."
        sd.update({
            b + "norm1.weight": 1 + r(dim), b + "norm1.bias": r(dim),
            b + "attn.qkv.weight": r(3 * dim, dim), b + "attn.qkv.bias": r(3 * dim),
            b + "attn.proj.weight": r(dim, dim), b + "attn.proj.bias": r(dim),
            b + "ls1.gamma": 0.5 + r(dim), b + "norm2.weight": 1 + r(dim), b + "norm2.bias": r(dim),
            b + "ls2.gamma": 0.5 + r(dim),
        })
        if swiglu:
            sd.update({b + "mlp.w12.weight": r(2 * hidden, dim), b + "mlp.w12.bias": r(2 * hidden),
                       b + "mlp.w3.weight": r(dim, hidden), b + "mlp.w3.bias": r(dim)})
        else:
            sd.update({b + "mlp.fc1.weight": r(hidden, dim), b + "mlp.fc1.bias": r(hidden),
                       b + "mlp.fc2.weight": r(dim, hidden), b + "mlp.fc2.bias": r(dim)})
    return sd


def reference_forward(sd, x, num_heads, patch=14, registers=0, swiglu=False, antialias=False, offset=0.1):
    """DINOv2 ``forward_features`` on the official keys; returns (cls, patch tokens) after the final norm."""
    B, _, H, W = x.shape
    dim = sd["cls_token"].shape[-1]
    t = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=patch)
    t = t.flatten(2).transpose(1, 2)
    t = torch.cat([sd["cls_token"].expand(B, -1, -1), t], 1)
    pe = sd["pos_embed"]
    M = int(math.sqrt(pe.shape[1] - 1))
    h0, w0 = H // patch, W // patch
    if (h0, w0) != (M, M):
        kw = {"scale_factor": ((h0 + offset) / M, (w0 + offset) / M)} if offset else {"size": (h0, w0)}
        pp = F.interpolate(pe[:, 1:].reshape(1, M, M, dim).permute(0, 3, 1, 2), mode="bicubic",
                           antialias=antialias, **kw)
        pe = torch.cat([pe[:, :1], pp.permute(0, 2, 3, 1).reshape(1, -1, dim)], 1)
    t = t + pe
    if registers:
        t = torch.cat([t[:, :1], sd["register_tokens"].expand(B, -1, -1), t[:, 1:]], 1)
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    hd = dim // num_heads
    for i in range(depth):
        p = lambda n: sd[f"blocks.{i}.{n}"]  # noqa: E731
        y = F.layer_norm(t, (dim,), p("norm1.weight"), p("norm1.bias"), eps=1e-6)
        qkv = F.linear(y, p("attn.qkv.weight"), p("attn.qkv.bias")).reshape(B, -1, 3, num_heads, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = ((q * hd**-0.5) @ k.transpose(-2, -1)).softmax(-1) @ v
        y = F.linear(a.transpose(1, 2).reshape(B, -1, dim), p("attn.proj.weight"), p("attn.proj.bias"))
        t = t + p("ls1.gamma") * y
        y = F.layer_norm(t, (dim,), p("norm2.weight"), p("norm2.bias"), eps=1e-6)
        if swiglu:
            x1, x2 = F.linear(y, p("mlp.w12.weight"), p("mlp.w12.bias")).chunk(2, -1)
            y = F.linear(F.silu(x1) * x2, p("mlp.w3.weight"), p("mlp.w3.bias"))
        else:
            y = F.linear(F.gelu(F.linear(y, p("mlp.fc1.weight"), p("mlp.fc1.bias"))), p("mlp.fc2.weight"), p("mlp.fc2.bias"))
        t = t + p("ls2.gamma") * y
    t = F.layer_norm(t, (dim,), sd["norm.weight"], sd["norm.bias"], eps=1e-6)
    return t[:, 0], t[:, 1 + registers:]


def chunk_blocks(sd, chunks):
    """The FSDP 'block chunks' layout of DINOv2 training checkpoints: blocks.CHUNK.GLOBAL_INDEX.*"""
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    size = math.ceil(depth / chunks)
    out = {}
    for k, v in sd.items():
        if k.startswith("blocks."):
            i = int(k.split(".")[1])
            k = f"blocks.{i // size}.{i}." + k.split(".", 2)[2]
        out[k] = v
    return out
