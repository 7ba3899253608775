"""The weight layout of `w4a8` engines' `ai.dspark` operators (runtime/dspark_runtime/native/int4_rows.c): int4
codes in blocks of 32 along the input axis with one float16 scale per block and output column, in tiles of 8
columns whose bytes an AVX2 register multiplies by 4 activations of each column at once."""

from __future__ import annotations

import numpy as np

MATMUL, GATHER = "Int4RowsMatMul", "Int4RowsGather"
BLOCK = 32  # weights per scale along K
TILE = 8  # output columns per tile


def pack(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 weights [N, K] (K a multiple of 32) -> codes [⌈N/8⌉, K/32, 128] uint8, scales [⌈N/8⌉, K/32, 8]
    float16, the last tile filled with zero rows. Symmetric: each block's largest-magnitude weight maps to the code
    -8 (its float16 scale rounded first), w ≈ (code - 8) · scale with the codes stored unsigned."""
    rows = np.concatenate([rows, np.zeros((-len(rows) % TILE, rows.shape[1]), np.float32)])
    n, k = rows.shape
    blocks = rows.reshape(n, k // BLOCK, BLOCK)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
    scales = (peak / -8).astype(np.float16)
    scales[scales == 0] = 1
    codes = (np.clip(np.rint(blocks / scales[..., None].astype(np.float32)), -8, 7) + 8).astype(np.uint8)
    column_scales = scales.reshape(n // TILE, TILE, k // BLOCK).transpose(0, 2, 1)
    return tile_nibbles(codes.reshape(n, k)), np.ascontiguousarray(column_scales)


def tile_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes [N, K] (N a multiple of 8) -> [N/8, K/32, 128] bytes: per tile and block chunk c (32 bytes) holds
    k = 8c..8c+3 of each column in its low nibbles and 8c+4..8c+7 in its high ones, 4 bytes a column."""
    n, k = codes.shape
    nibbles = codes.reshape(n // TILE, TILE, k // BLOCK, 4, 2, 4).transpose(0, 2, 3, 4, 1, 5)  # tile, block, c, half,
    tiles = nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 4)  # column, k: the low nibble k = 8c + k', the high +4
    return np.ascontiguousarray(tiles.reshape(n // TILE, k // BLOCK, 4 * BLOCK))


def unpack(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 weights [8 · tiles, K] that packed codes and scales hold."""
    tiles, blocks = codes.shape[:2]
    bytes_ = codes.reshape(tiles, blocks, 4, TILE, 4)  # tile, block, c, column, k'
    halves = np.stack([bytes_ & 0x0F, bytes_ >> 4], axis=3)  # tile, block, c, half, column, k'
    values = halves.astype(np.float32) - 8
    weights = values.transpose(0, 4, 1, 2, 3, 5).reshape(tiles * TILE, blocks * BLOCK // BLOCK, BLOCK)
    return (weights * scales.transpose(0, 2, 1).reshape(tiles * TILE, blocks, 1).astype(np.float32)).reshape(
        tiles * TILE, blocks * BLOCK)
