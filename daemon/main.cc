// engramd: the per-node Engram table daemon. See README.md ("Running the daemon") and daemon/coordinator.h.
//
//   engramd --checkpoint DIR [--checkpoint DIR ...] --tp 1[,2,...] [--shm-dir DIR] [--socket PATH] [--group NAME]
//           [--tickets N] [--threads N] [--log-level LEVEL] [--metrics-file PATH] [--metrics-address HOST:PORT]
//           [--prewarm-registration auto|off|PATH] [--config FILE]
//   engramd --version     prints "engramd <version>" (engram/version.h) and exits 0
//
// Runs in the foreground, logs to stderr, readiness through sd_notify (READY=1 once the requested segments are
// settled, STATUS= progress while loading). SIGTERM/SIGINT: stop accepting, tell sessions, leave READY segments in
// place. SIGHUP: re-read the configuration and serve the new set of checkpoints.
#include <grp.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_posix.h>
#include <signal.h>
#include <sys/resource.h>
#include <systemd/sd-daemon.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include "base/utf8.h"
#include "daemon/coordinator.h"
#include "daemon/descriptor_server.h"
#include "daemon/listener.h"
#include "daemon/log_sink.h"
#include "daemon/metrics_file.h"
#include "daemon/metrics_http.h"
#include "daemon/options.h"
#include "daemon/refuser.h"
#include "daemon/service.h"
#include "daemon/stream_bound.h"
#include "engram/version.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

int main(int argc, char** argv) {
  using namespace engram::daemon;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
      std::printf(
          "usage: engramd --checkpoint DIR [--checkpoint DIR ...] [--tp 1,2] [--shm-dir DIR] [--socket PATH]\n"
          "               [--group NAME] [--admin-group NAME] [--tickets N] [--max-sessions N] [--max-sessions-per-uid "
          "N] [--threads N] [--log-level LEVEL]\n"
          "               [--max-streams-per-uid N] [--max-connections-per-uid N] [--ticket-hold-ms MS]\n"
          "               [--reflection on|off] [--metrics-file PATH]\n"
          "               [--metrics-address HOST:PORT] [--prewarm-registration auto|off|PATH] [--config FILE]\n"
          "       engramd --version\n");
      return 0;
    }
    if (std::string(argv[i]) == "--version") {
      std::printf("engramd %s\n", ENGRAM_VERSION_STRING);
      return 0;
    }
  }
  auto opts = ParseOptions(argc, argv);
  if (!opts.ok()) {
    std::fprintf(stderr, "engramd: %s\n", std::string(opts.status().message()).c_str());
    return 2;
  }
  opts->publish_tuning = engram::daemon::PublishTuning::FromEnvironment();  // the environment, read once
  for (const std::string& name : opts->publish_tuning.removed) {
    spdlog::warn("event=removed_variable name={} detail=\"engramd no longer reads it (CHANGELOG.md): ignored\"", name);
  }
  // One event per line, whatever text a checkpoint or client brought (daemon/log_sink.h).
  auto logger = std::make_shared<spdlog::logger>(
      "engramd", std::make_shared<PrintableSink>(std::make_shared<spdlog::sinks::stderr_color_sink_mt>()));
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(opts->log_level));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");

  // Signals go to the main thread only (sigwait below): block them before any thread starts.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // Every connection and segment is a descriptor: take the whole hard limit (the per-uid bounds share it out).
  if (rlimit rl{}; ::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    const rlim_t was = rl.rlim_cur;
    rl.rlim_cur = rl.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &rl) == 0) spdlog::debug("event=nofile_raised from={} to={}", was, rl.rlim_max);
  }

  UdsListener listener;
  if (auto st = listener.Bind(opts->socket, opts->group, opts->admin_group); !st.ok()) {
    std::fprintf(stderr, "engramd: %s\n", std::string(st.message()).c_str());
    return 1;
  }
  Coordinator state(*opts);
  if (auto st = state.Start(); !st.ok()) {
    std::fprintf(stderr, "engramd: %s\n", std::string(st.message()).c_str());
    return 1;
  }
  // Refused peers' connections go to a server of their own whose only service answers PERMISSION_DENIED to every
  // method. Built before health and reflection are switched on: those plugins apply to every server built later.
  RefusingService refusing(&listener);
  grpc::ServerBuilder refuser_builder;
  refuser_builder.RegisterCallbackGenericService(&refusing);
  refuser_builder.SetMaxReceiveMessageSize(4096);
  std::unique_ptr<grpc::Server> refuser = refuser_builder.BuildAndStart();
  if (!refuser) {
    std::fprintf(stderr, "engramd: the gRPC server for refused peers did not start\n");
    return 1;
  }
  grpc::EnableDefaultHealthCheckService(true);
  // Reflection only when asked for (--reflection on), and then to operators only: StreamBound refuses its calls
  // otherwise (daemon/stream_bound.h).
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  EngramService service(&state, &listener, opts->max_sessions, opts->max_sessions_per_uid);
  grpc::ServerBuilder builder;
  builder.RegisterService(&service);
  // Threads beyond the session bound for the short calls (status, load, ...): sessions can never take them all.
  grpc::ResourceQuota quota("engramd");
  quota.SetMaxThreads(opts->max_sessions + 64);
  builder.SetResourceQuota(quota);
  // Every stream but Session (bounded by the service) is bounded per uid, within the 64 threads above the sessions'.
  StreamCounts stream_counts(&listener, opts->max_streams_per_uid, opts->reflection);
  {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(std::make_unique<StreamBoundFactory>(&stream_counts));
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
  }
  builder.SetMaxReceiveMessageSize(1 << 20);  // requests are small; anything larger is refused
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) {
    std::fprintf(stderr, "engramd: the gRPC server did not start\n");
    return 1;
  }
  auto* health = server->GetHealthCheckService();
  health->SetServingStatus(false);
  // Descriptor passing: a side socket next to the gRPC one, same mode and group, same authorisation.
  DescriptorChannel descriptors([&listener](const PeerCred& p) { return listener.Allowed(p); });
  {
    // Without it replicas in containers could only fall back: a startup error, not a silent degradation.
    if (auto st = descriptors.Bind(opts->socket, listener.group_gid()); !st.ok()) {
      std::fprintf(stderr, "engramd: the descriptor socket next to %s: %s\n", opts->socket.c_str(),
                   std::string(st.message()).c_str());
      return 1;
    }
    state.SetDescriptorChannel(&descriptors);
    descriptors.Start();
  }
  // Prometheus over HTTP, on a thread of its own (daemon/metrics_http.h); an address that cannot be bound is a
  // startup error, not a silent lack of metrics.
  std::unique_ptr<MetricsHttpServer> metrics_http;
  if (!opts->metrics_address.empty()) {
    auto started = MetricsHttpServer::Start(opts->metrics_address, [&state] { return state.MetricsText(); });
    if (!started.ok()) {
      std::fprintf(stderr, "engramd: %s\n", std::string(started.status().message()).c_str());
      return 1;
    }
    metrics_http = *std::move(started);
    spdlog::info("event=metrics_listening address={}", metrics_http->address());
  }
  listener.SetMaxConnectionsPerUid(opts->max_connections_per_uid);
  listener.Start(
      [&](int fd, bool allowed) { grpc::AddInsecureChannelFromFd(allowed ? server.get() : refuser.get(), fd); });
  spdlog::info("event=listening version={} socket={} shm_dir={} checkpoints={} tickets={}", ENGRAM_VERSION_STRING,
               engram::LogValue(opts->socket), engram::LogValue(opts->shm_dir), opts->checkpoints.size(),
               opts->tickets);

  std::atomic<bool> done{false};
  std::thread readiness([&] {
    int ticks = 0;
    while (!done && !state.WaitSettled(std::chrono::milliseconds(1000))) {
      // Publishing 189 GiB takes longer than any start timeout: extend it while progress is made.
      const std::string line = state.LoadProgressLine();
      sd_notifyf(0, "STATUS=loading: %s\nEXTEND_TIMEOUT_USEC=%d", line.c_str(), 30000000);
      if (++ticks % 5 == 0) spdlog::info("event=loading progress={}", engram::LogQuoted(line));
    }
    health->SetServingStatus(true);
    const std::string line = state.LoadProgressLine();
    sd_notifyf(0, "READY=1\nSTATUS=serving: %s", line.c_str());
    spdlog::info("event=ready detail={}", engram::LogQuoted(line));
  });

  std::thread metrics;
  if (!opts->metrics_file.empty()) {
    metrics = std::thread([&] {
      std::string last_error;  // logged when it changes, not every 2 s
      while (!done) {
        const absl::Status st = WriteMetricsFile(opts->metrics_file, state.MetricsText());
        const std::string error = st.ok() ? "" : std::string(st.message());
        if (error != last_error && !st.ok()) {
          spdlog::error("event=metrics_write_failed path={} detail={}",
                        engram::LogValue(engram::Printable(opts->metrics_file)),
                        engram::LogQuoted(engram::Printable(error)));
        }
        last_error = error;
        for (int i = 0; i < 20 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
  }

  while (true) {
    int sig = 0;
    sigwait(&sigs, &sig);
    if (sig == SIGHUP) {
      auto fresh = ParseOptions(argc, argv);
      if (!fresh.ok()) {
        spdlog::error("event=reload_failed detail={}", engram::LogQuoted(std::string(fresh.status().message())));
        state.NoteReloadFailure(opts->config_file, std::string(fresh.status().message()));
        continue;
      }
      sd_notify(0, "RELOADING=1");
      // The socket side first checks its groups (a missing group refuses the whole reload), then applies them once
      // the segments' part succeeded: all or nothing.
      const absl::StatusOr<UdsListener::Groups> groups = listener.ResolveGroups(fresh->group, fresh->admin_group);
      absl::Status st = groups.status();
      if (st.ok() && spdlog::level::from_str(fresh->log_level) == spdlog::level::off && fresh->log_level != "off") {
        st = absl::InvalidArgumentError("log_level '" + fresh->log_level + "' is not a level");
      }
      if (!st.ok()) {
        spdlog::error("event=reload_failed detail={}",
                      engram::LogQuoted(std::string(st.message()) + ": nothing changed"));
        state.NoteReloadFailure(opts->config_file, std::string(st.message()));
      } else if (st = state.Reload(*fresh); !st.ok()) {
        spdlog::error("event=reload_failed detail={}", engram::LogQuoted(std::string(st.message())));
      } else {
        listener.ApplyGroups(*groups);  // resolved above: the groups the check saw are the ones applied
        service.SetSessionBounds(fresh->max_sessions, fresh->max_sessions_per_uid);
        stream_counts.set_max_per_uid(fresh->max_streams_per_uid);
        listener.SetMaxConnectionsPerUid(fresh->max_connections_per_uid);
        quota.SetMaxThreads(fresh->max_sessions + 64);
        spdlog::set_level(spdlog::level::from_str(fresh->log_level));
      }
      // The reload is decided (refused, or applied in full); new shards publish in the background and status shows
      // their progress, so the service is ready again at once.
      sd_notify(0, "READY=1");
      continue;
    }
    spdlog::info("event=stopping signal={}", sig);
    sd_notify(0, "STOPPING=1");
    break;
  }
  done = true;
  listener.Stop();
  state.Drain();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  refuser->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  descriptors.Stop();
  if (metrics_http) metrics_http->Stop();
  readiness.join();
  if (metrics.joinable()) metrics.join();
  spdlog::info("event=stopped: READY segments stay in place for the next start");
  return 0;
}
