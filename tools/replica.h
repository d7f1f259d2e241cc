// What engram-replica's pieces share (tools/replica.cc, replica_checks.cc, replica_dp.cc): the rows a lookup is
// checked against (the checkpoint's own bytes through the independent row oracle, tools/row_oracle.h), the rows a
// sparse checkpoint's pattern file selects, and the DP_SHARDED run. The oracle and the table belong to the caller.
// Single-threaded, as the tool is.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engram/client.h"
#include "tools/row_oracle.h"

namespace engram::tools::replica {

// The bf16 row of global row `id` of the layer with id `layer_id`, straight from the checkpoint files through the
// independent oracle (0xFFFF-filled on a read error, which never equals a lookup's row: NaN is 0x7FFF).
std::vector<uint16_t> RowFromCheckpoint(engram::oracle::RowOracle* oracle, int64_t layer_id, int32_t id, int64_t D);

// The rows a sparse checkpoint's pattern says to check (engram-mkckpt --sparse / --like writes engram-pattern.json):
// per region of each layer, its first two rows, its middle and its last two, and the row just past it (a hole: it
// must read as a zero row), each kept when this shard owns it. Empty when the checkpoint has no pattern file; a file
// that is malformed, names a layer the table does not have, holds a region outside its layer or selects no row of
// this shard sets *error (a check that checks nothing must not pass).
struct PatternRow {
  int layer = 0;  // index into the table's layers
  int32_t row = 0;
  bool in_region = false;
};
std::vector<PatternRow> PatternRows(const std::string& checkpoint, const engram::client::Table& t, std::string* error);

// DP_SHARDED (--embedding-across-dp and no sharing): every batch is one group step through the table's engine
// (Prefetch: all-gather of ids, lookup of the owned columns, all-to-all of records); the rows it returns are
// checked against the checkpoint through the oracle: the group's columns carry the checkpoint's row, the others
// (other TP positions') are zero. Every member must run the same number of batches; --tokens may differ (0 too).
// Prints the result as the last line of output; returns the process exit code (0: every checked row matched).
int RunDpSharded(const engram::client::Table& t, engram::oracle::RowOracle* oracle, int64_t T, int64_t batches,
                 int64_t verify, const engram::client::AttachRequest& req, int64_t hold);

}  // namespace engram::tools::replica
