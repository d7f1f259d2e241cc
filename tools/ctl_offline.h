// engramctl's offline subcommands: they read a checkpoint or config and never talk to the daemon.
//   plan      layout, TP shards and whether the node's shm can hold the tables
//   tokenmap  the compressed token map of a tokenizer.json, with its SHA-256
//   hash      the hash ids of one request of tokens
// Each returns the process exit code: 0 success, 1 failure (message on stderr), 2 bad arguments.
#pragma once

namespace engram::tools {

int CmdPlan(int argc, char** argv);
int CmdTokenMap(int argc, char** argv);
int CmdHash(int argc, char** argv);

}  // namespace engram::tools
