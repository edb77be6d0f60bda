// The transition table of client/saved_tensor_state.h.
#include "client/engine/saved_tensor_state.h"

namespace actstash::client_internal {

std::optional<SavedState> NextState(SavedState state, SavedEvent event) {
  using S = SavedState;
  switch (event) {
    case SavedEvent::kStoreDone:
      if (state == S::kStoring) return S::kStored;
      if (state == S::kReleasedStoring) return S::kReleasedStored;
      return std::nullopt;
    case SavedEvent::kStoreFailed:
      if (state == S::kStoring) return S::kFailed;
      if (state == S::kReleasedStoring) return S::kReleasedFailed;
      return std::nullopt;
    case SavedEvent::kRelease:
      if (state == S::kStoring) return S::kReleasedStoring;
      if (state == S::kStored) return S::kReleasedStored;
      if (state == S::kFailed) return S::kReleasedFailed;
      return std::nullopt;
  }
  return std::nullopt;
}

const char* SavedStateName(SavedState state) {
  switch (state) {
    case SavedState::kStoring:
      return "storing";
    case SavedState::kStored:
      return "stored";
    case SavedState::kFailed:
      return "failed";
    case SavedState::kReleasedStoring:
      return "released-storing";
    case SavedState::kReleasedStored:
      return "released-stored";
    case SavedState::kReleasedFailed:
      return "released-failed";
  }
  return "?";
}

const char* SavedEventName(SavedEvent event) {
  switch (event) {
    case SavedEvent::kStoreDone:
      return "store done";
    case SavedEvent::kStoreFailed:
      return "store failed";
    case SavedEvent::kRelease:
      return "release";
  }
  return "?";
}

}  // namespace actstash::client_internal
