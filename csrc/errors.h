// Exception types of the core. The bindings map each to a Python exception class of the same
// name, so Python callers can catch a closed queue apart from a timeout or a version misuse.
#pragma once

#include <stdexcept>
#include <string>

namespace pipedream_fast {

// push/pop on a queue that close() has shut (pop raises only once the queue is drained).
class QueueClosed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// push/pop waited longer than its timeout.
class QueueTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A weight version was asked for that is unknown or released, or the ring is full.
class VersionError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace pipedream_fast
