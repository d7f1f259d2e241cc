// OpenSharedTable (client/table/tables.h) against a real published segment and a grant that lies about where a layer's
// records are: an offset near 2^64 wrapped the bounds check (offset + rows x record) and pointed the table's
// records outside the mapping; it must be FailedPrecondition, and the honest grant must still open.
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>

#include "client/session/session.h"
#include "client/table/tables.h"
#include "daemon/publisher.h"
#include "engram/v1/engram.pb.h"
#include "gtest/gtest.h"
#include "model/checkpoint.h"
#include "model/layout.h"
#include "model/token_map.h"
#include "model/tokenizer.h"
#include "shm/segment.h"
#include "tests/test_util.h"
#include "tools/synthetic.h"

namespace engram {
namespace {

TEST(GrantedTableTest, ALayerOffsetThatWrapsIsRefusedAndTheHonestGrantOpens) {
  testing::TempDir dir;
  tools::SyntheticSpec spec;
  spec.out_dir = dir / "ck";
  spec.table_mib = 3;
  ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
  auto ck = Checkpoint::Open(spec.out_dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  auto layout = Layout::Build((*ck)->config());
  ASSERT_TRUE(layout.ok());
  auto tok = Tokenizer::Load((*ck)->tokenizer_path());
  ASSERT_TRUE(tok.ok());
  const TokenMap map = TokenMap::Build(*tok);
  const std::string shm = dir / "shm";
  std::filesystem::create_directories(shm);
  auto pub = daemon::Publish(**ck, *layout, map, 1, 0, shm, 1, 1, 1);
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto shard = layout->Shard(1, 0);
  ASSERT_TRUE(shard.ok());

  // The grant engramd would send, built from the segment's own descriptor.
  auto reader = SegmentReader::Open(pub->path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  engram::v1::SegmentDescriptor desc;
  ASSERT_TRUE(desc.ParseFromString((*reader)->descriptor_bytes()));
  client::Grant g;
  g.segment_path = pub->path;
  g.segment_bytes = (*reader)->file_bytes();
  g.fingerprint = desc.fingerprint();
  g.head_dim = desc.head_dim();
  g.record_bytes = desc.record_bytes();
  for (const auto& l : desc.layers()) g.layers.push_back({l.layer_id(), l.row_begin(), l.row_end(), l.data_offset()});
  g.token_map.assign(desc.token_map().begin(), desc.token_map().end());
  reader->reset();

  auto honest = client::OpenSharedTable(g, -1, pub->path, desc.fingerprint(), *layout, *shard, Env::Default());
  ASSERT_TRUE(honest.ok()) << honest.status();
  honest->reset();

  // offset + rows x record wraps to a small number when the offset is near 2^64.
  const uint64_t span =
      static_cast<uint64_t>(g.layers[0].row_end - g.layers[0].row_begin) * static_cast<uint64_t>(g.record_bytes);
  g.layers[0].data_offset = std::numeric_limits<uint64_t>::max() - span + 2;
  auto lying = client::OpenSharedTable(g, -1, pub->path, desc.fingerprint(), *layout, *shard, Env::Default());
  ASSERT_FALSE(lying.ok());
  EXPECT_EQ(lying.status().code(), absl::StatusCode::kFailedPrecondition) << lying.status();
}

}  // namespace
}  // namespace engram
