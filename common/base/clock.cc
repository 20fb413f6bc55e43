#include "common/base/clock.h"

#include <algorithm>

namespace kvwire {
namespace {

class RealClock final : public Clock {
 public:
  TimePoint Now() const override { return std::chrono::steady_clock::now(); }
};

}  // namespace

const Clock& Clock::Real() {
  static const RealClock* const kClock = new RealClock();
  return *kClock;
}

Clock::TimePoint FromWallDeadline(const Clock& clock,
                                  std::chrono::system_clock::time_point deadline) {
  if (deadline == std::chrono::system_clock::time_point::max()) return Clock::TimePoint::max();
  const auto left = deadline - std::chrono::system_clock::now();
  // Far-future deadlines (gRPC's "infinite" is close to the maximum) stay unbounded.
  if (left > std::chrono::hours(24 * 365)) return Clock::TimePoint::max();
  return clock.Now() + std::chrono::duration_cast<Clock::TimePoint::duration>(left);
}

Clock::TimePoint FromWallDeadline(const Clock& clock,
                                  std::chrono::system_clock::time_point deadline,
                                  Clock::TimePoint::duration at_most) {
  return std::min(FromWallDeadline(clock, deadline), clock.Now() + at_most);
}

std::chrono::system_clock::time_point ToWallDeadline(const Clock& clock,
                                                     Clock::TimePoint deadline) {
  if (deadline == Clock::TimePoint::max()) return std::chrono::system_clock::time_point::max();
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline - clock.Now());
}

}  // namespace kvwire
