#include "kernels/strided_copy.h"

#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace actstash::kernels {
namespace {

// The CPU copy walks the coalesced layout with odometers (no per-element or
// per-row index division) and picks its loops by the strided side's strides.
// It visits every element exactly once, in some order; the order does not
// matter: a gather writes each destination element once, and a scatter's
// destination is checked not to overlap itself.

// One dim of a copy: its size, and its step in bytes on the strided side and
// on the dense (contiguous, row-major) side.
struct Dim {
  uint64_t size;
  uint64_t strided;
  uint64_t dense;
};

// Calls body(strided, dense) with the byte offsets of every index tuple of
// dims[0..count), last dim fastest; once with (0, 0) when count is 0.
template <typename Body>
void ForEachIndex(const Dim* dims, int count, Body&& body) {
  uint64_t index[kMaxDims] = {};
  uint64_t strided = 0;
  uint64_t dense = 0;
  while (true) {
    body(strided, dense);
    int d = count - 1;
    for (; d >= 0; --d) {
      strided += dims[d].strided;
      dense += dims[d].dense;
      if (++index[d] < dims[d].size) break;
      strided -= dims[d].strided * dims[d].size;  // modular: back to index 0
      dense -= dims[d].dense * dims[d].size;
      index[d] = 0;
    }
    if (d < 0) return;
  }
}

// Copies one element of type T (an unsigned integer of the element's size;
// memcpy of a constant size is a plain, unaligned-safe load or store).
template <typename T, bool kGather>
inline void CopyElement(const uint8_t* src, uint8_t* dst, uint64_t strided, uint64_t dense) {
  T value;
  std::memcpy(&value, src + (kGather ? strided : dense), sizeof(T));
  std::memcpy(dst + (kGather ? dense : strided), &value, sizeof(T));
}

// `count` elements from byte offsets (strided, dense) on, stepping by
// `strided_step` and `dense_step` bytes.
template <typename T, bool kGather>
void CopyLine(const uint8_t* src, uint8_t* dst, uint64_t strided, uint64_t dense, uint64_t count,
              uint64_t strided_step, uint64_t dense_step) {
  for (uint64_t j = 0; j < count; ++j, strided += strided_step, dense += dense_step) {
    CopyElement<T, kGather>(src, dst, strided, dense);
  }
}

// TransposeTile<kElem>(in, in_pitch, out, out_pitch): the kTile x kTile tile
// of kElem-byte elements (kTile * kElem = 16 bytes, one SSE2 register a row)
// whose rows start at in + r * in_pitch is written transposed, its column c
// as the row at out + c * out_pitch. Any alignment.
template <int kElem>
constexpr int kTile = 16 / kElem;

#if defined(__SSE2__)
template <int kElem>
inline __m128i UnpackLo(__m128i a, __m128i b) {
  if constexpr (kElem == 1) return _mm_unpacklo_epi8(a, b);
  if constexpr (kElem == 2) return _mm_unpacklo_epi16(a, b);
  if constexpr (kElem == 4) return _mm_unpacklo_epi32(a, b);
  if constexpr (kElem == 8) return _mm_unpacklo_epi64(a, b);
}

template <int kElem>
inline __m128i UnpackHi(__m128i a, __m128i b) {
  if constexpr (kElem == 1) return _mm_unpackhi_epi8(a, b);
  if constexpr (kElem == 2) return _mm_unpackhi_epi16(a, b);
  if constexpr (kElem == 4) return _mm_unpackhi_epi32(a, b);
  if constexpr (kElem == 8) return _mm_unpackhi_epi64(a, b);
}

// Interleaving rows p and p + n/2 into rows 2p and 2p + 1 rotates the bits of
// (row, lane) left by one; log2(n) rounds of it swap row and lane.
template <int kElem>
inline void TransposeTile(const uint8_t* in, uint64_t in_pitch, uint8_t* out, uint64_t out_pitch) {
  constexpr int n = kTile<kElem>;
  __m128i rows[n];
  for (int r = 0; r < n; ++r) {
    rows[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + r * in_pitch));
  }
  for (int round = 1; round < n; round *= 2) {
    __m128i next[n];
    for (int p = 0; p < n / 2; ++p) {
      next[2 * p] = UnpackLo<kElem>(rows[p], rows[p + n / 2]);
      next[2 * p + 1] = UnpackHi<kElem>(rows[p], rows[p + n / 2]);
    }
    for (int r = 0; r < n; ++r) rows[r] = next[r];
  }
  for (int c = 0; c < n; ++c) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c * out_pitch), rows[c]);
  }
}
#else
template <int kElem>
inline void TransposeTile(const uint8_t* in, uint64_t in_pitch, uint8_t* out, uint64_t out_pitch) {
  constexpr int n = kTile<kElem>;
  for (int r = 0; r < n; ++r) {
    for (int c = 0; c < n; ++c) {
      std::memcpy(out + c * out_pitch + r * kElem, in + r * in_pitch + c * kElem, kElem);
    }
  }
}
#endif

// Cache blocks of the plane copy: kBlockBytes / kElem elements a side.
constexpr uint64_t kBlockBytes = 128;

// The 2-D plane of an outer dim `row` and the innermost dim `col` at byte
// offsets (strided, dense): element (i, j) is at strided + i * row.strided +
// j * col.strided on the strided side and dense + i * row.dense + j * T on
// the dense side. Copied in cache blocks; inside a block, when the strided
// side is contiguous along `row` (row.strided == T), in 16-byte tiles
// transposed in registers, visited so that consecutive tiles continue the
// same destination lines (along j for a gather, along i for a scatter).
template <typename T, bool kGather>
void CopyPlane(const uint8_t* src, uint8_t* dst, uint64_t strided, uint64_t dense, const Dim& row,
               const Dim& col) {
  constexpr int kElem = sizeof(T);
  constexpr uint64_t n = kTile<kElem>;
  constexpr uint64_t kBlock = kBlockBytes / kElem;  // a multiple of n
  const bool tiles = row.strided == kElem;
  auto tile = [&](uint64_t i, uint64_t j) {
    const uint64_t s = strided + i * kElem + j * col.strided;
    const uint64_t d = dense + i * row.dense + j * kElem;
    if (kGather) {
      TransposeTile<kElem>(src + s, col.strided, dst + d, row.dense);
    } else {
      TransposeTile<kElem>(src + d, row.dense, dst + s, col.strided);
    }
  };
  for (uint64_t i0 = 0; i0 < row.size; i0 += kBlock) {
    const uint64_t i1 = i0 + kBlock < row.size ? i0 + kBlock : row.size;
    const uint64_t tiled_i1 = tiles ? i0 + (i1 - i0) / n * n : i0;  // rows [i0, tiled_i1)
    for (uint64_t j0 = 0; j0 < col.size; j0 += kBlock) {
      const uint64_t j1 = j0 + kBlock < col.size ? j0 + kBlock : col.size;
      const uint64_t tiled_j1 = j0 + (j1 - j0) / n * n;  // by columns [j0, tiled_j1)
      if (kGather) {
        for (uint64_t i = i0; i < tiled_i1; i += n) {
          for (uint64_t j = j0; j < tiled_j1; j += n) tile(i, j);
        }
      } else {
        for (uint64_t j = j0; j < tiled_j1; j += n) {
          for (uint64_t i = i0; i < tiled_i1; i += n) tile(i, j);
        }
      }
      for (uint64_t i = i0; i < i1; ++i) {  // what the tiles left: a right and a bottom strip
        const uint64_t from = i < tiled_i1 ? tiled_j1 : j0;
        CopyLine<T, kGather>(src, dst, strided + i * row.strided + from * col.strided,
                             dense + i * row.dense + from * kElem, j1 - from, col.strided, kElem);
      }
    }
  }
}

// The dim whose rows the plane copy should pair with the innermost dim
// (strided step `inner`, not one element): the outer dim with the smallest
// nonzero strided step below both `inner` and a cache line (neighbours along
// it then share cache lines), innermost on ties; -1 when there is none.
int PlaneRowDim(const Dim* dims, int outer_count, uint64_t inner) {
  constexpr uint64_t kCacheLine = 64;
  int best = -1;
  for (int d = 0; d < outer_count; ++d) {
    const uint64_t step = dims[d].strided;
    if (step == 0 || step >= inner || step >= kCacheLine) continue;
    if (best < 0 || step <= dims[best].strided) best = d;
  }
  return best;
}

template <typename T, bool kGather>
void CopyTyped(const uint8_t* src, uint8_t* dst, const StridedLayout& coalesced) {
  constexpr uint64_t kElem = sizeof(T);
  const int ndim = coalesced.ndim;
  if (ndim == 0) return CopyElement<T, kGather>(src, dst, 0, 0);
  // Coalesced dims all have size >= 2, so stride * kElem <= extent fits.
  Dim dims[kMaxDims] = {};
  uint64_t pitch = kElem;
  for (int d = ndim - 1; d >= 0; --d) {
    const auto size = static_cast<uint64_t>(coalesced.sizes[d]);
    dims[d] = {size, static_cast<uint64_t>(coalesced.strides[d]) * kElem, pitch};
    pitch *= size;
  }
  const Dim inner = dims[ndim - 1];
  const int outer_count = ndim - 1;
  if (inner.strided == kElem) {  // dense rows: one memcpy each
    const uint64_t bytes = inner.size * kElem;
    ForEachIndex(dims, outer_count, [&](uint64_t strided, uint64_t dense) {
      if (kGather) {
        std::memcpy(dst + dense, src + strided, bytes);
      } else {
        std::memcpy(dst + strided, src + dense, bytes);
      }
    });
    return;
  }
  const int row = PlaneRowDim(dims, outer_count, inner.strided);
  if (row < 0) {  // element by element along the innermost dim
    ForEachIndex(dims, outer_count, [&](uint64_t strided, uint64_t dense) {
      CopyLine<T, kGather>(src, dst, strided, dense, inner.size, inner.strided, kElem);
    });
    return;
  }
  Dim rest[kMaxDims] = {};  // the outer dims but `row`
  int rest_count = 0;
  for (int d = 0; d < outer_count; ++d) {
    if (d != row) rest[rest_count++] = dims[d];
  }
  ForEachIndex(rest, rest_count, [&](uint64_t strided, uint64_t dense) {
    CopyPlane<T, kGather>(src, dst, strided, dense, dims[row], inner);
  });
}

template <bool kGather>
void CopyStrided(const void* src, void* dst, const StridedLayout& layout) {
  const StridedLayout coalesced = CoalesceLayout(layout);
  const auto* s = static_cast<const uint8_t*>(src);
  auto* d = static_cast<uint8_t*>(dst);
  switch (layout.elem_size) {
    case 1:
      return CopyTyped<uint8_t, kGather>(s, d, coalesced);
    case 2:
      return CopyTyped<uint16_t, kGather>(s, d, coalesced);
    case 4:
      return CopyTyped<uint32_t, kGather>(s, d, coalesced);
    default:
      return CopyTyped<uint64_t, kGather>(s, d, coalesced);
  }
}

}  // namespace

absl::StatusOr<LayoutInfo> CheckStridedCopy(const void* strided, const StridedLayout& layout,
                                            const void* contiguous, size_t contiguous_bytes,
                                            bool strided_is_destination) {
  absl::StatusOr<LayoutInfo> inspected = InspectLayout(layout);
  if (!inspected.ok()) return inspected.status();
  const LayoutInfo& info = *inspected;
  const char* side = strided_is_destination ? "source" : "destination";
  if (contiguous_bytes < static_cast<uint64_t>(info.contiguous_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("strided copy: the contiguous ", side, " has ",
                                                   contiguous_bytes, " bytes, the tensor needs ",
                                                   info.contiguous_bytes));
  }
  if (info.numel == 0) return info;
  if (strided == nullptr || contiguous == nullptr) {
    return absl::InvalidArgumentError("strided copy: null pointer with a non-empty tensor");
  }
  if (strided_is_destination) {
    absl::Status overlap = CheckNoInternalOverlap(layout);
    if (!overlap.ok()) return overlap;
  }
  const auto s = reinterpret_cast<uintptr_t>(strided);
  const auto c = reinterpret_cast<uintptr_t>(contiguous);
  if (s < c + static_cast<uint64_t>(info.contiguous_bytes) &&
      c < s + static_cast<uint64_t>(info.extent_bytes)) {
    return absl::InvalidArgumentError(
        "strided copy: the contiguous buffer overlaps the strided tensor's extent");
  }
  return info;
}

absl::Status GatherCpu(const void* src, const StridedLayout& src_layout, void* dst,
                       size_t dst_bytes) {
  absl::StatusOr<LayoutInfo> info = CheckStridedCopy(src, src_layout, dst, dst_bytes, false);
  if (!info.ok()) return info.status();
  if (info->numel > 0) CopyStrided<true>(src, dst, src_layout);
  return absl::OkStatus();
}

absl::Status ScatterCpu(const void* src, size_t src_bytes, void* dst,
                        const StridedLayout& dst_layout) {
  absl::StatusOr<LayoutInfo> info = CheckStridedCopy(dst, dst_layout, src, src_bytes, true);
  if (!info.ok()) return info.status();
  if (info->numel > 0) CopyStrided<false>(src, dst, dst_layout);
  return absl::OkStatus();
}

}  // namespace actstash::kernels
