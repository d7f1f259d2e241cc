#!/usr/bin/env bash
# Builds the engram Python wheel, engram-<version>-py3-none-linux_<arch>.whl, from an existing CMake build: the
# package (python/engram, the build's _version.py), libengram_c.so inside it and every non-system shared library that
# library loads in engram/.libs/, renamed and with a $ORIGIN-relative RUNPATH (as auditwheel's repair does), debug
# info stripped. `pip install` of that one file into an engine's environment is the whole installation: no
# ENGRAM_LIB, no LD_LIBRARY_PATH, none of Debian's gRPC, protobuf, abseil or ICU on the machine.
# Left out, as the engine's environment has its own: the C library family, libstdc++ and libgcc_s (torch ships newer
# ones), the CUDA driver (libcuda) and NCCL (dlopen()ed at run time). cudart is linked statically; a library that
# loads libcudart.so is refused (its CUDA version would have to match the engine's).
# Usage: scripts/build-wheel.sh [--build DIR] [--out DIR]    (defaults: ./build, ./dist/); prints the wheel's path.
# Needs python3 (3.11: tomllib), patchelf, strip (scripts/bootstrap.sh installs them).
set -euo pipefail
die() { echo "build-wheel: $*" >&2; exit 1; }
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build
out=$root/dist
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: scripts/build-wheel.sh [--build DIR] [--out DIR]" >&2; exit 2 ;;
  esac
done
build=$(cd "$build" && pwd)
lib=$build/client/libengram_c.so
[ -f "$lib" ] || die "$lib is missing: build the engram_c target first"
for tool in patchelf strip ldd; do
  command -v "$tool" > /dev/null || die "$tool is missing (scripts/bootstrap.sh installs it)"
done

stage=$(mktemp -d "${TMPDIR:-/tmp}/engram-wheel.XXXXXX")
trap 'rm -rf "$stage"' EXIT
pkg=$stage/engram
mkdir -p "$pkg/.libs"
# The package's files as the source tree has them (subpackages included), no bytecode, no library of a build.
# The package's Python sources only (an editor's or a build's leftovers in the tree stay out).
(cd "$root/python/engram" && find . -name __pycache__ -prune -o -type f -name '*.py' ! -name '_version.py' -print0 |
  xargs -0 cp --parents -t "$pkg")
# The version is CMake's project(VERSION), its one source: the build's generated _version.py, or, from a build
# configured before that file existed, the version its cache records.
if [ -f "$build/python/engram/_version.py" ]; then
  cp "$build/python/engram/_version.py" "$pkg/_version.py"
else
  version=$(sed -n 's/^CMAKE_PROJECT_VERSION:STATIC=//p' "$build/CMakeCache.txt" 2>/dev/null || true)
  [ -n "$version" ] || die "no version: $build has no python/engram/_version.py, no CMAKE_PROJECT_VERSION in its cache"
  { echo '"""The engram package'"'"'s version, from CMake'"'"'s project(engram VERSION ...), its one source."""'
    echo "__version__ = \"$version\""; } > "$pkg/_version.py"
fi

# Every shared library ldd resolves, except the system's (see the header): soname and path, one per line.
deps=$(ldd "$lib" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}')
! grep -q '^libcudart\.so' <<< "$deps" || die "$lib loads libcudart.so: link the static cudart (CUDA::cudart_static)"
! ldd "$lib" | grep 'not found' >&2 || die "ldd cannot resolve those dependencies of $lib"
# The C library family, the C++ runtime, the CUDA driver, NCCL; and a sanitizer build's runtimes, which the process
# preloads (a second copy of one would not work).
system='^(libc|libm|libdl|librt|libpthread|libutil|libresolv|libanl|libmvec|libnsl|ld-linux[-a-z0-9_]*'
system+='|libstdc\+\+|libgcc_s|libcuda|libnccl|libasan|libubsan|libtsan|liblsan)\.so'
bundled=$(grep -vE "$system" <<< "$deps" || true)
# Each copy is renamed <name>-<8 hex of its content>.so.<n> (its soname too) and every reference to it rewritten, so
# the process loads these copies even where another library of the same soname is already loaded or on
# LD_LIBRARY_PATH.
declare -A rename=()
while read -r soname path; do
  [ -n "$soname" ] || continue
  base=${soname%%.so*}
  rename[$soname]=$base-$(sha256sum "$path" | cut -c1-8)${soname#"$base"}
done <<< "$bundled"

# fix_elf FILE RUNPATH: strips debug info, sets the RUNPATH and points every DT_NEEDED on a bundled library at its copy.
fix_elf() {
  local f=$1 args=() n
  strip --strip-debug "$f"
  for n in $(patchelf --print-needed "$f"); do
    if [ -n "${rename[$n]:-}" ]; then args+=(--replace-needed "$n" "${rename[$n]}"); fi
  done
  # One change per call: patchelf 0.14 writes a wrong RUNPATH when --set-rpath and --replace-needed share a call.
  if [ ${#args[@]} -gt 0 ]; then patchelf "${args[@]}" "$f"; fi
  patchelf --set-rpath "$2" "$f"
}
while read -r soname path; do
  [ -n "$soname" ] || continue
  copy=$pkg/.libs/${rename[$soname]}
  cp -L "$path" "$copy"
  chmod 0755 "$copy"
  fix_elf "$copy" '$ORIGIN'
  patchelf --set-soname "${rename[$soname]}" "$copy"
done <<< "$bundled"
cp -L "$lib" "$pkg/libengram_c.so"
chmod 0755 "$pkg/libengram_c.so"
fix_elf "$pkg/libengram_c.so" '$ORIGIN/.libs'
! env -u LD_LIBRARY_PATH ldd "$pkg/libengram_c.so" | grep 'not found' >&2 || die "the packaged library does not resolve"

# The wheel, written directly: python/pyproject.toml's [project] table is the distribution's metadata (name,
# summary, license, requires-python, entry points), _version.py its version. Entries are sorted and dated 1980-01-01,
# so the same build gives the same bytes.
mkdir -p "$out"
rm -f "$out"/engram-*-py3-none-*.whl  # one wheel in the directory: `pip install dist/engram-*.whl` names it
python3 - "$stage" "$root/python/pyproject.toml" "$out" "linux_$(uname -m)" <<'PY'
import base64, hashlib, os, re, sys, tomllib, zipfile

stage, pyproject, out, plat = sys.argv[1:]
with open(pyproject, "rb") as f:
    project = tomllib.load(f)["project"]
if "version" in project or "version" not in project.get("dynamic", []):
    sys.exit("build-wheel: pyproject.toml must declare the version dynamic (CMake's project(VERSION) is its source)")
src = open(os.path.join(stage, "engram", "_version.py")).read()
version = re.search(r'^__version__ = "([^"]+)"', src, re.M).group(1)
name = project["name"]
tag = f"py3-none-{plat}"
info = f"{name}-{version}.dist-info"

meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", f"Summary: {project['description']}"]
if "license" in project:
    meta.append(f"License: {project['license']['text']}")
if "requires-python" in project:
    meta.append(f"Requires-Python: {project['requires-python']}")
meta += [f"Requires-Dist: {d}" for d in project.get("dependencies", [])]
eps = []
for group, entries in project.get("entry-points", {}).items():
    eps.append(f"[{group}]")
    eps += [f"{k} = {v}" for k, v in entries.items()]
    eps.append("")
generated = {
    f"{info}/METADATA": "\n".join(meta) + "\n",
    f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: engram scripts/build-wheel.sh\nRoot-Is-Purelib: false\n"
                     f"Tag: {tag}\n",
    f"{info}/entry_points.txt": "\n".join(eps),
    f"{info}/top_level.txt": "engram\n",
}

files = []
for d, _, names in os.walk(os.path.join(stage, "engram")):
    for n in names:
        p = os.path.join(d, n)
        files.append((os.path.relpath(p, stage), p))
files.sort()

whl = os.path.join(out, f"{name}-{version}-{tag}.whl")
record = []


def add(z, arc, data, mode):
    zi = zipfile.ZipInfo(arc, date_time=(1980, 1, 1, 0, 0, 0))
    zi.external_attr = (0o100000 | mode) << 16
    zi.compress_type = zipfile.ZIP_DEFLATED
    z.writestr(zi, data)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record.append(f"{arc},sha256={digest},{len(data)}")


with zipfile.ZipFile(whl + ".part", "w") as z:
    for arc, p in files:
        with open(p, "rb") as f:
            add(z, arc, f.read(), os.stat(p).st_mode & 0o777)
    for arc, text in generated.items():
        add(z, arc, text.encode(), 0o644)
    record.append(f"{info}/RECORD,,")
    zi = zipfile.ZipInfo(f"{info}/RECORD", date_time=(1980, 1, 1, 0, 0, 0))
    zi.external_attr = (0o100644) << 16
    zi.compress_type = zipfile.ZIP_DEFLATED
    z.writestr(zi, "\n".join(record) + "\n")
os.replace(whl + ".part", whl)
print(whl)
PY
