// CPU stand-in for libcudart.so.13, for a host-code smoke test of nvlink_probe on a machine without a GPU
// (see cpu_smoke.sh). It runs the probe's real host code: routing, offset tables, buffer sizes, launch
// arguments, the order of launches and the data checks. The kernels are re-implemented here on the CPU (looked
// up by mangled name) and run synchronously in host issue order, so waits, memory ordering, timing and the
// device code itself are NOT tested: only a GPU run does that. FAKE_BREAK=pull|reduce|push|skiptoken drops a
// row / a token in the CPU kernels, to show that the probe's checks catch it (exit status 3).
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <cmath>
constexpr int kMaxRanks = 8;
struct ErrorRecord { int failed, gpu, peer, phase; unsigned target, seen; };
struct Mesh { int rank, ranks; uint8_t* recv[kMaxRanks]; unsigned* counters[kMaxRanks]; ErrorRecord* err; };
struct SendRow { int token, dest, dst_row, pad; };
struct Bases { const uint8_t* p[kMaxRanks]; };
static uint16_t pattern(int src, int token, int col, unsigned salt) {
  uint32_t h = src * 0x9E3779B1u ^ token * 0x85EBCA77u ^ col * 0xC2B2AE3Du ^ salt * 0x27D4EB2Fu;
  h ^= h >> 15; h *= 0x2C1B3C6Du; h ^= h >> 12; return h & 0x7FFF;
}
static int combine_value(int holder, int owner, int token, int col, unsigned salt) {
  return static_cast<int>(pattern(holder * kMaxRanks + owner, token, col, salt) % 17) - 8;
}
static float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static uint16_t f2bf(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7FFF + ((u >> 16) & 1); return u >> 16; }
static std::map<const void*, std::string> names;
static int cur_dev = 0;
static dim3 cfg_grid, cfg_block; static size_t cfg_smem; static void* cfg_stream;
static const char* brk() { const char* b = getenv("FAKE_BREAK"); return b ? b : ""; }
static std::map<std::string, long> launches;
extern "C" {
void** __cudaRegisterFatBinary(void*) { static void* h[1]; return h; }
void __cudaRegisterFatBinaryEnd(void**) {}
void __cudaUnregisterFatBinary(void**) {
  if (getenv("FAKE_STATS")) for (auto& kv : launches) fprintf(stderr, "fake: %8ld x %s\n", kv.second, kv.first.c_str());
}
void __cudaRegisterFunction(void**, const char* hostFun, char*, const char* name, int, uint3*, uint3*, dim3*, dim3*, int*) { names[hostFun] = name; }
cudaError_t __cudaGetKernel(cudaKernel_t* k, const void* f) { *k = (cudaKernel_t)f; return cudaSuccess; }
unsigned __cudaPushCallConfiguration(dim3 g, dim3 b, size_t s, void* st) { cfg_grid = g; cfg_block = b; cfg_smem = s; cfg_stream = st; return 0; }
cudaError_t __cudaPopCallConfiguration(dim3* g, dim3* b, size_t* s, void* st) { *g = cfg_grid; *b = cfg_block; *s = cfg_smem; *(void**)st = cfg_stream; return cudaSuccess; }
cudaError_t __cudaLaunchKernel(cudaKernel_t k, dim3 grid, dim3 block, void** a, size_t smem, cudaStream_t) {
  const std::string n = names[(const void*)k];
  launches[n]++;
  if (grid.x < 1 || block.x < 1 || block.x > 1024 || smem > 232448) { fprintf(stderr, "fake: bad launch %s\n", n.c_str()); exit(9); }
  auto A = [&](int i) { return a[i]; };
  if (n.find("barrier_kernel") != std::string::npos) return cudaSuccess;
  if (n.find("direct_send") != std::string::npos || n.find("tma_send") != std::string::npos) {
    const Mesh m = *(Mesh*)A(0);
    const uint8_t* x = *(const uint8_t**)A(1);
    const SendRow* rows = *(const SendRow**)A(2);
    const int num = *(int*)A(3);
    const int rb = n.find("tma") != std::string::npos ? *(int*)A(4) : *(int*)A(4) * 16;
    for (int i = 0; i < num; ++i) {
      if (!strcmp(brk(), "push") && i == num / 2) continue;  // (every direct send: run with --ops combine)
      memcpy(m.recv[rows[i].dest] + (size_t)rows[i].dst_row * rb, x + (size_t)rows[i].token * rb, rb);
    }
    return cudaSuccess;
  }
  if (n.find("combine_reduce") != std::string::npos) {
    const bool pull = n.find("Lb1E") != std::string::npos;
    const Bases b = *(Bases*)A(2);
    const int* tok_off = *(const int**)A(3);
    const int2* srcs = *(const int2**)A(4);
    const int tokens = *(int*)A(5), row_vecs = *(int*)A(6);
    uint16_t* out = *(uint16_t**)A(7);
    const int hidden = row_vecs * 8;
    for (int t = 0; t < tokens; ++t)
      for (int c = 0; c < hidden; ++c) {
        float acc = 0;
        for (int j = tok_off[t]; j < tok_off[t + 1]; ++j) {
          if (!strcmp(brk(), pull ? "pull" : "reduce") && t == 7 && j == tok_off[t] + 1) continue;
          const uint16_t* row = (const uint16_t*)(b.p[srcs[j].x] + (size_t)srcs[j].y * row_vecs * 16);
          acc += bf2f(row[c]);
        }
        if (!strcmp(brk(), "skiptoken") && t == tokens - 1) continue;
        out[(size_t)t * hidden + c] = f2bf(acc);
      }
    return cudaSuccess;
  }
  if (n.find("combine_fill_kernel") != std::string::npos) {
    uint16_t* rows = *(uint16_t**)A(0); const int2* e = *(const int2**)A(1);
    const int num = *(int*)A(2), hidden = *(int*)A(3), holder = *(int*)A(4); const unsigned salt = *(unsigned*)A(5);
    for (size_t i = 0; i < (size_t)num * hidden; ++i)
      rows[i] = f2bf((float)combine_value(holder, e[i / hidden].x, e[i / hidden].y, i % hidden, salt));
    return cudaSuccess;
  }
  if (n.find("combine_check_kernel") != std::string::npos) {
    const uint16_t* out = *(const uint16_t**)A(0); const uint8_t* hol = *(const uint8_t**)A(1);
    const int tokens = *(int*)A(2), hidden = *(int*)A(3), ranks = *(int*)A(4), owner = *(int*)A(5);
    const unsigned salt = *(unsigned*)A(6); unsigned long long* mm = *(unsigned long long**)A(7);
    for (int t = 0; t < tokens; ++t)
      for (int c = 0; c < hidden; ++c) {
        int want = 0;
        for (int d = 0; d < ranks; ++d) if ((hol[t] >> d) & 1) want += combine_value(d, owner, t, c, salt);
        *mm += !(bf2f(out[(size_t)t * hidden + c]) == (float)want);
      }
    return cudaSuccess;
  }
  if (n.find("fill_kernel") != std::string::npos) {
    uint16_t* x = *(uint16_t**)A(0); const int r = *(int*)A(1), T = *(int*)A(2), h = *(int*)A(3); const unsigned salt = *(unsigned*)A(4);
    for (size_t i = 0; i < (size_t)T * h; ++i) x[i] = pattern(r, i / h, i % h, salt);
    return cudaSuccess;
  }
  if (n.find("gather_kernel") != std::string::npos) {
    int4* p = *(int4**)A(0); const int4* x = *(const int4**)A(1); const int* tk = *(const int**)A(2);
    const int num = *(int*)A(3), rv = *(int*)A(4);
    for (int i = 0; i < num; ++i) memcpy(p + (size_t)i * rv, x + (size_t)tk[i] * rv, rv * 16);
    return cudaSuccess;
  }
  if (n.find("check_kernel") != std::string::npos) {
    const uint16_t* g = *(const uint16_t**)A(0); const int2* e = *(const int2**)A(1);
    const int num = *(int*)A(2), h = *(int*)A(3); const unsigned salt = *(unsigned*)A(4); unsigned long long* mm = *(unsigned long long**)A(5);
    for (int b = 0; b < num; ++b) for (int c = 0; c < h; ++c) *mm += g[(size_t)b * h + c] != pattern(e[b].x, e[b].y, c, salt);
    return cudaSuccess;
  }
  if (n.find("copy_kernel") != std::string::npos) {
    memcpy(*(void**)A(0), *(void**)A(1), *(size_t*)A(2) * 16);
    return cudaSuccess;
  }
  fprintf(stderr, "fake: unknown kernel %s\n", n.c_str()); exit(9);
}
const char* cudaGetErrorString(cudaError_t) { return "fake error"; }
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaGetDeviceCount(int* n) { *n = getenv("FAKE_GPUS") ? atoi(getenv("FAKE_GPUS")) : 4; return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int) { memset(p, 0, sizeof(*p)); strcpy(p->name, "FAKE H100 (CPU)"); p->multiProcessorCount = 132; return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  *v = a == cudaDevAttrMaxSharedMemoryPerBlockOptin ? 232448 : a == cudaDevAttrMaxSharedMemoryPerMultiprocessor ? 233472 : 0; return cudaSuccess; }
cudaError_t cudaSetDevice(int d) { cur_dev = d; return cudaSuccess; }
cudaError_t cudaDeviceCanAccessPeer(int* c, int, int) { *c = 1; return cudaSuccess; }
cudaError_t cudaDeviceGetP2PAttribute(int* v, cudaDeviceP2PAttr, int, int) { *v = 1; return cudaSuccess; }
cudaError_t cudaDeviceEnablePeerAccess(int, unsigned) { return cudaSuccess; }
cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) { return cudaSuccess; }
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, const void*, int, size_t) { *n = 1; return cudaSuccess; }
cudaError_t cudaHostAlloc(void** p, size_t s, unsigned) { *p = calloc(1, s); return cudaSuccess; }
cudaError_t cudaMalloc(void** p, size_t s) { *p = aligned_alloc(256, (s + 255) / 256 * 256); memset(*p, 0xA5, s); return cudaSuccess; }
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) { memcpy(d, s, n); return cudaSuccess; }
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t) { memcpy(d, s, n); return cudaSuccess; }
cudaError_t cudaMemcpyPeerAsync(void* d, int, const void* s, int, size_t n, cudaStream_t) { memcpy(d, s, n); return cudaSuccess; }
cudaError_t cudaMemset(void* d, int v, size_t n) { memset(d, v, n); return cudaSuccess; }
cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t) { memset(d, v, n); return cudaSuccess; }
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
cudaError_t cudaEventCreate(cudaEvent_t* e) { *e = (cudaEvent_t)malloc(8); return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { *e = (cudaEvent_t)malloc(8); return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t, cudaEvent_t) { *ms = 1.0f; return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) { *s = (cudaStream_t)malloc(8); return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) { return cudaSuccess; }
}
