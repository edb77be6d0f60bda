// The transition table of client/block_state.h.
#include "client/store/block_state.h"

namespace actstash::client_internal {

std::optional<BlockState> NextBlockState(BlockState state, BlockEvent event) {
  using S = BlockState;
  switch (event) {
    case BlockEvent::kSpill:
      if (state == S::kResident) return S::kSpilling;
      return std::nullopt;
    case BlockEvent::kSpillDone:
      if (state == S::kSpilling) return S::kSpilled;
      return std::nullopt;
    case BlockEvent::kSpillFailed:
      if (state == S::kSpilling) return S::kResident;
      return std::nullopt;
    case BlockEvent::kRestore:
      if (state == S::kSpilled) return S::kRestoring;
      return std::nullopt;
    case BlockEvent::kRestoreDone:
      if (state == S::kRestoring) return S::kResident;
      return std::nullopt;
    case BlockEvent::kRestoreFailed:
      if (state == S::kRestoring) return S::kSpilled;
      return std::nullopt;
    case BlockEvent::kSpillGone:
      if (state == S::kRestoring) return S::kLost;
      return std::nullopt;
  }
  return std::nullopt;
}

const char* BlockStateName(BlockState state) {
  switch (state) {
    case BlockState::kResident:
      return "resident";
    case BlockState::kSpilling:
      return "spilling";
    case BlockState::kSpilled:
      return "spilled";
    case BlockState::kRestoring:
      return "restoring";
    case BlockState::kLost:
      return "lost";
  }
  return "?";
}

const char* BlockEventName(BlockEvent event) {
  switch (event) {
    case BlockEvent::kSpill:
      return "spill";
    case BlockEvent::kSpillDone:
      return "spill done";
    case BlockEvent::kSpillFailed:
      return "spill failed";
    case BlockEvent::kRestore:
      return "restore";
    case BlockEvent::kRestoreDone:
      return "restore done";
    case BlockEvent::kRestoreFailed:
      return "restore failed";
    case BlockEvent::kSpillGone:
      return "spill gone";
  }
  return "?";
}

}  // namespace actstash::client_internal
