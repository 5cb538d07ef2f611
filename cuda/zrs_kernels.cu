// zrs copy kernels, registered on the CUDA dispatch key of the zrs copy ops.
//
//   zrs::pack_cast(Tensor[] shards, Tensor(a!) out) -> ()
//       copy-in: cast each shard to out.dtype, write them back to back into the flat `out`.
//   zrs::unpack_rank_major(Tensor recv, int world, int[] offsets, int[] numels,
//                          Tensor(a!)[] outs) -> ()
//       copy-out: recv is `world` rank blocks; member i sits at offsets[i] (numels[i] elements) in
//       each block; outs[i][r * numels[i] + j] = recv[r * block + offsets[i] + j].
//   zrs::pack_grads(Tensor[] grads, int world, int[] shards, float scale, Tensor(a!) out) -> ()
//       grad pack: out is (world, block); grad i (numel n_i, shards[i] * world >= n_i) goes,
//       times `scale` and cast, into out[:, off_i : off_i + shards[i]] rank-major, zero padded.
//
// The schemas live in python/zrs/ops.py. All three ops reduce to one job: a list of segments,
// each "read n_src elements of some dtype at src, write n_dst >= n_src elements at dst (zeros
// past n_src), times a scale". One kernel launch copies every segment of an op: the host builds
// the segment table and passes it inline as a kernel parameter when it is small; a larger table
// is kept on the device (`TableCache`), copied there once rather than per call. Each block takes
// one 16 KiB (of source) tile of one segment (binary search over the table). Segments whose src and
// dst are 16-byte aligned move 16 bytes per load and store; others take a coalesced scalar path.
// Everything runs on the current CUDA stream, with no host synchronisation.

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;     // elements per thread and step
// Steps per thread, all loads issued before the first store: 64 bytes of source per thread, so a
// block's tile is 16 KiB of source: 8192 bf16/fp16, 4096 fp32 or 2048 fp64 elements.
constexpr int unroll_of(size_t src_size) { return int(8 / src_size); }
constexpr int64_t tile_of(size_t src_size) { return int64_t{kThreads} * kVec * unroll_of(src_size); }
constexpr int kInline = 80;  // segments passed inside the kernel parameters (4 KiB limit)

enum DtypeCode : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kF64 = 3 };

struct Seg {
  const void* src;
  void* dst;
  int64_t n_src;       // elements read from src
  int64_t n_dst;       // elements written to dst; [n_src, n_dst) are zeros
  int64_t tile_start;  // first tile of this segment (prefix sum over the table)
  int32_t src_code;    // DtypeCode of src
  int32_t vec_ok;      // src and dst both 16-byte aligned
};
static_assert(sizeof(Seg) == 48, "Seg layout is shared between host and device");

struct InlineSegs {
  Seg s[kInline];
};
static_assert(sizeof(InlineSegs) + 32 <= 4096, "kernel parameters must fit in 4 KiB");

// Raw storage type and conversions through float (double only when a side is double), the same
// roundings as torch's own casts (double -> half/bf16 goes through float, as c10 does).
template <typename T>
struct Conv;
template <>
struct Conv<float> {
  using Raw = float;
  __device__ static float to_float(Raw r) { return r; }
  __device__ static Raw from_float(float x) { return x; }
};
template <>
struct Conv<__nv_bfloat16> {
  using Raw = unsigned short;
  __device__ static float to_float(Raw r) { return __bfloat162float(__ushort_as_bfloat16(r)); }
  __device__ static Raw from_float(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
};
template <>
struct Conv<__half> {
  using Raw = unsigned short;
  __device__ static float to_float(Raw r) { return __half2float(__ushort_as_half(r)); }
  __device__ static Raw from_float(float x) { return __half_as_ushort(__float2half_rn(x)); }
};
template <>
struct Conv<double> {
  using Raw = double;
};

template <typename T, typename Acc>
__device__ __forceinline__ Acc load_acc(typename Conv<T>::Raw r) {
  if constexpr (std::is_same_v<T, double>) {
    return static_cast<Acc>(r);
  } else {
    return static_cast<Acc>(Conv<T>::to_float(r));
  }
}

template <typename T, typename Acc>
__device__ __forceinline__ typename Conv<T>::Raw store_raw(Acc x) {
  if constexpr (std::is_same_v<T, double>) {
    return static_cast<double>(x);
  } else {
    return Conv<T>::from_float(static_cast<float>(x));
  }
}

// Vectors of kVec elements move as 16-byte words (1, 2 or 4 of them per vector), loaded through
// the read-only path and kept raw in registers until every load of the thread is in flight.
template <typename T>
constexpr int kWords = kVec * int(sizeof(typename Conv<T>::Raw)) / 16;

template <typename T, typename Acc>
__device__ __forceinline__ void unpack_words(const uint4 (&q)[kWords<T>], Acc (&v)[kVec]) {
  using Raw = typename Conv<T>::Raw;
#pragma unroll
  for (int j = 0; j < kWords<T>; ++j) {
    const uint32_t w[4] = {q[j].x, q[j].y, q[j].z, q[j].w};
    if constexpr (sizeof(Raw) == 2) {
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        v[8 * j + 2 * h] = load_acc<T, Acc>(static_cast<Raw>(w[h] & 0xffffu));
        v[8 * j + 2 * h + 1] = load_acc<T, Acc>(static_cast<Raw>(w[h] >> 16));
      }
    } else if constexpr (sizeof(Raw) == 4) {
#pragma unroll
      for (int h = 0; h < 4; ++h) v[4 * j + h] = load_acc<T, Acc>(__uint_as_float(w[h]));
    } else {
      v[2 * j] = load_acc<T, Acc>(__hiloint2double(int(w[1]), int(w[0])));
      v[2 * j + 1] = load_acc<T, Acc>(__hiloint2double(int(w[3]), int(w[2])));
    }
  }
}

template <typename T, typename Acc>
__device__ __forceinline__ void store_words(typename Conv<T>::Raw* p, const Acc (&v)[kVec]) {
  using Raw = typename Conv<T>::Raw;
  uint4* q = reinterpret_cast<uint4*>(p);
#pragma unroll
  for (int j = 0; j < kWords<T>; ++j) {
    uint32_t w[4];
    if constexpr (sizeof(Raw) == 2) {
#pragma unroll
      for (int h = 0; h < 4; ++h)
        w[h] = uint32_t(store_raw<T, Acc>(v[8 * j + 2 * h])) |
               (uint32_t(store_raw<T, Acc>(v[8 * j + 2 * h + 1])) << 16);
    } else if constexpr (sizeof(Raw) == 4) {
#pragma unroll
      for (int h = 0; h < 4; ++h) w[h] = __float_as_uint(store_raw<T, Acc>(v[4 * j + h]));
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const double d = store_raw<T, Acc>(v[2 * j + h]);
        w[2 * h] = uint32_t(__double2loint(d));
        w[2 * h + 1] = uint32_t(__double2hiint(d));
      }
    }
    __stwb(q + j, make_uint4(w[0], w[1], w[2], w[3]));
  }
}

template <typename Src, typename Dst>
__device__ __forceinline__ void copy_tile(const Seg& s, int64_t tile_in_seg, double scale_d,
                                          bool scaled) {
  using Acc = std::conditional_t<std::is_same_v<Src, double> || std::is_same_v<Dst, double>,
                                 double, float>;
  using SRaw = typename Conv<Src>::Raw;
  using DRaw = typename Conv<Dst>::Raw;
  constexpr int kU = unroll_of(sizeof(SRaw));
  const int64_t base = tile_in_seg * tile_of(sizeof(SRaw));
  const SRaw* __restrict__ src = static_cast<const SRaw*>(s.src);
  DRaw* __restrict__ dst = static_cast<DRaw*>(s.dst);
  __builtin_assume(__isGlobal(src));  // the table may sit in parameter space; the data never does
  __builtin_assume(__isGlobal(dst));
  const Acc scale = static_cast<Acc>(scale_d);

  if (s.vec_ok) {
    // Thread t handles elements [i, i + kVec), i = base + (u * kThreads + t) * kVec, u < kU.
    const int64_t first = base + int64_t(threadIdx.x) * kVec;
    const int64_t src_left = s.n_src - first, dst_left = s.n_dst - first;
    const SRaw* sp = src + first;
    DRaw* dp = dst + first;
    uint4 raw[kU][kWords<Src>];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (u * kThreads * kVec + kVec <= src_left) {
        const uint4* q = reinterpret_cast<const uint4*>(sp + u * kThreads * kVec);
#pragma unroll
        for (int j = 0; j < kWords<Src>; ++j) raw[u][j] = __ldg(q + j);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int o = u * kThreads * kVec;
      if (o >= dst_left) break;
      Acc v[kVec];
      if (o + kVec <= src_left) {
        unpack_words<Src, Acc>(raw[u], v);
      } else {  // the segment's tail, or zero padding
#pragma unroll
        for (int k = 0; k < kVec; ++k)
          v[k] = o + k < src_left ? load_acc<Src, Acc>(__ldg(sp + o + k)) : Acc(0);
      }
      if (scaled) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) v[k] *= scale;
      }
      if (o + kVec <= dst_left) {
        store_words<Dst, Acc>(dp + o, v);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k)
          if (o + k < dst_left) dp[o + k] = store_raw<Dst, Acc>(v[k]);
      }
    }
  } else {
    // Misaligned segment: element base + j * kThreads + t, coalesced across the warp.
    constexpr int kN = kVec * kU;
    const int64_t first = base + threadIdx.x;
    const int64_t src_left = s.n_src - first, dst_left = s.n_dst - first;
    const SRaw* sp = src + first;
    DRaw* dp = dst + first;
    SRaw r[kN];
#pragma unroll
    for (int j = 0; j < kN; ++j)
      if (j * kThreads < src_left) r[j] = __ldg(sp + j * kThreads);
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      if (j * kThreads < dst_left) {
        Acc x = j * kThreads < src_left ? load_acc<Src, Acc>(r[j]) : Acc(0);
        if (scaled) x *= scale;
        dp[j * kThreads] = store_raw<Dst, Acc>(x);
      }
    }
  }
}

template <typename Dst>
__global__ void __launch_bounds__(kThreads)
    seg_copy_kernel(const __grid_constant__ InlineSegs inl, const Seg* __restrict__ table,
                    int nseg, double scale, bool scaled) {
  const Seg* segs = table != nullptr ? table : inl.s;
  const int64_t tile = blockIdx.x;
  int lo = 0, hi = nseg - 1;  // the last segment whose tile_start <= tile
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (segs[mid].tile_start <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const Seg s = segs[lo];
  const int64_t t = tile - s.tile_start;
  switch (s.src_code) {
    case kF32:
      copy_tile<float, Dst>(s, t, scale, scaled);
      break;
    case kBF16:
      copy_tile<__nv_bfloat16, Dst>(s, t, scale, scaled);
      break;
    case kF16:
      copy_tile<__half, Dst>(s, t, scale, scaled);
      break;
    default:
      copy_tile<double, Dst>(s, t, scale, scaled);
      break;
  }
}

// --- host side -----------------------------------------------------------------------------

int32_t code_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kF32;
    case at::kBFloat16:
      return kBF16;
    case at::kHalf:
      return kF16;
    case at::kDouble:
      return kF64;
    default:
      return -1;
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

struct Plan {
  std::vector<Seg> segs;
  int64_t tiles = 0;

  void add(const void* src, int32_t src_code, int64_t n_src, void* dst, int64_t n_dst) {
    if (n_dst <= 0) return;
    Seg s{};
    s.src = src;
    s.dst = dst;
    s.n_src = n_src;
    s.n_dst = n_dst;
    s.tile_start = tiles;
    s.src_code = src_code;
    s.vec_ok = aligned16(src) && aligned16(dst);
    segs.push_back(s);
    const int64_t tile = tile_of(src_code == kF32 ? 4 : src_code == kF64 ? 8 : 2);
    tiles += (n_dst + tile - 1) / tile;
  }
};

// A copy of `bytes` on `device`, made from pinned memory on the current stream (no host sync);
// `host` is the pinned buffer, which a graph that captured the copy reads again at each replay.
at::Tensor to_device(const void* data, int64_t bytes, const at::Device& device, at::Tensor& host) {
  host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), data, bytes);
  return host.to(at::TensorOptions().device(device).dtype(at::kByte), /*non_blocking=*/true);
}

// Segment tables too large to pass inline, resident on the device: keyed by their bytes (the
// buffers' addresses included), so a table that repeats from step to step, as a plan's do, is
// copied host-to-device once. A copy is stream-ordered on the stream that made it; another stream
// that uses the table first waits for its event, and is recorded with the allocator so that an
// evicted table's memory is not reused while that stream may still read it. Under CUDA graph
// capture (which starts with a device synchronize, so every copy is done) a cached table is kept
// for good from then on, as the captured kernel reads it at every replay; a table first seen
// under capture belongs to the graph, which copies it itself.
class TableCache {
 public:
  const Seg* get(const std::vector<Seg>& segs, const at::Device& device, cudaStream_t stream) {
    const std::string_view key(reinterpret_cast<const char*>(segs.data()),
                               segs.size() * sizeof(Seg));
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    const bool capturing = capture != cudaStreamCaptureStatusNone;
    std::lock_guard<std::mutex> lock(mu_);
    auto found = index_.find(key);
    if (found != index_.end()) {
      lru_.splice(lru_.begin(), lru_, found->second);  // most recently used first
      Entry& e = **found->second;
      if (e.dev.device() == device) {
        if (capturing) {
          e.keep = true;
        } else if (stream != e.made_on && e.waited.insert(stream).second) {
          e.ready.block(c10::cuda::getStreamFromExternal(stream, device.index()));
          c10::cuda::CUDACachingAllocator::recordStream(
              e.dev.storage().data_ptr(), c10::cuda::getStreamFromExternal(stream, device.index()));
        }
        return static_cast<const Seg*>(e.dev.data_ptr());
      }
      if (!capturing) return nullptr;  // another GPU's table: the caller copies it for the call
    }
    if (capturing) {
      // First seen while a graph is captured: the graph copies it from pinned memory itself, at
      // each replay (a node of its own, ordered before the kernel on this stream). No cache
      // entry, so no event that eager streams would wait on; both copies live as long as the
      // process, as the graph may replay at any time.
      owned_.emplace_back();
      Owned& o = owned_.back();
      o.dev = to_device(key.data(), int64_t(key.size()), device, o.host);
      return static_cast<const Seg*>(o.dev.data_ptr());
    }
    auto e = std::make_unique<Entry>();
    e->bytes.assign(key.begin(), key.end());
    e->dev = to_device(key.data(), int64_t(key.size()), device, e->host);
    e->made_on = stream;
    e->ready.record(c10::cuda::getStreamFromExternal(stream, device.index()));
    lru_.push_front(std::move(e));
    index_.emplace(std::string_view(lru_.front()->bytes), lru_.begin());
    evict();
    return static_cast<const Seg*>(lru_.front()->dev.data_ptr());
  }

 private:
  struct Entry {
    std::string bytes;  // the table, the key
    at::Tensor host, dev;
    cudaStream_t made_on = nullptr;
    at::cuda::CUDAEvent ready;  // the host-to-device copy is done
    std::unordered_set<cudaStream_t> waited;
    bool keep = false;
  };
  using List = std::list<std::unique_ptr<Entry>>;
  struct Owned {  // a table first seen under capture: its graph's
    at::Tensor host, dev;
  };

  void evict() {
    for (auto it = std::prev(lru_.end()); lru_.size() > kMaxTables && it != lru_.begin();) {
      auto victim = it--;
      if ((*victim)->keep) continue;
      index_.erase(std::string_view((*victim)->bytes));
      lru_.erase(victim);
    }
  }

  static constexpr size_t kMaxTables = 1024;  // about a plan's worth: a few per graph and step
  std::mutex mu_;
  List lru_;
  std::unordered_map<std::string_view, List::iterator> index_;
  std::deque<Owned> owned_;
};

TableCache& table_cache() {
  static TableCache* cache = new TableCache();  // never destroyed: CUDA may be gone at exit
  return *cache;
}

void launch(const Plan& plan, at::ScalarType dst_type, double scale, const at::Device& device) {
  if (plan.tiles == 0) return;
  TORCH_CHECK(plan.tiles <= std::numeric_limits<int32_t>::max(),
              "zrs copy kernels: too many elements in one call (", plan.tiles, " tiles)");
  const int nseg = static_cast<int>(plan.segs.size());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  InlineSegs inl;
  const Seg* table = nullptr;
  at::Tensor table_dev;  // a table of another GPU than the cached one's: freed after the launch
  if (nseg <= kInline) {
    std::memcpy(inl.s, plan.segs.data(), nseg * sizeof(Seg));
  } else {
    table = table_cache().get(plan.segs, device, stream);
    if (table == nullptr) {
      at::Tensor host;
      table_dev = to_device(plan.segs.data(), int64_t(nseg) * int64_t(sizeof(Seg)), device, host);
      table = static_cast<const Seg*>(table_dev.data_ptr());
    }
  }
  const bool scaled = scale != 1.0;
  const dim3 grid(static_cast<unsigned>(plan.tiles));
  switch (code_of(dst_type)) {
    case kF32:
      seg_copy_kernel<float><<<grid, kThreads, 0, stream>>>(inl, table, nseg, scale, scaled);
      break;
    case kBF16:
      seg_copy_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(inl, table, nseg, scale, scaled);
      break;
    case kF16:
      seg_copy_kernel<__half><<<grid, kThreads, 0, stream>>>(inl, table, nseg, scale, scaled);
      break;
    case kF64:
      seg_copy_kernel<double><<<grid, kThreads, 0, stream>>>(inl, table, nseg, scale, scaled);
      break;
    default:
      TORCH_CHECK(false, "zrs copy kernels: unsupported output dtype ", dst_type);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

char* byte_ptr(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

void check_device(const at::Tensor& t, const at::Device& device, const char* what) {
  TORCH_CHECK(t.device() == device, "zrs copy kernels: ", what, " is on ", t.device(),
              " but the output is on ", device);
}

// --- pack_cast ---------------------------------------------------------------------------------

void pack_cast(at::TensorList shards, const at::Tensor& out) {
  TORCH_CHECK(out.is_contiguous(), "zrs::pack_cast: out must be contiguous");
  int64_t total = 0;
  for (const auto& s : shards) total += s.numel();
  TORCH_CHECK(total <= out.numel(), "zrs::pack_cast: the shards hold ", total,
              " elements but out has only ", out.numel());
  const at::Device device = out.device();
  c10::cuda::CUDAGuard guard(device);
  bool supported = code_of(out.scalar_type()) >= 0;
  for (const auto& s : shards) {
    check_device(s, device, "a shard");
    supported = supported && code_of(s.scalar_type()) >= 0;
  }
  const int64_t es = out.element_size();
  if (!supported) {  // other dtypes: plain torch copies
    int64_t off = 0;
    for (const auto& s : shards) {
      out.view({-1}).narrow(0, off, s.numel()).copy_(s.reshape({-1}));
      off += s.numel();
    }
    return;
  }
  std::vector<at::Tensor> keep;  // contiguous copies live until the launch is queued
  keep.reserve(shards.size());
  Plan plan;
  int64_t off = 0;
  for (const auto& s : shards) {
    keep.push_back(s.contiguous());
    const at::Tensor& c = keep.back();
    plan.add(c.data_ptr(), code_of(c.scalar_type()), c.numel(), byte_ptr(out) + off * es,
             c.numel());
    off += c.numel();
  }
  launch(plan, out.scalar_type(), 1.0, device);
}

// --- unpack_rank_major -----------------------------------------------------------------------

void unpack_rank_major(const at::Tensor& recv, int64_t world, at::IntArrayRef offsets,
                       at::IntArrayRef numels, at::TensorList outs) {
  TORCH_CHECK(world >= 1, "zrs::unpack_rank_major: world must be >= 1, got ", world);
  TORCH_CHECK(offsets.size() == numels.size() && numels.size() == outs.size(),
              "zrs::unpack_rank_major: offsets, numels and outs differ in length (",
              offsets.size(), ", ", numels.size(), ", ", outs.size(), ")");
  TORCH_CHECK(recv.is_contiguous(), "zrs::unpack_rank_major: recv must be contiguous");
  TORCH_CHECK(recv.numel() % world == 0, "zrs::unpack_rank_major: recv holds ", recv.numel(),
              " elements, not a multiple of world ", world);
  const int64_t block = recv.numel() / world;
  const at::Device device = recv.device();
  c10::cuda::CUDAGuard guard(device);
  bool supported = code_of(recv.scalar_type()) >= 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    TORCH_CHECK(offsets[i] >= 0 && numels[i] >= 0 && offsets[i] + numels[i] <= block,
                "zrs::unpack_rank_major: member ", i, " (offset ", offsets[i], ", numel ",
                numels[i], ") lies outside the rank block of ", block, " elements");
    TORCH_CHECK(outs[i].is_contiguous(), "zrs::unpack_rank_major: outs[", i,
                "] must be contiguous");
    TORCH_CHECK(outs[i].numel() >= world * numels[i], "zrs::unpack_rank_major: outs[", i,
                "] has ", outs[i].numel(), " elements, needs ", world * numels[i]);
    check_device(outs[i], device, "an output");
    supported = supported && code_of(outs[i].scalar_type()) >= 0;
  }
  if (!supported) {
    const at::Tensor blocks = recv.view({world, block});
    for (size_t i = 0; i < outs.size(); ++i) {
      outs[i].view({-1}).narrow(0, 0, world * numels[i]).view({world, numels[i]}).copy_(
          blocks.narrow(1, offsets[i], numels[i]));
    }
    return;
  }
  const int32_t rcode = code_of(recv.scalar_type());
  const int64_t res = recv.element_size();
  // One launch per distinct output dtype (one launch in practice: all outputs share a dtype).
  std::vector<bool> done(outs.size(), false);
  for (size_t first = 0; first < outs.size(); ++first) {
    if (done[first]) continue;
    const at::ScalarType dt = outs[first].scalar_type();
    Plan plan;
    for (size_t i = first; i < outs.size(); ++i) {
      if (done[i] || outs[i].scalar_type() != dt) continue;
      done[i] = true;
      const int64_t oes = outs[i].element_size();
      for (int64_t r = 0; r < world; ++r) {
        plan.add(byte_ptr(recv) + (r * block + offsets[i]) * res, rcode, numels[i],
                 byte_ptr(outs[i]) + r * numels[i] * oes, numels[i]);
      }
    }
    launch(plan, dt, 1.0, device);
  }
}

// --- pack_grads --------------------------------------------------------------------------------

void pack_grads(at::TensorList grads, int64_t world, at::IntArrayRef shards, double scale,
                const at::Tensor& out) {
  TORCH_CHECK(world >= 1, "zrs::pack_grads: world must be >= 1, got ", world);
  TORCH_CHECK(shards.size() == grads.size(), "zrs::pack_grads: ", grads.size(),
              " gradients but ", shards.size(), " shard sizes");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == world,
              "zrs::pack_grads: out must have shape (world, block) = (", world, ", ...), got ",
              out.sizes());
  TORCH_CHECK(out.size(1) <= 1 || out.stride(1) == 1,
              "zrs::pack_grads: out's rows must be contiguous (stride(1) == 1)");
  const int64_t block = out.size(1);
  const int64_t row = out.stride(0);
  const at::Device device = out.device();
  c10::cuda::CUDAGuard guard(device);
  int64_t need = 0;
  bool supported = code_of(out.scalar_type()) >= 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    check_device(g, device, "a gradient");
    TORCH_CHECK(shards[i] >= 0 && shards[i] * world >= g.numel(), "zrs::pack_grads: gradient ", i,
                " has ", g.numel(), " elements, more than ", world, " shards of ", shards[i]);
    need += shards[i];
    supported = supported && code_of(g.scalar_type()) >= 0;
  }
  TORCH_CHECK(need <= block, "zrs::pack_grads: the gradients need ", need,
              " elements per rank but out's rows hold ", block);
  if (!supported) {
    int64_t off = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      const at::Tensor& g = grads[i];
      const int64_t n = g.numel(), shard = shards[i];
      const bool wide = g.scalar_type() == at::kDouble || out.scalar_type() == at::kDouble;
      at::Tensor flat = at::zeros({world * shard}, g.options().dtype(wide ? at::kDouble : at::kFloat));
      flat.narrow(0, 0, n).copy_(g.reshape({-1}));
      if (scale != 1.0) flat.mul_(scale);
      out.narrow(1, off, shard).copy_(flat.view({world, shard}));
      off += shard;
    }
    return;
  }
  const int64_t oes = out.element_size();
  std::vector<at::Tensor> keep;
  keep.reserve(grads.size());
  Plan plan;
  int64_t off = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    keep.push_back(grads[i].contiguous());
    const at::Tensor& c = keep.back();
    const int64_t n = c.numel(), shard = shards[i];
    const int64_t ges = c.element_size();
    const int32_t gcode = code_of(c.scalar_type());
    for (int64_t r = 0; r < world; ++r) {
      const int64_t start = r * shard;
      const int64_t n_src = std::max<int64_t>(0, std::min<int64_t>(shard, n - start));
      plan.add(byte_ptr(c) + std::min(start, n) * ges, gcode, n_src,
               byte_ptr(out) + (r * row + off) * oes, shard);
    }
    off += shard;
  }
  launch(plan, out.scalar_type(), scale, device);
}

}  // namespace

TORCH_LIBRARY_IMPL(zrs, CUDA, m) {
  m.impl("pack_cast", &pack_cast);
  m.impl("unpack_rank_major", &unpack_rank_major);
  m.impl("pack_grads", &pack_grads);
}
