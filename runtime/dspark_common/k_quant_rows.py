"""The weight layout of `ai.dspark`'s `KQuantMatMul` and `KQuantGather` (runtime/dspark_common/native/k_quants.c):
a GGUF file's Q4_K, Q5_K or Q6_K blocks, byte for byte the numbers ggml keeps, re-laid in tiles of 8 output columns
(the nibbles as `int4_rows` lays them out, the upper bits beside them, the 6-bit or 8-bit scales and the float16
super-block scales widened to float32, exactly)."""

from __future__ import annotations

import numpy as np

from dspark_common.int4_rows import BLOCK, TILE, tile_nibbles

MATMUL, GATHER = "KQuantMatMul", "KQuantGather"
SUPER = 256  # weights per super-block
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
UPPER_BITS = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}  # code bits above the nibble
PARTS = ("codes", "high", "scales", "mins", "supers")


def bytes_per_weight(kind: str) -> float:
    """A weight's bytes in this layout: its code bits, its share of the per-32 sc and m bytes (Q6_K: a scale byte per
    16) and of the per-256 float32 d and dmin (Q6_K: d)."""
    six = kind == "Q6_K"
    return (4 + UPPER_BITS[kind]) / 8 + (1 / 16 if six else 2 / 32) + 4 * (1 if six else 2) / SUPER


def _halves(blocks: np.ndarray, at: int) -> np.ndarray:
    """float16 pairs at byte `at` of each block, as float32 [n, supers]."""
    return np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _scales_and_mins(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit sc and m per super-block, packed into 12 bytes (ggml's `get_scale_min_k4`)."""
    q = blocks[..., 4:16]
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, m


def decode(rows: np.ndarray, kind: str) -> dict[str, np.ndarray]:
    """A matrix's raw blocks [n, bytes per row] -> codes [n, K] (unsigned: Q4_K < 16, Q5_K < 32, Q6_K < 64, its
    value q - 32), scales [n, K/32] (Q6_K: int8 [n, K/16]), mins [n, K/32] (Q6_K: none), d and dmin [n, K/256]."""
    n = len(rows)
    blocks = rows.reshape(n, -1, BLOCK_BYTES[kind])
    if kind == "Q6_K":
        low, upper = blocks[..., :128].reshape(n, -1, 2, 2, 32), blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
        nibbles = np.stack([low & 0xF, low >> 4], axis=3)  # [n, B, half of 128, nibble, ql half, 32]
        shifts = np.array([0, 2, 4, 6], np.uint8).reshape(2, 2, 1)  # [nibble, ql half]: 2·(2·nibble + half)
        bits = (upper[..., None, :, :] >> shifts) & 3
        codes = (nibbles | (bits << 4)).reshape(n, -1)
        return {"codes": codes, "scales": blocks[..., 192:208].view(np.int8).reshape(n, -1), "mins": None,
                "d": _halves(blocks, 208), "dmin": None}
    qs = blocks[..., -128:].reshape(n, -1, 4, 1, 32)
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=3).reshape(n, -1, 8, 32)  # sub-block 2j low, 2j + 1 high
    if kind == "Q5_K":
        qh = blocks[..., 16:48].reshape(n, -1, 1, 32)
        codes = codes | (((qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1) << 4)
    sc, m = _scales_and_mins(blocks)
    return {"codes": codes.reshape(n, -1), "scales": sc.reshape(n, -1), "mins": m.reshape(n, -1),
            "d": _halves(blocks, 0), "dmin": _halves(blocks, 2)}


def values(rows: np.ndarray, kind: str) -> np.ndarray:
    """float32 [n, K] as ggml dequantizes the blocks: (d·sc)·q - dmin·m, Q6_K (d·sc)·(q - 32)."""
    parts = decode(rows, kind)
    n, k = parts["codes"].shape
    sub = 16 if kind == "Q6_K" else 32
    scale = (np.repeat(parts["d"], SUPER // sub, axis=1) * parts["scales"].astype(np.float32))
    codes = parts["codes"].astype(np.float32).reshape(n, -1, sub)
    if kind == "Q6_K":
        return (scale[..., None] * (codes - 32)).reshape(n, k)
    offset = np.repeat(parts["dmin"], SUPER // sub, axis=1) * parts["mins"].astype(np.float32)
    return (scale[..., None] * codes - offset[..., None]).reshape(n, k)


def pack(rows: np.ndarray, kind: str) -> dict[str, np.ndarray]:
    """Raw blocks [n, bytes per row] -> the operators' inputs (`PARTS`), the last tile filled with zero columns."""
    parts = decode(rows, kind)
    pad = -len(rows) % TILE
    parts = {key: None if value is None else np.concatenate([value, np.zeros((pad, *value.shape[1:]), value.dtype)])
             for key, value in parts.items()}
    codes = parts["codes"]
    n, k = codes.shape
    tiles, blocks = n // TILE, k // BLOCK
    upper = codes.reshape(tiles, TILE, blocks, 4, 2, 4).transpose(0, 2, 3, 4, 1, 5) >> 4  # tile, block, c, half, col, k
    bits = UPPER_BITS[kind]
    shifts = (bits * np.arange(8, dtype=np.uint16)).reshape(8, 1, 1)  # half s = 2c + half at bit·s
    slots = upper.reshape(tiles, blocks, 8, TILE, 4).astype(np.uint16) << shifts
    high = slots.sum(axis=2, dtype=np.uint16)  # [tile, block, col, k]: bit·slot positions, at most 16 bits
    planes = np.stack([high & 0xFF, high >> 8], axis=2)[:, :, :bits].astype(np.uint8)
    columns = lambda a: np.ascontiguousarray(a.reshape(tiles, TILE, -1).transpose(0, 2, 1))  # noqa: E731
    supers = [parts["d"]] + ([] if kind == "Q6_K" else [parts["dmin"]])
    return {"codes": tile_nibbles(codes & 0xF),
            "high": np.ascontiguousarray(planes.reshape(tiles, blocks, 32 * bits)),
            "scales": columns(parts["scales"]).view(np.uint8),
            "mins": columns(parts["mins"]) if parts["mins"] is not None else np.zeros((tiles, blocks, 0), np.uint8),
            "supers": np.ascontiguousarray(np.stack([columns(s) for s in supers], axis=2).astype(np.float32))}
