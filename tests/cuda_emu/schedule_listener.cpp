// Linked into the emulated GPU tests: a failed test names the emulation's schedule and
// device model, so that a failure under a random seed or a low occupancy can be replayed
// (FUSEDNORM_EMU_SCHEDULE=random:SEED, FUSEDNORM_EMU_SMS, FUSEDNORM_EMU_REGISTERS).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

namespace {

class ScheduleOnFailure : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result() == nullptr || !info.result()->Failed()) return;
    const char* sms = std::getenv("FUSEDNORM_EMU_SMS");
    const char* registers = std::getenv("FUSEDNORM_EMU_REGISTERS");
    std::printf(
        "cuda_emu: %s.%s failed under FUSEDNORM_EMU_SCHEDULE=%s FUSEDNORM_EMU_SMS=%s "
        "FUSEDNORM_EMU_REGISTERS=%s\n",
        info.test_suite_name(), info.name(), cuda_emu::schedule_name(), sms != nullptr ? sms : "",
        registers != nullptr ? registers : "");
    std::fflush(stdout);
  }
};

// Before gtest_main's RUN_ALL_TESTS (static initialization of this object file).
const bool registered = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new ScheduleOnFailure);
  return true;
}();

}  // namespace
