// engramctl: the operator's command line for engram. Offline subcommands (plan, tokenmap, hash) read checkpoints
// directly; daemon subcommands talk to engramd over its Unix socket.
#include <cstring>
#include <iostream>

#include "tools/ctl_offline.h"

namespace {

int Help(int code) {
  (code == 0 ? std::cout : std::cerr)
      << "usage: engramctl COMMAND [options]\n"
         "  plan (--checkpoint DIR | --config FILE) [--tp N] [--shm-dir DIR] [--json]\n"
         "  tokenmap --tokenizer FILE [--out FILE] [--json]\n"
         "  hash (--checkpoint DIR | --config FILE --tokenizer FILE) --tokens a,b,... [--dead 0,1,...] [--json]\n";
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Help(2);
  const std::string cmd = argv[1];
  if (cmd == "-h" || cmd == "--help" || cmd == "help") return Help(0);
  if (cmd == "plan") return engram::tools::CmdPlan(argc, argv);
  if (cmd == "tokenmap") return engram::tools::CmdTokenMap(argc, argv);
  if (cmd == "hash") return engram::tools::CmdHash(argc, argv);
  std::cerr << "engramctl: unknown command '" << cmd << "'\n";
  return Help(2);
}
