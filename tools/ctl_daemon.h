// engramctl's daemon subcommands (they talk to engramd over its Unix socket):
//   status [--json]                      what the daemon holds and who uses it
//   watch [--interval S] [--count N]     live progress of loading / verification (GiB/s, ETA) until settled
//   load --checkpoint DIR [--tp 1,2]     serve another checkpoint
//   unload --checkpoint DIR              stop serving one (mapped segments stay valid for their replicas)
//   drain                                tell every session the daemon is going away
//   attach ...                           open a replica session, check the grant against the checkpoint, hold it
// Exit codes: 0 success, 1 failure, 2 bad arguments, 3 the daemon is not running.
#pragma once

namespace engram::tools {

int CmdStatus(int argc, char** argv);
int CmdWatch(int argc, char** argv);
int CmdLoad(int argc, char** argv);
int CmdUnload(int argc, char** argv);
int CmdDrain(int argc, char** argv);
// Readiness (a Kubernetes readinessProbe, a script): exit 0 when engramd answers, is not draining and every segment
// it serves is READY; 1 (with what is not) otherwise; 3 when no daemon answers, 4 when it refuses this uid.
int CmdReady(int argc, char** argv);
int CmdAttach(int argc, char** argv);

}  // namespace engram::tools
