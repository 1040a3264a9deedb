// Linked into the emulated GPU tests: a failed test names the emulation's schedule, so that
// a failure under a random seed can be replayed (FUSEDNORM_EMU_SCHEDULE=random:SEED).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>

namespace {

class ScheduleOnFailure : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result() == nullptr || !info.result()->Failed()) return;
    std::printf("cuda_emu: %s.%s failed under FUSEDNORM_EMU_SCHEDULE=%s\n", info.test_suite_name(),
                info.name(), cuda_emu::schedule_name());
    std::fflush(stdout);
  }
};

// Before gtest_main's RUN_ALL_TESTS (static initialization of this object file).
const bool registered = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new ScheduleOnFailure);
  return true;
}();

}  // namespace
