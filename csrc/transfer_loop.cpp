#include "transfer_loop.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "activation_queue.h"  // now_ns: the clock of the engine's stamps

namespace pipedream_fast {

namespace {

double seconds_now() { return static_cast<double>(now_ns()) * 1e-9; }

}  // namespace

std::vector<double> TransferLoop::run(std::vector<TransferAction> actions) {
  std::vector<double> stamps;
  stamps.reserve(2 * actions.size());
  for (size_t i = 0; i < actions.size(); ++i) {
    TransferAction& a = actions[i];
    position_.store(static_cast<int64_t>(i));
    stamps.push_back(seconds_now());
    switch (a.kind) {
      case TransferKind::kSendActivation:
        engine_.send(a.peer, Channel::kActivation, a.stage + 1, a.microbatch,
                     std::move(a.tensors));
        break;
      case TransferKind::kSendGradient:
        engine_.send(a.peer, Channel::kGradient, a.stage - 1, a.microbatch,
                     std::move(a.tensors));
        break;
      case TransferKind::kPostActivation:
        engine_.post_recv(a.peer, Channel::kActivation, a.stage, a.microbatch);
        break;
      case TransferKind::kPostGradient:
        engine_.post_recv(a.peer, Channel::kGradient, a.stage, a.microbatch);
        break;
      default:
        throw std::invalid_argument("transfer action " + std::to_string(i) + ": unknown kind " +
                                    std::to_string(static_cast<int>(a.kind)));
    }
    stamps.push_back(seconds_now());
  }
  position_.store(-1);  // kept on a failure: the caller names the action that failed
  return stamps;
}

}  // namespace pipedream_fast
