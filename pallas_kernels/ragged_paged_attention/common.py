"""Shared pieces of ragged paged attention: the contract, input checks, and the tile plan the fast paths walk.

Layouts (one layer; the cache stacks layers on a leading axis and hands one slice to the op):
  q             [N, Hq, D]       every sequence's queries, token-major: sequence i owns rows
                                 cu_q_lens[i] .. cu_q_lens[i + 1] - 1
  k_pages       [P, ps, Hkv, D]  key pool of P pages of ps tokens; v_pages the same. Hq % Hkv == 0 (GQA:
                                 query head h reads kv head h // (Hq // Hkv))
  kv_lens       [R] int32        tokens in sequence i's cache INCLUDING this step's (already written)
  page_indices  [R, NP] int32    sequence i's pages in order: position p lives at page page_indices[i, p // ps],
                                 slot p % ps
  cu_q_lens     [R + 1] int32    non-decreasing, cu_q_lens[0] = 0
  num_seqs      [] or [1] int32  sequences in use; rows i >= num_seqs are padding
N, R and NP are static; every value above may change without a retrace.

Masking contract (the same in every implementation, tested):
  * query j of sequence i (q_len_i = cu_q_lens[i + 1] - cu_q_lens[i]) sits at position
    kv_lens[i] - q_len_i + j and sees key position k iff k <= its position, k < kv_lens[i], k < NP * ps and,
    with a sliding window W, k > position - W. Scores are sm_scale * q.k, soft-capped to
    soft_cap * tanh(s / soft_cap) when soft_cap is given; softmax in fp32.
  * a query with no visible key outputs 0, as does every row of a sequence i >= num_seqs and every row
    >= cu_q_lens[num_seqs].
  * only a sequence's used pages, page_indices[i, :ceil(min(kv_lens[i], NP * ps) / ps)], are read; entries past
    them may hold any integer, even outside [0, P), and change nothing (a NaN in an unused page or slot
    does not reach the output either). An entry inside the used range must lie in [0, P):
    `validate_metadata` checks that (and the rest of the value contract) on the host; inside a compiled step
    the kernels clamp page ids into the pool, so a bad one cannot fault.
Static mistakes (shapes, dtypes, options) raise ValueError naming the problem.

The fast paths cut the queries into *tiles*: `tile` consecutive query rows of ONE sequence, with the range
of key blocks those rows can see. Two classes of tiles cover a batch: short sequences (decode, a speculative
verify window: q_len <= the decode tile) take one small tile each, longer ones (prefill chunks) are cut into
prefill tiles. A tile never spans two sequences, so it reads exactly one sequence's pages, and its key range
stops at its last query (causal) and starts at its window.
"""
from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np



@dataclasses.dataclass(frozen=True)
class Dims:
    """The static sizes of one call."""
    num_tokens: int        # N
    num_q_heads: int       # Hq
    head_dim: int          # D
    num_pages: int         # P
    page_size: int         # ps
    num_kv_heads: int      # Hkv
    max_seqs: int          # R
    pages_per_seq: int     # NP

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def capacity(self) -> int:
        """Key positions a sequence can address: NP * ps."""
        return self.pages_per_seq * self.page_size


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _is_int(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.integer)


def check_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                 sliding_window=None, soft_cap=None, max_q_len=None) -> Dims:
    """Validates shapes, dtypes and options (layouts above); returns the Dims. Raises ValueError naming the
    problem."""
    if q.ndim != 3:
        raise ValueError(f"q must be token-major [N, Hq, D]; got shape {q.shape}")
    N, Hq, D = q.shape
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be a page pool [P, ps, Hkv, D]; got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages must have k_pages' shape {k_pages.shape}; got {v_pages.shape}")
    P, ps, Hkv, Dk = k_pages.shape
    if Dk != D:
        raise ValueError(f"k_pages / v_pages head dim {Dk} must equal q's head dim {D}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"query heads Hq={Hq} must be a multiple of kv heads Hkv={Hkv}")
    if not _is_float(q):
        raise ValueError(f"q must be a floating array; got dtype {q.dtype}")
    if not _is_float(k_pages) or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages must be floating arrays of one dtype; got {k_pages.dtype}, "
                         f"{v_pages.dtype}")
    if page_indices.ndim != 2:
        raise ValueError(f"page_indices must be [R, NP] (one row of pages per sequence); got shape "
                         f"{page_indices.shape}")
    R, NP = page_indices.shape
    for name, a, shape in (("page_indices", page_indices, (R, NP)), ("kv_lens", kv_lens, (R,)),
                           ("cu_q_lens", cu_q_lens, (R + 1,))):
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {shape} for R={R} sequences (page_indices' rows); "
                             f"got {a.shape}")
        if not _is_int(a):
            raise ValueError(f"{name} must be an integer (int32) array; got dtype {a.dtype}")
    if num_seqs.shape not in ((), (1,)) or not _is_int(num_seqs):
        raise ValueError(f"num_seqs must be an integer scalar of shape () or (1,); got {num_seqs.shape} "
                         f"{num_seqs.dtype}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise ValueError(f"sm_scale must be a Python float (it is static); got {type(sm_scale).__name__}")
    if sliding_window is not None and (not isinstance(sliding_window, numbers.Integral) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int; got {sliding_window!r}")
    if soft_cap is not None and (not isinstance(soft_cap, numbers.Real) or not soft_cap > 0):
        raise ValueError(f"soft_cap must be None or a positive float; got {soft_cap!r}")
    if max_q_len is not None and (not isinstance(max_q_len, numbers.Integral) or max_q_len < 1):
        raise ValueError(f"max_q_len must be None or a positive int; got {max_q_len!r}")
    return Dims(N, Hq, D, P, ps, Hkv, R, NP)


def validate_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, *, num_pages: int, page_size: int,
                      num_tokens: int) -> None:
    """Checks the value contract on the host (numpy; not inside jit): 0 <= num_seqs <= R, cu_q_lens starts at 0,
    is non-decreasing and ends within the N rows, every sequence in use has q_len <= kv_len <= NP * ps, and its
    used pages lie in [0, P). Raises ValueError naming the first offending sequence. The kernels never fault
    on a violation, but their output is then unspecified: run this where the metadata is built (tests, debug)."""
    kv = np.asarray(kv_lens).astype(np.int64)
    pt = np.asarray(page_indices).astype(np.int64)
    cu = np.asarray(cu_q_lens).astype(np.int64)
    R, NP = pt.shape
    ns = int(np.asarray(num_seqs).reshape(-1)[0])
    if not 0 <= ns <= R:
        raise ValueError(f"num_seqs={ns} must be in [0, R={R}]")
    if cu[0] != 0:
        raise ValueError(f"cu_q_lens[0] must be 0; got {cu[0]}")
    q_lens = np.diff(cu[:ns + 1])
    if np.any(q_lens < 0):
        i = int(np.argmax(q_lens < 0))
        raise ValueError(f"cu_q_lens must be non-decreasing; sequence {i} has q_len {q_lens[i]}")
    if cu[ns] > num_tokens:
        raise ValueError(f"cu_q_lens[num_seqs]={cu[ns]} exceeds the N={num_tokens} query rows")
    for i in range(ns):
        if not q_lens[i] <= kv[i] <= NP * page_size:
            raise ValueError(f"sequence {i}: need q_len ({q_lens[i]}) <= kv_len ({kv[i]}) <= NP * ps "
                             f"({NP} * {page_size})")
        used = pt[i, :-(-kv[i] // page_size)]
        if np.any((used < 0) | (used >= num_pages)):
            raise ValueError(f"sequence {i}: used page ids {used[(used < 0) | (used >= num_pages)].tolist()} "
                             f"lie outside the pool [0, {num_pages})")


def as_int32(kv_lens, page_indices, cu_q_lens, num_seqs):
    """The metadata as int32, num_seqs as a scalar clipped to [0, R]."""
    R = page_indices.shape[0]
    ns = jnp.clip(num_seqs.reshape(-1)[0].astype(jnp.int32), 0, R)
    return kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32), cu_q_lens.astype(jnp.int32), ns


def token_sequences(cu_q_lens, num_seqs, num_tokens: int):
    """cu_q_lens [R + 1] int32, num_seqs scalar -> (seq [N] int32, row [N] int32, valid [N] bool): the sequence
    owning each query row, the row's index inside it, and False for padding rows (>= cu_q_lens[num_seqs])."""
    R = cu_q_lens.shape[0] - 1
    n = jnp.arange(num_tokens, dtype=jnp.int32)
    # Entries past num_seqs may be anything: push them past every row so the table stays sorted.
    ends = jnp.where(jnp.arange(1, R + 1) <= num_seqs, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    seq = jnp.minimum(jnp.searchsorted(ends, n, side="right").astype(jnp.int32), R - 1)
    valid = n < cu_q_lens[num_seqs]
    return seq, n - cu_q_lens[seq], valid


def visible(q_pos, k_pos, kv_len, capacity: int, sliding_window: int | None):
    """The masking rule on broadcastable int32 arrays: key k_pos is visible to the query at q_pos."""
    ok = (k_pos <= q_pos) & (k_pos < kv_len) & (k_pos < capacity)
    if sliding_window is not None:
        ok = ok & (k_pos > q_pos - sliding_window)
    return ok


def cap_scores(s, soft_cap: float | None):
    """soft_cap * tanh(s / soft_cap) (fp32), or s unchanged."""
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def softmax_fold(m, l, s):
    """Folds one block of masked scores into a running softmax: m, l [..., 1] the max and sum so far (m = -inf before
    any key), s [..., block] fp32 scores, -inf where not visible. Returns (m_new, l_new, alpha, e): the new max and
    sum, the factor that rescales what was accumulated so far, and the block's weights (0 where masked)."""
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    e = jnp.exp(s - m_safe)
    return m_new, alpha * l + jnp.sum(e, axis=-1, keepdims=True), alpha, e


def cdiv(a, b):
    return -(-a // b)


def num_tiles(num_tokens: int, max_seqs: int, tile: int, longer_than: int, at_most: int | None) -> int:
    """A static bound on the tiles of one class: sequences with longer_than < q_len (<= at_most), cut into tiles of
    `tile` rows. At most L = min(R, N // (longer_than + 1)) sequences qualify; their ceil(q_len / tile) tiles
    sum to at most (N + L * (tile - 1)) // tile, and to L when no member is longer than a tile."""
    L = min(max_seqs, num_tokens // (longer_than + 1))
    if at_most is not None and at_most <= tile:
        return L
    return min((num_tokens + L * (tile - 1)) // tile, num_tokens)


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """W tiles of `tile` query rows, each inside one sequence; arrays [W] int32. Tiles that hold no rows
    (past the batch's real tiles) have rows = 0 and an empty block range.

    seq      the sequence the tile belongs to
    row0     the tile's first row in q (token-major)
    rows     its valid rows (<= tile)
    pos0     the position of its first row
    kv_len   the sequence's readable keys, min(kv_lens, NP * ps)
    blk_lo   first key block (of `block` keys) a row of the tile can see
    blk_hi   one past the last; blk_lo == blk_hi: nothing to read (rows output 0)
    """
    seq: jax.Array
    row0: jax.Array
    rows: jax.Array
    pos0: jax.Array
    kv_len: jax.Array
    blk_lo: jax.Array
    blk_hi: jax.Array
    tile: int
    block: int

    @property
    def size(self) -> int:
        return self.seq.shape[0]

    def token_rows(self, num_tokens: int):
        """[W, tile] int32: the q row of every tile row, num_tokens (out of range) where the tile has no row."""
        r = jnp.arange(self.tile, dtype=jnp.int32)
        return jnp.where(r[None, :] < self.rows[:, None], self.row0[:, None] + r[None, :], num_tokens)

    def take(self, idx):
        """The plan with its tiles reordered / selected by idx [W'] int32."""
        f = {k: getattr(self, k)[idx] for k in ("seq", "row0", "rows", "pos0", "kv_len", "blk_lo", "blk_hi")}
        return TilePlan(**f, tile=self.tile, block=self.block)


def plan_tiles(kv_lens, cu_q_lens, num_seqs, dims: Dims, *, tile: int, longer_than: int, at_most: int | None,
               block: int, sliding_window: int | None) -> TilePlan:
    """The tiles of the sequences in use with longer_than < q_len (<= at_most), each cut into tiles of `tile`
    rows, in sequence order. block: keys per key block (the blk_lo / blk_hi unit). int32 metadata (as_int32)."""
    R = dims.max_seqs
    W = num_tiles(dims.num_tokens, R, tile, longer_than, at_most)
    i = jnp.arange(R, dtype=jnp.int32)
    q_len = jnp.where(i < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    member = q_len > longer_than
    if at_most is not None:
        member = member & (q_len <= at_most)
    n = jnp.where(member, cdiv(q_len, tile), 0)
    ends = jnp.cumsum(n)
    k = jnp.arange(W, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, k, side="right").astype(jnp.int32), R - 1)
    real = k < ends[-1]
    t = k - (ends[seq] - n[seq])
    ql = q_len[seq]
    rows = jnp.where(real, jnp.minimum(tile, ql - t * tile), 0)
    pos0 = kv_lens[seq] - ql + t * tile
    kv_len = jnp.clip(kv_lens[seq], 0, dims.capacity)
    hi = jnp.clip(pos0 + rows, 0, kv_len)                       # keys < hi: up to the tile's last query
    lo = jnp.zeros_like(hi) if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    blk_lo = lo // block
    blk_hi = jnp.where(real & (hi > lo), cdiv(hi, block), blk_lo)
    return TilePlan(seq=seq, row0=cu_q_lens[seq] + t * tile, rows=rows, pos0=pos0, kv_len=kv_len,
                    blk_lo=blk_lo, blk_hi=blk_hi, tile=tile, block=block)


def tile_classes(num_tokens: int, decode_tile: int, prefill_tile: int, decode_only: bool = False):
    """The two tile classes as (tile, longer_than, at_most): decode tiles hold a whole short sequence
    (q_len <= decode_tile), prefill tiles cut the longer ones. The prefill class is dropped when no sequence can
    be longer than a decode tile: num_tokens <= decode_tile, or the caller's promise (decode_only)."""
    classes = [(decode_tile, 0, decode_tile)]
    if num_tokens > decode_tile and not decode_only:
        classes.append((prefill_tile, decode_tile, None))
    return classes
