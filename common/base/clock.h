// The time source of the engines, injectable so that tests drive queue timeouts and
// deadlines without waiting for them. Deadlines inside kvwire are points on this clock;
// the gRPC edges convert from and to wall-clock deadlines.
#pragma once

#include <chrono>

namespace kvwire {

class Clock {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  virtual ~Clock() = default;
  virtual TimePoint Now() const = 0;

  // std::chrono::steady_clock.
  static const Clock& Real();
};

// A wall-clock deadline (gRPC's) as a point on `clock`; time_point::max() stays "none".
Clock::TimePoint FromWallDeadline(const Clock& clock,
                                  std::chrono::system_clock::time_point deadline);
// The same, but no later than `at_most` from now (a server's bound on what callers ask).
Clock::TimePoint FromWallDeadline(const Clock& clock,
                                  std::chrono::system_clock::time_point deadline,
                                  Clock::TimePoint::duration at_most);
// And back, for an outgoing call.
std::chrono::system_clock::time_point ToWallDeadline(const Clock& clock, Clock::TimePoint deadline);

inline double Milliseconds(Clock::TimePoint::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

}  // namespace kvwire
