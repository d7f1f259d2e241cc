// The state of one Session (client/session/session.h) shared by its pieces: session.cc (open, requests, reports),
// session_events.cc (the events loop and the reconnect after a lost lease) and session_group.cc (the DP group).
//
// Internal to client/session/. Ownership: the Session owns its Impl; the Impl owns the current Connection and the
// events thread (joined by ~Session). Thread-safety: `mu` guards conn, closing, outcome, engine_choice, on_group and
// the join ids; the driving thread and the events thread share the Impl, the events thread alone reads the stream
// after Keep().
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/session/connection.h"
#include "client/session/session.h"
#include "engram/v1/engram.grpc.pb.h"

namespace engram::client {

struct Session::Impl {
  std::string socket;
  Declaration declaration;
  bool granted = false;                       // this session's mapping came from a grant
  bool takes_engine_choice = false;           // the daemon of the current connection takes EngineChoice
  uint64_t segment_dev = 0, segment_ino = 0;  // that file's identity when it was granted

  std::mutex mu;  // guards conn, closing, outcome
  std::condition_variable cv;
  std::unique_ptr<Connection> conn;
  bool closing = false;
  std::optional<v1::ClientMessage> outcome;         // replayed after a reconnect
  std::optional<v1::ClientMessage> engine_choice;   // the same (after the outcome)
  std::function<void(const GroupEvent&)> on_group;  // the DP group this session joined (JoinGroup)
  uint64_t join_id = 0;                             // that membership's id (0: none)
  uint64_t next_join_id = 1;
  std::thread events;

  // DP group updates (JoinGroup), from the events thread (session_group.cc).
  void DeliverGroupUpdate(const v1::GroupUpdate& u);
  void DeliverGroupLeft(const v1::GroupLeft& l);
  // The session ended: a group this session joined cannot go on (its membership was this lease); the reconnect
  // that follows does not rejoin it.
  void LoseGroup();

  absl::Status Write(const v1::ClientMessage& m) {
    if (conn->stream->Write(m)) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat("the session with engramd on ", socket, " ended"));
  }
  // The stream's final status, for a failed read or write.
  absl::Status Ended(const std::string& what) { return FromGrpc(conn->stream->Finish(), what); }

  // The events loop (session_events.cc): drains daemon events; when the session breaks (engramd died or restarted),
  // logs it and reconnects with backoff, replays the outcome so that status lists this replica again, and keeps the
  // mapping it has (still valid: the pages stay mapped whatever happened to the daemon).
  void Run();
};

}  // namespace engram::client
