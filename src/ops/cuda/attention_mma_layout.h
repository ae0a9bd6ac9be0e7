// Lane <-> element mappings of the warp-level tensor-core instructions the mma.sync attention
// forward (attention_mma.cu) uses, written from the PTX ISA's fragment tables, as plain
// host/device functions: the kernel computes its addresses and register packing with them,
// and tests/test_attention_mma_emulation.cpp checks on the host (no GPU) that they compose as the
// instructions require (every tile element held exactly once; ldmatrix delivering what mma
// expects; the S accumulator reused as the P·V A operand).
//
// Notation: lane in [0, 32), g = lane / 4 (groupID), t = lane % 4 (thread in group).
//   mma.m16n8k16 A (16 x 16, row major), 8 16-bit elements a0..a7 in 4 .b32 registers
//     (register j holds a_{2j} in its low half, a_{2j+1} in its high half):
//     a_i: row = g + 8 * ((i / 2) % 2), col = 2 t + (i % 2) + 8 * (i / 4)
//   mma.m16n8k16 B (16 x 8, K x N, "col"), 4 elements b0..b3 in 2 registers:
//     b_i: k = 2 t + (i % 2) + 8 * (i / 2), n = g
//   mma.m16n8k16 C / D (16 x 8 fp32), 4 elements c0..c3:
//     c_i: row = g + 8 * (i / 2), col = 2 t + (i % 2)
//   ldmatrix.m8n8.x4.b16: lanes 8 r .. 8 r + 7 give the addresses of rows 0..7 of matrix r;
//     register r of a lane holds 2 elements e = 0, 1 of matrix r: without .trans those at
//     (row g, col 2 t + e), with .trans those at (row 2 t + e, col g) of the stored matrix.
#pragma once

#if defined(__CUDACC__)
#define MT_MMA_HD __host__ __device__ __forceinline__
#else
#define MT_MMA_HD inline
#endif

namespace mt::cuda::mma_layout {

// mma.m16n8k16 operand element i of `lane`.
MT_MMA_HD int a_row(int lane, int i) { return lane / 4 + 8 * ((i / 2) % 2); }
MT_MMA_HD int a_col(int lane, int i) { return 2 * (lane % 4) + (i % 2) + 8 * (i / 4); }
MT_MMA_HD int b_k(int lane, int i) { return 2 * (lane % 4) + (i % 2) + 8 * (i / 2); }
MT_MMA_HD int b_n(int lane, int /*i*/) { return lane / 4; }
MT_MMA_HD int c_row(int lane, int i) { return lane / 4 + 8 * (i / 2); }
MT_MMA_HD int c_col(int lane, int i) { return 2 * (lane % 4) + (i % 2); }

// ldmatrix.x4: the (row, col) within stored matrix `reg` (0..3) of element e of register reg.
MT_MMA_HD int ldm_row(int lane, int e, bool trans) { return trans ? 2 * (lane % 4) + e : lane / 4; }
MT_MMA_HD int ldm_col(int lane, int e, bool trans) { return trans ? lane / 4 : 2 * (lane % 4) + e; }

// The kernel's ldmatrix row addresses (offsets from the block's origin in the [keys, D] tile).
// K (S = Q K^T, no .trans): one x4 covers 8 keys x 32 dims, matrix r = dims [8 r, 8 r + 8);
// registers (0, 1) are the B operand of the k-step over dims [0, 16), (2, 3) of [16, 32).
MT_MMA_HD int k_ldm_key(int lane) { return lane % 8; }
MT_MMA_HD int k_ldm_dim(int lane) { return 8 * (lane / 8); }
// V (O += P V, .trans): one x4 covers 16 keys x 16 dims, matrix r = keys [8 (r % 2), +8) x
// dims [8 (r / 2), +8); registers (0, 1) are the B operand for output dims [0, 8), (2, 3)
// for [8, 16).
MT_MMA_HD int v_ldm_key(int lane) { return lane % 8 + 8 * ((lane / 8) % 2); }
MT_MMA_HD int v_ldm_dim(int lane) { return 8 * (lane / 16); }

// A operand by ldmatrix.x4 (no .trans) from a row-major [rows][cols] tile, 16 x 16 per x4:
// matrix r = rows [8 (r % 2), +8) x cols [8 (r / 2), +8), so register r is A register j = r
// (a_{2r}, a_{2r+1}). The backward loads its K, V (dK/dV kernel) and Q, dO (dQ kernel) A
// fragments so. (The backward's B operands reuse k_ldm_* with rows = queries (S^T = K Q^T,
// dP^T = V dO^T) or keys (S = Q K^T, dP = dO V^T), and v_ldm_* with .trans with rows = queries
// (dV += P^T dO, dK += dS^T Q) or keys (dQ += dS K).)
MT_MMA_HD int a_ldm_row(int lane) { return lane % 8 + 8 * ((lane / 8) % 2); }
MT_MMA_HD int a_ldm_col(int lane) { return 8 * (lane / 16); }

// Q (A operand) register j of a lane, loaded straight from global memory as the pair of
// columns (col, col + 1) of row `row` of the warp's 16-row, 16-column k-step.
MT_MMA_HD int q_reg_row(int lane, int j) { return a_row(lane, 2 * j); }
MT_MMA_HD int q_reg_col(int lane, int j) { return a_col(lane, 2 * j); }

// P (A operand of the k-step over keys [16 s, 16 s + 16)) register j packs the accumulator
// elements (2 (j % 2), 2 (j % 2) + 1) of the S tile over keys [8 p_tile(s, j), +8).
MT_MMA_HD int p_tile(int s, int j) { return 2 * s + j / 2; }
MT_MMA_HD int p_elem(int j, int e) { return 2 * (j % 2) + e; }

}  // namespace mt::cuda::mma_layout
