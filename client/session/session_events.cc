// The events loop of a kept Session (client/session/session_impl.h): daemon events drained, and the lease
// re-established after the session breaks.
#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <utility>

#include "base/utf8.h"
#include "client/log.h"
#include "client/session/session_impl.h"

namespace engram::client {

void Session::Impl::Run() {
  while (true) {
    Connection* c;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (closing) return;
      c = conn.get();
    }
    v1::ServerMessage m;
    while (c->stream->Read(&m)) {
      if (m.has_event() && m.event().kind() == v1::Event::DRAINING) {
        Log().warn("engram: event=daemon_draining detail={}", engram::LogQuoted(m.event().detail()));
      }
      if (m.has_group_update()) DeliverGroupUpdate(m.group_update());
      if (m.has_group_left()) DeliverGroupLeft(m.group_left());
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      if (closing) return;
    }
    LoseGroup();
    Log().warn(
        "engram: event=lease_lost socket={} detail=\"engramd ended the session; the mapping stays valid, "
        "reconnecting\"",
        socket);
    auto backoff = std::chrono::milliseconds(100);
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mu);
        if (cv.wait_for(lock, backoff, [&] { return closing; })) return;
      }
      backoff = std::min(backoff * 2, std::chrono::milliseconds(5000));
      v1::ServerMessage answer;
      auto next = Connect(socket, std::chrono::milliseconds(2000), declaration, &answer);
      if (!next.ok()) continue;
      // The same file (device and inode as the daemon reports them, the same in every mount namespace; not
      // just the name: a republished segment has the old name), or not.
      const bool same = answer.has_grant() && granted && segment_ino != 0 &&
                        answer.grant().segment_dev() == segment_dev && answer.grant().segment_ino() == segment_ino;
      std::lock_guard<std::mutex> lock(mu);
      if (closing) {
        (*next)->ctx.TryCancel();
        return;
      }
      if (outcome && outcome->outcome().mode() == v1::SHARED && !same) {
        // This replica keeps reading its mapping of a file the daemon no longer serves: a copy of its own now.
        auto* o = outcome->mutable_outcome();
        o->set_mode(v1::PRIVATE_PINNED);
        o->set_attach(v1::ATTACH_NONE);
        auto* r = o->add_reasons();
        r->set_code(v1::SEGMENT_NOT_READY);
        r->set_hint(
            "engramd restarted and no longer serves the segment this replica mapped; the replica keeps "
            "reading its own mapping of the old file (no longer shared): restart it to share again");
      }
      if (outcome && !(*next)->stream->Write(*outcome)) continue;
      takes_engine_choice = TakesEngineChoice(answer);
      if (engine_choice && takes_engine_choice && !(*next)->stream->Write(*engine_choice)) continue;
      std::unique_ptr<Connection> old = std::move(conn);
      conn = std::move(*next);
      (void)old->stream->Finish();  // it ended (Read returned false): collect its status, then let it go
      Log().info("engram: event=lease_restored socket={} same_segment={}", socket, same);
      break;
    }
  }
}

}  // namespace engram::client
