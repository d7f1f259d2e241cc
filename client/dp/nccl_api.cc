#include "client/dp/nccl_api.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"

namespace engram::client {
namespace {

template <typename F>
bool Load(void* lib, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(::dlsym(lib, name));
  return *fn != nullptr;
}

}  // namespace

absl::StatusOr<const NcclApi*> NcclApi::Get() {
  static const absl::StatusOr<const NcclApi*> api = []() -> absl::StatusOr<const NcclApi*> {
    void* lib = ::dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) lib = ::dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      return absl::UnavailableError(absl::StrCat("DP_SHARDED on the GPU needs NCCL: ", ::dlerror(),
                                                 " (install libnccl2; it is loaded at run time)"));
    }
    auto* a = new NcclApi();
    ncclResult_t (*get_version)(int*) = nullptr;
    const bool ok = Load(lib, "ncclGetUniqueId", &a->GetUniqueId) &&
                    Load(lib, "ncclCommInitRankConfig", &a->CommInitRankConfig) &&
                    Load(lib, "ncclCommGetAsyncError", &a->CommGetAsyncError) &&
                    Load(lib, "ncclCommAbort", &a->CommAbort) && Load(lib, "ncclCommDestroy", &a->CommDestroy) &&
                    Load(lib, "ncclCommFinalize", &a->CommFinalize) && Load(lib, "ncclAllGather", &a->AllGather) &&
                    Load(lib, "ncclSend", &a->Send) && Load(lib, "ncclRecv", &a->Recv) &&
                    Load(lib, "ncclGroupStart", &a->GroupStart) && Load(lib, "ncclGroupEnd", &a->GroupEnd) &&
                    Load(lib, "ncclGetErrorString", &a->GetErrorString) && Load(lib, "ncclGetVersion", &get_version);
    if (!ok) return absl::UnavailableError("libnccl.so.2 lacks an entry point this build needs (NCCL >= 2.14)");
    get_version(&a->version);
    Load(lib, "ncclCommSplit", &a->CommSplit);  // optional: without it the steps keep the non-blocking communicator
    return a;
  }();
  return api;
}

}  // namespace engram::client
