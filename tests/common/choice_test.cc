#include "common/choice.h"

#include <gtest/gtest.h>

namespace actstash {
namespace {

enum class Mode { kAuto, kOn, kOff };
constexpr Choice<Mode> kModes[] = {{"auto", Mode::kAuto}, {"on", Mode::kOn}, {"off", Mode::kOff}};

TEST(ChoiceTest, EveryNameParsesToItsValue) {
  EXPECT_EQ(*ParseChoice("auto", "mode", kModes), Mode::kAuto);
  EXPECT_EQ(*ParseChoice("on", "mode", kModes), Mode::kOn);
  EXPECT_EQ(*ParseChoice("off", "mode", kModes), Mode::kOff);
}

TEST(ChoiceTest, AnythingElseNamesTheSettingAndTheChoices) {
  for (absl::string_view bad : {"", "yes", "ON", "auto ", "of"}) {
    absl::StatusOr<Mode> parsed = ParseChoice(bad, "cuda_pin", kModes);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(parsed.status().message(),
              absl::StrCat("cuda_pin: '", bad, "' is not one of auto, on, off"));
  }
}

}  // namespace
}  // namespace actstash
