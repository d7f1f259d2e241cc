#!/usr/bin/env bash
# Builds the GPU tests and benchmarks here (sm_90, static cudart) and bundles them with the shared libraries they
# need into .gpu-bundle/ (git-ignored), for the GPU machine, which lacks our Debian libraries. Name .gpu-bundle in
# the device tool's `carry` and run `.gpu-bundle/run.sh [tests|sanitize|bench|all|daemon]` there; logs go to $OUT.
# Usage: scripts/gpu-bundle.sh [kernels|daemon]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ENGRAM_BUILD_DIR:-$root/build}
if [ "${1:-}" = dp ]; then  # only its targets, in an already configured build directory
  cmake --build "$build" --target gpu_dp_test bench_dp engramd engramctl engram-replica engram-replica-faults engram-mkckpt > /dev/null
elif [ "${1:-}" = hostgather ]; then  # only its targets, in an already configured build directory
  cmake --build "$build" --target gpu_host_gather_test gpu_kernels_test gpu_prefetch_test uva_lookup_helper \
    bench_kernels > /dev/null
elif [ "${1:-}" = register ]; then  # only its targets, in an already configured build directory
  cmake --build "$build" --target bench_register bench_daemon engramd > /dev/null
elif [ "${1:-}" = fullscale ]; then  # only its targets, in an already configured build directory
  cmake --build "$build" --target bench_register bench_first_touch engramd engramctl engram-replica engram-mkckpt \
    gpu_client_test > /dev/null
elif [ "${1:-}" = python ]; then  # only what the Python set needs (a full CUDA build is long on 2 cores)
  [ -f "$build/build.ninja" ] || cmake -S "$root" -B "$build" -G Ninja -DENGRAM_CUDA=ON -DENGRAM_CUDA_ARCHS=90 \
    -DENGRAM_WERROR="${ENGRAM_WERROR:-OFF}" > /dev/null
  cmake --build "$build" --target engram_c engramd engramctl engram-mkckpt > /dev/null
else
  "$root/scripts/build.sh" -DENGRAM_CUDA=ON -DENGRAM_CUDA_ARCHS=90 > /dev/null
fi
out=${ENGRAM_BUNDLE_DIR:-$root/.gpu-bundle}   # .gpu-bundle-<name> when several bundles are in flight
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
# What to bundle (the carry limit is 64 MiB): `kernels` (default: GPU tests and bench_kernels) or `daemon`
# (engramd and bench_daemon, for the publish benchmark on that machine's cores).
case "${1:-kernels}" in
  kernels) bins=("$build/tests/gpu_kernels_test" "$build/tests/gpu_prefetch_test" "$build/tests/uva_lookup_helper"
                 "$build/bench/bench_kernels") ;;
  daemon) bins=("$build/bench/bench_daemon" "$build/daemon/engramd") ;;
  client) bins=("$build/tests/gpu_client_test" "$build/daemon/engramd" "$build/tools/engramctl"
                "$build/tools/engram-replica" "$build/tools/engram-mkckpt") ;;
  # Every GPU test (the gpu ctest label), with what they start: engramd, the replica, engramctl, engram-mkckpt;
  # and bench_kernels and bench_dp, so one run can check the final tree and measure the lookup paths and the DP step.
  tests) bins=("$build/tests/gpu_kernels_test" "$build/tests/gpu_prefetch_test" "$build/tests/uva_lookup_helper"
               "$build/tests/gpu_client_test" "$build/tests/gpu_host_gather_test" "$build/tests/gpu_dp_test"
               "$build/daemon/engramd" "$build/tools/engramctl" "$build/tools/engram-replica" "$build/tools/engram-replica-faults"
               "$build/tools/engram-mkckpt" "$build/bench/bench_kernels" "$build/bench/bench_dp") ;;
  # The Python package: its wheel, libengram_c.so with engramd/engramctl/engram-mkckpt, the python/ tree, its tests
  # and bench/decode_step.py, run with the GPU machine's own python3, torch, CuPy, NumPy (run.sh python; the package
  # installed from the wheel, or ENGRAM_PY_FROM=source: from its source tree with ENGRAM_LIB).
  python) bins=("$build/client/libengram_c.so" "$build/daemon/engramd" "$build/tools/engramctl"
                "$build/tools/engram-mkckpt") ;;
  # DP_SHARDED on two GPUs: its GPU test (engramd + two replicas), bench_dp (run.sh dp).
  dp) bins=("$build/tests/gpu_dp_test" "$build/bench/bench_dp" "$build/daemon/engramd" "$build/tools/engramctl"
            "$build/tools/engram-replica" "$build/tools/engram-replica-faults" "$build/tools/engram-mkckpt") ;;
  # The host-gather lookup path: its GPU test, the kernel tests, bench_kernels (run.sh hostgather).
  hostgather) bins=("$build/tests/gpu_host_gather_test" "$build/tests/gpu_kernels_test" "$build/tests/gpu_prefetch_test"
                    "$build/tests/uva_lookup_helper" "$build/bench/bench_kernels") ;;
  # Registration and publishing on each page kind: bench_register, bench_daemon (run.sh register).
  register) bins=("$build/bench/bench_register" "$build/bench/bench_daemon" "$build/daemon/engramd") ;;
  # A real-size table (a sparse DeepSeek-V4.1-Flash checkpoint): publish, attach, registration (run.sh fullscale).
  fullscale) bins=("$build/bench/bench_register" "$build/bench/bench_first_touch" "$build/daemon/engramd" "$build/tools/engramctl"
                   "$build/tools/engram-replica" "$build/tools/engram-mkckpt" "$build/tests/gpu_client_test") ;;
  *) echo "usage: scripts/gpu-bundle.sh [kernels|daemon|client|tests|python|dp|hostgather|register|fullscale]" >&2; exit 2 ;;
esac
# ENGRAM_BUNDLE_EXTRA="bench/bench_daemon ...": more binaries of the build directory in the same bundle (built already).
for x in ${ENGRAM_BUNDLE_EXTRA:-}; do bins+=("$build/$x"); done
# engramd's registration prewarm tool goes beside it (its --prewarm-registration auto looks there).
for b in "${bins[@]}"; do
  if [ "$(basename "$b")" = engramd ] && [ -x "$build/daemon/engram-prewarm" ]; then bins+=("$build/daemon/engram-prewarm"); break; fi
done
for b in "${bins[@]}"; do
  cp "$b" "$out/bin/"
  # Everything ldd resolves except the C library family and the driver (the GPU machine has its own).
  ldd "$b" | awk '/=> \// {print $3}' | grep -vE '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libcuda)\.so' |
    while read -r lib; do cp -Lu "$lib" "$out/lib/"; done
done
if [ "${1:-}" = python ]; then
  # The host's libstdc++/libgcc_s stay (torch needs the newer ones there).
  rm -f "$out"/lib/libstdc++.so* "$out"/lib/libgcc_s.so*
  mkdir -p "$out/py/tests" "$out/py/bench"
  # The package as its wheel (py/dist; run.sh installs it into py/python, where the tests and benchmarks look) and
  # its source tree apart (py/python-src), for ENGRAM_PY_FROM=source.
  "$root/scripts/build-wheel.sh" --build "$build" --out "$out/py/dist" > /dev/null
  cp -r "$root/python" "$out/py/python"
  mkdir -p "$out/py/python-src" && mv "$out/py/python/engram" "$out/py/python-src/engram"
  # The build's generated version file, where the tests read it in the build directory run.sh makes (pybuild/).
  if [ -f "$build/python/engram/_version.py" ]; then
    mkdir -p "$out/pybuild/python/engram" && cp "$build/python/engram/_version.py" "$out/pybuild/python/engram/"
  fi
  cp -r "$root/tests/python" "$out/py/tests/python"
  # What the documentation tests read from the repository (the tests find it two levels above tests/python).
  cp -r "$root/docs" "$root/include" "$root/README.md" "$out/py/"
  cp "$root/bench/decode_step.py" "$root/bench/vllm_lookup.py" "$root/bench/sglang_lookup.py" "$out/py/bench/"
  # vLLM's own source files for the plugin's tests and benchmark (git-ignored, never committed): ENGRAM_VLLM_SRC,
  # else .cache/vllm-src of this checkout, when present.
  # Each is a tree of the engine's files, or a directory of such trees, one per commit (tests/python/*_stubs.py).
  vsrc=${ENGRAM_VLLM_SRC:-$root/.cache/vllm-src}
  if [ -d "$vsrc" ] && find "$vsrc" -path '*/vllm/*' -name '*.py' -print -quit | grep -q .; then
    mkdir -p "$out/py/vllm-src" && cp -r "$vsrc/." "$out/py/vllm-src/"
  fi
  ssrc=${ENGRAM_SGLANG_SRC:-$root/.cache/sglang-src}  # SGLang's, the same way
  if [ -d "$ssrc" ] && find "$ssrc" -path '*/python/sglang/*' -name '*.py' -print -quit | grep -q .; then
    mkdir -p "$out/py/sglang-src" && cp -r "$ssrc/." "$out/py/sglang-src/"
  fi
  find "$out/py" -name __pycache__ -prune -exec rm -rf {} +
  # pytest for a machine without it: Debian's (pure Python), used only when `import pytest` fails there.
  mkdir -p "$out/py/pytest-fallback"
  for m in pytest _pytest pluggy iniconfig py.py packaging; do
    [ -e "/usr/lib/python3/dist-packages/$m" ] && cp -r "/usr/lib/python3/dist-packages/$m" "$out/py/pytest-fallback/"
  done
fi
# The wheel carries libengram_c.so (and run.sh takes it from there in either mode): the bundle keeps one copy.
if [ -d "$out/py/dist" ]; then rm -f "$out/bin/libengram_c.so"; fi
mkdir -p "$out/data"
cp -r "$root/tests/data/configs" "$root/tests/data/goldens" "$root/tests/data/tokenizers" "$out/data/"
strip --strip-debug "$out"/lib/*.so* "$out"/bin/* "$out"/daemon/* 2>/dev/null || true
# Libraries travel compressed (ICU's data alone is 30 MiB); run.sh unpacks them on first use.
tar -C "$out" -czf "$out/lib.tar.gz" lib && rm -rf "$out/lib"
cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the bundled GPU tests / sanitizers / benchmarks (and, with `daemon`, the publish benchmark on this machine's
# cores); writes logs under $OUT (or /tmp/engram-gpu-out).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
libs=/tmp/engram-gpu-libs-$(cksum < "$here/lib.tar.gz" | cut -d" " -f1)
[ -d "$libs/lib" ] || { mkdir -p "$libs" && tar -C "$libs" -xzf "$here/lib.tar.gz"; }
export LD_LIBRARY_PATH=$libs/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export ENGRAM_TEST_DATA_DIR=$here/data ENGRAM_BIN_DIR=$here/bin
out=${OUT:-/tmp/engram-gpu-out}
mkdir -p "$out"
# gpu_client_test starts engramd as $ENGRAM_BIN_DIR/../daemon/engramd (made here: the bundle carries one copy).
if [ -x "$here/bin/engramd" ] && [ ! -x "$here/daemon/engramd" ]; then
  mkdir -p "$here/daemon" && cp "$here/bin/engramd" "$here/daemon/engramd"
fi
what=${1:-all}
rc=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  # Exit 77 means the binary found no GPU (skipped): on the GPU machine that is a failure of the run too.
  export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off in every process (gpu_dp_test uses NCCL)
  for t in gpu_kernels_test gpu_prefetch_test gpu_client_test gpu_host_gather_test gpu_dp_test; do
    [ -x "$here/bin/$t" ] || continue
    "$here/bin/$t" 2>&1 | tee "$out/$t.log" | grep -E '^\[  (PASSED|FAILED|SKIPPED) |FAILED|seed|no GPU|GPU probe' ; r=${PIPESTATUS[0]}
    echo "$t: exit $r"; [ "$r" = 0 ] || rc=1
  done
fi
if [ "$what" = sanitize ] || [ "$what" = all ]; then
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  for tool in memcheck racecheck; do
    ENGRAM_GPU_QUICK=1 "$cs" --tool $tool --error-exitcode 9 "$here/bin/gpu_kernels_test" \
      --gtest_filter='GpuHash*:GpuGate*:GpuLookupTest.EqualsTheCpuReferenceBitForBit' > "$out/sanitize-$tool.log" 2>&1
    r=$?; echo "compute-sanitizer $tool: exit $r ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize-$tool.log" | tail -1))"
    [ $r = 0 ] || rc=1
  done
fi
if [ "$what" = client ]; then
  # libengram_client on the GPU: its GPU test, then engramd + 4 replicas (DP 4) registering a shared table:
  # 4 KiB pages with 1 and 4 tickets, then a huge=always tmpfs with 1 ticket.
  "$here/bin/gpu_client_test" 2>&1 | tee "$out/gpu_client_test.log" | grep -E '^\[  (PASSED|FAILED|SKIPPED) |Failure' || rc=1
  # Only this run's own directories are used and removed: a private subdirectory of /dev/shm (same tmpfs, so the
  # same registration cost; engramd scans only its --shm-dir) and one in a huge-page tmpfs this run mounts.
  w=$(mktemp -d /tmp/engram-client-run.XXXXXX)
  shm=$(mktemp -d /dev/shm/engram-run.XXXXXX)
  hp=$(mktemp -d /mnt/engram-hp.XXXXXX)
  "$here/bin/engram-mkckpt" --out "$w/ck" --table-mib $(( ${ENGRAM_CLIENT_GIB:-16} * 1024 )) | tee "$out/client.log"
  mount -t tmpfs -o size=$(( ${ENGRAM_CLIENT_GIB:-16} + 4 ))G,huge=always tmpfs "$hp"
  for setting in "$shm 1" "$shm 4" "$hp 1"; do
    set -- $setting
    "$here/bin/engramd" --checkpoint "$w/ck" --shm-dir "$1" --socket "$w/sock" --tickets "$2" --log-level warn 2>> "$out/client.log" &
    d=$!
    for _ in $(seq 600); do "$here/bin/engramctl" status --socket "$w/sock" --json 2>/dev/null | grep -q '"state":"READY"' && break; sleep 0.2; done
    echo "== shm $1, tickets $2: $("$here/bin/engramctl" status --socket "$w/sock" --json | grep -o '"load_seconds":[0-9.]*' | head -1)" | tee -a "$out/client.log"
    t0=$(date +%s.%N)
    for r in 0 1 2 3; do
      "$here/bin/engram-replica" --socket "$w/sock" --checkpoint "$w/ck" --shm-dir "$1" --dp-size 4 --dp-rank $r \
        --tokens 4096 --batches 2 --verify 64 > "$w/r$r.json" 2>&1 &
    done
    wait $(jobs -p | grep -v "^$d$") 2>/dev/null
    echo "  4 replicas done in $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" | tee -a "$out/client.log"
    for r in 0 1 2 3; do tail -1 "$w/r$r.json" | tee -a "$out/client.log"; done
    kill $d; wait $d
    rm -f "$1"/engram-*   # this run's segments only: $1 is one of its own directories
  done
  umount "$hp" && rmdir "$hp"
  rm -rf "$shm" "$w"
fi
if [ "$what" = dp ]; then
  # DP_SHARDED on two GPUs: NVLink multicast stays off (NCCL_NVLS_ENABLE=0) in every process. libnccl.so.2 is the
  # machine's own (dlopen), never bundled.
  export NCCL_NVLS_ENABLE=0
  ldconfig -p | grep -m1 libnccl.so.2 | tee "$out/nccl.txt"
  # bench first (its numbers choose the defaults), each step bounded so a hang cannot eat the rest.
  timeout 110 "$here/bin/bench_dp" ${ENGRAM_DP_BENCH_ARGS:-} 2>&1 | tee "$out/bench_dp.log"; [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  timeout 130 "$here/bin/gpu_dp_test" 2>&1 | tee "$out/gpu_dp_test.log" | grep -E '^\[  (PASSED|FAILED|SKIPPED) |Failure|^(all-to-all|nvlink-peer|pinned)' ; r=${PIPESTATUS[0]}
  echo "gpu_dp_test: exit $r"; [ "$r" = 0 ] || rc=1
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  if [ -n "$cs" ]; then
    # The exchange's kernels (Dp*: ids split, pack, unpack), the peer gather (peer path and own columns) and the
    # lookup (sequential form), every all-to-all form (small shards and batches, 7 KiB chunks, pipelined and as a
    # CUDA graph; the main a2a column is the graph form too; rank 1 with fewer tokens than the slot, 0 at T = 1:
    # memcheck is slow).
    for k in Dp PeerGather Lookup; do
      "$cs" --tool memcheck --error-exitcode 9 --report-api-errors no --kernel-name kns=$k "$here/bin/bench_dp" \
        --tokens 1,3,127 --uneven 1 --iters 2 --rows 4096 --uva-rows 4096 --variants seq,7,g7 > "$out/sanitize-dp-memcheck-$k.log" 2>&1
      r=$?; echo "compute-sanitizer memcheck $k (bench_dp): exit $r ($(grep -E 'ERROR SUMMARY' "$out/sanitize-dp-memcheck-$k.log" | tail -1))"
      [ $r = 0 ] || rc=1
    done
  fi
fi
if [ "$what" = hostgather ]; then
  # The host-gather path: GPU tests, compute-sanitizer on its test (small batches), then bench_kernels (every path,
  # the crossover table written to $out/lookup_paths.txt).
  export NCCL_NVLS_ENABLE=0
  for t in gpu_host_gather_test gpu_kernels_test gpu_prefetch_test; do
    "$here/bin/$t" 2>&1 | tee "$out/$t.log" | grep -E '^\[  (PASSED|FAILED|SKIPPED) |Failure|no GPU' ; r=${PIPESTATUS[0]}
    echo "$t: exit $r"; [ "$r" = 0 ] || rc=1
  done
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  for tool in memcheck racecheck; do
    ENGRAM_GPU_QUICK=1 "$cs" --tool $tool --error-exitcode 9 "$here/bin/gpu_host_gather_test" > "$out/sanitize-hg-$tool.log" 2>&1
    r=$?; echo "compute-sanitizer $tool (host gather): exit $r ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize-hg-$tool.log" | tail -1))"
    [ $r = 0 ] || rc=1
  done
  ENGRAM_LOOKUP_PATH_TABLE=$out/lookup_paths.txt "$here/bin/bench_kernels" "$here/data/configs/v41-flash.json" \
    "${ENGRAM_TABLE_GIB:-16}" 2>&1 | tee "$out/bench_kernels.log" || rc=1
  # The same on a huge=always tmpfs this run mounts (a segment on 2 MiB pages, as engramd --shm-dir on such a mount
  # publishes it): ENGRAM_HG_HUGE=0 skips it.
  if [ "${ENGRAM_HG_HUGE:-1}" = 1 ]; then
    hp=$(mktemp -d /mnt/engram-hg.XXXXXX)
    if mount -t tmpfs -o size=$(( ${ENGRAM_TABLE_GIB:-16} + 2 ))G,huge=always tmpfs "$hp"; then
      ENGRAM_BENCH_SHM_DIR=$hp ENGRAM_LOOKUP_PATH_TABLE=$out/lookup_paths-huge.txt "$here/bin/bench_kernels" \
        "$here/data/configs/v41-flash.json" "${ENGRAM_TABLE_GIB:-16}" 2>&1 | tee "$out/bench_kernels-huge.log" || rc=1
      umount "$hp"
    else
      echo "no huge=always tmpfs could be mounted: the huge-page run is skipped" | tee "$out/bench_kernels-huge.log"; rc=1
    fi
    rmdir "$hp"
  fi
fi
if [ "$what" = daemon ]; then
  "$here/bin/bench_daemon" --gib "${ENGRAM_PUBLISH_GIB:-16}" --engramd "$here/bin/engramd" 2>&1 | tee "$out/bench_daemon.log" || rc=1
fi
if [ "$what" = register ]; then
  # Registration (bench_register) and publishing (bench_daemon) on 4 KiB /dev/shm, a huge=always tmpfs this run
  # mounts and, where a 2 MiB hugetlb pool can be had, a hugetlbfs mount (the pool is grown for the run and put back).
  gib=${ENGRAM_REGISTER_GIB:-16}
  shm=$(mktemp -d /dev/shm/engram-reg.XXXXXX)
  thp=$(mktemp -d /mnt/engram-thp.XXXXXX)
  mount -t tmpfs -o size=$(( 2 * gib + 8 ))G,huge=always tmpfs "$thp"
  old_hp=$(cat /proc/sys/vm/nr_hugepages)
  need=$(( gib * 512 + 64 ))
  [ "$old_hp" -ge "$need" ] || echo "$need" > /proc/sys/vm/nr_hugepages
  grep -E 'HugePages_(Total|Free)|Hugepagesize' /proc/meminfo | tee "$out/register-meminfo.txt"
  htlb=""
  if [ "$(awk '/HugePages_Free/ {print $2}' /proc/meminfo)" -ge "$need" ]; then
    htlb=$(mktemp -d /mnt/engram-htlb.XXXXXX)
    mount -t hugetlbfs -o pagesize=2M none "$htlb" || { rmdir "$htlb"; htlb=""; }
  else
    echo "hugetlb: asked for $need 2 MiB pages, the kernel gave $(cat /proc/sys/vm/nr_hugepages): no hugetlbfs case" | tee -a "$out/register-meminfo.txt"
  fi
  kinds=(--kind "4k-shm:$shm:0.64" --kind "thp-tmpfs:$thp:0.45")
  mounts=(--shm "4k-shm:$shm")   # the huge-page tmpfs last: the product default runs on the last one
  [ -z "$htlb" ] || { kinds+=(--kind "hugetlbfs:$htlb:0.34"); mounts+=(--shm "hugetlbfs:$htlb"); }
  mounts+=(--shm "thp-tmpfs:$thp")
  "$here/bin/bench_register" --gib "$gib" "${kinds[@]}" ${ENGRAM_REGISTER_ARGS:-} 2>&1 | tee "$out/bench_register.log" || rc=1
  "$here/bin/bench_daemon" --gib "${ENGRAM_PUBLISH_GIB:-$gib}" "${mounts[@]}" --only-mounts 1 ${ENGRAM_PUBLISH_ARGS:-} 2>&1 | tee "$out/bench_daemon.log" || rc=1
  [ -z "$htlb" ] || { umount "$htlb"; rmdir "$htlb"; }
  umount "$thp"; rmdir "$thp"
  rm -rf "$shm"
  echo "$old_hp" > /proc/sys/vm/nr_hugepages
  echo "nr_hugepages put back to $(cat /proc/sys/vm/nr_hugepages)" | tee -a "$out/register-meminfo.txt"
fi
if [ "$what" = fullscale ]; then
  # A sparse checkpoint of DeepSeek-V4.1-Flash's real geometry (ENGRAM_FS_LAYERS, default layer 1: 94.4 GiB of
  # records at TP 1), on each mount of ENGRAM_FS_MOUNTS (4k: a directory of /dev/shm; thp: a tmpfs this run mounts
  # with huge=$ENGRAM_FS_HUGE, default always as the shipped mount unit): publish, one replica's attach step by step with every pattern region checked, ENGRAM_FS_FOUR=1:
  # four replicas at once with each ticket count of ENGRAM_FS_TICKETS (engramd restarted, adopting the segment),
  # then bench_register on the published segment (ENGRAM_FS_REG: its variants).
  export NCCL_NVLS_ENABLE=0
  w=$(mktemp -d /tmp/engram-fs.XXXXXX)
  log=$out/fullscale.log
  "$here/bin/engram-mkckpt" --out "$w/ck" --like deepseek-v4.1-flash --layers "${ENGRAM_FS_LAYERS:-1}" | tee -a "$log"
  { echo "uptime $(cut -d" " -f1 /proc/uptime) s"; grep -E 'MemTotal|MemAvailable|Shmem:|HugePages_Total' /proc/meminfo; lscpu | grep -E '^(NUMA node|Model name|Socket)';
    echo "shmem_enabled: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled)"; df -h /dev/shm | tail -1; } | tee -a "$log"
  wait_ready() {
    for _ in $(seq 1500); do "$here/bin/engramctl" status --socket "$w/sock" --json 2>/dev/null | grep -q '"state":"READY"' && return 0; sleep 0.2; done
    return 1
  }
  for m in ${ENGRAM_FS_MOUNTS:-4k thp}; do
    if [ "$m" = thp ]; then
      dir=$(mktemp -d /mnt/engram-fs.XXXXXX)
      mount -t tmpfs -o size=$(( ${ENGRAM_FS_MOUNT_GIB:-110} ))G,huge=${ENGRAM_FS_HUGE:-always} tmpfs "$dir" || { echo "no huge tmpfs"; rc=1; continue; }
    else
      dir=$(mktemp -d /dev/shm/engram-fs.XXXXXX)
    fi
    first=1
    for tickets in ${ENGRAM_FS_TICKETS:-1}; do
      t0=$(date +%s.%N)
      # ENGRAM_FS_PREWARM: engramd's --prewarm-registration (auto: engram-prewarm beside it; off).
      "$here/bin/engramd" --checkpoint "$w/ck" --shm-dir "$dir" --socket "$w/sock" --tickets "$tickets" --log-level info \
        --prewarm-registration "${ENGRAM_FS_PREWARM:-auto}" 2>> "$out/fullscale-engramd-$m.log" &
      d=$!
      wait_ready || { echo "$m: not READY"; rc=1; }
      echo "== $m ($dir), tickets $tickets: READY after $(awk "BEGIN{print $(date +%s.%N) - $t0}") s; $("$here/bin/engramctl" status --socket "$w/sock" --json | grep -o '"load_seconds":[0-9.]*' | head -1)" | tee -a "$log"
      if [ $first = 1 ] && [ "${ENGRAM_FS_PREWARM:-auto}" != off ]; then
        # engramd's own first registration of the segment: wait for it to settle, then show what it paid.
        for _ in $(seq 600); do "$here/bin/engramctl" status --socket "$w/sock" --json | grep -qE '"state":"(queued|running)"' || break; sleep 0.2; done
        echo "  prewarm settled $(awk "BEGIN{print $(date +%s.%N) - $t0}") s after engramd's start: $("$here/bin/engramctl" status --socket "$w/sock" --json | grep -o '"prewarm":{[^}]*}')" | tee -a "$log"
      fi
      grep -E 'MemAvailable|Shmem:|ShmemHugePages' /proc/meminfo | tr '\n' ' ' | tee -a "$log"; echo | tee -a "$log"
      if [ $first = 1 ] && [ -n "${ENGRAM_FS_BEFORE:-}" ]; then
        # ENGRAM_FS_BEFORE="each": bench_register on the published segment before the first replica (the machine's
        # first registration, chunk by chunk), with the kernel's vmstat counters that moved meanwhile.
        seg=$(ls "$dir"/engram-* 2>/dev/null | head -1)
        echo "== before the first replica, uptime $(cut -d' ' -f1 /proc/uptime) s: bench_register $ENGRAM_FS_BEFORE" | tee -a "$log"
        # ENGRAM_FS_BEFORE="read2": the segment read through twice with read(2) instead (the page cache marks a page
        # accessed on each read, and activates it on the second), to see whether the first registration's extra goes.
        for pass in 1 2; do
          cp /proc/vmstat "$w/vmstat.0"
          if [ "$ENGRAM_FS_BEFORE" = scratch ]; then
            # ENGRAM_FS_BEFORE="scratch": a registration of anonymous memory (not the segment's pages) first.
            "$here/bin/engram-prewarm" --scratch-mib "${ENGRAM_FS_SCRATCH_MIB:-8192}" 2>&1 | tee -a "$log"
          elif [ "$ENGRAM_FS_BEFORE" = read2 ]; then
            t2=$(date +%s.%N); dd if="$seg" of=/dev/null bs=16M 2>/dev/null
            echo "  read pass $pass: $(awk "BEGIN{print $(date +%s.%N) - $t2}") s" | tee -a "$log"
          else
            "$here/bin/bench_register" --file "$seg" --only "$ENGRAM_FS_BEFORE" --chunks-gib "${ENGRAM_FS_BEFORE_CHUNKS:-8}" 2>&1 | tee -a "$log"
          fi
          echo "  pass $pass vmstat moved: $(awk 'NR==FNR{a[$1]=$2;next} ($2-a[$1])!=0{printf "%s=%d ", $1, $2-a[$1]}' "$w/vmstat.0" /proc/vmstat)" | tee -a "$log"
        done
      fi
      if [ $first = 1 ]; then
        # The node's first replica (on a fresh machine: its first registration since boot), then a second one.
        for which in first second; do
          echo "== $which replica, uptime $(cut -d' ' -f1 /proc/uptime) s" | tee -a "$log"
          "$here/bin/engram-replica" --socket "$w/sock" --checkpoint "$w/ck" --dp-size 2 --tokens 1024 --batches 2 --verify 64 2>&1 | tail -1 | tee -a "$log"
          [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        done
        first=0
      fi
      if [ "${ENGRAM_FS_FOUR:-0}" = 1 ]; then
        t1=$(date +%s.%N)
        for r in 0 1 2 3; do
          "$here/bin/engram-replica" --socket "$w/sock" --checkpoint "$w/ck" --dp-size 4 --dp-rank $r --tokens 1024 \
            --batches 1 --verify 16 > "$w/r$r.json" 2>&1 &
        done
        wait $(jobs -p | grep -v "^$d$") 2>/dev/null
        echo "  4 replicas, tickets $tickets: all done in $(awk "BEGIN{print $(date +%s.%N) - $t1}") s" | tee -a "$log"
        for r in 0 1 2 3; do tail -1 "$w/r$r.json" | tee -a "$log"; done
      fi
      kill $d; wait $d
    done
    seg=$(ls "$dir"/engram-* 2>/dev/null | head -1)
    [ -z "$seg" ] || [ -z "${ENGRAM_FS_REG:-runtime,seq+pf,each}" ] || \
      "$here/bin/bench_register" --file "$seg" --only "${ENGRAM_FS_REG:-runtime,seq+pf,each}" --chunks-gib "${ENGRAM_FS_CHUNKS:-16}" 2>&1 | tee -a "$log"
    rm -f "$dir"/engram-*
    # The publish's ceiling on the same mount: a first-touch copy of the same bytes (and after fallocate).
    [ "${ENGRAM_FS_COPY:-1}" = 0 ] || "$here/bin/bench_first_touch" --dir "$dir" --gib "${ENGRAM_FS_COPY_GIB:-94.4}" 2>&1 | tee -a "$log"
    [ "$m" = thp ] && umount "$dir"
    rm -rf "$dir"
  done
  rm -rf "$w"
  if [ "${ENGRAM_FS_TEST:-1}" = 1 ]; then
    "$here/bin/gpu_client_test" --gtest_filter="${ENGRAM_FS_TEST_FILTER:-GpuFullScale.*}" 2>&1 | tee "$out/gpu_fullscale_test.log" | \
      grep -E '^\[  (PASSED|FAILED|SKIPPED) |Failure|full-scale|Skipped' ; [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  fi
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  "$here/bin/bench_kernels" "$here/data/configs/v41-flash.json" "${ENGRAM_TABLE_GIB:-16}" 2>&1 | tee "$out/bench_kernels.log" || rc=1
fi
if [ "$what" = python ]; then
  # The engram package on this machine's python3/torch: pytest (every test, the torch ops, CUDA graphs, compile),
  # then the decode-step benchmark against an engramd serving a table of ENGRAM_PY_TABLE_GIB GiB in /dev/shm.
  export NCCL_NVLS_ENABLE=0
  export PYTHONDONTWRITEBYTECODE=1
  export ENGRAM_BUILD_DIR=$here/pybuild
  mkdir -p "$here/pybuild/tools" "$here/pybuild/daemon"
  ln -sf "$here/bin/engram-mkckpt" "$here/bin/engramctl" "$here/pybuild/tools/"
  ln -sf "$here/bin/engramd" "$here/pybuild/daemon/engramd"
  py=$(command -v python3)
  # The package goes into py/python, where the tests, their subprocesses and the benchmarks import it from:
  # installed from the wheel as an engine's environment gets it (pip --target, no dependencies, no index; the
  # library and its dependencies the wheel's own, no ENGRAM_LIB), or with ENGRAM_PY_FROM=source its source tree with
  # the bundled library by ENGRAM_LIB. Without pip the wheel is unpacked (the same files).
  rm -rf "$here"/py/python/engram "$here"/py/python/engram-*.dist-info
  whl=$(ls "$here"/py/dist/engram-*.whl)
  if [ "${ENGRAM_PY_FROM:-wheel}" = source ]; then
    cp -r "$here/py/python-src/engram" "$here/py/python/"
    # The library (and its own libraries beside it) as the wheel carries it, named by ENGRAM_LIB.
    rm -rf "$here/py/wheel-files" && "$py" -m zipfile -e "$whl" "$here/py/wheel-files"
    export ENGRAM_LIB=$here/py/wheel-files/engram/libengram_c.so
  else
    "$py" -m pip install -q --disable-pip-version-check --no-deps --no-index --target "$here/py/python" "$whl" ||
      "$py" -m zipfile -e "$whl" "$here/py/python"
    unset ENGRAM_LIB
  fi
  export PYTHONPATH=$here/py/python
  "$py" -c 'import engram; print("engram", engram.__version__, engram.__file__, engram._lib.path)' | tee "$out/python-engram.txt"
  [ -d "$here/py/vllm-src" ] && export ENGRAM_VLLM_SRC=$here/py/vllm-src
  [ -d "$here/py/sglang-src" ] && export ENGRAM_SGLANG_SRC=$here/py/sglang-src
  "$py" -c 'import torch, numpy; print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "numpy", numpy.__version__)' | tee "$out/python-env.txt"
  "$py" -c 'import pytest' 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$here/py/pytest-fallback
  [ -n "${ENGRAM_PY_NO_TESTS:-}" ] || "$py" -m pytest -q -rs -p no:cacheprovider "$here/py/tests/python" -k "not test_install" 2>&1 | tee "$out/pytest.log" | tail -25
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  if [ -n "${ENGRAM_VLLM_BENCH_MIB:-}" ] && [ -n "${ENGRAM_VLLM_SRC:-}" ]; then
    # vLLM's own lookup against the plugin's, same run (bench/vllm_lookup.py): table sizes in MiB.
    "$py" "$here/py/bench/vllm_lookup.py" --build "$here/pybuild" --table-mib "$ENGRAM_VLLM_BENCH_MIB" \
      ${ENGRAM_VLLM_BENCH_ARGS:-} 2>&1 | tee "$out/vllm_lookup.log" || rc=1
  fi
  if [ -n "${ENGRAM_SGLANG_BENCH_MIB:-}" ] && [ -n "${ENGRAM_SGLANG_SRC:-}" ]; then
    # SGLang's own gather against the plugin's, same run (bench/sglang_lookup.py).
    "$py" "$here/py/bench/sglang_lookup.py" --build "$here/pybuild" --table-mib "$ENGRAM_SGLANG_BENCH_MIB" \
      ${ENGRAM_SGLANG_BENCH_ARGS:-} 2>&1 | tee "$out/sglang_lookup.log" || rc=1
  fi
  [ -n "${ENGRAM_PY_NO_DECODE:-}" ] && exit $rc
  w=$(mktemp -d /tmp/engram-py.XXXXXX)
  shm=$(mktemp -d /dev/shm/engram-py.XXXXXX)
  "$here/bin/engram-mkckpt" --out "$w/ck" --table-mib $(( ${ENGRAM_PY_TABLE_GIB:-16} * 1024 )) --layers 1,14 --heads 8 \
    --max-ngram 4 --hidden 5120 --hc-mult 4 --shards 2 | tee "$out/decode_step.log"
  "$here/bin/engramd" --checkpoint "$w/ck" --tp 1 --shm-dir "$shm" --socket "$w/sock" --log-level warn 2>> "$out/decode_step.log" &
  d=$!
  for _ in $(seq 900); do "$here/bin/engramctl" status --socket "$w/sock" --json 2>/dev/null | grep -q '"state":"READY"' && break; sleep 0.2; done
  "$py" "$here/py/bench/decode_step.py" --checkpoint "$w/ck" --socket "$w/sock" --shm-dir "$shm" \
    --config "$here/data/configs/v41-flash.json" 2>&1 | tee -a "$out/decode_step.log" || rc=1
  kill $d; wait $d
  rm -rf "$shm" "$w"
fi
exit $rc
RUN
chmod +x "$out/run.sh"
du -sh "$out"
