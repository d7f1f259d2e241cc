// What the engramd hardening tests (tests/integration/daemon_hardening_*_test.cc) share: whether this machine can run
// processes as other uids (NoOtherUids), and one `engramctl attach` against a daemon (AttachOnce).
//
// Every test has its own shm directory and socket under a temporary directory (never /dev/shm), so the tests run in
// parallel. They synchronise on conditions (status answers, files, log lines), never on sleeps. Root-only cases skip
// with the reason. Test-only; not thread-safe.
#pragma once

#include <unistd.h>

#include <iostream>
#include <string>

#include "nlohmann/json.hpp"
#include "tests/integration/daemon_harness.h"
#include "tests/integration/json_lines.h"
#include "tests/test_util.h"

namespace engram::testing {

// Why a test that runs processes as other uids (setpriv) cannot run here, or "" when it can: root, setpriv, and with
// `nogroup` the group 'nogroup' (gid 65534) that such tests give the daemon.
inline std::string NoOtherUids(const std::string& why_root, bool nogroup) {
  if (::geteuid() != 0) return "needs root: " + why_root;
  if (RunCmd("command -v setpriv").exit_code != 0) return "setpriv (util-linux) is not installed";
  if (nogroup && RunCmd("getent group nogroup").exit_code != 0) return "no group 'nogroup' (gid 65534)";
  return "";
}

// `engramctl attach` once: its first JSON line (decision, verified rows, mismatches).
inline nlohmann::json AttachOnce(const Daemon& d, const std::string& ckpt, const std::string& shm,
                                 const std::string& extra = "", const std::string& prefix = "") {
  auto r = RunCmd(prefix + BinPath("engramctl") + " attach --socket " + d.socket() + " --checkpoint " + ckpt +
                  " --shm-dir " + shm + " --dp-size 2 --verify 100 " + extra);
  nlohmann::json j = JsonLine(r.out, false);
  if (j.is_null()) std::cerr << "attach: " << r.exit_code << " " << r.out << r.err << "\n";
  return j;
}

}  // namespace engram::testing
