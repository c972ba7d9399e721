// TransferLoop: the runs of transfer actions in a rank's program, performed in one call.
//
// Between two computes a rank's program holds a run of point-to-point actions: the send of
// the activation just made, the receive posted for a gradient to come, and so on. Performed
// one by one from Python, each pays the executor's whole per-action path (dispatch, timing,
// the step tracker, a generator step) for a call into the engine of a few microseconds. The
// executor instead hands the run to `run` at once: the engine calls are made here, in order,
// with the GIL released, and each action is stamped on the clock of time.perf_counter
// (CLOCK_MONOTONIC), so the calibration and the trace get the same start and end times as
// from the Python loop.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "comm_engine.h"

namespace pipedream_fast {

// What a transfer action does, as the executor codes it.
enum class TransferKind : int { kSendActivation = 0, kSendGradient = 1, kPostActivation = 2,
                                kPostGradient = 3 };

struct TransferAction {
  TransferKind kind;
  int stage;           // the action's own stage (a send's sending stage, a receive's receiver)
  int64_t microbatch;
  int peer;
  std::vector<at::Tensor> tensors;  // a send's message; empty for a receive
};

class TransferLoop {
 public:
  explicit TransferLoop(CommEngine& engine) : engine_(engine) {}

  // Performs `actions` in order. Returns each action's start and end, in seconds
  // (2 per action). A send goes to the stage after (activation) or before (gradient) the
  // action's; a failing action raises as the engine raised, after the earlier ones ran.
  std::vector<double> run(std::vector<TransferAction> actions);

  // The index, within the run in progress, of the action being performed; -1 when idle.
  // After a failed run, the index of the action that failed. Safe from any thread (a
  // report on a stuck rank).
  int64_t position() const { return position_.load(); }

 private:
  CommEngine& engine_;
  std::atomic<int64_t> position_{-1};
};

}  // namespace pipedream_fast
