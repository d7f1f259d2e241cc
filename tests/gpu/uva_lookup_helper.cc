// Helper process for GpuLookupTest.SharedSegmentRegisteredByAnotherProcess: maps a /dev/shm table read-only,
// registers it with CUDA (read-only, mapped), looks up the given ids (head_dim 256) and writes the bf16 rows.
// Usage: uva_lookup_helper SHM_PATH ROWS IDS_BIN OUT_BIN. Exit 0 on success.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/engram_kernels.h"

int main(int argc, char** argv) {
  if (argc != 5) return 2;
  const int64_t rows = std::atoll(argv[2]), D = 256, rb = 264;
  int fd = ::open(argv[1], O_RDONLY);
  if (fd < 0) return 3;
  void* map = ::mmap(nullptr, static_cast<size_t>(rows * rb), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return 4;
  if (cudaHostRegister(map, static_cast<size_t>(rows * rb), cudaHostRegisterMapped | cudaHostRegisterReadOnly) !=
      cudaSuccess) {
    std::fprintf(stderr, "register: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 5;
  }
  void* dptr = nullptr;
  if (cudaHostGetDevicePointer(&dptr, map, 0) != cudaSuccess) return 6;
  std::ifstream in(argv[3], std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string raw = ss.str();
  std::vector<int32_t> ids(raw.size() / 4);
  std::memcpy(ids.data(), raw.data(), raw.size());
  int32_t* d_ids = nullptr;
  uint16_t* d_out = nullptr;
  cudaMalloc(reinterpret_cast<void**>(&d_ids), raw.size());
  cudaMalloc(reinterpret_cast<void**>(&d_out), ids.size() * D * 2);
  cudaMemcpy(d_ids, ids.data(), raw.size(), cudaMemcpyHostToDevice);
  engram::kernels::LookupArgs a;
  a.records = static_cast<const uint8_t*>(dptr);
  a.row_begin = 0;
  a.row_end = rows;
  a.head_dim = static_cast<int32_t>(D);
  a.ids = d_ids;
  a.num_tokens = static_cast<int32_t>(ids.size() / 24);
  a.num_cols = 24;
  a.ids_stride = 24;
  a.out = d_out;
  if (engram::kernels::LaunchLookup(a, nullptr) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) return 7;
  std::vector<uint16_t> out(ids.size() * D);
  cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost);
  std::ofstream(argv[4], std::ios::binary)
      .write(reinterpret_cast<char*>(out.data()), static_cast<long>(out.size() * 2));
  cudaHostUnregister(map);
  return 0;
}
