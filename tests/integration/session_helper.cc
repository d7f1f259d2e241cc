// session_helper: a minimal replica session for the daemon tests, as a separate process so a test can kill -9 it at
// a known point. It says hello for CHECKPOINT (DP 2, TP 1) on SOCKET, seeing SHM_DIR, and then:
//   ticket  takes the registration ticket, prints {"ticket": true} and holds it (never reports a result) until killed;
//   events  prints {"granted": true|false} and then one {"event": KIND} line per server event until the stream ends,
//           then {"ended": true}.
// Output lines are flushed at once: the tests synchronise on them. Usage: session_helper SOCKET CHECKPOINT SHM_DIR MODE
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <iostream>

#include "engram/v1/engram.grpc.pb.h"
#include "model/checkpoint.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: session_helper SOCKET CHECKPOINT SHM_DIR ticket|events\n";
    return 2;
  }
  const std::string socket = argv[1], mode = argv[4];
  auto ck = engram::Checkpoint::Open(argv[2]);
  if (!ck.ok()) {
    std::cerr << ck.status() << "\n";
    return 1;
  }
  engram::v1::ClientMessage hello;
  auto* h = hello.mutable_hello();
  h->set_fingerprint((*ck)->Fingerprint());
  h->set_checkpoint(argv[2]);
  h->set_tp_size(1);
  h->set_dp_size(2);
  h->set_local_dp_size(2);
  h->set_pid(::getpid());
  auto stub = engram::v1::Engram::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto s = stub->Session(&ctx);
  engram::v1::ServerMessage answer;
  if (!s->Write(hello) || !s->Read(&answer)) {
    std::cout << R"({"error": "no answer"})" << std::endl;
    return 1;
  }
  if (mode == "ticket") {
    if (!answer.has_grant()) {
      std::cout << R"({"error": "no grant"})" << std::endl;
      return 1;
    }
    engram::v1::ClientMessage t;
    t.mutable_ticket_request();
    engram::v1::ServerMessage got;
    if (!s->Write(t)) return 1;
    while (s->Read(&got)) {
      if (got.has_ticket()) {
        std::cout << R"({"ticket": true})" << std::endl;
        for (;;) ::pause();  // hold it until killed
      }
    }
    return 1;
  }
  std::cout << "{\"granted\": " << (answer.has_grant() ? "true" : "false") << "}" << std::endl;
  engram::v1::ServerMessage m;
  while (s->Read(&m)) {
    if (m.has_event()) {
      std::cout << "{\"event\": \"" << engram::v1::Event::Kind_Name(m.event().kind()) << "\"}" << std::endl;
    }
  }
  std::cout << R"({"ended": true})" << std::endl;
  return 0;
}
