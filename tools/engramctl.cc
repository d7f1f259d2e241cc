// engramctl: the operator's command line for engram. Offline subcommands (plan, tokenmap, hash) read checkpoints
// directly; daemon subcommands talk to engramd over its Unix socket.
#include <algorithm>
#include <cstring>
#include <iostream>
#include <vector>

#include "engram/version.h"
#include "tools/ctl_daemon.h"
#include "tools/ctl_offline.h"

namespace {

int Help(int code) {
  (code == 0 ? std::cout : std::cerr)
      << "usage: engramctl COMMAND [options]\n"
         "  plan (--checkpoint DIR | --config FILE) [--tp N] [--dp N] [--local-dp N] [--tokens N]\n"
         "       [--cpu-offload true|false] [--elastic-ep] [--embedding-across-dp] [--shm-dir DIR] [--json]\n"
         "  tokenmap --tokenizer FILE [--out FILE] [--json]\n"
         "  hash (--checkpoint DIR | --config FILE --tokenizer FILE) --tokens a,b,... [--dead 0,1,...] [--json]\n"
         "  status [--socket PATH] [--json]\n"
         "  watch [--socket PATH] [--interval S] [--count N]\n"
         "  load --checkpoint DIR [--tp 1,2] [--timeout S] [--socket PATH]\n"
         "  unload --checkpoint DIR [--socket PATH]\n"
         "  drain [--socket PATH]\n"
         "  ready [--socket PATH]              (exit 0 when every segment is READY: a readiness probe)\n"
         "  attach --checkpoint DIR [--tp-size N --tp-rank R --dp-size N --dp-rank R --local-dp-size N]\n"
         "         [--cpu-offload auto|true|false] [--dp-shared-memory auto|true|false] [--embedding-across-dp]\n"
         "         [--elastic-ep] [--no-descriptor] [--shm-dir DIR] [--ticket] [--verify N] [--hold S]\n"
         "         [--timeout S] [--socket PATH]\n"
         "  --version                          (print engramctl's version)\n";
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  // `engramctl --socket PATH status`: a leading --socket belongs to the daemon subcommands; move it behind the
  // command so that each subcommand parses it as its own.
  std::vector<char*> args(argv, argv + argc);
  if (args.size() >= 3 && std::strcmp(args[1], "--socket") == 0) {
    std::rotate(args.begin() + 1, args.begin() + 3, args.begin() + std::min<size_t>(4, args.size()));
  } else if (args.size() >= 2 && std::strncmp(args[1], "--socket=", 9) == 0) {
    std::rotate(args.begin() + 1, args.begin() + 2, args.begin() + std::min<size_t>(3, args.size()));
  }
  argv = args.data();
  if (argc < 2) return Help(2);
  const std::string cmd = argv[1];
  if (cmd == "-h" || cmd == "--help" || cmd == "help") return Help(0);
  if (cmd == "--version") {
    std::cout << "engramctl " << ENGRAM_VERSION_STRING << "\n";
    return 0;
  }
  if (cmd == "plan") return engram::tools::CmdPlan(argc, argv);
  if (cmd == "tokenmap") return engram::tools::CmdTokenMap(argc, argv);
  if (cmd == "hash") return engram::tools::CmdHash(argc, argv);
  if (cmd == "status") return engram::tools::CmdStatus(argc, argv);
  if (cmd == "watch") return engram::tools::CmdWatch(argc, argv);
  if (cmd == "load") return engram::tools::CmdLoad(argc, argv);
  if (cmd == "unload") return engram::tools::CmdUnload(argc, argv);
  if (cmd == "drain") return engram::tools::CmdDrain(argc, argv);
  if (cmd == "ready") return engram::tools::CmdReady(argc, argv);
  if (cmd == "attach") return engram::tools::CmdAttach(argc, argv);
  std::cerr << "engramctl: unknown command '" << cmd << "'\n";
  return Help(2);
}
